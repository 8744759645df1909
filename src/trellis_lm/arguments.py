"""Command-line argument types and error reporting shared by the package's commands
(``trellis-lm`` and its ``convert`` and ``bench`` parts): each argparse ``type`` names what it
expected, a bad argument is one line on standard error, and options take hyphens or
underscores (:class:`Parser`)."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

T = TypeVar("T")

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


def _checked(parse: Callable[[str], T], accept: Callable[[T], bool], expected: str) -> Callable[[str], T]:
    def checked(text: str) -> T:
        try:
            value = parse(text)
            if accept(value):
                return value
        except ValueError:
            pass
        # ArgumentTypeError's text is argparse's whole message; a ValueError would only say "invalid".
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")

    return checked


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``minimum``."""
    return _checked(int, lambda value: value >= minimum, f"an integer >= {minimum}")


def float_above(minimum: float, maximum: Optional[float] = None) -> Callable[[str], float]:
    """An argparse ``type``: a finite number > ``minimum`` (and <= ``maximum`` when given)."""
    expected = f"a number > {minimum:g}" if maximum is None else f"a number in ({minimum:g}, {maximum:g}]"
    return _checked(
        float, lambda value: math.isfinite(value) and value > minimum and (maximum is None or value <= maximum),
        expected,
    )


def probability(text: str) -> float:
    """An argparse ``type``: a number in [0, 1]."""
    return _checked(float, lambda value: 0 <= value <= 1, "a number in [0, 1]")(text)


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    return _checked(float, lambda value: 0 <= value < 1, "a number in [0, 1)")(text)


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
