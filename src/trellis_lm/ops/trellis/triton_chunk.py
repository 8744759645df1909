"""Backend ``"triton"``: Triton kernels for the Trellis op, forward and hand-derived backward.

The math, piece by piece, is stated in plain PyTorch in ``tests/kernel_mirror.py`` (read its
docstring first); every kernel here computes one of those pieces for one head:

forward
    ``_state_fwd_kernel``   grid (sequences, heads), one launch per pass (keys, values; on a
                            GPU side by side, two streams): the chain of memories across
                            chunks, kept on-chip in float32 with its anchor; saves the memory
                            at every chunk start.
    ``_output_fwd_kernel``  grid (chunk slots, heads): both reads of a chunk from its saved
                            start memories, chunks in parallel.
    ``_recurrent_kernel``   grid (sequences, heads): the per-token loop of the design page
                            (both passes fused, memories on-chip). Used for ``chunk_size=1``
                            (the exact recurrence; it then saves the memories every
                            ``RECURRENT_SEGMENT`` tokens) and for one-token decode steps, where
                            the chunk form would pad every token to a 16-row tile. The backend's
                            single-token step launches it directly, and can update a state in
                            place (:mod:`.triton_step`).
backward (recomputes every chunk's intermediates from the saved chunk-start memories)
    ``_value_bwd_kernel``,  grid (chunk slots, heads), one after the other: gradients that need
    ``_key_bwd_kernel``     no later chunk, the value read's and then the key read's (the first
                            hands the second the gradient at the mixing input). As one kernel
                            they spilled more and ptxas serialized its tensor-core products
                            for lack of registers (sm_90 compiles; BENCHMARKS.md).
    ``_chain_bwd_kernel``   grid (sequences, heads), one launch per pass, chunks in reverse:
                            carries the memory gradient back, through the anchors (the
                            second-order terms through ``vjp_phi``). The two passes write
                            separate outputs, so on a GPU they run side by side (two streams).
    ``_gates_bwd_kernel``   grid (chunk slots, heads): sums the local and both chains' parts of
                            ``dalpha`` and ``dgamma``, and finishes ``dlog_beta`` as a reverse
                            cumulative sum inside every chunk.
    ``_recurrent_bwd_kernel`` grid (sequences, heads), ``chunk_size=1`` only: tokens in
                            reverse (both passes), each segment's memories recomputed from
                            its checkpoint into scratch first.

Tiles: rows (tokens of a chunk) and the head and slot dims are padded to the next power of
two >= 16 (``tl.dot``'s minimum) and masked. Decays are accumulated in log space inside a
chunk. Products use ``tl.dot`` with ``input_precision`` from the environment variable
``TRELLIS_TRITON_DOT_PRECISION``, default ``"tf32x3"`` (three tf32 products on tensor cores,
about float32 accuracy: the op computes in float32 whatever its inputs' dtype, as the torch
backend does). ``"ieee"`` (plain float32 FMAs) compiles slowly and overflows shared memory at
head dim 128 on an H100; ``"tf32"`` (one tf32 product, ~1e-3) needs more shared memory, over
the H100's at head dim 128; ``"bf16"`` rounds both operands of every product to bfloat16
(accumulating in float32, memories kept in float32): one tensor-core pass on half the
registers, within issue 39's 1e-2 bound for bf16 inputs (tests/test_triton.py), for bf16
training (``bench_gpu.py --only tune`` times the settings with their errors). (The interpreter
computes tf32 products in float32.)

Shared memory, from ahead-of-time compiles for sm_90 with tf32x3 at C = M = 64 (no GPU was
available to run them): every kernel fits the H100's 227 KB at D = 64 and D = 128 with the
``num_stages`` chosen in ``_stages``; the chain kernels do not fit with 3 stages.

``"exact"`` writes run the kernels of :mod:`.triton_exact` (the exact chunk form, design page
section 2b), which use the read kernels and the local backward kernels here with the writes ``U``
they saved (``EXACT=True``); one token, or ``chunk_size=1``, runs the token-by-token kernels.

Float64 inputs and ``compress_fn="identity"`` are not computed by these kernels (identity's chunk
form needs a triangular solve they lack): the registry of :mod:`.dispatch` refuses both for
``backend="triton"`` and gives them to ``"torch"`` under ``"auto"``, and the custom op refuses
identity too. CPU tensors need ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    # A try block: transformers' import check of remote code skips it, so a checkpoint's code
    # loads where triton is absent; the dispatcher imports this module only where it imports.
    raise ImportError("backend 'triton' needs the triton package (pip install triton); use backend 'torch'") from error

from .compress_mix import COMPRESS_FNS, EPS, MIX_FNS
from .state import TrellisState
from .triton_interpreter import take_one_element_as_index
from ..varlen import chunk_slots, make_plan

if os.environ.get("TRITON_INTERPRET") == "1":
    take_one_element_as_index()

DOT_PRECISIONS = ("tf32x3", "tf32", "ieee", "bf16")
DOT_PRECISION = os.environ.get("TRELLIS_TRITON_DOT_PRECISION", "tf32x3")
if DOT_PRECISION not in DOT_PRECISIONS:
    raise ValueError(f"TRELLIS_TRITON_DOT_PRECISION must be one of {DOT_PRECISIONS}, got {DOT_PRECISION!r}")
# At C = 1 the forward saves the memories before every this-many tokens and the backward
# recomputes the others, a segment at a time (_recurrent_bwd_kernel): saved memory T / 64 of
# the chunk kernels' at C = 1, scratch of 64 memories per sequence and head.
RECURRENT_SEGMENT = 64
_EPS = tl.constexpr(EPS)


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """``a @ b`` accumulated in float32, the operands as ``PREC`` (:func:`_kernel_precision`)
    says: ``"bf16"`` rounds both to bfloat16 (one tensor-core pass, half the registers per
    operand), ``"bf16_rounded"`` the same products in float32, the others are ``tl.dot``'s
    ``input_precision``."""
    if PREC == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == "bf16_rounded":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


# ---------------------------------------------------------------------------------------------
# Row-wise functions over the slot axis (axis 1 of an [R, BM] tile; `cm` masks the real slots).
# Every result is zero in the padded slots, so padded slots never leak into a product.


@triton.jit
def _rsum(x):
    return tl.sum(x, axis=1)[:, None]


@triton.jit
def _residual_vjp(z, a, cm, M, CF: tl.constexpr):
    """u = vjp_phi(z, phi(z) - a); CF: 0 identity, 1 l2norm, 2 layernorm."""
    if CF == 0:
        u = z - a
    elif CF == 1:
        r = 1.0 / tl.sqrt(_rsum(z * z) + _EPS)
        zh = z * r
        e = zh - a
        u = (e - zh * _rsum(zh * e)) * r
    else:
        c = tl.where(cm, z - _rsum(z) / M, 0.0)
        r = 1.0 / tl.sqrt(_rsum(c * c) / M + _EPS)
        zh = c * r
        e = zh - a
        u = (e - _rsum(e) / M - zh * (_rsum(zh * e) / M)) * r
    return tl.where(cm, u, 0.0)


@triton.jit
def _residual_vjp_bwd(z, a, gu, cm, M, CF: tl.constexpr):
    """(dz, da) of u = _residual_vjp(z, a) for cotangent gu (see tests/kernel_mirror.py, residual_vjp_backward)."""
    gu = tl.where(cm, gu, 0.0)
    if CF == 0:
        gz = gu
        ga = -gu
    elif CF == 1:
        r = 1.0 / tl.sqrt(_rsum(z * z) + _EPS)
        zh = z * r
        e = zh - a
        s = _rsum(zh * e)
        gt = gu * r
        gs = -_rsum(gt * zh)
        ge = gt + gs * zh
        gzh = -gt * s + gs * e + ge
        gr = _rsum(gu * (e - zh * s)) + _rsum(gzh * z)
        gz = gzh * r - gr * r * r * r * z
        ga = -ge
    else:
        c = tl.where(cm, z - _rsum(z) / M, 0.0)
        r = 1.0 / tl.sqrt(_rsum(c * c) / M + _EPS)
        zh = c * r
        e = tl.where(cm, zh - a, 0.0)
        me = _rsum(e) / M
        s = _rsum(zh * e) / M
        gt = gu * r
        gs = -_rsum(gt * zh)
        ge = tl.where(cm, gt - _rsum(gt) / M + gs * zh / M, 0.0)
        gzh = -gt * s + gs * e / M + ge
        gr = _rsum(gu * (e - me - zh * s)) + _rsum(gzh * c)
        gc = gzh * r - gr * r * r * r * c / M
        gz = gc - _rsum(gc) / M
        ga = -ge
    return tl.where(cm, gz, 0.0), tl.where(cm, ga, 0.0)


@triton.jit
def _mix(y, cm, M, MF: tl.constexpr):
    """h = f(y); MF: 0 ln_silu, 1 l2_silu, 2 softmax."""
    if MF == 2:
        ym = tl.where(cm, y, float("-inf"))
        p = tl.exp(ym - tl.max(ym, axis=1)[:, None])
        h = p / _rsum(p)
    else:
        s = tl.where(cm, y * tl.sigmoid(y), 0.0)
        if MF == 1:
            h = s / tl.sqrt(_rsum(s * s) + _EPS)
        else:
            c = tl.where(cm, s - _rsum(s) / M, 0.0)
            h = c / tl.sqrt(_rsum(c * c) / M + _EPS)
    return tl.where(cm, h, 0.0)


@triton.jit
def _mix_bwd(y, gh, cm, M, MF: tl.constexpr):
    """dy of h = _mix(y) for cotangent gh."""
    gh = tl.where(cm, gh, 0.0)
    if MF == 2:
        ym = tl.where(cm, y, float("-inf"))
        p = tl.exp(ym - tl.max(ym, axis=1)[:, None])
        h = p / _rsum(p)
        gy = h * (gh - _rsum(h * gh))
    else:
        sig = tl.sigmoid(y)
        s = tl.where(cm, y * sig, 0.0)
        ds = sig * (1.0 + y * (1.0 - sig))
        if MF == 1:
            r = 1.0 / tl.sqrt(_rsum(s * s) + _EPS)
            h = s * r
            gs = (gh - h * _rsum(h * gh)) * r
        else:
            c = tl.where(cm, s - _rsum(s) / M, 0.0)
            r = 1.0 / tl.sqrt(_rsum(c * c) / M + _EPS)
            h = c * r
            gs = (gh - _rsum(gh) / M - h * (_rsum(h * gh) / M)) * r
        gy = gs * ds
    return tl.where(cm, gy, 0.0)


# ---------------------------------------------------------------------------------------------
# Loads and stores. Token tensors are [tokens, H, D] contiguous; memories [rows, H, M, D].


# A tile's pointers are its block's start, offset in int64 as a scalar, plus int32 offsets
# inside the block: an int64 offset per element would hold two registers each, and the
# [64, 64] tiles already fill the register file (the sm_90 compiles spill; see BENCHMARKS.md).


@triton.jit
def _tok_ptrs(ptr, tok0, nrows, h, H, D, BT: tl.constexpr, BD: tl.constexpr):
    r = tl.arange(0, BT)
    d = tl.arange(0, BD)
    block = ptr + (tok0.to(tl.int64) * H + h) * D
    mask = (r < nrows)[:, None] & (d < D)[None, :]
    return block + (r[:, None] * (H * D) + d[None, :]), mask


@triton.jit
def _load_tok(ptr, tok0, nrows, h, H, D, BT: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _tok_ptrs(ptr, tok0, nrows, h, H, D, BT, BD)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_tok(ptr, x, tok0, nrows, h, H, D, BT: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _tok_ptrs(ptr, tok0, nrows, h, H, D, BT, BD)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scal_ptrs(ptr, tok0, nrows, h, H, BT: tl.constexpr):
    r = tl.arange(0, BT)
    return ptr + (tok0.to(tl.int64) * H + h) + r * H, r < nrows


@triton.jit
def _load_scal(ptr, tok0, nrows, h, H, BT: tl.constexpr):
    ptrs, mask = _scal_ptrs(ptr, tok0, nrows, h, H, BT)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_scal(ptr, x, tok0, nrows, h, H, BT: tl.constexpr):
    ptrs, mask = _scal_ptrs(ptr, tok0, nrows, h, H, BT)
    tl.store(ptrs, x, mask=mask)


@triton.jit
def _mat_ptrs(ptr, index, M, D, BM: tl.constexpr, BD: tl.constexpr):
    """Pointers to memory number `index` (= row * H + head) of shape [M, D]."""
    m = tl.arange(0, BM)
    d = tl.arange(0, BD)
    block = ptr + index.to(tl.int64) * M * D
    return block + (m[:, None] * D + d[None, :]), (m < M)[:, None] & (d < D)[None, :]


@triton.jit
def _load_mat(ptr, index, M, D, BM: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _mat_ptrs(ptr, index, M, D, BM, BD)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _anchor(a0_ptr, S, index, M, D, BM: tl.constexpr, BD: tl.constexpr, resumed):
    """A chunk's anchor: in a resumed first chunk (the scalar ``resumed``) the given one, row
    ``index`` of ``a0``, else the chunk-start memory ``S``; ``a0`` is read only where it counts."""
    ptrs, mask = _mat_ptrs(a0_ptr, index, M, D, BM, BD)
    # (Written as a product: the interpreter turns `block & scalar` into int32, not a mask.)
    mask = (mask.to(tl.int32) * resumed.to(tl.int32)) != 0
    return tl.where(resumed, tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), S)


@triton.jit
def _store_mat(ptr, x, index, M, D, BM: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _mat_ptrs(ptr, index, M, D, BM, BD)
    tl.store(ptrs, x, mask=mask)


@triton.jit
def _load_vec(ptr, tok, h, H, D, BD: tl.constexpr):
    """Token ``tok``'s (a flat int64 index) vector of head ``h``, ``[BD]`` in float32."""
    d = tl.arange(0, BD)
    return tl.load(ptr + (tok * H + h) * D + d, mask=d < D, other=0.0).to(tl.float32)


@triton.jit
def _store_vec(ptr, x, tok, h, H, D, BD: tl.constexpr):
    """Write ``x [BD]`` as token ``tok``'s vector of head ``h`` (in the pointer's dtype)."""
    d = tl.arange(0, BD)
    tl.store(ptr + (tok * H + h) * D + d, x.to(ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _write_inputs(k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, tok, h, H, M, DK, DV,
                  BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    """What one token's writes read: k, v, alpha (a ``[1, BM]`` row), beta and gamma."""
    al = _load_vec(al_ptr, tok, h, H, M, BM)[None, :]
    beta = tl.exp(tl.load(lb_ptr + tok * H + h).to(tl.float32))
    gam = tl.load(g_ptr + tok * H + h).to(tl.float32)
    return _load_vec(k_ptr, tok, h, H, DK, BDK), _load_vec(v_ptr, tok, h, H, DV, BDV), al, beta, gam


@triton.jit
def _chunk_rows(i, off, L, C):
    """Sequence-relative token range [lo, lo + nrows) of chunk i."""
    lo = tl.maximum(i * C - off, 0)
    hi = tl.minimum((i + 1) * C - off, L)
    return lo, hi - lo


@triton.jit
def _log_decays(lb, nrows, BT: tl.constexpr):
    """c = cumulative log decay inside the chunk, and c at the chunk's last token."""
    r = tl.arange(0, BT)
    c = tl.cumsum(lb, axis=0)
    return c, tl.sum(tl.where(r == nrows - 1, c, 0.0), axis=0)


@triton.jit
def _log_after(lb, BT: tl.constexpr):
    """``sum_{j > i} lb_j`` (= c_last - c_i) summed directly: the difference is inf - inf = NaN
    after a full forget (log_beta = -inf), the direct sum is -inf and its exp the exact 0.
    Padded rows hold lb = 0, so they add nothing."""
    r = tl.arange(0, BT)
    return tl.sum(tl.where(r[None, :] > r[:, None], lb[None, :], 0.0), axis=1)


@triton.jit
def _decay_matrix(lb, nrows, BT: tl.constexpr):
    """E[r, i] = exp(c_r - c_i) for i <= r < nrows, else 0 (so D = E * gamma[None, :]).

    The exponent is the direct sum ``sum_{i < j <= r} lb_j`` (a cumulative sum down the rows of
    the strictly lower lb tile), never a difference, so a full forget gives 0, not NaN."""
    r = tl.arange(0, BT)
    gap = tl.cumsum(tl.where(r[:, None] > r[None, :], lb[:, None], 0.0), axis=0)
    keep = (r[:, None] >= r[None, :]) & (r < nrows)[:, None]
    return tl.exp(tl.where(keep, gap, float("-inf")))


# ---------------------------------------------------------------------------------------------
# Forward kernels.


@triton.jit
def _chunked_sequence(seq_start_ptr, seq_len_ptr, off_ptr, base_ptr, n, C):
    """Sequence ``n``'s first token, length, offset in its first chunk, first saved-memory slot
    and its number of chunks (none when it is empty)."""
    start = tl.load(seq_start_ptr + n)
    L = tl.load(seq_len_ptr + n)
    off = tl.load(off_ptr + n)
    base = tl.load(base_ptr + n)
    return start, L, off, base, tl.where(L > 0, (off + L - 1) // C + 1, 0)


@triton.jit
def _state_fwd_kernel(
    x_ptr, al_ptr, lb_ptr, g_ptr, m0_ptr, a0_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, base_ptr,
    hs_ptr, m_out_ptr, a_out_ptr,
    H, M, D, C,
    BT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, CF: tl.constexpr, PREC: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    start, L, off, base, n_chunks = _chunked_sequence(seq_start_ptr, seq_len_ptr, off_ptr, base_ptr, n, C)
    cm = (tl.arange(0, BM) < M)[None, :]
    S = _load_mat(m0_ptr, n * H + h, M, D, BM, BD)
    A = _load_mat(a0_ptr, n * H + h, M, D, BM, BD)
    # The given anchor counts when resuming mid-chunk, and passes through an empty sequence.
    A = tl.where((off > 0) | (L == 0), A, S)
    for i in range(0, n_chunks):
        A = tl.where(i == 0, A, S)
        _store_mat(hs_ptr, S, (base + i) * H + h, M, D, BM, BD)
        lo, nrows = _chunk_rows(i, off, L, C)
        X = _load_tok(x_ptr, start + lo, nrows, h, H, D, BT, BD)
        Al = _load_tok(al_ptr, start + lo, nrows, h, H, M, BT, BM)
        lb = _load_scal(lb_ptr, start + lo, nrows, h, H, BT)
        g = _load_scal(g_ptr, start + lo, nrows, h, H, BT)
        _, c_last = _log_decays(lb, nrows, BT)
        w = g * tl.exp(_log_after(lb, BT))
        U = _residual_vjp(_dot(X, tl.trans(A), PREC), Al, cm, M, CF)
        S = tl.exp(c_last) * S - _dot(tl.trans(U * w[:, None]), X, PREC)
    _store_mat(m_out_ptr, S, n * H + h, M, D, BM, BD)
    _store_mat(a_out_ptr, A, n * H + h, M, D, BM, BD)


@triton.jit
def _key_operands(
    q_ptr, k_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, hk_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h,
    H, M, DK, C,
    BT: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr,
):
    """What the key read of chunk slot ``j`` (of sequence ``n``), head ``h``, reads: its rows,
    saved start memory, anchor (the given one in a resumed first chunk), inputs, and the decays
    ``E[r, i] = exp(c_r - c_i)``, ``mu = exp(c)``, ``Dm = E * gamma``. Returns
    ``(tok0, nrows, cm, resumed, SK, AK, Q, K, Al, E, mu, Dm)``."""
    i = tl.load(cidx_ptr + j)
    start = tl.load(seq_start_ptr + n)
    L = tl.load(seq_len_ptr + n)
    off = tl.load(off_ptr + n)
    lo, nrows = _chunk_rows(i, off, L, C)
    tok0 = start + lo
    cm = (tl.arange(0, BM) < M)[None, :]
    resumed = (i == 0) & (off > 0)
    SK = _load_mat(hk_ptr, j * H + h, M, DK, BM, BDK)
    AK = _anchor(ak0_ptr, SK, n * H + h, M, DK, BM, BDK, resumed)
    Q = _load_tok(q_ptr, tok0, nrows, h, H, DK, BT, BDK)
    K = _load_tok(k_ptr, tok0, nrows, h, H, DK, BT, BDK)
    Al = _load_tok(al_ptr, tok0, nrows, h, H, M, BT, BM)
    lb = _load_scal(lb_ptr, tok0, nrows, h, H, BT)
    g = _load_scal(g_ptr, tok0, nrows, h, H, BT)
    c, _ = _log_decays(lb, nrows, BT)
    E = _decay_matrix(lb, nrows, BT)
    return tok0, nrows, cm, resumed, SK, AK, Q, K, Al, E, tl.exp(c), E * g[None, :]


@triton.jit
def _value_operands(v_ptr, av0_ptr, hv_ptr, tok0, nrows, resumed, n, j, h, H, M, DV,
                    BT: tl.constexpr, BM: tl.constexpr, BDV: tl.constexpr):
    """The value pass's ``(SV, AV, V)`` of the chunk :func:`_key_operands` read."""
    SV = _load_mat(hv_ptr, j * H + h, M, DV, BM, BDV)
    AV = _anchor(av0_ptr, SV, n * H + h, M, DV, BM, BDV, resumed)
    return SV, AV, _load_tok(v_ptr, tok0, nrows, h, H, DV, BT, BDV)


@triton.jit
def _writes(u_ptr, X, A, Al, tok0, nrows, h, H, M, cm, BT: tl.constexpr, BM: tl.constexpr, CF: tl.constexpr,
            PREC: tl.constexpr, EXACT: tl.constexpr):
    """A chunk's ``U`` (one pass): with ``EXACT`` the rows the exact writes' state kernel saved
    (:mod:`.triton_exact`: each from the memory just before its write, by substitution), else
    ``vjp_phi`` at the anchor ``A``, all rows at once."""
    if EXACT:
        U = _load_tok(u_ptr, tok0, nrows, h, H, M, BT, BM)
    else:
        U = _residual_vjp(_dot(X, tl.trans(A), PREC), Al, cm, M, CF)
    return U


@triton.jit
def _key_read(Q, K, SK, UK, mu, Dm, cm, M, MF: tl.constexpr, PREC: tl.constexpr):
    """A chunk's key read (design page, section 2): ``Y = mu * Q SK^T - (D * Q K^T) UK`` and
    ``H = f(Y)``."""
    Y = mu[:, None] * _dot(Q, tl.trans(SK), PREC) - _dot(Dm * _dot(Q, tl.trans(K), PREC), UK, PREC)
    return Y, _mix(Y, cm, M, MF)


@triton.jit
def _chunk_reads(
    q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, av0_ptr, hk_ptr, hv_ptr, uk_ptr, uv_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h,
    H, M, DK, DV, C,
    BT: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    CF: tl.constexpr, MF: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """The forward of chunk slot ``j``, head ``h`` up to its value read, which the forward kernel
    completes and the value backward differentiates: the operands, both writes ``UK``/``UV`` and
    the key read. Returns ``(tok0, nrows, cm, E, mu, Dm, SV, V, Y, Hh, UV)``."""
    tok0, nrows, cm, resumed, SK, AK, Q, K, Al, E, mu, Dm = _key_operands(
        q_ptr, k_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, hk_ptr,
        seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h, H, M, DK, C, BT, BM, BDK)
    SV, AV, V = _value_operands(v_ptr, av0_ptr, hv_ptr, tok0, nrows, resumed, n, j, h, H, M, DV, BT, BM, BDV)
    UK = _writes(uk_ptr, K, AK, Al, tok0, nrows, h, H, M, cm, BT, BM, CF, PREC, EXACT)
    Y, Hh = _key_read(Q, K, SK, UK, mu, Dm, cm, M, MF, PREC)
    UV = _writes(uv_ptr, V, AV, Al, tok0, nrows, h, H, M, cm, BT, BM, CF, PREC, EXACT)
    return tok0, nrows, cm, E, mu, Dm, SV, V, Y, Hh, UV


@triton.jit
def _output_fwd_kernel(
    q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, av0_ptr, hk_ptr, hv_ptr, uk_ptr, uv_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cseq_ptr, cidx_ptr,
    o_ptr,
    H, M, DK, DV, C,
    BT: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    CF: tl.constexpr, MF: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """Both reads of one chunk slot and head; ``EXACT``: the writes ``U`` come saved in
    ``uk``/``uv`` (else they are recomputed from the anchors and those pointers are not read)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(cseq_ptr + j)
    if n >= 0:
        tok0, nrows, _, _, mu, Dm, SV, V, _, Hh, UV = _chunk_reads(
            q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, av0_ptr, hk_ptr, hv_ptr, uk_ptr, uv_ptr,
            seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h,
            H, M, DK, DV, C, BT, BM, BDK, BDV, CF, MF, PREC, EXACT)
        HU = _dot(Hh, tl.trans(UV), PREC)
        O = mu[:, None] * _dot(Hh, SV, PREC) - _dot(Dm * HU, V, PREC)
        _store_tok(o_ptr, O, tok0, nrows, h, H, DV, BT, BDV)
    else:  # a spare slot of the saved-memory buffer: give it defined contents
        _store_mat(hk_ptr, tl.zeros([BM, BDK], dtype=tl.float32), j * H + h, M, DK, BM, BDK)
        _store_mat(hv_ptr, tl.zeros([BM, BDV], dtype=tl.float32), j * H + h, M, DV, BM, BDV)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, mk0_ptr, mv0_ptr, ak0_ptr, av0_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, base_ptr,
    o_ptr, mk_ptr, mv_ptr, ak_ptr, av_ptr, ck_ptr, cv_ptr,
    H, M, DK, DV, C, T,
    BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, CF: tl.constexpr, MF: tl.constexpr,
    PACKED: tl.constexpr, SEG: tl.constexpr,
):
    """Token by token. The outputs may be the input state tensors (in-place update): every
    program reads its own memories before the loop and writes them after it. Unless PACKED,
    row n is tokens n*T .. n*T + T - 1 and the seq_* pointers are not read. With SEG > 0 the
    memories before every SEG-th token of a sequence are saved, its segment i's at slot
    ``base[n] + i`` of ck / cv (the recurrent backward's checkpoints); with SEG = 0 the base,
    ck and cv pointers are not read."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    if PACKED:
        start = tl.load(seq_start_ptr + n)
        L = tl.load(seq_len_ptr + n)
    else:
        start = n.to(tl.int64) * T
        L = T
    off = tl.load(off_ptr + n)
    m = tl.arange(0, BM)
    cm = (m < M)[None, :]
    SK = _load_mat(mk0_ptr, n * H + h, M, DK, BM, BDK)
    SV = _load_mat(mv0_ptr, n * H + h, M, DV, BM, BDV)
    keep = (off > 0) | (L == 0)
    AK = tl.where(keep, _load_mat(ak0_ptr, n * H + h, M, DK, BM, BDK), SK)
    AV = tl.where(keep, _load_mat(av0_ptr, n * H + h, M, DV, BM, BDV), SV)
    for t in range(0, L):
        tok = (start + t).to(tl.int64)
        new_chunk = (off + t) % C == 0
        AK = tl.where(new_chunk, SK, AK)
        AV = tl.where(new_chunk, SV, AV)
        if SEG > 0:
            if t % SEG == 0:
                base = tl.load(base_ptr + n)
                _store_mat(ck_ptr, SK, (base + t // SEG) * H + h, M, DK, BM, BDK)
                _store_mat(cv_ptr, SV, (base + t // SEG) * H + h, M, DV, BM, BDV)
        kk, vv, al, beta, gam = _write_inputs(k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, tok, h, H, M, DK, DV, BM, BDK, BDV)
        qq = _load_vec(q_ptr, tok, h, H, DK, BDK)
        # identity (CF == 0) takes its residuals at the current memories (design page, section 1).
        if CF == 0:
            zk = tl.sum(SK * kk[None, :], axis=1)[None, :]
            zv = tl.sum(SV * vv[None, :], axis=1)[None, :]
        else:
            zk = tl.sum(AK * kk[None, :], axis=1)[None, :]
            zv = tl.sum(AV * vv[None, :], axis=1)[None, :]
        uk = _residual_vjp(zk, al, cm, M, CF)
        SK = beta * SK - gam * tl.reshape(uk, [BM])[:, None] * kk[None, :]
        hh = _mix(tl.sum(SK * qq[None, :], axis=1)[None, :], cm, M, MF)
        uv = _residual_vjp(zv, al, cm, M, CF)
        SV = beta * SV - gam * tl.reshape(uv, [BM])[:, None] * vv[None, :]
        o = tl.sum(SV * tl.reshape(hh, [BM])[:, None], axis=0)
        _store_vec(o_ptr, o, tok, h, H, DV, BDV)
    _store_mat(mk_ptr, SK, n * H + h, M, DK, BM, BDK)
    _store_mat(mv_ptr, SV, n * H + h, M, DV, BM, BDV)
    _store_mat(ak_ptr, AK, n * H + h, M, DK, BM, BDK)
    _store_mat(av_ptr, AV, n * H + h, M, DV, BM, BDV)


# ---------------------------------------------------------------------------------------------
# Backward kernels.


@triton.jit
def _gate_parts(dD, dmu, E, Dm, mu):
    """(dgamma, dc) of ``D = E * gamma`` and ``mu = exp(c)`` for cotangents ``dD`` and ``dmu``
    (``E[r, i] = exp(c_r - c_i)``, ``Dm = D``): linear in both, so parts may be summed."""
    dDD = dD * Dm
    return tl.sum(dD * E, axis=0), dmu * mu + tl.sum(dDD, axis=1) - tl.sum(dDD, axis=0)


@triton.jit
def _value_bwd_kernel(
    q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, av0_ptr, hk_ptr, hv_ptr, uk_ptr, uv_ptr, do_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cseq_ptr, cidx_ptr,
    dv_ptr, duv_ptr, pv_ptr, dy_ptr, dg_ptr, dc_ptr,
    H, M, DK, DV, C,
    BT: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
    CF: tl.constexpr, MF: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """``tests/kernel_mirror.py``: chunk_local_backward for one chunk and head, its first half: the
    value read back to ``dY``, the gradient at the mixing function's input, which
    :func:`_key_bwd_kernel` takes on (two kernels: one held every tile of both and spilled)."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(cseq_ptr + j)
    if n >= 0:
        tok0, nrows, cm, E, mu, Dm, SV, V, Y, Hh, UV = _chunk_reads(  # the forward, recomputed
            q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, av0_ptr, hk_ptr, hv_ptr, uk_ptr, uv_ptr,
            seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h,
            H, M, DK, DV, C, BT, BM, BDK, BDV, CF, MF, PREC, EXACT)
        dO = _load_tok(do_ptr, tok0, nrows, h, H, DV, BT, BDV)
        # Value read: O = mu * H SV - (D * H UV^T) V; dY first, so that Y dies early.
        dOV = _dot(dO, tl.trans(V), PREC)
        dHU = -Dm * dOV
        dH = mu[:, None] * _dot(dO, tl.trans(SV), PREC) + _dot(dHU, UV, PREC)
        _store_tok(dy_ptr, _mix_bwd(Y, dH, cm, M, MF), tok0, nrows, h, H, M, BT, BM)
        _store_tok(duv_ptr, _dot(tl.trans(dHU), Hh, PREC), tok0, nrows, h, H, M, BT, BM)
        _store_tok(pv_ptr, mu[:, None] * Hh, tok0, nrows, h, H, M, BT, BM)
        HU = _dot(Hh, tl.trans(UV), PREC)
        _store_tok(dv_ptr, -_dot(tl.trans(Dm * HU), dO, PREC), tok0, nrows, h, H, DV, BT, BDV)
        dmu = tl.sum(_dot(Hh, SV, PREC) * dO, axis=1)
        dg, dc = _gate_parts(-HU * dOV, dmu, E, Dm, mu)
        _store_scal(dg_ptr, dg, tok0, nrows, h, H, BT)
        _store_scal(dc_ptr, dc, tok0, nrows, h, H, BT)


@triton.jit
def _key_bwd_kernel(
    q_ptr, k_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, hk_ptr, uk_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cseq_ptr, cidx_ptr,
    dq_ptr, dk_ptr, duk_ptr, pk_ptr, dg_ptr, dc_ptr,
    H, M, DK, C,
    BT: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr,
    CF: tl.constexpr, PREC: tl.constexpr, EXACT: tl.constexpr,
):
    """``tests/kernel_mirror.py``: chunk_local_backward for one chunk and head, its second half: the
    key read, from the ``dY`` that :func:`_value_bwd_kernel` left in ``duk`` (overwritten here
    by ``dU_k``, row for row, by the program that read it); adds its parts of dgamma and dc to
    that kernel's."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(cseq_ptr + j)
    if n >= 0:
        tok0, nrows, cm, _, SK, AK, Q, K, Al, E, mu, Dm = _key_operands(
            q_ptr, k_ptr, al_ptr, lb_ptr, g_ptr, ak0_ptr, hk_ptr,
            seq_start_ptr, seq_len_ptr, off_ptr, cidx_ptr, n, j, h, H, M, DK, C, BT, BM, BDK)
        dY = _load_tok(duk_ptr, tok0, nrows, h, H, M, BT, BM)
        # Key read: Y = mu * Q SK^T - (D * Q K^T) UK, H = f(Y).
        UK = _writes(uk_ptr, K, AK, Al, tok0, nrows, h, H, M, cm, BT, BM, CF, PREC, EXACT)
        QK = _dot(Q, tl.trans(K), PREC)
        dmu = tl.sum(_dot(Q, tl.trans(SK), PREC) * dY, axis=1)
        PK = mu[:, None] * dY
        dQKD = -_dot(dY, tl.trans(UK), PREC)
        dQK = Dm * dQKD
        _store_tok(duk_ptr, -_dot(tl.trans(Dm * QK), dY, PREC), tok0, nrows, h, H, M, BT, BM)
        _store_tok(pk_ptr, PK, tok0, nrows, h, H, M, BT, BM)
        _store_tok(dq_ptr, _dot(PK, SK, PREC) + _dot(dQK, K, PREC), tok0, nrows, h, H, DK, BT, BDK)
        _store_tok(dk_ptr, _dot(tl.trans(dQK), Q, PREC), tok0, nrows, h, H, DK, BT, BDK)
        dg, dc = _gate_parts(QK * dQKD, dmu, E, Dm, mu)
        _store_scal(dg_ptr, _load_scal(dg_ptr, tok0, nrows, h, H, BT) + dg, tok0, nrows, h, H, BT)
        _store_scal(dc_ptr, _load_scal(dc_ptr, tok0, nrows, h, H, BT) + dc, tok0, nrows, h, H, BT)


@triton.jit
def _chain_bwd_kernel(
    x_ptr, al_ptr, lb_ptr, g_ptr, a0_ptr, hs_ptr, du_ptr, p_ptr, r_ptr, dm_fin_ptr, da_fin_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, base_ptr,
    dx_ptr, dal_ptr, dg_ptr, dc_ptr, dm0_ptr, da0_ptr,
    H, M, D, DR, C,
    BT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BDR: tl.constexpr, CF: tl.constexpr,
    PREC: tl.constexpr,
):
    """``tests/kernel_mirror.py``: chunk_chain_backward over one sequence's chunks in reverse, one pass.

    Adds into dx (the pass's own input, written by the local kernels); writes this pass's parts
    of dalpha, dgamma and dc, which :func:`_gates_bwd_kernel` sums with the other pass's and the
    local kernels' (so the two passes share no output and may run at once).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    start, L, off, base, n_chunks = _chunked_sequence(seq_start_ptr, seq_len_ptr, off_ptr, base_ptr, n, C)
    r = tl.arange(0, BT)
    cm = (tl.arange(0, BM) < M)[None, :]
    dS = _load_mat(dm_fin_ptr, n * H + h, M, D, BM, BD)
    dA_fin = _load_mat(da_fin_ptr, n * H + h, M, D, BM, BD)
    dA0 = tl.zeros([BM, BD], dtype=tl.float32)
    for ii in range(0, n_chunks):
        i = n_chunks - 1 - ii
        lo, nrows = _chunk_rows(i, off, L, C)
        tok0 = start + lo
        S = _load_mat(hs_ptr, (base + i) * H + h, M, D, BM, BD)
        resumed = (i == 0) & (off > 0)
        A = _anchor(a0_ptr, S, n * H + h, M, D, BM, BD, resumed)
        X = _load_tok(x_ptr, tok0, nrows, h, H, D, BT, BD)
        Al = _load_tok(al_ptr, tok0, nrows, h, H, M, BT, BM)
        dU = _load_tok(du_ptr, tok0, nrows, h, H, M, BT, BM)
        P = _load_tok(p_ptr, tok0, nrows, h, H, M, BT, BM)
        R = _load_tok(r_ptr, tok0, nrows, h, H, DR, BT, BDR)
        lb = _load_scal(lb_ptr, tok0, nrows, h, H, BT)
        g = _load_scal(g_ptr, tok0, nrows, h, H, BT)
        _, c_last = _log_decays(lb, nrows, BT)
        wexp = tl.where(r < nrows, tl.exp(_log_after(lb, BT)), 0.0)
        w = g * wexp
        mu_last = tl.exp(c_last)
        Z = _dot(X, tl.trans(A), PREC)
        U = _residual_vjp(Z, Al, cm, M, CF)
        XdS = _dot(X, tl.trans(dS), PREC)
        dU = dU - w[:, None] * XdS
        dw = -tl.sum(U * XdS, axis=1)
        dX = -_dot(w[:, None] * U, dS, PREC)
        dmu_last = tl.sum(tl.sum(S * dS, axis=1), axis=0)
        dZ, dAl = _residual_vjp_bwd(Z, Al, dU, cm, M, CF)
        dX += _dot(dZ, A, PREC)
        dA = _dot(tl.trans(dZ), X, PREC)
        dA += tl.where(ii == 0, dA_fin, 0.0)  # the final state's anchor is the last chunk's
        dg = dw * wexp
        dc = -dw * w + tl.where(r == nrows - 1, tl.sum(dw * w, axis=0) + dmu_last * mu_last, 0.0)
        dX += _load_tok(dx_ptr, tok0, nrows, h, H, D, BT, BD)
        _store_tok(dx_ptr, dX, tok0, nrows, h, H, D, BT, BD)
        _store_tok(dal_ptr, dAl, tok0, nrows, h, H, M, BT, BM)
        _store_scal(dg_ptr, dg, tok0, nrows, h, H, BT)
        _store_scal(dc_ptr, dc, tok0, nrows, h, H, BT)
        dS = mu_last * dS + _dot(tl.trans(P), R, PREC) + tl.where(resumed, 0.0, dA)
        dA0 += tl.where(resumed, dA, 0.0)
    dA0 = tl.where(n_chunks == 0, dA_fin, dA0)  # an empty sequence hands its anchor through
    _store_mat(dm0_ptr, dS, n * H + h, M, D, BM, BD)
    _store_mat(da0_ptr, dA0, n * H + h, M, D, BM, BD)


@triton.jit
def _gates_bwd_kernel(
    dg_ptr, dc_ptr, dgk_ptr, dck_ptr, dgv_ptr, dcv_ptr, dalk_ptr, dalv_ptr,
    seq_start_ptr, seq_len_ptr, off_ptr, cseq_ptr, cidx_ptr,
    dgam_ptr, dlb_ptr, dal_ptr,
    H, M, C,
    BT: tl.constexpr, BM: tl.constexpr,
):
    """The local kernels' and both chains' parts of one chunk slot and head summed: dgamma,
    dalpha, and dlog_beta, the reverse cumulative sum of dc inside the chunk."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(cseq_ptr + j)
    if n >= 0:
        i = tl.load(cidx_ptr + j)
        lo, nrows = _chunk_rows(i, tl.load(off_ptr + n), tl.load(seq_len_ptr + n), C)
        tok0 = tl.load(seq_start_ptr + n) + lo
        dc = (_load_scal(dc_ptr, tok0, nrows, h, H, BT) + _load_scal(dck_ptr, tok0, nrows, h, H, BT)
              + _load_scal(dcv_ptr, tok0, nrows, h, H, BT))
        _store_scal(dlb_ptr, tl.cumsum(dc, axis=0, reverse=True), tok0, nrows, h, H, BT)
        dg = (_load_scal(dg_ptr, tok0, nrows, h, H, BT) + _load_scal(dgk_ptr, tok0, nrows, h, H, BT)
              + _load_scal(dgv_ptr, tok0, nrows, h, H, BT))
        _store_scal(dgam_ptr, dg, tok0, nrows, h, H, BT)
        dal = _load_tok(dalk_ptr, tok0, nrows, h, H, M, BT, BM) + _load_tok(dalv_ptr, tok0, nrows, h, H, M, BT, BM)
        _store_tok(dal_ptr, dal, tok0, nrows, h, H, M, BT, BM)


@triton.jit
def _token_reads(SK, SV, kk, vv, al, beta, gam, cm, M, BM: tl.constexpr, CF: tl.constexpr):
    """One token's writes from the memories before it (the anchors at C = 1): ``(z_k, u_k, z_v,
    u_v, SK', SV')``, z and u as ``[1, BM]`` rows."""
    zk = tl.sum(SK * kk[None, :], axis=1)[None, :]
    zv = tl.sum(SV * vv[None, :], axis=1)[None, :]
    uk = _residual_vjp(zk, al, cm, M, CF)
    uv = _residual_vjp(zv, al, cm, M, CF)
    SK2 = beta * SK - gam * tl.reshape(uk, [BM])[:, None] * kk[None, :]
    SV2 = beta * SV - gam * tl.reshape(uv, [BM])[:, None] * vv[None, :]
    return zk, uk, zv, uv, SK2, SV2


@triton.jit
def _recurrent_bwd_kernel(
    q_ptr, k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, do_ptr, ck_ptr, cv_ptr, dmk_ptr, dmv_ptr, dak_ptr, dav_ptr,
    seq_start_ptr, seq_len_ptr, base_ptr, sk_ptr, sv_ptr,
    dq_ptr, dk_ptr, dv_ptr, dal_ptr, dlb_ptr, dg_ptr, dmk0_ptr, dmv0_ptr, dak0_ptr, dav0_ptr,
    H, M, DK, DV,
    SEG: tl.constexpr, BM: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr, CF: tl.constexpr, MF: tl.constexpr,
):
    """``tests/kernel_mirror.py``: mirror_token_backward (C = 1) for one sequence and head.

    Segments of SEG tokens in reverse: the memories before each token of the segment are
    recomputed from its checkpoint into this program's scratch rows of sk / sv
    (``[rows * H, SEG, M, D]``), then the tokens run in reverse through token_backward, the
    memories after a token being those before the next one (after the segment's last token:
    where the recomputation ended). Memory: checkpoints every SEG tokens and SEG memories of
    scratch per program, where the chunk kernels at C = 1 would save every token's memories."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(seq_start_ptr + n)
    L = tl.load(seq_len_ptr + n)
    base = tl.load(base_ptr + n)
    m = tl.arange(0, BM)
    cm = (m < M)[None, :]
    scratch = (n * H + h) * SEG
    GK = _load_mat(dmk_ptr, n * H + h, M, DK, BM, BDK)
    GV = _load_mat(dmv_ptr, n * H + h, M, DV, BM, BDV)
    n_seg = tl.cdiv(L, SEG)
    for ii in range(0, n_seg):
        s = n_seg - 1 - ii
        lo = s * SEG
        hi = tl.minimum(lo + SEG, L)
        SK = _load_mat(ck_ptr, (base + s) * H + h, M, DK, BM, BDK)
        SV = _load_mat(cv_ptr, (base + s) * H + h, M, DV, BM, BDV)
        for t in range(lo, hi):
            _store_mat(sk_ptr, SK, scratch + t - lo, M, DK, BM, BDK)
            _store_mat(sv_ptr, SV, scratch + t - lo, M, DV, BM, BDV)
            tok = (start + t).to(tl.int64)
            kk, vv, al, beta, gam = _write_inputs(k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, tok, h, H, M, DK, DV,
                                                  BM, BDK, BDV)
            _, _, _, _, SK, SV = _token_reads(SK, SV, kk, vv, al, beta, gam, cm, M, BM, CF)
        tl.debug_barrier()  # the scratch rows written above, read below by other threads
        # SK, SV: the memories after the segment's last token.
        for tt in range(lo, hi):
            t = hi - 1 - (tt - lo)
            SK2, SV2 = SK, SV
            SK = _load_mat(sk_ptr, scratch + t - lo, M, DK, BM, BDK)
            SV = _load_mat(sv_ptr, scratch + t - lo, M, DV, BM, BDV)
            tok = (start + t).to(tl.int64)
            kk, vv, al, beta, gam = _write_inputs(k_ptr, v_ptr, al_ptr, lb_ptr, g_ptr, tok, h, H, M, DK, DV,
                                                  BM, BDK, BDV)
            qq = _load_vec(q_ptr, tok, h, H, DK, BDK)
            dO = _load_vec(do_ptr, tok, h, H, DV, BDV)
            zk, uk, zv, uv, _, _ = _token_reads(SK, SV, kk, vv, al, beta, gam, cm, M, BM, CF)
            y = tl.sum(SK2 * qq[None, :], axis=1)[None, :]
            hh = _mix(y, cm, M, MF)
            # Value read o = SV'^T h, then the value write SV' = beta SV - gamma uv v^T.
            GV += tl.reshape(hh, [BM])[:, None] * dO[None, :]
            dh = tl.sum(SV2 * dO[None, :], axis=1)[None, :]
            gv = tl.sum(GV * vv[None, :], axis=1)[None, :]
            dbeta = tl.sum(tl.sum(GV * SV, axis=1), axis=0)
            dgam = -tl.sum(tl.sum(uv * gv, axis=1), axis=0)
            dzv, dal = _residual_vjp_bwd(zv, al, -gam * gv, cm, M, CF)
            uv_c = tl.reshape(uv, [BM])[:, None]
            dzv_c = tl.reshape(dzv, [BM])[:, None]
            dvv = tl.sum(dzv_c * SV - gam * uv_c * GV, axis=0)
            GV = beta * GV + dzv_c * vv[None, :]
            # Key read y = SK' q, h = f(y), then the key write.
            dy = _mix_bwd(y, dh, cm, M, MF)
            dy_c = tl.reshape(dy, [BM])[:, None]
            GK += dy_c * qq[None, :]
            dqq = tl.sum(dy_c * SK2, axis=0)
            gk = tl.sum(GK * kk[None, :], axis=1)[None, :]
            dbeta += tl.sum(tl.sum(GK * SK, axis=1), axis=0)
            dgam -= tl.sum(tl.sum(uk * gk, axis=1), axis=0)
            dzk, dal_k = _residual_vjp_bwd(zk, al, -gam * gk, cm, M, CF)
            uk_c = tl.reshape(uk, [BM])[:, None]
            dzk_c = tl.reshape(dzk, [BM])[:, None]
            dkk = tl.sum(dzk_c * SK - gam * uk_c * GK, axis=0)
            GK = beta * GK + dzk_c * kk[None, :]
            if t == L - 1:  # the final anchors are the memories before the last token
                GK += _load_mat(dak_ptr, n * H + h, M, DK, BM, BDK)
                GV += _load_mat(dav_ptr, n * H + h, M, DV, BM, BDV)
            _store_vec(dq_ptr, dqq, tok, h, H, DK, BDK)
            _store_vec(dk_ptr, dkk, tok, h, H, DK, BDK)
            _store_vec(dv_ptr, dvv, tok, h, H, DV, BDV)
            _store_vec(dal_ptr, tl.reshape(dal + dal_k, [BM]), tok, h, H, M, BM)
            tl.store(dlb_ptr + tok * H + h, dbeta * beta)
            tl.store(dg_ptr + tok * H + h, dgam)
        tl.debug_barrier()  # the next segment overwrites the scratch rows read above
    _store_mat(dmk0_ptr, GK, n * H + h, M, DK, BM, BDK)
    _store_mat(dmv0_ptr, GV, n * H + h, M, DV, BM, BDV)
    # An empty sequence hands its anchors through; otherwise the given anchors are replaced
    # before they are read (every token starts a chunk).
    empty = L == 0
    _store_mat(dak0_ptr, tl.where(empty, _load_mat(dak_ptr, n * H + h, M, DK, BM, BDK), 0.0), n * H + h, M, DK, BM, BDK)
    _store_mat(dav0_ptr, tl.where(empty, _load_mat(dav_ptr, n * H + h, M, DV, BM, BDV), 0.0), n * H + h, M, DV, BM, BDV)


# ---------------------------------------------------------------------------------------------
# Host side.


def _kernel_precision() -> str:
    """``DOT_PRECISION`` as the kernels take it. Triton's interpreter multiplies bfloat16 tiles
    wrongly (triton 3.6 to 3.9 return garbage for ``tl.dot`` of two bfloat16 tiles), so there
    ``"bf16"`` becomes ``"bf16_rounded"``: the operands rounded to bfloat16 and multiplied in
    float32, the same products (one of two bfloat16 numbers is exact in float32), summed in
    float32 as the tensor cores do."""
    if DOT_PRECISION == "bf16" and os.environ.get("TRITON_INTERPRET") == "1":
        return "bf16_rounded"
    return DOT_PRECISION


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _row_tile(chunk_size: int, length: int) -> int:
    """Rows of a chunk tile: no chunk holds more than min(C, T) tokens of one sequence, so a
    short call at a large C compiles and runs small tiles (the cost follows the tokens)."""
    return _pow2(min(chunk_size, length))


def _warps(kernel: str, *dims: int) -> int:
    """Warps per program of a ``"chunk"`` or ``"recurrent"`` kernel, chosen from the sm_90
    compiles (``bench_gpu.py --compile-check``: ptxas's spilled bytes and whether it serializes
    the tensor-core instructions; untimed). The chunk kernels hold many [64, D] float32 tiles:
    8 warps spill least at D = 64 and 128 (16 warps cap a thread at 128 registers, and at
    D = 128 ptxas then serializes every chunk kernel's wgmma). The token-by-token kernels hold
    [M, D] memories and single rows: 16 warps spill less above D = 64."""
    if kernel == "recurrent" and max(dims) > 64:
        return 16
    return 8


def _stages(kernel: str, *tiles: int) -> int:
    """Software-pipelining depth of the chunk loops (more stages = more shared memory)."""
    if kernel == "state":
        return 2
    if kernel == "chain":
        return 2 if max(tiles) <= 64 else 1
    return 1  # no loop to pipeline


def _codes(compress_fn: str, mix_fn: str) -> tuple[int, int]:
    return COMPRESS_FNS.index(compress_fn), MIX_FNS.index(mix_fn)


def _use_recurrent(length: int, chunk_size: int) -> bool:
    """Token by token for the exact recurrence and for one-token steps (see the module doc)."""
    return chunk_size == 1 or length == 1


def _state_pass(x, alpha, log_beta, gamma, m0, a0, plan, chunk_size, cf):
    """Run the state chain of one pass; returns (chunk-start memories, final memory, final anchor)."""
    rows, heads, slots_m, dim = m0.shape
    hs = x.new_empty((plan.slots, heads, slots_m, dim), dtype=torch.float32)
    m_out = torch.empty_like(m0, dtype=torch.float32)
    a_out = torch.empty_like(m0, dtype=torch.float32)
    if rows * heads:
        _state_fwd_kernel[(rows, heads)](
            x, alpha, log_beta, gamma, m0, a0,
            plan.seq_start, plan.seq_len, plan.offset, plan.chunk_base,
            hs, m_out, a_out,
            heads, slots_m, dim, chunk_size,
            BT=_row_tile(chunk_size, x.shape[1]), BM=_pow2(slots_m), BD=_pow2(dim), CF=cf, PREC=_kernel_precision(),
            num_warps=_warps("chunk"), num_stages=_stages("state"),
        )
    return hs, m_out, a_out


@functools.cache
def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device)


def _tensors_in(results) -> list[torch.Tensor]:
    """The tensors of nested tuples of tensors."""
    if isinstance(results, torch.Tensor):
        return [results]
    return [t for item in results for t in _tensors_in(item)]


def _side_by_side(like: torch.Tensor, first, second) -> tuple:
    """``(*first(), *second())`` of two launches that share no output and read nothing the other
    writes: the key and value passes of a chain, each one program per sequence and head, too
    few to fill a GPU for a small batch of long sequences. On a GPU (``like``'s device) ``second``
    runs on a side stream beside ``first``, and the side stream joins the caller's before
    anything returns (the caller frees nothing they still read)."""
    if not like.is_cuda:
        return (*first(), *second())
    main, side = torch.cuda.current_stream(like.device), _side_stream(like.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        later = second()
    earlier = first()
    main.wait_stream(side)
    for t in _tensors_in(later):  # made on the side stream, used and freed on the caller's
        t.record_stream(main)
    return (*earlier, *later)


def _both_state_passes(k, v, alpha, log_beta, gamma, keys, values, plan, chunk_size, cf):
    """:func:`_state_pass` of the keys (memory and anchor ``keys``) and of the values, side by
    side (:func:`_side_by_side`). Returns both passes' results."""
    return _side_by_side(
        k, lambda: (_state_pass(k, alpha, log_beta, gamma, *keys, plan, chunk_size, cf),),
        lambda: (_state_pass(v, alpha, log_beta, gamma, *values, plan, chunk_size, cf),))


def recurrent_launch(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                     o, outs, chunk_size, cf, mf, checkpoints=None):
    """One launch of the token-by-token kernel; ``outs`` = new (m_k, m_v, anchor_k, anchor_v),
    which may be the state tensors themselves (in-place update). ``checkpoints``: ``(plan,
    c_k, c_v)`` to save the memories before every ``RECURRENT_SEGMENT``-th token of each
    sequence at the slots of ``plan`` (:func:`_segment_plan`), for the recurrent backward."""
    length, heads, dk = q.shape[1:]
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    rows = offset.numel()
    if cu_seqlens is None:
        seq_start = seq_len = offset  # not read
    else:
        seq_start, seq_len = cu_seqlens[:-1].contiguous(), (cu_seqlens[1:] - cu_seqlens[:-1]).contiguous()
    base, c_k, c_v = (offset, m_k, m_v) if checkpoints is None else (checkpoints[0].chunk_base, *checkpoints[1:])
    if rows * heads:
        _recurrent_kernel[(rows, heads)](
            q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v,
            seq_start, seq_len, offset, base,
            o, *outs, c_k, c_v,
            heads, slots_m, dk, dv, chunk_size, length,
            BM=_pow2(slots_m), BDK=_pow2(dk), BDV=_pow2(dv), CF=cf, MF=mf, PACKED=cu_seqlens is not None,
            SEG=0 if checkpoints is None else RECURRENT_SEGMENT,
            num_warps=_warps("recurrent", dk, dv, slots_m), num_stages=1,
        )


def _segment_plan(offset, batch, length, cu_seqlens):
    """Where the recurrent backward's checkpoints go: segments of ``RECURRENT_SEGMENT`` tokens
    are the chunks of this plan (at C = 1 every offset is 0)."""
    return make_plan(offset, batch, length, RECURRENT_SEGMENT, cu_seqlens)


def _recurrent_backward(q, k, v, alpha, log_beta, gamma, offset, cu_seqlens, c_k, c_v, d_o, d_mk, d_mv, d_ak, d_av,
                        cf, mf):
    """The gradients of :func:`_backward_impl` at ``chunk_size = 1`` (:func:`_recurrent_bwd_kernel`)."""
    batch, length, heads, dk = q.shape
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    rows = offset.numel()
    plan = _segment_plan(offset, batch, length, cu_seqlens)
    grads = [torch.empty_like(t) for t in (q, k, v, alpha, log_beta, gamma)]
    d_init = [torch.empty_like(t) for t in (d_mk, d_mv, d_ak, d_av)]
    scratch = [q.new_empty((rows * heads * RECURRENT_SEGMENT, slots_m, d)) for d in (dk, dv)]
    if rows * heads:
        _recurrent_bwd_kernel[(rows, heads)](
            q, k, v, alpha, log_beta, gamma, d_o, c_k, c_v, d_mk, d_mv, d_ak, d_av,
            plan.seq_start, plan.seq_len, plan.chunk_base, *scratch,
            *grads, *d_init,
            heads, slots_m, dk, dv,
            SEG=RECURRENT_SEGMENT, BM=_pow2(slots_m), BDK=_pow2(dk), BDV=_pow2(dv), CF=cf, MF=mf,
            num_warps=_warps("recurrent", dk, dv, slots_m), num_stages=1,
        )
    return (*grads, *d_init)


def _forward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                  chunk_size, compress_fn, mix_fn):
    """All tensors contiguous float32 on one device. Returns (o, m_k, m_v, a_k, a_v, h_k, h_v):
    h_* the memories at every chunk start, at C = 1 those before every ``RECURRENT_SEGMENT``-th
    token of each sequence (the recurrent backward's checkpoints), and empty for one token at
    C > 1 (the backward recomputes its chunk start)."""
    batch, length, heads, dk = q.shape
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    cf, mf = _codes(compress_fn, mix_fn)
    if _use_recurrent(length, chunk_size):
        o = torch.empty_like(v)
        outs = [torch.empty_like(t) for t in (m_k, m_v, anchor_k, anchor_v)]
        if chunk_size > 1:  # one token mid-chunk: the backward rebuilds its chunk start
            recurrent_launch(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                             o, outs, chunk_size, cf, mf)
            return (o, *outs, q.new_empty((0,)), q.new_empty((0,)))
        plan = _segment_plan(offset, batch, length, cu_seqlens)
        c_k, c_v = (m.new_empty((plan.slots,) + tuple(m.shape[1:])) for m in (m_k, m_v))
        recurrent_launch(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                         o, outs, chunk_size, cf, mf, checkpoints=(plan, c_k, c_v))
        return (o, *outs, c_k, c_v)
    plan = make_plan(offset, batch, length, chunk_size, cu_seqlens)
    (h_k, mk_out, ak_out), (h_v, mv_out, av_out) = _both_state_passes(
        k, v, alpha, log_beta, gamma, (m_k, anchor_k), (m_v, anchor_v), plan, chunk_size, cf)
    o = read_launch(q, k, v, alpha, log_beta, gamma, (anchor_k, anchor_v), (h_k, h_v), None, plan, chunk_size, cf, mf)
    return o, mk_out, mv_out, ak_out, av_out, h_k, h_v


def read_launch(q, k, v, alpha, log_beta, gamma, anchors, starts, writes, plan, chunk_size, cf, mf):
    """``o``: both reads of every chunk of ``plan`` (:func:`_output_fwd_kernel`), from the chunk-start
    memories ``starts = (h_k, h_v)``; ``writes = (u_k, u_v)``, the exact writes' saved ``U``, or
    ``None`` to recompute them from ``anchors`` (the given anchors of a resumed first chunk)."""
    length, heads, dk = q.shape[1:]
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    o = torch.empty_like(v)
    if plan.slots * heads:
        _output_fwd_kernel[(plan.slots, heads)](
            q, k, v, alpha, log_beta, gamma, *anchors, *starts, *(writes or starts),
            plan.seq_start, plan.seq_len, plan.offset, plan.chunk_seq, plan.chunk_idx,
            o,
            heads, slots_m, dk, dv, chunk_size,
            BT=_row_tile(chunk_size, length), BM=_pow2(slots_m), BDK=_pow2(dk), BDV=_pow2(dv), CF=cf, MF=mf,
            PREC=_kernel_precision(), EXACT=writes is not None,
            num_warps=_warps("chunk"), num_stages=_stages("output"),
        )
    return o


def local_backward(q, k, v, alpha, log_beta, gamma, anchors, starts, writes, d_o, plan, chunk_size, cf, mf):
    """The gradients that need no later chunk (:func:`_value_bwd_kernel`, then :func:`_key_bwd_kernel`),
    arguments as :func:`read_launch`'s. Returns ``(dq, dk, dv, du_k, du_v, p_k, p_v, dgamma, dc)``:
    the reads' parts of the input gradients, of ``dU`` and of the gates (``dc``: of the in-chunk
    cumulative log decays), and ``p_*``, what the chains' memory gradients add at each chunk start."""
    length, heads, dk = q.shape[1:]
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    dq, dk_, dv_ = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    du_k, du_v, p_k, p_v = (torch.empty_like(alpha) for _ in range(4))
    d_gamma, dc = torch.empty_like(gamma), torch.empty_like(gamma)
    if plan.slots * heads:
        tiles = dict(BT=_row_tile(chunk_size, length), BM=_pow2(slots_m), BDK=_pow2(dk), CF=cf, PREC=_kernel_precision(),
                     EXACT=writes is not None, num_warps=_warps("chunk"), num_stages=_stages("local"))
        chunks = (plan.seq_start, plan.seq_len, plan.offset, plan.chunk_seq, plan.chunk_idx)
        u_k, u_v = writes or starts
        _value_bwd_kernel[(plan.slots, heads)](
            q, k, v, alpha, log_beta, gamma, *anchors, *starts, u_k, u_v, d_o, *chunks,
            dv_, du_v, p_v, du_k, d_gamma, dc,
            heads, slots_m, dk, dv, chunk_size, BDV=_pow2(dv), MF=mf, **tiles,
        )
        _key_bwd_kernel[(plan.slots, heads)](
            q, k, alpha, log_beta, gamma, anchors[0], starts[0], u_k, *chunks,
            dq, dk_, du_k, p_k, d_gamma, dc,
            heads, slots_m, dk, chunk_size, **tiles,
        )
    return dq, dk_, dv_, du_k, du_v, p_k, p_v, d_gamma, dc


def gates_backward(d_gamma, dc, chain_parts, alpha, log_beta, plan, chunk_size):
    """``(dalpha, dlog_beta, dgamma)``: the reads' parts (``d_gamma``, ``dc``) and both chains'
    ``chain_parts = ((dal_k, dg_k, dc_k), (dal_v, dg_v, dc_v))`` summed (:func:`_gates_bwd_kernel`)."""
    (dal_k, dg_k, dc_k), (dal_v, dg_v, dc_v) = chain_parts
    heads, slots_m = alpha.shape[-2:]
    d_alpha, d_lb, d_gamma_all = torch.empty_like(alpha), torch.empty_like(log_beta), torch.empty_like(d_gamma)
    if plan.slots * heads:
        _gates_bwd_kernel[(plan.slots, heads)](
            d_gamma, dc, dg_k, dc_k, dg_v, dc_v, dal_k, dal_v,
            plan.seq_start, plan.seq_len, plan.offset, plan.chunk_seq, plan.chunk_idx,
            d_gamma_all, d_lb, d_alpha,
            heads, slots_m, chunk_size, BT=_row_tile(chunk_size, alpha.shape[1]), BM=_pow2(slots_m),
            num_warps=_warps("chunk"),
        )
    return d_alpha, d_lb, d_gamma_all


def _backward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                   h_k, h_v, d_o, d_mk, d_mv, d_ak, d_av, chunk_size, compress_fn, mix_fn):
    """Gradients for (q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v)."""
    batch, length, heads, dk = q.shape
    dv, slots_m = v.shape[-1], alpha.shape[-1]
    rows = offset.numel()
    cf, mf = _codes(compress_fn, mix_fn)
    if chunk_size == 1:
        return _recurrent_backward(q, k, v, alpha, log_beta, gamma, offset, cu_seqlens, h_k, h_v, d_o,
                                   d_mk, d_mv, d_ak, d_av, cf, mf)
    plan = make_plan(offset, batch, length, chunk_size, cu_seqlens)
    if h_k.numel() == 0 and plan.slots > 0:  # one token mid-chunk: rebuild its chunk start
        (h_k, _, _), (h_v, _, _) = _both_state_passes(
            k, v, alpha, log_beta, gamma, (m_k, anchor_k), (m_v, anchor_v), plan, chunk_size, cf)
    dq, dk_, dv_, du_k, du_v, p_k, p_v, d_gamma, dc = local_backward(
        q, k, v, alpha, log_beta, gamma, (anchor_k, anchor_v), (h_k, h_v), None, d_o, plan, chunk_size, cf, mf)
    BT, BM = _row_tile(chunk_size, length), _pow2(slots_m)

    def chain(x, a0, hs, du, p, r, dm_fin, da_fin, dx):
        """One pass's chain: its parts of (dalpha, dgamma, dc) and the gradients of its initial
        memory and anchor; adds into ``dx``."""
        parts = (torch.empty_like(alpha), torch.empty_like(gamma), torch.empty_like(gamma))
        d_init = (torch.empty_like(dm_fin), torch.empty_like(da_fin))
        dim, r_dim = x.shape[-1], r.shape[-1]
        if rows * heads:
            _chain_bwd_kernel[(rows, heads)](
                x, alpha, log_beta, gamma, a0, hs, du, p, r, dm_fin, da_fin,
                plan.seq_start, plan.seq_len, plan.offset, plan.chunk_base,
                dx, *parts, *d_init,
                heads, slots_m, dim, r_dim, chunk_size,
                BT=BT, BM=BM, BD=_pow2(dim), BDR=_pow2(r_dim), CF=cf, PREC=_kernel_precision(),
                num_warps=_warps("chunk"), num_stages=_stages("chain", BT, BM, _pow2(dim), _pow2(r_dim)),
            )
        return parts, d_init

    key_parts, keys, value_parts, values = _side_by_side(
        q, lambda: chain(k, anchor_k, h_k, du_k, p_k, q, d_mk, d_ak, dk_),
        lambda: chain(v, anchor_v, h_v, du_v, p_v, d_o, d_mv, d_av, dv_))
    d_alpha, d_lb, d_gamma_all = gates_backward(d_gamma, dc, (key_parts, value_parts), alpha, log_beta, plan, chunk_size)
    return dq, dk_, dv_, d_alpha, d_lb, d_gamma_all, keys[0], values[0], keys[1], values[1]


# ---------------------------------------------------------------------------------------------
# Custom ops (so torch.compile traces through the op) and their autograd.


@torch.library.custom_op("trellis_lm::triton_chunk_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, m_k: torch.Tensor, m_v: torch.Tensor, anchor_k: torch.Tensor, anchor_v: torch.Tensor,
    offset: torch.Tensor, cu_seqlens: Optional[torch.Tensor], chunk_size: int, compress_fn: str, mix_fn: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _refuse_identity(compress_fn)
    return _forward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                         chunk_size, compress_fn, mix_fn)


def _refuse_identity(compress_fn: str) -> None:
    """The chunk kernels take every write's residual at the chunk's anchor; identity's is at the
    current memory (design page, section 2), a different function for C > 1."""
    if compress_fn == "identity":
        raise ValueError("trellis_lm::triton_chunk_fwd does not compute compress_fn='identity' (run backend 'torch')")


@_fwd_op.register_fake
def _(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens, chunk_size, compress_fn, mix_fn):
    _refuse_identity(compress_fn)
    batch, length = q.shape[:2]
    news = [torch.empty_like(t) for t in (m_k, m_v, anchor_k, anchor_v)]
    if _use_recurrent(length, chunk_size) and chunk_size > 1:
        return (torch.empty_like(v), *news, q.new_empty((0,)), q.new_empty((0,)))
    saved_every = RECURRENT_SEGMENT if chunk_size == 1 else chunk_size
    slots = chunk_slots(offset.shape[0], batch, length, saved_every, cu_seqlens is not None)
    return (torch.empty_like(v), *news, m_k.new_empty((slots,) + tuple(m_k.shape[1:])),
            m_v.new_empty((slots,) + tuple(m_v.shape[1:])))


@torch.library.custom_op("trellis_lm::triton_chunk_bwd", mutates_args=())
def _bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, m_k: torch.Tensor, m_v: torch.Tensor, anchor_k: torch.Tensor, anchor_v: torch.Tensor,
    offset: torch.Tensor, cu_seqlens: Optional[torch.Tensor], h_k: torch.Tensor, h_v: torch.Tensor,
    d_o: torch.Tensor, d_mk: torch.Tensor, d_mv: torch.Tensor, d_ak: torch.Tensor, d_av: torch.Tensor,
    chunk_size: int, compress_fn: str, mix_fn: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens,
                          h_k, h_v, d_o, d_mk, d_mv, d_ak, d_av, chunk_size, compress_fn, mix_fn)


@_bwd_op.register_fake
def _(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens, h_k, h_v,
      d_o, d_mk, d_mv, d_ak, d_av, chunk_size, compress_fn, mix_fn):
    return tuple(torch.empty_like(t) for t in (q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v))


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, cu_seqlens, chunk_size, cf, mf = inputs
    h_k, h_v = output[5], output[6]
    ctx.save_for_backward(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, h_k, h_v)
    ctx.cu_seqlens = cu_seqlens
    ctx.args = (chunk_size, cf, mf)


def _backward(ctx, d_o, d_mk, d_mv, d_ak, d_av, _d_hk, _d_hv):
    q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, h_k, h_v = ctx.saved_tensors
    fill = lambda g, like: torch.zeros_like(like) if g is None else g.contiguous()  # noqa: E731
    grads = _bwd_op(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, ctx.cu_seqlens,
                    h_k, h_v, fill(d_o, v), fill(d_mk, m_k), fill(d_mv, m_v), fill(d_ak, anchor_k),
                    fill(d_av, anchor_v), *ctx.args)
    return tuple(grads) + (None,) * 5


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def check_device(q: torch.Tensor) -> None:
    """Backend ``"triton"`` runs on CUDA tensors, or on CPU ones under the interpreter."""
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend 'triton' runs on CUDA tensors (got {q.device}); on CPU set TRITON_INTERPRET=1 "
            "before importing triton (slow: for tests), or use backend 'torch'"
        )
