"""Write the code a checkpoint needs next to its weights, as flat files.

transformers' remote-code loader copies a module and the files of its relative imports, and
it only understands flat imports ``from .name import x`` that resolve to a sibling ``name.py``.
The package keeps its ops and mixers in sub-packages, so a checkpoint gets flat copies: a
module at ``a/b/c.py`` becomes ``trellis_a_b_c.py``, a package ``a/b/__init__.py`` becomes
``trellis_a_b.py``, modules at the package root keep their names, and only the relative
import lines are rewritten to match. Everything else is copied verbatim.

Only what a model runs is exported: the modules the configuration and the model import,
followed through their relative imports (including imports made inside functions, which
transformers' loader also requires to be present), and of the layer kinds' code only the kinds
the caller names (the configuration names the model's and the default kind's). A kind's code is
its mixer ``mixers/<kind>.py`` and its op ``ops/<kind>/`` (the Trellis op with its Triton
kernels, which a GPU user of the checkpoint runs); the kinds are the modules ``mixers/__init__.py``
imports, one line each, besides ``mixers.base`` (read from its text: this module imports nothing
of the package). The package ``__init__`` files that import every kind lose the lines of the
others in the copy, and any other module that imports a left-out kind's code is an error (the
copy would not load).

When the classes themselves were loaded as remote code, their files are already flat and
transformers copies them on save by itself; :func:`code_is_packaged` tells the two apart.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Callable, Optional

# Where the import closure starts; this file is in it because the configuration imports it.
CHECKPOINT_MODULES = ("configuration_trellis", "modeling_trellis")
FLAT_PREFIX = "trellis"

AUTO_MAP = {
    "AutoConfig": "configuration_trellis.TrellisConfig",
    "AutoModel": "modeling_trellis.TrellisModel",
    "AutoModelForCausalLM": "modeling_trellis.TrellisForCausalLM",
}

_HERE = Path(__file__).resolve().parent
# `from <dots><module> import`, at any indentation, as transformers' loader matches it.
_RELATIVE_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.+)(?P<module>[\w.]*)[ \t]+import\b", re.MULTILINE)


def code_is_packaged() -> bool:
    """True when running from the ``trellis_lm`` package (the ops are a sub-package here)."""
    return (_HERE / "ops" / "__init__.py").is_file()


def flat_name(module: str) -> str:
    """The flat file stem of a module given by its dotted path inside the package.

    ``"cache_trellis"`` -> ``"cache_trellis"``; ``"ops"`` -> ``"trellis_ops"``;
    ``"ops.trellis.step"`` -> ``"trellis_ops_trellis_step"``.
    """
    parts = module.split(".")
    return module if len(parts) == 1 and not (_HERE / module).is_dir() else "_".join([FLAT_PREFIX, *parts])


def resolve(package: str, dots: str, module: str) -> str:
    """The dotted path inside the package that ``from <dots><module> import`` names, written in
    the (dotted, possibly empty) ``package``.

    Raises ``ValueError`` for what a flat folder cannot hold: ``from . import x`` (no module
    named) and imports climbing above the package root.
    """
    if not module:
        raise ValueError(f"cannot flatten `from {dots} import ...`: name the module (`from .name import ...`)")
    base = package.split(".") if package else []
    climb = len(dots) - 1
    if climb > len(base):
        raise ValueError(f"cannot flatten `from {dots}{module} import ...` in {package or 'the root'}: it leaves the package")
    return ".".join(base[: len(base) - climb] + module.split("."))


def relative_imports(source: str, package: str) -> list[str]:
    """Dotted paths (inside the package) of every relative import in ``source``."""
    return [resolve(package, m["dots"], m["module"]) for m in _RELATIVE_IMPORT.finditer(source)]


def flatten_imports(source: str, package: str) -> str:
    """Rewrite the relative import lines of ``source`` (a module of ``package``) to flat names."""

    def rewrite(match: re.Match) -> str:
        target = resolve(package, match["dots"], match["module"])
        return f"{match['indent']}from .{flat_name(target)} import"

    return _RELATIVE_IMPORT.sub(rewrite, source)


def _module_file(module: str) -> tuple[Path, str]:
    """``(path, package)`` of a dotted module path inside the package."""
    path = _HERE.joinpath(*module.split("."))
    if path.is_dir():
        return path / "__init__.py", module
    return path.with_suffix(".py"), module.rpartition(".")[0]


def kind_code(kinds: Iterable[str]) -> Callable[[str], bool]:
    """Whether a module (dotted path inside the package) holds the code of one of ``kinds``:
    ``mixers.<kind>``, ``ops.<kind>`` or a module under ``ops/<kind>/``."""
    kinds = tuple(kinds)
    return lambda module: any(module in (f"mixers.{kind}", f"ops.{kind}") or module.startswith(f"ops.{kind}.")
                              for kind in kinds)


def package_kinds() -> list[str]:
    """The package's layer kinds: the modules ``mixers/__init__.py`` imports besides ``mixers.base``
    (one line a kind), in its order."""
    imported = relative_imports(_module_file("mixers")[0].read_text(encoding="utf-8"), "mixers")
    return [module.split(".")[1] for module in imported if module.startswith("mixers.") and module != "mixers.base"]


def without_imports(source: str, package: str, left_out: Callable[[str], bool]) -> str:
    """``source`` without its relative import lines of the modules ``left_out`` names (each on
    one line: a kind's import in a package ``__init__``)."""
    lines = []
    for line in source.splitlines(keepends=True):
        match = _RELATIVE_IMPORT.match(line)
        if match and left_out(resolve(package, match["dots"], match["module"])):
            if "(" in line and ")" not in line:
                raise ValueError(f"cannot leave out `{line.strip()}` in {package or 'the root'}: write it on one line")
            continue
        lines.append(line)
    return "".join(lines)


def flat_sources(kinds: Optional[Iterable[str]] = None) -> dict[str, str]:
    """File name in a checkpoint -> source text, for every module the checkpoint code of a model
    with layers of ``kinds`` needs (``None``: every kind)."""
    if not code_is_packaged():
        raise RuntimeError("the flat checkpoint code can only be built from the trellis_lm package")
    every_kind = package_kinds()
    carried = set(every_kind) if kinds is None else set(kinds)
    left_out = kind_code(kind for kind in every_kind if kind not in carried)
    sources: dict[str, str] = {}
    pending = list(CHECKPOINT_MODULES)
    while pending:
        module = pending.pop()
        name = f"{flat_name(module)}.py"
        if name in sources:
            continue
        path, package = _module_file(module)
        source = path.read_text(encoding="utf-8")
        if path.name == "__init__.py":
            source = without_imports(source, package, left_out)
        imports = relative_imports(source, package)
        stray = [target for target in imports if left_out(target)]
        if stray:
            raise RuntimeError(f"{module} imports {stray[0]}, the code of a layer kind this checkpoint has no layer of; "
                               "only the package __init__ files may import every kind")
        sources[name] = flatten_imports(source, package)
        pending.extend(imports)
    return dict(sorted(sources.items()))


def export_code(save_directory: str | os.PathLike, kinds: Optional[Iterable[str]] = None) -> list[Path]:
    """Write :func:`flat_sources` of ``kinds`` (the model's layer kinds; ``None``: every kind)
    into ``save_directory``; returns the paths written."""
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in flat_sources(kinds).items():
        (folder / name).write_text(text, encoding="utf-8")
        written.append(folder / name)
    return written
