"""The single-token step of the torch backend: what decoding runs once per layer and token.

The loop body of the design page (section 1) for one token, arranged to launch few tensor
operations: on CPUs a decode step's cost is mostly per-operation overhead, not arithmetic on
the [H, M, D] memories. Same arithmetic as :mod:`.reference` (``tests/test_lattice_ops.py``).
"""

from __future__ import annotations

import torch

from .state import LatticeState
from .terms import rownorm, token_terms


def step_forward(q, k, v, gamma, state, chunk_size, variant, cu_seqlens):
    """One token per row (``T == 1``, no ``cu_seqlens``); arguments as validated by
    :func:`~.dispatch.lattice_attention`: q, k ``[N, 1, H, M]``, v ``[N, 1, H, D]``, gamma
    ``[N, 1, H]``. Returns ``o [N, 1, H, D]`` and the state."""
    u, a, offset = state.memory, state.anchor, state.offset
    starts_chunk = (offset == 0)[:, None, None, None]
    # Eagerly on CPUs, renormalising only when some row starts a chunk saves two memory-sized
    # passes per step (reading the flag is no device sync there); on GPUs, and compiled, the
    # select runs every step instead of waiting on the device.
    if q.device.type != "cpu" or torch.compiler.is_compiling() or bool(starts_chunk.any()):
        s = rownorm(u)
        u = torch.where(starts_chunk, s, u)
        a = torch.where(starts_chunk, s, a)
    rows, _, heads, slots = q.shape
    dim = v.shape[-1]
    # With one token per row, [N, 1, H, *] is [N, H, *] in the same memory: views, not selects.
    b, w = token_terms(variant, a, k.view(rows, heads, slots), v.view(rows, heads, dim),
                       gamma.view(rows, heads))  # [N, H, M], [N, H, D]
    b = b.view(rows, heads, slots, 1)
    # u - b (w - (a . w) a) = (u - outer(b, w)) + (b (a . w)) a; a . w as the row vector w times
    # a's transpose (torch's CPU batched matmul is several times slower as matrix @ column)
    u = torch.addcmul(torch.addcmul(u, b, w.view(rows, heads, 1, dim), value=-1),
                      b * (w.view(rows, heads, 1, dim) @ a.mT).view(rows, heads, slots, 1), a)
    o = (q.view(rows, heads, 1, slots) @ rownorm(u)).view(rows, 1, heads, dim)  # [N, H, 1, D] has its layout
    return o, LatticeState(u, a, (offset + 1) % chunk_size)
