"""Decode step on the GPU: one kernel launch per layer, state updated in place.

:func:`trellis_decode_step_` runs the token-by-token kernel of :mod:`.triton_chunk` on a few
new tokens per row (usually one) and writes the memories and anchors back into the given
:class:`TrellisState`'s own tensors, so a cache can keep fixed buffers (and CUDA graphs can
capture the step). It computes the same numbers as ``trellis_attention`` with that state as
``initial_state`` (for the same chunk size), without autograd.

The position within the chunk (``state.offset``) is read by the kernel; advancing it is one
tiny extra op. Every layer of a model sees the same tokens, so a model-level cache can share
one offset tensor across layers and advance it once per step (``advance_offset=False`` on
every layer, then ``state.offset.add_(T).remainder_(C)``).
"""

from __future__ import annotations

import torch

from .functions import check_names
from .state import TrellisState
from .triton_chunk import _check_device, _codes, recurrent_launch


def trellis_decode_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    log_beta: torch.Tensor,
    gamma: torch.Tensor,
    state: TrellisState,
    *,
    chunk_size: int,
    compress_fn: str = "layernorm",
    mix_fn: str = "ln_silu",
    advance_offset: bool = True,
) -> torch.Tensor:
    """Run ``T`` tokens per row (``[B, T, H, *]``, any float dtype) and update ``state`` in place.

    ``state`` holds float32 contiguous ``[B, H, M, D]`` memories and anchors and an int64
    ``[B]`` offset on the inputs' device. Returns ``o [B, T, H, Dv]`` in q's dtype.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, Dk], got {tuple(q.shape)}")
    batch, length, heads, dk = q.shape
    dv, slots = v.shape[-1], alpha.shape[-1]
    check_names(compress_fn, mix_fn)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    _check_device(q)
    for name, t, shape in (
        ("m_k", state.m_k, (batch, heads, slots, dk)), ("m_v", state.m_v, (batch, heads, slots, dv)),
        ("anchor_k", state.anchor_k, (batch, heads, slots, dk)), ("anchor_v", state.anchor_v, (batch, heads, slots, dv)),
    ):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != q.device:
            raise ValueError(
                f"state.{name} must be a contiguous float32 tensor of shape {shape} on {q.device}, "
                f"got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if state.offset.shape != (batch,) or state.offset.dtype != torch.long or state.offset.device != q.device:
        raise ValueError(f"state.offset must be an int64 tensor [{batch}] on {q.device}")
    if state.m_k.data_ptr() == state.anchor_k.data_ptr() or state.m_v.data_ptr() == state.anchor_v.data_ptr():
        # A pair (m_k, m_v) turned into a state shares its memory with the anchors.
        raise ValueError("state memories and anchors must not share storage for an in-place step (clone the anchors)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, alpha, log_beta, gamma)):
        raise ValueError("trellis_decode_step_ has no backward; call it under torch.no_grad() or inference_mode()")
    cf, mf = _codes(compress_fn, mix_fn)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    tensors = [t.contiguous() for t in (q, k, v, alpha, log_beta, gamma)]
    outs = [state.m_k, state.m_v, state.anchor_k, state.anchor_v]
    recurrent_launch(*tensors, *outs, state.offset, None, o, outs, chunk_size, cf, mf)
    if advance_offset:
        state.offset.add_(length).remainder_(chunk_size)
    return o
