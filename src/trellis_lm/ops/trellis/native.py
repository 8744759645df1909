"""Backend ``"native"``: the design page's per-token recurrence (section 1) as one C loop per
(sequence, head) pair, built on this machine (:mod:`..native_build`; the C code: :mod:`.recurrence_c`).

What ``"auto"`` takes on a CPU where a C compiler is found: inference (prefill, decode,
evaluation) computes the exact function of the reference at a few multiply-adds per memory
entry and token, without the chunk form's operations or its substitution loop. Every setting
of the op is computed (the three compressions and mixes, ``"exact"`` and ``"anchored"`` writes
at any C, packed sequences, states handed in and out).

A single token per row (a decode step, :func:`native_step`) runs its own loop over the memories
in their [M, D] layout, in place where the caller gives the state up (``consume_state``: a
server's slots, read and written where they lie).

Two cases run the ``"torch"`` backend instead, which computes the same function:

* calls that record gradients (training): the C loop has no backward, the chunk form has;
* calls traced by ``torch.compile`` (a compiled decode step): a graph cannot call the library.

The pairs are shared among ``torch.get_num_threads()`` threads of the library's own, where the
call holds enough work (:data:`PAIR_WORK` multiply-adds a thread) and more than one token per row.
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
        ("offsets_out", ctypes.c_void_p),
        ("state_in", ctypes.c_void_p * 4), ("state_out", ctypes.c_void_p * 4),
        ("state_in_rows", ctypes.c_int64 * 4), ("state_out_rows", ctypes.c_int64 * 4),
        ("rows", ctypes.c_int64), ("tokens", ctypes.c_int64), ("heads", ctypes.c_int64), ("slots", ctypes.c_int64),
        ("dk", ctypes.c_int64), ("dv", ctypes.c_int64), ("chunk", ctypes.c_int64),
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


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """A state tensor ``[N, H, M, D]`` with each row's ``[H, M, D]`` dense (rows at any distance, as
    a server's slots or an expanded initial memory lie), a copy only if not."""
    return x if x.shape[0] == 0 or x[0].is_contiguous() else x.contiguous()


def _writable(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether a state's tensors ``[N, H, M, D]`` can take the state after in place: each row's
    ``[H, M, D]`` dense and rows apart (not one row for all, as an expanded initial memory), no
    two overlapping (a state whose anchors are its memories), none recording gradients."""
    for x in tensors:
        rows = x.shape[0]
        if x.requires_grad or (rows and not x[0].is_contiguous()) or (rows > 1 and x.stride(0) < x[0].numel()):
            return False
    return all(_apart(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:])


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of dense rows (:func:`_writable`) share no byte: their spans do not
    meet, or, at one row stride (the fields of a server's slots, interleaved row by row), each row
    of one lies between rows of the other."""
    if not (a.shape[0] and b.shape[0]):
        return True
    row_bytes = [x[0].numel() * x.element_size() for x in (a, b)]
    spans = sorted((x.data_ptr(), x.data_ptr() + (x.shape[0] - 1) * x.stride(0) * x.element_size() + row)
                   for x, row in zip((a, b), row_bytes))
    if spans[0][1] <= spans[1][0]:
        return True
    stride = a.stride(0) * a.element_size()
    if not (a.shape[0] == b.shape[0] > 1 and stride == b.stride(0) * b.element_size()):
        return False
    (first, first_row), (second, second_row) = sorted(zip((a.data_ptr(), b.data_ptr()), row_bytes))
    gap = (second - first) % stride
    return gap >= first_row and gap + second_row <= stride


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
    return _run(inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens, in_place=False)


def native_step(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens,
                consume_state=False):
    """Backend ``"native"``'s single-token step (arguments as :func:`~.step.step_forward` takes
    them): the C loop's one-token form. With ``consume_state`` (the caller reads the state's
    tensors no more) the state after is written into them where they can take it
    (:func:`_writable`), and returned as those tensors."""
    inputs = (q, k, v, alpha, log_beta, gamma)
    held = (state.m_k, state.m_v, state.anchor_k, state.anchor_v)
    if torch.compiler.is_compiling() or _records_grad((*inputs, *held)):
        return step_forward(*inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens)
    written = held if write_gradient == "anchored" else held[:2]
    return _run(inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens,
                in_place=consume_state and _writable(written))


def _run(inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens, in_place):
    """The C loop on the op's inputs and ``state`` (see :func:`native_forward`); ``in_place``: the
    state after goes into ``state``'s own tensors (the memories, and the anchors where written)."""
    q, v, alpha = inputs[0], inputs[2], inputs[3]
    batch, length, heads, dk = q.shape
    dv, slots = v.shape[-1], alpha.shape[-1]
    rows = state.offset.numel()
    inputs = [_rows_view(x) for x in inputs]
    o = q.new_empty(v.shape)
    keep_anchors = write_gradient == "anchored"
    # The anchors of exact writes are neither read nor returned by the loop: not copied either.
    held = (state.m_k, state.m_v, state.anchor_k, state.anchor_v)[: 4 if keep_anchors else 2]
    state_in = [_dense_rows(x) for x in held]
    state_out = state_in if in_place else [torch.empty(x.shape, dtype=x.dtype) for x in state_in]
    offsets = state.offset.contiguous()
    offsets_out = torch.empty_like(offsets)
    job = _Job()
    job.inputs[:] = [x.data_ptr() for x in inputs]
    job.out = o.data_ptr()
    # (row, token, head) strides; packed sequences are one row of B = 1, told apart by their starts.
    for i, x in enumerate((*inputs, o)):
        job.strides[i][:] = (x.stride(0) if cu_seqlens is None else 0, x.stride(1), x.stride(2))
    if cu_seqlens is not None:  # else every row starts at 0 with T tokens
        starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.diff().long()
        job.starts, job.lengths = starts.data_ptr(), lengths.data_ptr()
    job.offsets, job.offsets_out = offsets.data_ptr(), offsets_out.data_ptr()
    unused = [0] * (4 - len(state_in))
    job.state_in[:] = [x.data_ptr() for x in state_in] + unused
    job.state_out[:] = [x.data_ptr() for x in state_out] + unused
    job.state_in_rows[:] = [x.stride(0) for x in state_in] + unused
    job.state_out_rows[:] = [x.stride(0) for x in state_out] + unused
    job.rows, job.tokens, job.heads, job.chunk = rows, length, heads, chunk_size
    job.slots, job.dk, job.dv = slots, dk, dv
    job.compress, job.mix = COMPRESS_FNS.index(compress_fn), MIX_FNS.index(mix_fn)
    job.read_anchors = not reads_current_memory(compress_fn, write_gradient)
    job.keep_anchors, job.eps = keep_anchors, EPS
    work = batch * length * heads * slots * (dk + dv) * 3
    # A decode step (one token per row) stays on this thread: its call is short, and a thread of the
    # library's would share a core with torch's own workers, which spin on after the step's products
    # (served decode steps at 16 and 64 sequences: the C step 4x and 1.6x the time on two threads).
    threads = 1 if length == 1 else max(1, min(torch.get_num_threads(), work // PAIR_WORK))
    if _recurrence().trellis_recurrence(ctypes.byref(job), q.dtype == torch.float64, threads):
        raise MemoryError("trellis_attention(backend='native'): the C loop could not allocate its scratch memory")
    m_k, m_v = state_out[:2]
    if keep_anchors:
        a_k, a_v = state_out[2:]
    elif cu_seqlens is None or not bool((lengths == 0).any()):  # nothing reads the anchors of exact writes
        a_k, a_v = m_k, m_v
    else:  # they follow the memories, but for empty rows
        empty = (lengths == 0)[:, None, None, None]
        a_k, a_v = torch.where(empty, state.anchor_k, m_k), torch.where(empty, state.anchor_v, m_v)
    return o, TrellisState(m_k, m_v, a_k, a_v, offsets_out)
