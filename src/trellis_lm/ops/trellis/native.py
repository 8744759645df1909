"""Backend ``"native"``: the design page's per-token recurrence (section 1) as one C loop per
(sequence, head) pair, built on this machine (:mod:`..native_build`; the C code: :mod:`.recurrence_c`).

What ``"auto"`` takes on a CPU where a C compiler is found: inference (prefill, decode,
evaluation) computes the exact function of the reference at a few multiply-adds per memory
entry and token, without the chunk form's operations or its substitution loop. Every setting
of the op is computed (the three compressions and mixes, ``"exact"`` and ``"anchored"`` writes
at any C, packed sequences, states handed in and out).

Three cases run the ``"torch"`` backend instead, which computes the same function:

* one token per row (a decode step; the registry hands those to torch's step): its few tensor
  operations cost less than a call of the library with its arguments;
* calls that record gradients (training): the C loop has no backward, the chunk form has;
* calls traced by ``torch.compile`` (a compiled decode step): a graph cannot call the library.

The pairs are shared among ``torch.get_num_threads()`` threads of the library's own, where the
call holds enough work (:data:`PAIR_WORK` multiply-adds a thread).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch

from ..native_build import NativeUnavailable, load
from ..registry import OpCall
from .chunked import chunked_forward
from .compress_mix import COMPRESS_FNS, EPS, MIX_FNS, reads_current_memory
from .recurrence_c import SOURCE
from .state import TrellisState
from .step import step_forward

# A thread is started for every this many multiply-adds of the call (tokens x heads x 6 M D):
# starting one costs tens of microseconds, about as long as this much arithmetic.
PAIR_WORK = 1 << 20


class _Job(ctypes.Structure):
    """``trellis_job`` of :data:`.recurrence_c.SOURCE`, field for field."""

    _fields_ = [
        ("inputs", ctypes.c_void_p * 6), ("out", ctypes.c_void_p), ("strides", (ctypes.c_int64 * 3) * 7),
        ("starts", ctypes.c_void_p), ("lengths", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
        ("state_in", ctypes.c_void_p * 4), ("state_out", ctypes.c_void_p * 4),
        ("rows", ctypes.c_int64), ("heads", ctypes.c_int64), ("slots", ctypes.c_int64), ("dk", ctypes.c_int64),
        ("dv", ctypes.c_int64), ("chunk", ctypes.c_int64),
        ("compress", ctypes.c_int), ("mix", ctypes.c_int), ("read_anchors", ctypes.c_int),
        ("keep_anchors", ctypes.c_int), ("eps", ctypes.c_double),
    ]


@functools.cache
def _recurrence() -> ctypes.CDLL:
    library = load("trellis_recurrence", SOURCE)
    library.trellis_recurrence.argtypes = [ctypes.POINTER(_Job), ctypes.c_int, ctypes.c_int]
    library.trellis_recurrence.restype = ctypes.c_int
    return library


def native_unavailable(call: OpCall) -> Optional[str]:
    """Why backend ``"native"`` cannot run ``call`` here (``None``: it can)."""
    if call.device.type != "cpu":
        return f"it runs a C loop on CPU tensors, got {call.device}"
    if torch.compiler.is_compiling():  # traced, it runs the torch form (native_forward): nothing to build
        return None
    try:
        _recurrence()
    except NativeUnavailable as error:
        return str(error)
    return None


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last axis dense (what the C loop indexes by one), a copy only if not."""
    return x if x.shape[-1] == 1 or x.stride(-1) == 1 else x.contiguous()


def _records_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def native_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient,
                   cu_seqlens):
    """Backend ``"native"``; arguments as validated by :func:`trellis_lm.ops.trellis_attention`
    (``q, k [B, T, H, Dk]``, ``v [B, T, H, Dv]``, ``alpha [B, T, H, M]``, ``log_beta, gamma
    [B, T, H]`` in the compute dtype, ``state`` with ``N`` rows: ``B``, or the sequences of
    ``cu_seqlens`` with ``B = 1``). Returns ``o [B, T, H, Dv]`` and the final state."""
    inputs = (q, k, v, alpha, log_beta, gamma)
    if torch.compiler.is_compiling() or _records_grad((*inputs, state.m_k, state.m_v, state.anchor_k, state.anchor_v)):
        torch_form = step_forward if q.shape[1] == 1 and cu_seqlens is None else chunked_forward
        return torch_form(*inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens)
    batch, length, heads, dk = q.shape
    dv, slots = v.shape[-1], alpha.shape[-1]
    rows = state.offset.numel()
    if cu_seqlens is None:
        starts = torch.zeros(rows, dtype=torch.long)
        lengths = torch.full((rows,), length, dtype=torch.long)
    else:
        starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
    inputs = [_rows_view(x) for x in inputs]
    o = q.new_empty(v.shape)
    keep_anchors = write_gradient == "anchored"
    # The anchors of exact writes are neither read nor returned by the loop: not copied either.
    held = (state.m_k, state.m_v, state.anchor_k, state.anchor_v)[: 4 if keep_anchors else 2]
    state_in = [x.contiguous() for x in held]
    state_out = [torch.empty_like(x) for x in state_in]
    offsets = state.offset.contiguous()
    job = _Job()
    job.inputs[:] = [x.data_ptr() for x in inputs]
    job.out = o.data_ptr()
    # (row, token, head) strides; packed sequences are one row of B = 1, told apart by their starts.
    for i, x in enumerate((*inputs, o)):
        job.strides[i][:] = (x.stride(0) if cu_seqlens is None else 0, x.stride(1), x.stride(2))
    job.starts, job.lengths, job.offsets = starts.data_ptr(), lengths.data_ptr(), offsets.data_ptr()
    job.state_in[:] = [x.data_ptr() for x in state_in] + [0] * (4 - len(state_in))
    job.state_out[:] = [x.data_ptr() for x in state_out] + [0] * (4 - len(state_out))
    job.rows, job.heads, job.slots, job.dk, job.dv, job.chunk = rows, heads, slots, dk, dv, chunk_size
    job.compress, job.mix = COMPRESS_FNS.index(compress_fn), MIX_FNS.index(mix_fn)
    job.read_anchors = not reads_current_memory(compress_fn, write_gradient)
    job.keep_anchors, job.eps = keep_anchors, EPS
    work = batch * length * heads * slots * (dk + dv) * 3
    threads = max(1, min(torch.get_num_threads(), work // PAIR_WORK))
    if _recurrence().trellis_recurrence(ctypes.byref(job), q.dtype == torch.float64, threads):
        raise MemoryError("trellis_attention(backend='native'): the C loop could not allocate its scratch memory")
    m_k, m_v = state_out[:2]
    if keep_anchors:
        a_k, a_v = state_out[2:]
    else:  # nothing reads the anchors of exact writes: they follow the memories, but for empty rows
        empty = (lengths == 0)[:, None, None, None]
        a_k, a_v = (m_k, m_v) if not bool(empty.any()) else (
            torch.where(empty, state.anchor_k, m_k), torch.where(empty, state.anchor_v, m_v))
    return o, TrellisState(m_k, m_v, a_k, a_v, (state.offset + lengths) % chunk_size)
