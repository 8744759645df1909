"""The chunk-parallel form of the design page, section 2, in batched PyTorch.

Every sequence is laid on a grid whose chunks start at multiples of C (:func:`grid_positions`):
a chunk's tokens fill a block of L cells from cell 0, where L is the most real tokens any row
has in one chunk (so L <= min(C, T): a short call costs what its tokens cost, whatever C).
The free cells are fillers with gamma = 0 and log_beta = 0, which leave the memories
untouched, so rows that resume mid-chunk, rows of different length (``cu_seqlens``) and rows
that resume at a chunk boundary all share one set of chunk boundaries and are processed
together. Within a chunk the state-independent parts (decays, the masked ``D * Q K^T``, and
for ``identity`` the triangular solve) are computed for all chunks at once; only the chain
from one chunk's state to the next runs as a Python loop over chunks.
"""

from __future__ import annotations

import torch

from ..varlen import from_chunks, grid_positions, to_chunks
from .functions import compress_residual_vjp, mix
from .state import TrellisState


def log_decays(log_beta: torch.Tensor):
    """The in-chunk log decays of section 2, each summed directly over its own tokens.

    A difference of cumulative sums (``c_r - c_i``) is ``inf - inf`` = NaN once a full forget
    (``log_beta = -inf``) has entered both sums; a direct sum is ``-inf``, whose exp is the exact 0.

    Args:
        log_beta: ``[..., L]`` one chunk's log forget gates (fillers 0).
    Returns:
        ``c [..., L]`` with ``c_r = sum_{j <= r} lb_j``; ``before [..., L]`` = ``c_{r-1}`` (0 at r = 0);
        ``after [..., L]`` = ``sum_{j > i} lb_j`` (= ``c_L - c_i``); ``gap [..., L, L]`` with
        ``gap[r, i] = sum_{i < j <= r} lb_j`` (= ``c_r - c_i``) for i <= r and -inf above the diagonal.
    """
    size = log_beta.shape[-1]
    zero = log_beta.new_zeros(log_beta.shape[:-1] + (1,))
    c = log_beta.cumsum(-1)
    before = torch.cat([zero, c[..., :-1]], dim=-1)
    after = torch.cat([log_beta.flip(-1).cumsum(-1).flip(-1)[..., 1:], zero], dim=-1)
    rows = torch.arange(size, device=log_beta.device)
    below = rows[:, None] > rows[None, :]  # token j = row r' enters gap[r, i] for i < r' <= r
    gap = torch.where(below, log_beta[..., :, None], 0.0).cumsum(-2)
    return c, before, after, gap.masked_fill(~(below | (rows[:, None] == rows[None, :])), float("-inf"))


def identity_residual_basis(x: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, before: torch.Tensor,
                            gap: torch.Tensor):
    """``identity`` residuals at the current state, in the form ``U = W S^T - Z`` (section 2).

    With residuals taken before each token's write, ``u_r = M_{r-1} x_r - alpha_r`` and
    ``M_{r-1} = e^{c_{r-1}} S - sum_{i<r} gamma_i e^{c_{r-1} - c_i} u_i x_i^T``, so
    ``(I + Lm) U = diag(e^{before}) X S^T - A`` with the strictly lower
    ``Lm[r, i] = gamma_i e^{c_{r-1} - c_i} (x_r . x_i)``. One unit-lower-triangular solve,
    batched over every leading dim (rows, heads, chunks), gives ``W`` and ``Z`` for all chunks
    before their start states are known.

    Args:
        x: ``[..., L, D]`` keys (or values); alpha ``[..., L, M]``; gamma, before ``[..., L]``;
        gap: ``[..., L, L]`` from :func:`log_decays`.
    Returns:
        ``(W [..., L, D], Z [..., L, M])``.
    """
    dim = x.shape[-1]
    # gap[r - 1, i] = c_{r-1} - c_i for i < r (row 0 has no earlier token).
    prev = torch.cat([torch.full_like(gap[..., :1, :], float("-inf")), gap[..., :-1, :]], dim=-2)
    lower = prev.exp() * gamma[..., None, :] * (x @ x.transpose(-1, -2))
    rhs = torch.cat([before.exp()[..., None] * x, alpha], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    return solved[..., :dim], solved[..., dim:]


def chunked_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, cu_seqlens):
    """Backend ``"torch"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`."""
    batch, length, heads, _ = q.shape
    rows, chunk = state.offset.numel(), chunk_size
    flat_index, lengths, chunks, width = grid_positions(state.offset, batch, length, cu_seqlens, chunk)
    Q, K, V, A, LB, G = (
        to_chunks(x.reshape((batch * length,) + tuple(x.shape[2:])), flat_index, rows, chunks, width)
        for x in (q, k, v, alpha, log_beta, gamma)
    )  # Q: [N, H, chunks, L, Dk]; LB, G: [N, H, chunks, L]

    # State-independent per-chunk quantities, for all chunks at once (decays in log space).
    cum, before, after, gap = log_decays(LB)
    mu = cum.exp()[..., None]  # [N, H, chunks, L, 1]
    decay = gap.exp() * G[..., None, :]  # D[r, i] = gamma_i exp(c_r - c_i), i <= r
    dqk = decay * (Q @ K.transpose(-1, -2))
    mu_last = cum[..., -1:].exp()[..., None]  # [N, H, chunks, 1, 1]
    w = (G * after.exp())[..., None]  # [N, H, chunks, L, 1]
    identity = compress_fn == "identity"
    if identity:  # residuals at the current state: U = W S^T - Z, whatever the anchors
        w_k, z_k = identity_residual_basis(K, A, G, before, gap)
        w_v, z_v = identity_residual_basis(V, A, G, before, gap)

    s_k, s_v = state.m_k, state.m_v
    # Rows that resume at a chunk boundary take their anchor from the state itself.
    at_start = (state.offset == 0)[:, None, None, None]
    a_k = torch.where(at_start, s_k, state.anchor_k)
    a_v = torch.where(at_start, s_v, state.anchor_v)
    last_chunk = ((state.offset + lengths - 1).clamp(min=0) // chunk)[:, None, None, None]
    final_a_k, final_a_v = a_k, a_v
    outputs = []
    for c in range(chunks):
        Kc, Vc, Ac = K[:, :, c], V[:, :, c], A[:, :, c]
        if identity:
            u_k = w_k[:, :, c] @ s_k.transpose(-1, -2) - z_k[:, :, c]  # [N, H, L, M]
        else:
            u_k = compress_residual_vjp(compress_fn, Kc @ a_k.transpose(-1, -2), Ac)
        h = mix(mix_fn, mu[:, :, c] * (Q[:, :, c] @ s_k.transpose(-1, -2)) - dqk[:, :, c] @ u_k)
        if identity:
            u_v = w_v[:, :, c] @ s_v.transpose(-1, -2) - z_v[:, :, c]
        else:
            u_v = compress_residual_vjp(compress_fn, Vc @ a_v.transpose(-1, -2), Ac)
        outputs.append(mu[:, :, c] * (h @ s_v) - (decay[:, :, c] * (h @ u_v.transpose(-1, -2))) @ Vc)
        final_a_k = torch.where(last_chunk == c, a_k, final_a_k)
        final_a_v = torch.where(last_chunk == c, a_v, final_a_v)
        s_k = mu_last[:, :, c] * s_k - (w[:, :, c] * u_k).transpose(-1, -2) @ Kc
        s_v = mu_last[:, :, c] * s_v - (w[:, :, c] * u_v).transpose(-1, -2) @ Vc
        a_k, a_v = s_k, s_v

    o = torch.stack(outputs, dim=2)  # [N, H, chunks, L, Dv]
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
