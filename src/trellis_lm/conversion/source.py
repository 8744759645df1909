"""Where a conversion's teacher comes from: a Hugging Face checkpoint folder or a GGUF file.

:func:`locate_source` decides which from the path alone (so its errors need no optional
package); :class:`TeacherSource` then loads the config, the model and the tokenizer the same way
for both, and :func:`copy_tokenizer` puts the tokenizer into a converted folder: a folder's
files byte for byte together with the code its ``auto_map`` names (:func:`copy_auto_map_code`),
or, for a GGUF file, the tokenizer transformers builds from the file's metadata.

transformers reads GGUF files (``from_pretrained(folder, gguf_file=name)``) only when the
``gguf`` package is installed, and dequantizes the weights to float32.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.utils import is_gguf_available

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
GGUF_INSTALL_HINT = "pip install gguf (or, in a clone of trellis-lm, pip install '.[real]')"

# Files a checkpoint's tokenizer and chat template may live in; copied byte for byte.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)

# The relative imports transformers' remote-code loader follows (and so requires next to a module):
# `from .name import ...` and `import .name`, at any indentation.
_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\w+)\s+import\b|import\s+\.(\w+)\s*$)", re.MULTILINE)


@dataclass(frozen=True)
class TeacherSource:
    """A teacher checkpoint on disk: the folder transformers loads from, and the GGUF file in it
    (``None`` for a Hugging Face folder with ``config.json`` and weights)."""

    folder: Path
    gguf_file: Optional[str] = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def path(self) -> Path:
        """What a conversion reads: the folder, or only the GGUF file (a folder may hold it among
        other things, which a conversion may write beside)."""
        return self.folder / (self.gguf_file or "")

    def __str__(self) -> str:
        return str(self.path)

    def load_config(self) -> PreTrainedConfig:
        """The teacher's config (for a GGUF file, built from its metadata)."""
        return AutoConfig.from_pretrained(self.folder, **self._gguf_kwargs())

    def load_model(self, dtype: Union[str, torch.dtype] = "auto") -> PreTrainedModel:
        """The teacher model; a GGUF file's weights are dequantized (float32 unless ``dtype`` says)."""
        return AutoModelForCausalLM.from_pretrained(self.folder, dtype=dtype, **self._gguf_kwargs())

    def load_tokenizer(self) -> Any:
        """The teacher's tokenizer (for a GGUF file, built from its metadata)."""
        return AutoTokenizer.from_pretrained(self.folder, **self._gguf_kwargs())

    def _gguf_kwargs(self) -> dict[str, str]:
        if not self.is_gguf:
            return {}
        if not is_gguf_available():
            # transformers would raise an ImportError deep inside from_pretrained; say what to do.
            raise ValueError(f"{self}: reading a GGUF file needs the gguf package (>= 0.10): {GGUF_INSTALL_HINT}")
        return {"gguf_file": self.gguf_file}


def locate_source(src: Union[str, Path]) -> TeacherSource:
    """The teacher checkpoint at ``src``, told apart by the path alone (no optional package needed).

    ``src`` may be a Hugging Face checkpoint folder (it has ``config.json``, which wins over any
    ``.gguf`` beside it), a ``.gguf`` file, or a folder without ``config.json`` holding exactly
    one ``.gguf`` file.

    Raises:
        ValueError: ``src`` does not exist, is a file other than ``.gguf``, or is a folder with
            neither ``config.json`` nor a ``.gguf`` file, or with several ``.gguf`` files (named,
            so the caller can pass the one meant).
    """
    src = Path(src)
    if src.is_file():
        if src.suffix.lower() != GGUF_SUFFIX:
            raise ValueError(
                f"{src} is a file but not a {GGUF_SUFFIX} file: expected a checkpoint folder (with config.json) "
                f"or a {GGUF_SUFFIX} file"
            )
        return TeacherSource(src.parent, src.name)
    if not src.is_dir():
        raise ValueError(f"{src} is not a local checkpoint folder or {GGUF_SUFFIX} file: download it first")
    if (src / "config.json").is_file():
        return TeacherSource(src)
    ggufs = sorted(p.name for p in src.iterdir() if p.is_file() and p.suffix.lower() == GGUF_SUFFIX)
    if len(ggufs) > 1:
        raise ValueError(
            f"{src} holds {len(ggufs)} {GGUF_SUFFIX} files ({', '.join(ggufs)}): pass the file to convert, "
            f"e.g. {src / ggufs[0]}"
        )
    if not ggufs:
        raise ValueError(
            f"{src} is not a local checkpoint folder (no config.json, and no {GGUF_SUFFIX} file): download it first"
        )
    return TeacherSource(src, ggufs[0])


def copy_tokenizer(source: TeacherSource, dst: Path, keep: Iterable[str] = ()) -> None:
    """Put the teacher's tokenizer and chat template into the converted folder ``dst``.

    A folder's tokenizer files are copied byte for byte, with the code files their ``auto_map``
    needs (:func:`copy_auto_map_code`; files named in ``keep``, the converted model's own code,
    are never overwritten). A GGUF file has no tokenizer files: the tokenizer transformers builds
    from its metadata (vocabulary, merges, special tokens, chat template) is saved instead.
    """
    if source.is_gguf:
        source.load_tokenizer().save_pretrained(dst)
        return
    for name in TOKENIZER_FILES:
        if (source.folder / name).is_file():
            shutil.copyfile(source.folder / name, dst / name)
    copy_auto_map_code(source.folder, dst, keep=keep)


def copy_auto_map_code(src: Path, dst: Path, keep: Iterable[str] = ()) -> list[str]:
    """Copy the code files that the ``auto_map`` entries of ``src``'s ``tokenizer_config.json`` and
    ``config.json`` name, and the files they import relatively, from ``src`` to ``dst``.

    The tokenizer files are copied with their ``auto_map``, and transformers' remote-code loader
    (``trust_remote_code=True``) then looks for ``module.py`` next to them for every
    ``module.Class`` entry, and for each file that module imports as ``from .name import``.
    References into other repositories (``repo--module.Class``) carry no local file and are left
    as they are. A named file that ``src`` lacks is logged and skipped (the source could not load
    it either); files named in ``keep`` are not overwritten (the converted model's own code).

    Returns the names of the files copied, sorted.
    """
    keep = set(keep)
    pending = [f"{module}.py" for module in _auto_map_modules(src)]
    copied: set[str] = set()
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        path = src / name
        if not path.is_file():
            logger.warning("%s: the auto_map needs %s, which is not in the folder; not copied", src, name)
            continue
        if name in keep:
            if path.read_bytes() != (dst / name).read_bytes():
                logger.warning("%s: keeping the converted model's own %s rather than the source's", src, name)
            continue
        shutil.copyfile(path, dst / name)
        copied.add(name)
        source = path.read_text(encoding="utf-8")
        pending.extend(f"{a or b}.py" for a, b in _RELATIVE_IMPORT.findall(source))
    return sorted(copied)


def _auto_map_modules(folder: Path) -> set[str]:
    """The modules ``module`` of every local ``module.Class`` in the folder's two ``auto_map``s."""
    references: list[Any] = []
    for name in ("tokenizer_config.json", "config.json"):
        if (folder / name).is_file():
            auto_map = json.loads((folder / name).read_text(encoding="utf-8")).get("auto_map") or {}
            # A tokenizer's auto_map is {"AutoTokenizer": [slow, fast]}, or that list alone (legacy).
            references.extend(auto_map.values() if isinstance(auto_map, dict) else [auto_map])
    modules = set()
    for reference in references:
        for item in reference if isinstance(reference, (list, tuple)) else [reference]:
            if isinstance(item, str) and "--" not in item and "." in item:
                modules.add(item.rpartition(".")[0])
    return modules


__all__ = ["TOKENIZER_FILES", "TeacherSource", "copy_auto_map_code", "copy_tokenizer", "locate_source"]


def path_overlap(path: Path, other: Path) -> Optional[str]:
    """How ``path`` overlaps ``other`` ("is", "lies inside", "holds"), or ``None`` if it does not."""
    if _path_inside(path, other):
        return "is" if _path_inside(other, path) else "lies inside"
    return "holds" if _path_inside(other, path) else None


def _path_inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it, however either is spelt: by their resolved
    names (symlinks followed; also for paths yet to be created), and by identity on disk, which
    also sees bind mounts and case-insensitive names."""
    path, folder = path.resolve(), folder.resolve()
    if folder == path or folder in path.parents:
        return True
    return folder.exists() and any(p.exists() and os.path.samefile(p, folder) for p in (path, *path.parents))
