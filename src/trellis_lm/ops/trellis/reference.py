"""The per-token loop of the design page, section 1: slow, plain, and the ground truth.

Vectorised over sequences and heads only; every token is one step of the loop, exactly as
written on the design page. Packed input (``cu_seqlens``) runs one sequence at a time.
"""

from __future__ import annotations

import torch

from ..varlen import per_sequence
from .compress_mix import compress_residual_vjp, mix, reads_current_memory
from .state import TrellisState


def _write(memory, anchor, key, alpha, beta, gamma, compress_fn, current):
    """One online-gradient step: ``beta * M - gamma * outer(vjp_phi(A key, phi(A key) - alpha), key)``.

    ``A`` is the anchor, or with ``current`` the memory itself (``"exact"`` writes, and
    ``identity`` whatever C: design page, section 1).

    Shapes: memory, anchor ``[N, H, M, D]``, key ``[N, H, D]``, alpha ``[N, H, M]``,
    beta ``[N, H, 1, 1]``, gamma ``[N, H, 1]``.
    """
    at = memory if current else anchor
    u = compress_residual_vjp(compress_fn, (at @ key[..., None])[..., 0], alpha)
    # gamma is folded into the small vector u, so the [M, D] memory is written in two passes.
    return torch.addcmul(beta * memory, (gamma * u)[..., :, None], key[..., None, :], value=-1)


def _run_rows(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient):
    """Inputs ``[N, T, H, *]`` in the compute dtype; each row starts from its own state."""
    m_k, m_v, a_k, a_v, offset = state.m_k, state.m_v, state.anchor_k, state.anchor_v, state.offset
    current = reads_current_memory(compress_fn, write_gradient)
    # Shaped once for all tokens to broadcast over a step's [N, H, M, D] memories.
    betas, gammas = log_beta.exp()[..., None, None], gamma[..., None]
    outputs = []
    for t in range(q.shape[1]):
        starts_chunk = (offset + t) % chunk_size == 0
        if bool(starts_chunk.any()):  # only one token in C starts a chunk: skip copying the rest
            a_k = torch.where(starts_chunk[:, None, None, None], m_k, a_k)
            a_v = torch.where(starts_chunk[:, None, None, None], m_v, a_v)
        alpha_t, beta_t, gamma_t = alpha[:, t], betas[:, t], gammas[:, t]
        m_k = _write(m_k, a_k, k[:, t], alpha_t, beta_t, gamma_t, compress_fn, current)
        h = mix(mix_fn, (m_k @ q[:, t, ..., None])[..., 0])
        m_v = _write(m_v, a_v, v[:, t], alpha_t, beta_t, gamma_t, compress_fn, current)
        outputs.append((h[..., None, :] @ m_v)[..., 0, :])
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    if write_gradient == "exact" and outputs:  # nothing reads the anchors: they follow the memories
        a_k, a_v = m_k, m_v
    return o, TrellisState(m_k, m_v, a_k, a_v, (offset + q.shape[1]) % chunk_size)


def reference_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient,
                      cu_seqlens):
    """Backend ``"reference"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`."""
    def run(*args):
        return _run_rows(*args, chunk_size, compress_fn, mix_fn, write_gradient)

    return per_sequence(run, (q, k, v, alpha, log_beta, gamma), state, cu_seqlens)
