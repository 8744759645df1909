"""The per-token loop of the design page, section 1: slow, plain, and the ground truth.

Vectorised over sequences and heads only; every token is one step of the loop, exactly as
written on the design page. Packed input (``cu_seqlens``) runs one sequence at a time.
"""

from __future__ import annotations

import torch

from .functions import compress_residual_vjp, mix
from .state import TrellisState


def _write(memory, anchor, key, alpha, beta, gamma, compress_fn):
    """One online-gradient step: ``beta * M - gamma * outer(vjp_phi(A key, phi(A key) - alpha), key)``."""
    u = compress_residual_vjp(compress_fn, torch.einsum("nhmd,nhd->nhm", anchor, key), alpha)
    # gamma is folded into the small vector u, so the [M, D] memory is written in two passes.
    return torch.addcmul(beta[..., None, None] * memory, (gamma[..., None] * u)[..., :, None], key[..., None, :], value=-1)


def _run_rows(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn):
    """Inputs ``[N, T, H, *]`` in the compute dtype; each row starts from its own state."""
    m_k, m_v, a_k, a_v, offset = state.m_k, state.m_v, state.anchor_k, state.anchor_v, state.offset
    outputs = []
    for t in range(q.shape[1]):
        starts_chunk = (offset + t) % chunk_size == 0
        if bool(starts_chunk.any()):  # only one token in C starts a chunk: skip copying the rest
            a_k = torch.where(starts_chunk[:, None, None, None], m_k, a_k)
            a_v = torch.where(starts_chunk[:, None, None, None], m_v, a_v)
        beta = log_beta[:, t].exp()
        m_k = _write(m_k, a_k, k[:, t], alpha[:, t], beta, gamma[:, t], compress_fn)
        h = mix(mix_fn, torch.einsum("nhmd,nhd->nhm", m_k, q[:, t]))
        m_v = _write(m_v, a_v, v[:, t], alpha[:, t], beta, gamma[:, t], compress_fn)
        outputs.append(torch.einsum("nhmd,nhm->nhd", m_v, h))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, TrellisState(m_k, m_v, a_k, a_v, (offset + q.shape[1]) % chunk_size)


def reference_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, cu_seqlens):
    """Backend ``"reference"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`."""
    if cu_seqlens is None:
        return _run_rows(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn)
    outputs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        row = state.map(lambda t: t[n : n + 1])
        pieces = (x[:, start:end] for x in (q, k, v, alpha, log_beta, gamma))
        o, final = _run_rows(*pieces, row, chunk_size, compress_fn, mix_fn)
        outputs.append(o)
        finals.append(final)
    final = TrellisState(**{name: torch.cat([f.tensors()[name] for f in finals]) for name in state.tensors()})
    return torch.cat(outputs, dim=1), final
