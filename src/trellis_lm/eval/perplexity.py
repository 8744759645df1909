"""Perplexity of a causal LM on held-out token files: at one window length, and by position
along long files read in one pass (how a model fares past its training length)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


@torch.no_grad()
def perplexity(model: PreTrainedModel, files: Sequence[torch.Tensor], length: int, max_windows: int,
               batch_size: int = 16) -> float:
    """exp(mean next-token loss) over non-overlapping windows of ``length + 1`` tokens of the
    files (every token predicted from its window's earlier tokens only). Of all the files'
    windows at most ``max_windows`` are used, evenly spaced over the list, so every part of the
    split is sampled rather than its first files."""
    windows = [f[s : s + length + 1] for f in files for s in range(0, f.numel() - length - 1, length)]
    windows = evenly_spaced(windows, max_windows)
    if not windows:
        raise ValueError(f"no held-out file holds a window of {length + 1} tokens")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i : i + batch_size]).long()
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def evenly_spaced(items: list, count: int) -> list:
    """At most ``count`` of ``items``, evenly spaced over the list (all of them when fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def position_buckets(length: int, train_length: int) -> list[tuple[int, int]]:
    """``[0, L), [L, 2L), [2L, 4L), ...`` up to ``length`` (L the training length)."""
    buckets, start, end = [], 0, train_length
    while start < length:
        buckets.append((start, min(end, length)))
        start, end = end, 2 * end
    return buckets


@torch.no_grad()
def perplexity_by_position(model: PreTrainedModel, files: Sequence[torch.Tensor], length: int, train_length: int,
                           max_files: int, reset_every: Optional[int] = None) -> dict[str, float]:
    """Up to ``max_files`` held-out files of at least ``length + 1`` tokens (evenly spaced over
    the eligible ones), each read in one pass over its first ``length + 1`` tokens; perplexity per
    position bucket (:func:`position_buckets`), keyed ``"start-end"``.

    With ``reset_every``, each file is read instead in consecutive segments of that many tokens,
    each from a fresh state (every token then sees at most ``reset_every`` tokens of context):
    the same tokens scored, so the two readings differ only by what the model carries from far
    back."""
    if reset_every is not None and reset_every < 1:
        raise ValueError(f"reset_every must be a positive number of tokens or None, got {reset_every}")
    long_files = [f[: length + 1].long() for f in evenly_spaced([f for f in files if f.numel() > length], max_files)]
    if not long_files:
        raise ValueError(f"no held-out file holds {length + 1} tokens")
    segment = reset_every or length
    losses = torch.zeros(length)
    for tokens in long_files:
        for start in range(0, length, segment):
            piece = tokens[start : min(start + segment, length) + 1]
            logits = model(input_ids=piece[None, :-1], use_cache=False).logits[0]
            losses[start : start + piece.numel() - 1] += F.cross_entropy(logits.float(), piece[1:], reduction="none")
    losses /= len(long_files)
    return {f"{a}-{b}": math.exp(losses[a:b].mean().item()) for a, b in position_buckets(length, train_length)}
