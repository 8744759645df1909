"""The chunk-parallel form of the design page, section 2, in batched PyTorch.

Every sequence is laid on a grid whose chunks start at multiples of C: sequence n's token j
sits at grid position ``offset_n + j``. Free grid cells hold zero inputs, so gamma = 0 and
``b = 0`` for every variant: they leave ``U`` untouched, and their reads (q = 0) are discarded.
Rows that resume mid-chunk, rows of different length (``cu_seqlens``) and rows that resume at a
chunk boundary thus share one set of chunk boundaries and are processed together.

Only the chain of states needs a loop over chunks: each chunk's terms are taken at its anchor,
which is the previous chunk's final ``rownorm(U)``. The loop therefore computes just what the
next anchor needs (``W``, ``Z = W A^T`` and ``U' = U0 + c_L A - B^T W``); the cumulative sums, the
norms and the reads are then computed for all chunks at once from the stacked anchors.
"""

from __future__ import annotations

import torch

from ..varlen import from_chunks, grid_positions, to_chunks
from .state import LatticeState
from .terms import rownorm


def chunked_forward(q, k, v, gamma, state, chunk_size, variant, cu_seqlens):
    """Backend ``"torch"``; arguments as validated by :func:`~.dispatch.lattice_attention`."""
    batch, length, heads, _ = q.shape
    rows, chunk = state.offset.numel(), chunk_size
    flat_index, lengths, grid = grid_positions(state.offset, batch, length, cu_seqlens, chunk)
    Q, K, V, G = (
        to_chunks(x.reshape((batch * length,) + tuple(x.shape[2:])), flat_index, rows, grid, chunk)
        for x in (q, k, v, gamma)
    )  # Q, K: [N, H, chunks, C, M]; V: [N, H, chunks, C, D]; G: [N, H, chunks, C]
    G = G[..., None]
    # For dec and sim, b does not depend on the anchor (nor w for enc and sim): once for all chunks.
    B_all = G * K if variant == "dec" else -G * K if variant == "sim" else None

    # Rows that resume at a chunk boundary start from rownorm(U) (A = U = S); the others keep both.
    at_start = (state.offset == 0)[:, None, None, None]
    s = rownorm(state.memory)
    u = torch.where(at_start, s, state.memory)
    a = torch.where(at_start, s, state.anchor)
    u_first = u
    last_chunk = ((state.offset + lengths - 1).clamp(min=0) // chunk)[:, None, None, None]
    final_u, final_a = u, a
    anchors, ws, zs, bs = [], [], [], []
    for c in range(grid // chunk):
        if c > 0:
            a = u = rownorm(u)
        Kc = K[:, :, c]
        if variant == "dec":
            Wc = Kc @ a - V[:, :, c]  # A^T k - v per token
            Bc = B_all[:, :, c]
        else:
            Wc = V[:, :, c]
        Zc = Wc @ a.transpose(-1, -2)  # [N, H, C, M]: a_i . w_j
        if variant == "enc":
            Bc = G[:, :, c] * (Zc - Kc)  # here Z = V A^T, the reconstruction A v
        elif variant == "sim":
            Bc = B_all[:, :, c]
        c_last = (Bc * Zc).sum(-2)[..., None]  # [N, H, M, 1]
        u = torch.addcmul(u - Bc.transpose(-1, -2) @ Wc, c_last, a)  # U' = U0 + c_L A - B^T W
        final_u = torch.where(last_chunk == c, u, final_u)
        final_a = torch.where(last_chunk == c, a, final_a)
        anchors.append(a)
        zs.append(Zc)
        if variant == "dec":
            ws.append(Wc)
        if variant == "enc":
            bs.append(Bc)

    A = torch.stack(anchors, dim=2)  # [N, H, chunks, M, D]
    Z = torch.stack(zs, dim=2)  # [N, H, chunks, C, M]
    W = torch.stack(ws, dim=2) if variant == "dec" else V
    B = torch.stack(bs, dim=2) if variant == "enc" else B_all
    # Every chunk but the first starts at its anchor (U0 = A, so W U0^T = Z); the first starts
    # from the carried U, which differs from A when resuming mid-chunk.
    u_first = u_first[:, :, None]
    U0 = torch.cat([u_first, A[:, :, 1:]], dim=2)
    WU0 = torch.cat([W[:, :, :1] @ u_first.transpose(-1, -2), Z[:, :, 1:]], dim=2)
    cs = (B * Z).cumsum(-2)  # [N, H, chunks, C, M]
    F = W @ W.transpose(-1, -2)  # [N, H, chunks, C, C]
    R = F.tril(-1) @ B
    quad = (B * (F.diagonal(dim1=-2, dim2=-1)[..., None] * B + 2 * R)).cumsum(-2)  # |sum_j b_j w_j|^2
    n2 = (
        (U0 * U0).sum(-1)[..., None, :]
        + 2 * cs * (A * U0).sum(-1)[..., None, :]
        - 2 * (B * WU0).cumsum(-2)
        + (quad - cs * cs).clamp(min=0)  # the projected sum's squared norm: cancels in low precision
    )  # |u_p,i|^2, >= 1
    Qt = Q * n2.rsqrt()
    # Qt U0 + (Qt c) A = (Qt (1 + c)) A + Qt (U0 - A), and U0 - A is zero past the first chunk.
    Y = (Qt * (1 + cs)) @ A - (Qt @ B.transpose(-1, -2)).tril() @ W
    Y = torch.cat([Y[:, :, :1] + Qt[:, :, :1] @ (u_first - A[:, :, :1]), Y[:, :, 1:]], dim=2)

    # A sequence with no tokens hands its initial state back untouched.
    empty = (lengths == 0)[:, None, None, None]
    final = LatticeState(
        torch.where(empty, state.memory, final_u),
        torch.where(empty, state.anchor, final_a),
        (state.offset + lengths) % chunk,
    )
    return from_chunks(Y, flat_index, batch, length), final
