"""Distillation data: texts, token tensors or datasets, as rows of token ids, and their batches."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

TrainData = Union[Sequence[str], torch.Tensor, Dataset]


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


__all__ = ["TokenBlocks", "TrainData", "as_dataset", "pad_batch"]
