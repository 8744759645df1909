"""Command-line argument types and error reporting shared by the package's commands
(``trellis-lm`` and its ``convert`` and ``bench`` parts): each argparse ``type`` names what it
expected, a bad argument is one line on standard error, and options take hyphens or
underscores (:class:`Parser`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import numbers
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Optional, Union

BAD_ARGUMENTS = 2  # exit status; argparse's own for a command line it cannot parse
# What the Hub accepts as a repository id: "name" or "namespace/name". A path that does not exist
# and cannot be one is a local path with a typo, which can be refused without asking the Hub.
_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")
GLOB_CHARACTERS = frozenset("*?[")


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose long options take hyphens and underscores alike.

    The package's own commands spell options with hyphens (``--max-new-tokens``) and the
    Trainer recipes with underscores (``--max_steps``, HfArgumentParser's spelling, which also
    takes hyphens): a user should not have to remember which. An option that the parser does
    not know as written, but does know with ``-`` and ``_`` swapped (abbreviated or not), is
    read as the known one; everything else, and everything after ``--``, is left to argparse.
    Sub-command parsers made by ``add_subparsers().add_parser`` are of this class too.
    """

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> tuple[Any, list[str]]:
        given = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self._as_declared(given), namespace)

    def _as_declared(self, args: list[str]) -> list[str]:
        # argparse's table of option strings, the same for argument groups.
        declared = [option for option in self._option_string_actions if option.startswith("--")]
        spelled = []
        for index, arg in enumerate(args):
            if arg == "--":
                return spelled + args[index:]
            spelled.append(_declared_spelling(arg, declared))
        return spelled


def _declared_spelling(arg: str, declared: list[str]) -> str:
    """``arg`` (``--name`` or ``--name=value``) spelled as the one option of ``declared`` it
    names with ``-`` and ``_`` swapped; ``arg`` itself when argparse can take it as written."""
    name, equals, value = arg.partition("=")
    if not name.startswith("--") or len(name) < 3 or any(option.startswith(name) for option in declared):
        return arg
    wanted = _hyphenated(name)
    same = [option for option in declared if _hyphenated(option) == wanted]
    matches = same or [option for option in declared if _hyphenated(option).startswith(wanted)]
    return matches[0] + equals + value if len(matches) == 1 else arg


def _hyphenated(option: str) -> str:
    return "--" + option[2:].replace("_", "-")


class CommandLineError(Exception):
    """A bad argument found after parsing (a model that does not load, an unknown task, ...):
    :func:`main` reports it as one line and returns :data:`BAD_ARGUMENTS`."""


def report_error(prog: str, message: str) -> int:
    """Print ``PROG: error: MESSAGE`` as one line on stderr; returns :data:`BAD_ARGUMENTS`."""
    print(f"{prog}: error: {first_line(message)}", file=sys.stderr)
    return BAD_ARGUMENTS


def first_line(message: object) -> str:
    """The first non-blank line of ``message``: library errors (transformers' OSErrors) append
    paragraphs of advice that would break the one-line contract."""
    return next((line.strip() for line in str(message).splitlines() if line.strip()), str(message))


@contextlib.contextmanager
def blame(argument: str, *errors: type[BaseException]) -> Iterator[None]:
    """Report ``errors`` raised in the block as a bad ``argument`` (:class:`CommandLineError`)."""
    try:
        yield
    except errors as error:
        raise CommandLineError(f"argument {argument}: {first_line(error)}") from None


class ArgumentType:
    """An argparse ``type`` that names what it expected, and checks a value given from Python
    the same way (:meth:`problem`): a function that a command also calls refuses what the
    command's parser refuses, in the same words.

    Args:
        parse: ``int`` or ``float``, what the command line's text is read as.
        accept: whether a parsed value is in range.
        expected: what is accepted, in words ("an integer >= 1").
    """

    def __init__(self, parse: Callable[[str], Any], accept: Callable[[Any], bool], expected: str) -> None:
        self.parse, self.accept, self.expected = parse, accept, expected

    def __call__(self, text: str) -> Any:
        try:
            value = self.parse(text)
            if self.accept(value):
                return value
        except ValueError:
            pass
        # ArgumentTypeError's text is argparse's whole message; a ValueError would only say "invalid".
        raise argparse.ArgumentTypeError(f"expected {self.expected}, got {text!r}")

    def problem(self, value: Any) -> Optional[str]:
        """Why ``value`` (from Python) is not a value this type gives, or ``None``: a string or a
        bool where a number is expected (``"0.01"`` would fail only once used), a float where an
        integer is, or a number out of range."""
        kind = numbers.Integral if self.parse is int else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind) or not self.accept(self.parse(value)):
            return f"expected {self.expected}, got {value!r}"
        return None


def int_at_least(minimum: int) -> ArgumentType:
    """An argparse ``type``: an integer >= ``minimum``."""
    return ArgumentType(int, lambda value: value >= minimum, f"an integer >= {minimum}")


def float_above(minimum: float, maximum: Optional[float] = None) -> ArgumentType:
    """An argparse ``type``: a finite number > ``minimum`` (and <= ``maximum`` when given)."""
    expected = f"a number > {minimum:g}" if maximum is None else f"a number in ({minimum:g}, {maximum:g}]"
    return ArgumentType(
        float, lambda value: math.isfinite(value) and value > minimum and (maximum is None or value <= maximum),
        expected,
    )


# argparse ``type``s: a number in [0, 1], and in [0, 1).
probability = ArgumentType(float, lambda value: 0 <= value <= 1, "a number in [0, 1]")
fraction = ArgumentType(float, lambda value: 0 <= value < 1, "a number in [0, 1)")
any_integer = ArgumentType(int, lambda value: True, "an integer")


def flag_problem(value: Any) -> Optional[str]:
    """Why ``value`` (from Python) is not a flag's value, or ``None``: ``"no"`` or ``1`` would be
    read as true, silently."""
    return None if isinstance(value, bool) else f"expected True or False, got {value!r}"


# How errors name the arguments of a function that a command also calls: as a Python caller
# passes them, or, within `command_words`, as the command's options.
_OPTION: ContextVar[Optional[Callable[[str], str]]] = ContextVar("trellis_lm_option", default=None)


@contextlib.contextmanager
def command_words(option: Callable[[str], str]) -> Iterator[None]:
    """Within the block, :func:`named`, :func:`argument` and :func:`passing` name an argument
    as the command line sets it: ``option(name)`` is the option (or positional argument) that
    sets the Python argument ``name``."""
    token = _OPTION.set(option)
    try:
        yield
    finally:
        _OPTION.reset(token)


def named(name: str) -> str:
    """The argument ``name`` (a function's ``"dst"`` or a field's ``"DistillOptions.work_dir"``)
    as a message mentions it: itself, or the option that sets it (``--work-dir``) in
    :func:`command_words`."""
    option = _OPTION.get()
    return name if option is None else option(name.rpartition(".")[2])


def argument(name: str) -> str:
    """The subject of an error about the argument ``name`` (see :func:`named`):
    ``DistillOptions.work_dir`` or ``argument dst``; ``argument --work-dir`` in :func:`command_words`."""
    return name if "." in name and _OPTION.get() is None else f"argument {named(name)}"


def passing(name: str, value: Any = True) -> str:
    """How an error tells its reader to pass ``value`` for the argument ``name``:
    ``overwrite=True``, ``heldout_blocks=N``; ``--overwrite``, ``--heldout-blocks N`` in
    :func:`command_words` (``True``: a flag)."""
    option = _OPTION.get()
    if option is None:
        return f"{name}={value}"
    return option(name) if value is True else f"{option(name)} {value}"


# A comma that starts another FIELD=VALUE (a value may hold commas: a JSON list).
_NEXT_FIELD = re.compile(r",(?=\s*[A-Za-z_]\w*\s*=)")


def config_fields(items: Sequence[str], option: str) -> dict[str, Any]:
    """``FIELD=VALUE`` items (``--set compress_fn=l2norm``; one string may hold several, separated
    by commas: ``hidden_size=256,mixer_types=["trellis","attention"]``) as ``{field: value}``, each
    value read as JSON where it parses (``true``, ``0.5``, ``null``, a list), else as the string.
    Which fields exist and what they hold is the configuration's to check. Raises a
    ``ValueError`` starting with ``option`` for an item without a field name or ``=``, or a field
    given twice."""
    fields: dict[str, Any] = {}
    for item in (part for text in items for part in _NEXT_FIELD.split(text)):
        name, equals, value = item.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier():
            raise ValueError(f"{option}: {item!r} is not FIELD=VALUE")
        if name in fields:
            raise ValueError(f"{option}: {name} is given twice")
        try:
            fields[name] = json.loads(value)
        except json.JSONDecodeError:
            fields[name] = value
    return fields


def utf8_text(data: bytes, path: Any, subject: str, first_line: int = 1) -> str:
    """``data`` (read from ``path``, from its line ``first_line`` on) as UTF-8 text; other bytes are
    a ``ValueError`` starting with ``subject`` that names the file and the line."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + data[: error.start].count(b"\n")
        raise ValueError(f"{subject}: {path} line {line} is not UTF-8 text (byte {data[error.start]:#04x}): "
                         "expected UTF-8 files") from None


def json_lines(path: Path, subject: str, expected: str) -> Iterator[tuple[int, Any]]:
    """Each line of the JSONL file ``path`` that is not blank, as ``(its number, its JSON value)``;
    a line that is not UTF-8 or not JSON is a ``ValueError`` starting with ``subject`` that names
    the file and the line (``expected``: what a line holds, e.g. ``{"text": "..."}``)."""
    for number, line in enumerate(path.read_bytes().split(b"\n"), 1):
        text = utf8_text(line, path, subject, number)
        if not text.strip():
            continue
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{subject}: {path} line {number} is not JSON ({error.msg}): expected one {expected} "
                             "object per line") from None
        yield number, value


def checkpoint_problem(text: str) -> Optional[str]:
    """Why ``text`` cannot be a checkpoint folder or Hub id, as far as the disk tells (``None``:
    it may be one; a Hub id is only checked when it is loaded).

    A missing path that looks local is refused here, before transformers spends a minute
    retrying the Hub for it: one that cannot be a Hub id (``./x``, ``/x``, ``a/b/c``), or
    ``name/x`` where ``name`` is a folder here (``outputs/my-modle``, a typo).
    """
    if not text.strip():
        return "an empty name: expected a checkpoint folder or Hub id"
    path = Path(text)
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{text} has no config.json: expected a checkpoint folder"
    if path.exists():
        return f"{text} is a file: expected a checkpoint folder or Hub id"
    if not _HUB_ID.fullmatch(text):
        return f"{text} does not exist: expected a checkpoint folder or Hub id"
    if len(path.parts) > 1 and Path(path.parts[0]).is_dir():
        return (f"{text} does not exist ({path.parts[0]} is a folder here, so it is not read as a Hub id): "
                "expected a checkpoint folder or Hub id")
    return None


def checkpoint(text: str) -> str:
    """An argparse ``type``: a checkpoint folder (with ``config.json``) or a Hub id."""
    problem = checkpoint_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def existing_folder(text: str) -> str:
    """An argparse ``type``: a folder that exists."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"expected an existing folder, got {text!r}")
    return text


def output_file(text: str) -> str:
    """An argparse ``type``: a file to write at the end of a run, checked now so a long run does
    not end without its output."""
    path = Path(text)
    if path.is_dir() or not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path in an existing folder, got {text!r}")
    return text


_EVAL_BATCH_SIZE = re.compile(r"auto(:[1-9][0-9]*)?|[1-9][0-9]*")


def eval_batch_size(text: str) -> Union[int, str]:
    """An argparse ``type``: requests per batch, or ``auto`` / ``auto:N`` (lm-eval finds the
    largest that fits, N times over the run)."""
    if not _EVAL_BATCH_SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, 'auto' or 'auto:N', got {text!r}")
    return text if text.startswith("auto") else int(text)
