"""Write the code a checkpoint needs next to its weights, as flat files.

transformers' remote-code loader copies a module and the files of its relative imports, and
it only understands flat imports ``from .name import x`` that resolve to a sibling ``name.py``.
The package keeps the op in the sub-package ``ops/``, so a checkpoint gets flat copies:
``ops/__init__.py`` becomes ``trellis_ops.py``, ``ops/X.py`` becomes ``trellis_ops_X.py``, and
only the relative import lines are rewritten to match. Everything else is copied verbatim.

When the classes themselves were loaded as remote code, their files are already flat and
transformers copies them on save by itself; :func:`code_is_packaged` tells the two apart.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Modules of the package a checkpoint needs besides the op; this file is one of them because
# the configuration imports it.
CHECKPOINT_MODULES = ("configuration_trellis", "modeling_trellis", "cache_trellis", "model_card_trellis", "remote_code")
OPS_PACKAGE = "ops"
FLAT_OPS = "trellis_ops"

AUTO_MAP = {
    "AutoConfig": "configuration_trellis.TrellisConfig",
    "AutoModel": "modeling_trellis.TrellisModel",
    "AutoModelForCausalLM": "modeling_trellis.TrellisForCausalLM",
}

_HERE = Path(__file__).resolve().parent
# `from <dots><module> import`, at any indentation, as transformers' loader matches it.
_RELATIVE_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.+)(?P<module>[\w.]*)[ \t]+import\b", re.MULTILINE)


def code_is_packaged() -> bool:
    """True when running from the ``trellis_lm`` package (``ops/`` is a sub-package here)."""
    return (_HERE / OPS_PACKAGE / "__init__.py").is_file()


def flat_name(module: str, inside_ops: bool) -> str:
    """The flat module name for a relative import target.

    From the package root, ``ops`` -> ``trellis_ops``, ``ops.X`` -> ``trellis_ops_X`` and any
    other sibling keeps its name; from inside ``ops/``, ``X`` -> ``trellis_ops_X``.
    """
    parts = module.split(".")
    if inside_ops and len(parts) == 1:
        return f"{FLAT_OPS}_{module}"
    if not inside_ops and parts[0] == OPS_PACKAGE and len(parts) <= 2:
        return FLAT_OPS if len(parts) == 1 else f"{FLAT_OPS}_{parts[1]}"
    if not inside_ops and len(parts) == 1:
        return module
    raise ValueError(f"cannot flatten the relative import of {module!r} (inside ops: {inside_ops})")


def flatten_imports(source: str, inside_ops: bool) -> str:
    """Rewrite the relative import lines of ``source`` to the flat names of :func:`flat_name`.

    Raises ``ValueError`` for relative imports the flat layout cannot express
    (``from . import x``, ``from .. import x``, deeper packages).
    """

    def rewrite(match: re.Match) -> str:
        if match["dots"] != "." or not match["module"]:
            raise ValueError(f"cannot flatten {match.group(0).strip()!r}: only `from .name import ...` is supported")
        return f"{match['indent']}from .{flat_name(match['module'], inside_ops)} import"

    return _RELATIVE_IMPORT.sub(rewrite, source)


def flat_sources() -> dict[str, str]:
    """File name in a checkpoint -> source text, for every module the checkpoint code needs."""
    if not code_is_packaged():
        raise RuntimeError("the flat checkpoint code can only be built from the trellis_lm package")
    sources = {
        f"{name}.py": flatten_imports((_HERE / f"{name}.py").read_text(encoding="utf-8"), inside_ops=False)
        for name in CHECKPOINT_MODULES
    }
    for path in sorted((_HERE / OPS_PACKAGE).glob("*.py")):
        name = FLAT_OPS if path.stem == "__init__" else f"{FLAT_OPS}_{path.stem}"
        sources[f"{name}.py"] = flatten_imports(path.read_text(encoding="utf-8"), inside_ops=True)
    return sources


def export_code(save_directory: str | os.PathLike) -> list[Path]:
    """Write :func:`flat_sources` into ``save_directory``; returns the paths written."""
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in flat_sources().items():
        (folder / name).write_text(text, encoding="utf-8")
        written.append(folder / name)
    return written
