"""What decoding costs after a long context: ms per token and the bytes a model's cache holds."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import PreTrainedModel

from ..cache_trellis import CACHE_ARG


@torch.no_grad()
def decode_cost(model: PreTrainedModel, context: torch.Tensor, steps: int = 16) -> dict[str, float]:
    """ms per generated token (greedy, batch 1) after reading ``context`` (1-D ids) in one call,
    and the bytes of the model's cache then."""
    out = model(input_ids=context[None].long(), use_cache=True)
    cache = getattr(out, CACHE_ARG)
    token = out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, use_cache=True, **{CACHE_ARG: cache})
        cache = getattr(out, CACHE_ARG)
        token = out.logits[:, -1:].argmax(-1)
    ms = (time.perf_counter() - started) / steps * 1e3
    return {"ms_per_token": ms, "cache_bytes": cache_nbytes(cache)}


def cache_nbytes(cache: Any) -> int:
    """Bytes of every tensor a cache holds (a :class:`TrellisCache` or transformers' own)."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
