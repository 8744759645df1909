"""The chunk-parallel form of the design page, section 2, in batched PyTorch.

Every sequence is laid on a grid whose chunks start at multiples of C: sequence n's token j
sits at grid position ``offset_n + j``. The free grid cells are fillers with gamma = 0 and
log_beta = 0, which leave the memories untouched, so rows that resume mid-chunk, rows of
different length (``cu_seqlens``) and rows that resume at a chunk boundary all share one set
of chunk boundaries and are processed together. Within a chunk the state-independent parts
(decays, the masked ``D * Q K^T``) are computed for all chunks at once; only the chain from
one chunk's state to the next runs as a Python loop over chunks.
"""

from __future__ import annotations

import torch

from ..varlen import from_chunks, grid_positions, to_chunks
from .functions import compress_residual_vjp, mix
from .state import TrellisState


def chunked_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, cu_seqlens):
    """Backend ``"torch"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`."""
    batch, length, heads, _ = q.shape
    rows, chunk = state.offset.numel(), chunk_size
    flat_index, lengths, grid = grid_positions(state.offset, batch, length, cu_seqlens, chunk)
    Q, K, V, A, LB, G = (
        to_chunks(x.reshape((batch * length,) + tuple(x.shape[2:])), flat_index, rows, grid, chunk)
        for x in (q, k, v, alpha, log_beta, gamma)
    )  # Q: [N, H, chunks, C, Dk]; LB, G: [N, H, chunks, C]

    # State-independent per-chunk quantities, for all chunks at once (decays in log space).
    cum = LB.cumsum(-1)
    mu = cum.exp()[..., None]  # [N, H, chunks, C, 1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    gap = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf"))
    decay = gap.exp() * G[..., None, :]  # D[r, i] = gamma_i exp(c_r - c_i), i <= r
    dqk = decay * (Q @ K.transpose(-1, -2))
    mu_last = cum[..., -1:].exp()[..., None]  # [N, H, chunks, 1, 1]
    w = (G * (cum[..., -1:] - cum).exp())[..., None]  # [N, H, chunks, C, 1]

    s_k, s_v = state.m_k, state.m_v
    # Rows that resume at a chunk boundary take their anchor from the state itself.
    at_start = (state.offset == 0)[:, None, None, None]
    a_k = torch.where(at_start, s_k, state.anchor_k)
    a_v = torch.where(at_start, s_v, state.anchor_v)
    last_chunk = ((state.offset + lengths - 1).clamp(min=0) // chunk)[:, None, None, None]
    final_a_k, final_a_v = a_k, a_v
    outputs = []
    for c in range(grid // chunk):
        Kc, Vc, Ac = K[:, :, c], V[:, :, c], A[:, :, c]
        u_k = compress_residual_vjp(compress_fn, Kc @ a_k.transpose(-1, -2), Ac)  # [N, H, C, M]
        h = mix(mix_fn, mu[:, :, c] * (Q[:, :, c] @ s_k.transpose(-1, -2)) - dqk[:, :, c] @ u_k)
        u_v = compress_residual_vjp(compress_fn, Vc @ a_v.transpose(-1, -2), Ac)
        outputs.append(mu[:, :, c] * (h @ s_v) - (decay[:, :, c] * (h @ u_v.transpose(-1, -2))) @ Vc)
        final_a_k = torch.where(last_chunk == c, a_k, final_a_k)
        final_a_v = torch.where(last_chunk == c, a_v, final_a_v)
        s_k = mu_last[:, :, c] * s_k - (w[:, :, c] * u_k).transpose(-1, -2) @ Kc
        s_v = mu_last[:, :, c] * s_v - (w[:, :, c] * u_v).transpose(-1, -2) @ Vc
        a_k, a_v = s_k, s_v

    o = torch.stack(outputs, dim=2)  # [N, H, chunks, C, Dv]
    # A sequence with no tokens hands its initial state back untouched, anchors included.
    empty = (lengths == 0)[:, None, None, None]
    final = TrellisState(
        s_k,
        s_v,
        torch.where(empty, state.anchor_k, final_a_k),
        torch.where(empty, state.anchor_v, final_a_v),
        (state.offset + lengths) % chunk,
    )
    return from_chunks(o, flat_index, batch, length), final
