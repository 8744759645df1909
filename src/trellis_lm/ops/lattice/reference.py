"""The per-token loop of the design page, section 1: slow, plain, and the ground truth.

Vectorised over sequences and heads only; every token is one step of the loop, exactly as
written on the design page. Packed input (``cu_seqlens``) runs one sequence at a time.
"""

from __future__ import annotations

import torch

from ..varlen import per_sequence
from .state import LatticeState
from .terms import rownorm, token_terms


def _run_rows(q, k, v, gamma, state, chunk_size, variant):
    """Inputs ``[N, T, H, *]`` in the compute dtype; each row starts from its own state."""
    u, a, offset = state.memory, state.anchor, state.offset
    outputs = []
    for t in range(q.shape[1]):
        starts_chunk = ((offset + t) % chunk_size == 0)[:, None, None, None]
        if bool(starts_chunk.any()):  # A = U = S for the rows whose token starts a chunk
            s = rownorm(u)
            u = torch.where(starts_chunk, s, u)
            a = torch.where(starts_chunk, s, a)
        b, w = token_terms(variant, a, k[:, t], v[:, t], gamma[:, t])  # [N, H, M], [N, H, D]
        a_dot_w = a @ w[..., None]  # [N, H, M, 1]
        u = u - b[..., None] * (w[..., None, :] - a_dot_w * a)  # each slot moves orthogonally to a_i
        s = rownorm(u)
        outputs.append((q[:, t, :, None, :] @ s)[..., 0, :])  # S^T q, read after the write
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, LatticeState(u, a, (offset + q.shape[1]) % chunk_size)


def reference_forward(q, k, v, gamma, state, chunk_size, variant, cu_seqlens):
    """Backend ``"reference"``; arguments as validated by :func:`~.dispatch.lattice_attention`."""
    def run(*args):
        return _run_rows(*args, chunk_size, variant)

    return per_sequence(run, (q, k, v, gamma), state, cu_seqlens)
