"""The state KVM carries from one call to the next: compressed rows plus the raw window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from ..state import OpState
from .functions import KVMConfig


@dataclass
class KVMState(OpState):
    """Compressed state, block window and counters of N sequences (design page ``kvm.md``).

    The state rows and the window live in buffers of ``R <= S = state_size`` rows and ``W' <= W
    = window_chunks * chunk_size`` slots; counters say which entries hold data, and entries
    past them are zero. The op grows the buffers with the tokens (:func:`room_for`), never by
    ``S`` or ``W`` alone, so a short sequence costs what its tokens need whatever the settings;
    once they reach ``(S, W)`` a sequence's state has the same shapes after a thousand tokens
    as after a million.

    Attributes:
        keys: ``[N, H, R, Dk]`` the key sums ``SK`` (rows ``>= used`` are zero). They are plain
            sums of gated prepared keys; ``LN_s`` is applied at every read and merge.
        values: ``[N, H, R, Dv]`` the value sums ``SV`` (rows ``>= used`` are zero).
        radii: ``[N, H, R]`` each row's read-out radius ``r``, fixed when the row was created.
        used: ``[N]`` int64, state rows in use (the same for every head).
        window_k: ``[N, H, W', Dk]`` the window's raw keys (RoPE applied, not prepared), in order:
            slot ``s`` holds the token at position ``covered + s``; slots ``>= seen - covered``
            are zero.
        window_v: ``[N, H, W', Dv]`` the window's values, laid out like ``window_k``.
        window_g: ``[N, H, W']`` the window's merge gates, laid out like ``window_k``.
        seen: ``[N]`` int64, tokens processed so far (the position of the next token).
        covered: ``[N]`` int64, tokens folded into the state so far, a multiple of the chunk
            size; it is also the position of the window's first token.

    Tensors are float32, or float64 when the op ran in float64.
    """

    keys: torch.Tensor
    values: torch.Tensor
    radii: torch.Tensor
    used: torch.Tensor
    window_k: torch.Tensor
    window_v: torch.Tensor
    window_g: torch.Tensor
    seen: torch.Tensor
    covered: torch.Tensor

    @classmethod
    def empty(
        cls, rows: int, heads: int, state_size: int, window: int, dk: int, dv: int,
        *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
    ) -> "KVMState":
        """The state before the first token: no rows, an empty window, in buffers of
        ``state_size`` rows and ``window`` slots (at most the op's ``state_size`` and ``W``).
        ``0, 0`` is enough: the op grows the buffers as the tokens need."""

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def counter() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        return cls(
            zeros(rows, heads, state_size, dk), zeros(rows, heads, state_size, dv), zeros(rows, heads, state_size),
            counter(), zeros(rows, heads, window, dk), zeros(rows, heads, window, dv), zeros(rows, heads, window),
            counter(), counter(),
        )

    @property
    def room(self) -> tuple[int, int]:
        """``(R, W')``: the state rows and window slots the buffers hold."""
        return self.keys.shape[2], self.window_k.shape[2]

    def with_room(self, rows: int, window: int) -> "KVMState":
        """This state in buffers of at least ``rows`` state rows and ``window`` window slots, the
        new entries zero (``self`` when it has them): the same state, as every entry past the
        counters is zero."""
        more_rows, more_slots = max(rows - self.keys.shape[2], 0), max(window - self.window_k.shape[2], 0)
        if not (more_rows or more_slots):
            return self
        more = dict(keys=more_rows, values=more_rows, radii=more_rows,
                    window_k=more_slots, window_v=more_slots, window_g=more_slots)

        def grow(x: torch.Tensor, n: int) -> torch.Tensor:  # n zeros after dim 2 of [N, H, L, *]
            return F.pad(x, (0, 0) * (x.dim() - 3) + (0, n)) if n else x

        return KVMState(**{name: grow(t, more.get(name, 0)) for name, t in self.tensors().items()})

    @classmethod
    def cat(cls, states: Sequence["KVMState"]) -> "KVMState":
        """The states of several groups of sequences as one, in order, in buffers as large as
        the largest."""
        rows, window = (max(sizes) for sizes in zip(*(s.room for s in states)))
        return super().cat([s.with_room(rows, window) for s in states])


def covered_after(seen: int, config: KVMConfig) -> int:
    """``covered`` of a sequence that has seen ``seen`` tokens: its chunks that have left the
    window (the page folds chunk ``j - B`` when chunk ``j`` starts)."""
    return max((seen - 1) // config.chunk_size + 1 - config.window_chunks, 0) * config.chunk_size if seen > 0 else 0


def room_for(config: KVMConfig, seen: Iterable[int]) -> tuple[int, int]:
    """``(R, W')``, buffers enough for sequences that have seen ``seen`` tokens: state rows hold
    folded tokens (``used <= covered``), the window at most the tokens seen; ``S`` and ``W`` cap
    both.

    Both grow with the tokens seen, never shrink, so a sequence run in pieces ends with the
    shapes it has when run in one call (when it starts from buffers no larger than these).
    """
    last = max(seen, default=0)
    return min(config.state_size, covered_after(last, config)), min(config.window, last)
