"""Backend ``"triton"``'s single-token step: one kernel launch per layer and decode token.

It runs the token-by-token kernel of :mod:`.triton_chunk` (``_recurrent_kernel``).

:func:`triton_step` is the backend's :attr:`~trellis_lm.ops.registry.Backend.step`: what
``trellis_step`` and a one-token ``trellis_attention`` call run under ``backend="triton"``, and
under ``"auto"`` on CUDA tensors. It launches the kernel itself, into a new state (a caller may
still hold the one it read). The custom op behind :func:`.triton_backend.triton_forward` launches
the same kernel for one token, through dispatch and autograd bookkeeping that are host time a
decode step pays per layer and token, and needs only where autograd records the call or
``torch.compile`` traces it: there the step runs ``triton_forward``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .state import TrellisState
from .triton_backend import triton_forward
from .triton_chunk import _codes, check_device, recurrent_launch


def triton_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, state: TrellisState, chunk_size: int, compress_fn: str, mix_fn: str,
    write_gradient: str, cu_seqlens: Optional[torch.Tensor], consume_state: bool = False,
) -> tuple[torch.Tensor, TrellisState]:
    """The single-token step of backend ``"triton"``; arguments as validated by
    :func:`trellis_lm.ops.trellis_attention` (whose registry sends it only what the kernels
    compute): q, k ``[N, 1, H, Dk]``, v ``[N, 1, H, Dv]``, alpha ``[N, 1, H, M]``, log_beta and
    gamma ``[N, 1, H]``. Returns ``o [N, 1, H, Dv]`` (float32) and a new state; ``state`` is only read
    (``consume_state``, a permission, is not taken). ``"exact"`` writes run as ``chunk_size=1``
    (each token its own anchor)."""
    exact = write_gradient == "exact"
    anchors = (state.m_k, state.m_v) if exact else (state.anchor_k, state.anchor_v)
    memories = (state.m_k, state.m_v, *anchors)
    inputs = (q, k, v, alpha, log_beta, gamma)
    records = torch.is_grad_enabled() and any(t.requires_grad for t in inputs + memories)
    if records or cu_seqlens is not None or torch.compiler.is_compiling():
        return triton_forward(*inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens)
    check_device(q)
    # The kernel indexes every tensor as a dense row-major block of float32.
    inputs = [t.to(torch.float32).contiguous() for t in inputs]
    memories = [t.to(torch.float32).contiguous() for t in memories]
    offset = state.offset.to(torch.long).contiguous()
    outs = [torch.empty_like(t) for t in memories]
    o = torch.empty_like(inputs[2])
    recurrent_launch(*inputs, *memories, torch.zeros_like(offset) if exact else offset, None, o, outs,
                     1 if exact else chunk_size, *_codes(compress_fn, mix_fn))
    if exact:
        outs[2:] = outs[:2]
    return o, TrellisState(*outs, (offset + q.shape[1]) % chunk_size)
