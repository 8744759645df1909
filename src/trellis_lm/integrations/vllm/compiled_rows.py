"""The compiled mixer calls of the vLLM plugin under ``compile_decode`` (CPU): a memory mixer's
rows of one token and of draft tokens, whose steps are mostly per-operation overhead on a CPU,
through ``torch.compile`` (:func:`advanced_compiled`). ``generate()``'s compiled decode step is
:mod:`trellis_lm.compiled_decode`'s."""

from __future__ import annotations

from functools import cache
from typing import Any, Callable

import torch
from torch import nn

from ...cache_entries import MemoryEntry
from ...compiled_decode import plain_tensor, warn_recompile_limit


def _advance(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry) -> tuple[torch.Tensor, MemoryEntry]:
    return mixer.advance(x, None, entry)


def _advance_each(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry) -> tuple[torch.Tensor, list[MemoryEntry]]:
    return mixer.advance_each(x, entry)


@cache
def _compiled_mixer(each: bool) -> Callable:
    return torch.compile(_advance_each if each else _advance, fullgraph=True)


def advanced_compiled(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry,
                      each: bool) -> tuple[torch.Tensor, Any]:
    """A memory ``mixer``'s :meth:`~trellis_lm.mixers.MemoryMixer.advance` on ``x [B, T, D]``
    (every token real; ``each``: :meth:`~trellis_lm.mixers.MemoryMixer.advance_each`) from
    ``entry``, through ``torch.compile``: the unit a server compiles. As
    :class:`~trellis_lm.compiled_decode.CompiledSegments`: one compiled function per
    process, eager past the recompile limit, with a warning.

    The compiled function guards on its inputs' layout and kind: a server hands in views of its
    state slots (at offsets, strided), copies, and tensors made in inference mode (which carry
    other dispatch keys), so each input that is not a plain dense tensor of its own is copied
    into one first (outside inference mode), a tensor the entry holds under two names (a
    state's stand-ins, see :class:`~trellis_lm.integrations.vllm.slots.SlotLayout`) once: one
    compilation per batch shape, not one per mix."""
    with torch.inference_mode(False), torch.no_grad():
        copies: dict[int, torch.Tensor] = {}  # one copy of a tensor the entry holds twice: still one

        def plain(t: torch.Tensor) -> torch.Tensor:
            return copies.setdefault(id(t), plain_tensor(t))

        x = plain_tensor(x)
        entry = entry.map(plain)
        if x.shape[0] > 1:  # any batch of several rows: one compilation (a batch of one is its own)
            for t in (x, *entry.tensors().values()):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            return _compiled_mixer(each)(mixer, x, entry)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warn_recompile_limit()
            return (_advance_each if each else _advance)(mixer, x, entry)
