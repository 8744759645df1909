"""Backend ``"triton"``'s entry point: which kernels a call runs (:mod:`.triton_chunk` for
anchored writes and the per-token recurrence, :mod:`.triton_exact` for exact writes), each
through its custom op so that autograd and ``torch.compile`` see one operation."""

from __future__ import annotations

import torch

from .state import TrellisState
from .triton_chunk import _fwd_op, _use_recurrent, check_device
from .triton_exact import exact_forward


def triton_forward(q, k, v, alpha, log_beta, gamma, state: TrellisState, chunk_size, compress_fn, mix_fn,
                   write_gradient, cu_seqlens):
    """Backend ``"triton"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`,
    whose registry sends it only what the kernels compute (float32 or lower, not identity).

    ``"exact"`` writes (the recurrence of ``chunk_size=1``, whatever C) run the exact chunk
    kernels of :mod:`.triton_exact` in their own layout, except for one token or ``chunk_size=1``,
    which run the per-token kernels; the state they hand back keeps the call's C in its offset,
    with anchors equal to its memories (design page, section 3)."""
    check_device(q)
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    offset = state.offset.to(torch.long).contiguous()
    lengths = torch.full_like(offset, q.shape[1]) if cu_seqlens is None else cu_seqlens[1:] - cu_seqlens[:-1]
    lengths = lengths.to(offset.device)
    inputs = [f32(t) for t in (q, k, v, alpha, log_beta, gamma)]
    if write_gradient == "anchored":
        memories = [f32(t) for t in (state.m_k, state.m_v, state.anchor_k, state.anchor_v)]
        o, m_k, m_v, a_k, a_v, _, _ = _fwd_op(*inputs, *memories, offset, cu_seqlens, chunk_size, compress_fn, mix_fn)
        return o, TrellisState(m_k, m_v, a_k, a_v, (offset + lengths) % chunk_size)
    memories = [f32(t) for t in (state.m_k, state.m_v)]
    if _use_recurrent(q.shape[1], chunk_size):  # each token its own anchor: the per-token kernels at C = 1
        o, m_k, m_v, _, _, _, _ = _fwd_op(*inputs, *memories, *memories, torch.zeros_like(offset), cu_seqlens, 1,
                                          compress_fn, mix_fn)
    else:
        o, m_k, m_v, *_ = exact_forward(*inputs, *memories, cu_seqlens, compress_fn, mix_fn)
    # Anchors follow the memories, but a sequence with no tokens hands its state back untouched.
    empty = (lengths == 0)[:, None, None, None]
    a_k, a_v = torch.where(empty, state.anchor_k, m_k), torch.where(empty, state.anchor_v, m_v)
    return o, TrellisState(m_k, m_v, a_k, a_v, (offset + lengths) % chunk_size)
