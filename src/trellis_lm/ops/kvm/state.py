"""The state KVM carries from one call to the next: compressed rows plus the raw window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import OpState


@dataclass
class KVMState(OpState):
    """Compressed state, block window and counters of N sequences (design page ``kvm.md``).

    Every tensor is preallocated to its largest size, so the state of a sequence has the same
    shapes after 1 token as after a million (``S = state_size``, ``W = window_chunks *
    chunk_size``); counters say which entries hold data.

    Attributes:
        keys: ``[N, H, S, Dk]`` the key sums ``SK`` (rows ``>= used`` are zero). They are plain
            sums of gated prepared keys; ``LN_s`` is applied at every read and merge.
        values: ``[N, H, S, Dv]`` the value sums ``SV`` (rows ``>= used`` are zero).
        radii: ``[N, H, S]`` each row's read-out radius ``r``, fixed when the row was created.
        used: ``[N]`` int64, state rows in use (the same for every head).
        window_k: ``[N, H, W, Dk]`` the window's raw keys (RoPE applied, not prepared), in order:
            slot ``s`` holds the token at position ``covered + s``; slots ``>= seen - covered``
            are zero.
        window_v: ``[N, H, W, Dv]`` the window's values, laid out like ``window_k``.
        window_g: ``[N, H, W]`` the window's merge gates, laid out like ``window_k``.
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
        """The state before the first token: no rows, an empty window."""

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        def counter() -> torch.Tensor:
            return torch.zeros(rows, dtype=torch.long, device=device)

        return cls(
            zeros(rows, heads, state_size, dk), zeros(rows, heads, state_size, dv), zeros(rows, heads, state_size),
            counter(), zeros(rows, heads, window, dk), zeros(rows, heads, window, dv), zeros(rows, heads, window),
            counter(), counter(),
        )
