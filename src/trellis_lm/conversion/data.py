"""Distillation data: texts read from files, token tensors or datasets, as rows of token ids,
and their batches."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from ..arguments import argument, json_lines, utf8_text

TrainData = Union[Sequence[str], torch.Tensor, Dataset]
PathLike = Union[str, os.PathLike]
TEXT_SUFFIXES = (".txt", ".jsonl")


def read_texts(paths: Union[PathLike, Sequence[PathLike]], name: str = "paths") -> list[str]:
    """Texts from ``.txt`` files (one text each), ``.jsonl`` files (a ``"text"`` string per line)
    and folders of them (every such file below, in sorted order); a single path is one path.

    Raises:
        ValueError: naming the argument ``name`` (:func:`~trellis_lm.arguments.argument`), the file
            and, in a ``.jsonl`` file, the line: no path given, a path that does not exist or
            is of another kind, bytes that are not UTF-8, a line that is not JSON or has no
            ``"text"`` string, no text at all.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError(f"{argument(name)}: no training texts given: expected .txt or .jsonl files, or folders "
                         "of them")
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"{argument(name)}: {path}: no such file or folder")
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()))
        elif path.suffix in TEXT_SUFFIXES:
            files.append(path)
        else:
            raise ValueError(f"{argument(name)}: {path}: expected a .txt or .jsonl file, or a folder of them")
    texts = [text for file in files for text in _file_texts(file, name)]
    if not texts:
        raise ValueError(f"{argument(name)}: {' '.join(map(str, paths))}: no texts found")
    return texts


def _file_texts(file: Path, name: str) -> list[str]:
    """The texts of one ``.txt`` or ``.jsonl`` file; errors name the file and its line."""
    if file.suffix == ".txt":
        return [utf8_text(file.read_bytes(), file, argument(name))]
    texts = []
    for number, record in json_lines(file, argument(name), '{"text": "..."}'):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f'{argument(name)}: {file} line {number} has no "text" string: expected one '
                             '{"text": "..."} object per line')
        texts.append(record["text"])
    return texts


class TokenBlocks(Dataset):
    """Rows of token ids; item i is ``{"input_ids": LongTensor [T_i]}``."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        self.rows = [torch.as_tensor(row, dtype=torch.long) for row in rows]

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, block_size: int) -> "TokenBlocks":
        """Tokenize ``texts``, join them with the EOS token, and cut the stream into blocks of
        ``block_size`` tokens (the last block may be shorter; one of fewer than 2 tokens is
        dropped, as it holds no prediction)."""
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        stream = torch.tensor([token for row in ids for token in row + separator], dtype=torch.long)
        return cls([block for block in stream.split(block_size) if len(block) >= 2])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


def check_token_ids(name: str, ids: torch.Tensor, *models: Any) -> None:
    """Refuse ``ids`` (the argument ``name``) unless they are integer token ids of every one of
    ``models``' vocabularies (``config.vocab_size``): floats would be truncated, an id past a
    vocabulary fails inside an embedding. Raises a ``ValueError`` naming ``name``."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be a tensor of integer token ids, got "
                         f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    vocab = min(model.config.vocab_size for model in models)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} holds token ids in [{int(ids.min())}, {int(ids.max())}], but the models' vocabulary "
                         f"is [0, {vocab})")


def as_dataset(data: TrainData, tokenizer: Optional[PreTrainedTokenizerBase], block_size: int) -> Dataset:
    """A map-style dataset of ``{"input_ids"[, "attention_mask"]}`` items from any accepted form."""
    if isinstance(data, torch.Tensor):
        return TokenBlocks(list(data))
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], str):
        if tokenizer is None:
            raise ValueError("texts need a tokenizer: pass tokenizer=")
        return TokenBlocks.from_texts(data, tokenizer, block_size)
    return data


def pad_batch(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (with 0: padding is masked out everywhere) -> ``[B, T]`` ids and mask."""
    rows = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
    masks = [torch.as_tensor(f.get("attention_mask", torch.ones_like(row)), dtype=torch.long)
             for f, row in zip(features, rows)]
    return {
        "input_ids": nn.utils.rnn.pad_sequence(rows, batch_first=True),
        "attention_mask": nn.utils.rnn.pad_sequence(masks, batch_first=True),
    }


__all__ = ["TokenBlocks", "TrainData", "as_dataset", "check_token_ids", "pad_batch", "read_texts"]
