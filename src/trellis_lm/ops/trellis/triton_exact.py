"""Backend ``"triton"`` for ``"exact"`` writes: the exact chunk form (design page, section 2b) as
kernels, forward and hand-derived backward.

Exact writes take each residual at the memory just before its write, so the function does not
depend on C: the kernels lay every sequence out in chunks of :data:`EXACT_CHUNK` tokens from
its first token, whatever the call's C and offsets (the state handed back still counts
tokens in the call's C). Inside a chunk the tokens go in blocks of :data:`EXACT_BLOCK`:

forward
    ``_exact_state_kernel``  grid (sequences, heads), one launch per pass (keys, values; on a
                             GPU side by side): the memory on-chip across the whole sequence.
                             Per block, ``Z = e^{cp} X S^T`` and the Gram ``X X^T`` are two
                             products; the block's tokens are then substituted one at a time
                             in registers (``u_r = vjp_phi(z_r, phi(z_r) - alpha_r)``, then
                             ``u_r``'s write pushed into the later rows' ``z``); one product
                             advances the memory past the block. Saves the memory at every
                             chunk start and every token's ``u``.
    the reads                ``_output_fwd_kernel`` of :mod:`.triton_chunk` with the saved
                             ``U`` (section 2's reads hold with the exact ``U``), chunks in
                             parallel.
backward
    the reads                ``_value_bwd_kernel`` and ``_key_bwd_kernel`` of
                             :mod:`.triton_chunk`, with the saved ``U``.
    ``_exact_chain_bwd_kernel`` grid (sequences, heads), one launch per pass, chunks and their
                             blocks in reverse: the memory before each block of a chunk is
                             rebuilt from the chunk's saved start into scratch, then each
                             block runs the reverse substitution of section 2b (``g_r = dU_r -
                             sum_{j>r} Lm[j, r] dz_j``, ``dz_r = J_r^T g_r``, registers again)
                             and hands the memory gradient to the block before it.
    the gates                ``_gates_bwd_kernel`` of :mod:`.triton_chunk`.

Gates inside a block are summed directly over their own tokens (never a difference of
cumulative sums), so a full forget gives exact zeros, as in the other kernels. Products use the
backend's ``TRELLIS_TRITON_DOT_PRECISION``; the substitutions are float32 element-wise work.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    # A try block: transformers' import check of a checkpoint's code skips it (see triton_chunk.py).
    raise ImportError("backend 'triton' needs the triton package (pip install triton); use backend 'torch'") from error

from ..varlen import chunk_slots, make_plan
from .triton_chunk import (
    _codes, _dot, _kernel_precision, _load_mat, _load_scal, _load_tok, _log_after, _pow2, _residual_vjp,
    _residual_vjp_bwd, _row_tile, _side_by_side, _store_mat, _store_scal, _store_tok, gates_backward, local_backward,
    read_launch,
)

# Tokens per chunk of the exact kernels' layout: one program of the read kernels takes a chunk,
# and the state kernels save the memory at every chunk start.
EXACT_CHUNK = 64
# Tokens substituted one at a time in registers (tl.dot's smallest tile); the memory advances
# once per block, by one tensor-core product.
EXACT_BLOCK = 16
# Warps per program of the two sequential kernels: 8 spill far less than 4 in the sm_90 compiles
# (bench_gpu.py --compile-check; BENCHMARKS.md, "The exact chunk kernels"); untimed (no GPU yet).
EXACT_WARPS = 8


@triton.jit
def _load_row(ptr, tok0, r, nrows, h, H, D, BD: tl.constexpr):
    """Row ``r`` of the block at token ``tok0``, head ``h``, as ``[1, BD]`` in float32; zeros
    unless ``r < nrows``."""
    d = tl.arange(0, BD)
    mask = (d < D) & ((d * 0 + r) < nrows)  # a vector mask (the interpreter takes `& scalar` as int32)
    return tl.load(ptr + ((tok0 + r).to(tl.int64) * H + h) * D + d, mask=mask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _shift_down(x, BB: tl.constexpr):
    """``y[r] = x[r - 1]``, ``y[0] = 0`` (a selection: an infinite entry moves, nothing is subtracted)."""
    r = tl.arange(0, BB)
    return tl.sum(tl.where(r[:, None] == r[None, :] + 1, x[None, :], 0.0), axis=1)


@triton.jit
def _shift_up(x, BB: tl.constexpr):
    """``y[r] = x[r + 1]``, ``y[BB - 1] = 0``."""
    r = tl.arange(0, BB)
    return tl.sum(tl.where(r[None, :] == r[:, None] + 1, x[None, :], 0.0), axis=1)


@triton.jit
def _block_decays(lb, g, BB: tl.constexpr):
    """One block's decays (padded rows hold ``lb = g = 0``), with ``c_r = sum_{j <= r} lb_j`` in
    the block and ``cp_r = c_{r-1}`` (0 for its first token): ``ecp [BB] = e^{cp}``, ``Ep [BB, BB]
    = e^{cp_r - c_i}`` for ``i < r`` (else 0; ``Lm = g_i Ep * X X^T``), ``w [BB] = g_i e^{c_last -
    c_i}`` and ``mu_last = e^{c_last}``. Every exponent is a direct sum of gates."""
    r = tl.arange(0, BB)
    prev = _shift_down(lb, BB)
    ecp = tl.exp(tl.cumsum(prev, axis=0))
    # gp[r, i] = sum_{i < j <= r - 1} lb_j: lb_{j-1} placed at row j of column i for j - 1 > i,
    # summed down the rows.
    gp = tl.cumsum(tl.where(r[:, None] > r[None, :] + 1, prev[:, None], 0.0), axis=0)
    Ep = tl.where(r[:, None] > r[None, :], tl.exp(gp), 0.0)
    w = g * tl.exp(_log_after(lb, BB))
    return ecp, Ep, w, tl.exp(tl.sum(lb, axis=0))


@triton.jit
def _block_inputs(x_ptr, u_ptr, lb_ptr, g_ptr, tok0, nrows, h, H, M, D, BB: tl.constexpr, BM: tl.constexpr,
                  BD: tl.constexpr):
    """A block's ``X [BB, BD]``, saved ``U [BB, BM]`` and gates, padded rows zero."""
    return (_load_tok(x_ptr, tok0, nrows, h, H, D, BB, BD), _load_tok(u_ptr, tok0, nrows, h, H, M, BB, BM),
            _load_scal(lb_ptr, tok0, nrows, h, H, BB), _load_scal(g_ptr, tok0, nrows, h, H, BB))


@triton.jit
def _program_sequence(seq_start_ptr, seq_len_ptr, base_ptr):
    """``(n, h, start, L, base)``: this program's sequence and head (grid (sequences, heads)), the
    sequence's first flat token and length, and its first chunk slot of the plan."""
    n = tl.program_id(0)
    return n, tl.program_id(1), tl.load(seq_start_ptr + n), tl.load(seq_len_ptr + n), tl.load(base_ptr + n)


@triton.jit
def _exact_state_kernel(
    x_ptr, al_ptr, lb_ptr, g_ptr, m0_ptr,
    seq_start_ptr, seq_len_ptr, base_ptr,
    hs_ptr, u_ptr, m_out_ptr,
    H, M, D,
    CHUNK: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, CF: tl.constexpr,
    PREC: tl.constexpr,
):
    """One pass of one sequence and head: every token's ``u`` (to ``u``), the memory at every
    chunk start (to ``hs``, slot ``base[n] + chunk``) and after the last token (to ``m_out``)."""
    n, h, start, L, base = _program_sequence(seq_start_ptr, seq_len_ptr, base_ptr)
    cm = (tl.arange(0, BM) < M)[None, :]
    rows = tl.arange(0, BB)
    S = _load_mat(m0_ptr, n * H + h, M, D, BM, BD)
    for b in range(0, tl.cdiv(L, BB)):
        lo = b * BB
        if lo % CHUNK == 0:
            _store_mat(hs_ptr, S, (base + lo // CHUNK) * H + h, M, D, BM, BD)
        nrows = tl.minimum(L - lo, BB)
        tok0 = start + lo
        X = _load_tok(x_ptr, tok0, nrows, h, H, D, BB, BD)
        lb = _load_scal(lb_ptr, tok0, nrows, h, H, BB)
        g = _load_scal(g_ptr, tok0, nrows, h, H, BB)
        ecp, Ep, w, mu_last = _block_decays(lb, g, BB)
        Lm = g[None, :] * Ep * _dot(X, tl.trans(X), PREC)
        Z = ecp[:, None] * _dot(X, tl.trans(S), PREC)
        U = tl.zeros([BB, BM], dtype=tl.float32)
        for r in range(BB):  # a loop, not unrolled: the unrolled steps spill (BENCHMARKS.md)
            here = rows[:, None] == r
            al = _load_row(al_ptr, tok0, r, nrows, h, H, M, BM)
            u = _residual_vjp(tl.sum(tl.where(here, Z, 0.0), axis=0)[None, :], al, cm, M, CF)
            U = tl.where(here, u, U)
            # u_r's write reaches every later token's read: column r of Lm (zero on and above row r).
            Z -= tl.sum(tl.where(rows[None, :] == r, Lm, 0.0), axis=1)[:, None] * u
        _store_tok(u_ptr, U, tok0, nrows, h, H, M, BB, BM)
        S = mu_last * S - _dot(tl.trans(U * w[:, None]), X, PREC)
    _store_mat(m_out_ptr, S, n * H + h, M, D, BM, BD)


@triton.jit
def _exact_chain_bwd_kernel(
    x_ptr, al_ptr, lb_ptr, g_ptr, hs_ptr, u_ptr, du_ptr, p_ptr, r_ptr, dm_fin_ptr,
    seq_start_ptr, seq_len_ptr, base_ptr, scratch_ptr,
    dx_ptr, dal_ptr, dg_ptr, dc_ptr, dm0_ptr,
    H, M, D, DR,
    CHUNK: tl.constexpr, BT: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
    BDR: tl.constexpr, CF: tl.constexpr, PREC: tl.constexpr,
):
    """One pass of one sequence and head, chunks and blocks in reverse (module docstring).

    Reads the reads' gradient at ``U`` (``du``) and at each chunk's start memory (``p^T r`` over
    the chunk's rows, as the anchored chain kernel); adds into ``dx``; writes this pass's parts
    of dalpha, dgamma and ``dc`` (the gradient of the in-chunk cumulative log decays, which
    ``_gates_bwd_kernel`` turns into dlog_beta) and the gradient of the initial memory.
    ``scratch``: ``CHUNK / BB`` memories per program, the memories before each block of the
    chunk being worked on.
    """
    n, h, start, L, base = _program_sequence(seq_start_ptr, seq_len_ptr, base_ptr)
    cm = (tl.arange(0, BM) < M)[None, :]
    rows = tl.arange(0, BB)
    lower = rows[:, None] > rows[None, :]
    scratch = (n * H + h) * (CHUNK // BB)
    dS = _load_mat(dm_fin_ptr, n * H + h, M, D, BM, BD)
    n_chunks = tl.cdiv(L, CHUNK)
    for ii in range(0, n_chunks):
        i = n_chunks - 1 - ii
        tok_c = start + i * CHUNK
        nrows_c = tl.minimum(L - i * CHUNK, CHUNK)
        n_blocks = tl.cdiv(nrows_c, BB)
        # The memories before each block, from the chunk's start, into scratch.
        S = _load_mat(hs_ptr, (base + i) * H + h, M, D, BM, BD)
        for b in range(0, n_blocks):
            _store_mat(scratch_ptr, S, scratch + b, M, D, BM, BD)
            X, U, lb, g = _block_inputs(x_ptr, u_ptr, lb_ptr, g_ptr, tok_c + b * BB, nrows_c - b * BB, h, H, M, D,
                                        BB, BM, BD)
            _, _, w, mu_last = _block_decays(lb, g, BB)
            S = mu_last * S - _dot(tl.trans(U * w[:, None]), X, PREC)
        tl.debug_barrier()  # the scratch rows written above, read below by other threads
        carry = tl.full([], 0.0, tl.float32)  # minus the block-relative dc of the block after, owed to this block's last row
        for bb in range(0, n_blocks):
            b = n_blocks - 1 - bb
            tok0 = tok_c + b * BB
            nrows = tl.minimum(nrows_c - b * BB, BB)
            S = _load_mat(scratch_ptr, scratch + b, M, D, BM, BD)
            X, U, lb, g = _block_inputs(x_ptr, u_ptr, lb_ptr, g_ptr, tok0, nrows, h, H, M, D, BB, BM, BD)
            ecp, Ep, w, mu_last = _block_decays(lb, g, BB)
            gram = _dot(X, tl.trans(X), PREC)
            Lm = g[None, :] * Ep * gram
            Z = ecp[:, None] * _dot(X, tl.trans(S), PREC) - _dot(Lm, U, PREC)  # each z_r, rebuilt
            # Through S' = mu_last S - (w U)^T X.
            XdS = _dot(X, tl.trans(dS), PREC)
            G = _load_tok(du_ptr, tok0, nrows, h, H, M, BB, BM) - w[:, None] * XdS
            dw = -tl.sum(U * XdS, axis=1)
            dmu_last = tl.sum(tl.sum(S * dS, axis=1), axis=0)
            dX = -_dot(w[:, None] * U, dS, PREC)
            # The reverse substitution: G holds g_r once every later row's dz has been taken off.
            dZ = tl.zeros([BB, BM], dtype=tl.float32)
            dAl = tl.zeros([BB, BM], dtype=tl.float32)
            for rr in range(BB):
                r = BB - 1 - rr
                here = rows[:, None] == r
                al = _load_row(al_ptr, tok0, r, nrows, h, H, M, BM)
                dz, da = _residual_vjp_bwd(tl.sum(tl.where(here, Z, 0.0), axis=0)[None, :], al,
                                           tl.sum(tl.where(here, G, 0.0), axis=0)[None, :], cm, M, CF)
                dZ = tl.where(here, dz, dZ)
                dAl = tl.where(here, da, dAl)
                G -= tl.sum(tl.where(here, Lm, 0.0), axis=0)[:, None] * dz  # row r of Lm, over the earlier rows
            # Through z = e^{cp} X S^T - Lm U, Lm = g_i Ep * X X^T.
            dZS = _dot(dZ, S, PREC)
            dX += ecp[:, None] * dZS
            dLm = tl.where(lower, -_dot(dZ, tl.trans(U), PREC), 0.0)
            dgram = dLm * Ep * g[None, :]
            dX += _dot(dgram + tl.trans(dgram), X, PREC)
            dg = dw * tl.exp(_log_after(lb, BB)) + tl.sum(dLm * Ep * gram, axis=0)
            # Block-relative dc: cp_r = c_{r-1} (e^{cp} and the rows of Lm's exponent), c_i (its
            # columns), c_last (w and mu_last).
            dgp = dLm * Lm
            dc = (_shift_up(tl.sum(X * dZS, axis=1) * ecp + tl.sum(dgp, axis=1), BB) - tl.sum(dgp, axis=0) - dw * w
                  + tl.where(rows == nrows - 1, tl.sum(dw * w, axis=0) + dmu_last * mu_last, 0.0))
            # In the chunk's count, c_r(block) = c_{lo + r} - c_{lo - 1}: the block before owes the sum.
            _store_scal(dc_ptr, dc + tl.where(rows == BB - 1, carry, 0.0), tok0, nrows, h, H, BB)
            carry = -tl.sum(dc, axis=0)
            _store_tok(dx_ptr, dX + _load_tok(dx_ptr, tok0, nrows, h, H, D, BB, BD), tok0, nrows, h, H, D, BB, BD)
            _store_tok(dal_ptr, dAl, tok0, nrows, h, H, M, BB, BM)
            _store_scal(dg_ptr, dg, tok0, nrows, h, H, BB)
            dS = mu_last * dS + _dot(tl.trans(dZ * ecp[:, None]), X, PREC)
        tl.debug_barrier()  # the next chunk overwrites the scratch rows read above
        # The chunk's reads read its start memory.
        P = _load_tok(p_ptr, tok_c, nrows_c, h, H, M, BT, BM)
        R = _load_tok(r_ptr, tok_c, nrows_c, h, H, DR, BT, BDR)
        dS += _dot(tl.trans(P), R, PREC)
    _store_mat(dm0_ptr, dS, n * H + h, M, D, BM, BD)


# ---------------------------------------------------------------------------------------------
# Host side.


def _plan(q: torch.Tensor, rows: int, cu_seqlens: Optional[torch.Tensor]):
    """The chunk plan of the exact layout: every sequence from its first token, chunks of
    :data:`EXACT_CHUNK`."""
    batch, length = q.shape[:2]
    return make_plan(torch.zeros(rows, dtype=torch.long, device=q.device), batch, length, EXACT_CHUNK, cu_seqlens)


def exact_tiles(chain: bool, length: int, slots: int, dim: int, r_dim: int = 0) -> dict:
    """The constexpr tiles of :func:`_exact_state_kernel` (``chain`` False) or
    :func:`_exact_chain_bwd_kernel` (True, whose chunk-start term reads ``r`` of ``r_dim``
    columns), for ``length`` tokens a call, ``slots`` M and head dim ``dim``."""
    tiles = dict(CHUNK=EXACT_CHUNK, BB=EXACT_BLOCK, BM=_pow2(slots), BD=_pow2(dim), PREC=_kernel_precision())
    if chain:
        tiles.update(BT=_row_tile(EXACT_CHUNK, length), BDR=_pow2(r_dim))
    return tiles


def _state_pass(x, alpha, log_beta, gamma, m0, plan, cf):
    """One pass's state chain: ``(chunk-start memories, U, final memory)``."""
    rows, heads, slots_m, dim = m0.shape
    hs = x.new_empty((plan.slots, heads, slots_m, dim))
    u = torch.empty_like(alpha)
    m_out = torch.empty_like(m0)
    if rows * heads:
        _exact_state_kernel[(rows, heads)](
            x, alpha, log_beta, gamma, m0, plan.seq_start, plan.seq_len, plan.chunk_base, hs, u, m_out,
            heads, slots_m, dim, CF=cf, num_warps=EXACT_WARPS, **exact_tiles(False, x.shape[1], slots_m, dim),
        )
    return hs, u, m_out


def _exact_forward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, compress_fn, mix_fn):
    """All tensors contiguous float32 on one device; ``m_*`` ``[N, H, M, D]``. Returns ``(o, m_k,
    m_v, u_k, u_v, h_k, h_v)``: the outputs, the final memories, every token's writes ``U`` and
    the memories at every chunk start of the exact layout (the backward's)."""
    cf, mf = _codes(compress_fn, mix_fn)
    plan = _plan(q, m_k.shape[0], cu_seqlens)
    (h_k, u_k, mk_out), (h_v, u_v, mv_out) = _side_by_side(
        k, lambda: (_state_pass(k, alpha, log_beta, gamma, m_k, plan, cf),),
        lambda: (_state_pass(v, alpha, log_beta, gamma, m_v, plan, cf),))
    o = read_launch(q, k, v, alpha, log_beta, gamma, (m_k, m_v), (h_k, h_v), (u_k, u_v), plan, EXACT_CHUNK, cf, mf)
    return o, mk_out, mv_out, u_k, u_v, h_k, h_v


def _exact_backward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, u_k, u_v, h_k, h_v, d_o, d_mk, d_mv,
                         compress_fn, mix_fn):
    """Gradients for ``(q, k, v, alpha, log_beta, gamma, m_k, m_v)``."""
    cf, mf = _codes(compress_fn, mix_fn)
    rows, heads, slots_m = m_k.shape[:3]
    plan = _plan(q, rows, cu_seqlens)
    dq, dk, dv, du_k, du_v, p_k, p_v, d_gamma, dc = local_backward(
        q, k, v, alpha, log_beta, gamma, (m_k, m_v), (h_k, h_v), (u_k, u_v), d_o, plan, EXACT_CHUNK, cf, mf)

    def chain(x, hs, u, du, p, r, dm_fin, dx):
        """One pass's parts of (dalpha, dgamma, dc) and its initial memory's gradient; adds into ``dx``."""
        parts = (torch.empty_like(alpha), torch.empty_like(gamma), torch.empty_like(gamma))
        d_init = torch.empty_like(dm_fin)
        dim = x.shape[-1]
        if rows * heads:
            scratch = x.new_empty((rows * heads * (EXACT_CHUNK // EXACT_BLOCK), slots_m, dim))
            _exact_chain_bwd_kernel[(rows, heads)](
                x, alpha, log_beta, gamma, hs, u, du, p, r, dm_fin, plan.seq_start, plan.seq_len, plan.chunk_base,
                scratch, dx, *parts, d_init, heads, slots_m, dim, r.shape[-1], CF=cf, num_warps=EXACT_WARPS,
                **exact_tiles(True, x.shape[1], slots_m, dim, r.shape[-1]),
            )
        return parts, d_init

    key_parts, d_mk0, value_parts, d_mv0 = _side_by_side(
        q, lambda: chain(k, h_k, u_k, du_k, p_k, q, d_mk, dk), lambda: chain(v, h_v, u_v, du_v, p_v, d_o, d_mv, dv))
    d_alpha, d_lb, d_gamma = gates_backward(d_gamma, dc, (key_parts, value_parts), alpha, log_beta, plan, EXACT_CHUNK)
    return dq, dk, dv, d_alpha, d_lb, d_gamma, d_mk0, d_mv0


# ---------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces through them) and their autograd.


@torch.library.custom_op("trellis_lm::triton_exact_fwd", mutates_args=())
def exact_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, m_k: torch.Tensor, m_v: torch.Tensor, cu_seqlens: Optional[torch.Tensor], compress_fn: str,
    mix_fn: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact writes' kernels on contiguous float32 inputs ``[B, T, H, *]`` and initial memories
    ``m_k [N, H, M, Dk]``, ``m_v [N, H, M, Dv]`` (``compress_fn`` ``"layernorm"`` or
    ``"l2norm"``). Returns ``(o, m_k, m_v, u_k, u_v, h_k, h_v)`` (:func:`_exact_forward_impl`)."""
    _refuse_identity(compress_fn)
    return _exact_forward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, compress_fn, mix_fn)


def _refuse_identity(compress_fn: str) -> None:
    """identity's exact residuals are a linear solve (design page, section 2) these kernels lack."""
    if compress_fn == "identity":
        raise ValueError("trellis_lm::triton_exact_fwd does not compute compress_fn='identity' (run backend 'torch')")


@exact_forward.register_fake
def _(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, compress_fn, mix_fn):
    _refuse_identity(compress_fn)
    batch, length = q.shape[:2]
    slots = chunk_slots(m_k.shape[0], batch, length, EXACT_CHUNK, cu_seqlens is not None)
    return (torch.empty_like(v), torch.empty_like(m_k), torch.empty_like(m_v), torch.empty_like(alpha),
            torch.empty_like(alpha), m_k.new_empty((slots,) + tuple(m_k.shape[1:])),
            m_v.new_empty((slots,) + tuple(m_v.shape[1:])))


@torch.library.custom_op("trellis_lm::triton_exact_bwd", mutates_args=())
def _exact_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, m_k: torch.Tensor, m_v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
    u_k: torch.Tensor, u_v: torch.Tensor, h_k: torch.Tensor, h_v: torch.Tensor, d_o: torch.Tensor,
    d_mk: torch.Tensor, d_mv: torch.Tensor, compress_fn: str, mix_fn: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    return _exact_backward_impl(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, u_k, u_v, h_k, h_v, d_o,
                                d_mk, d_mv, compress_fn, mix_fn)


@_exact_bwd_op.register_fake
def _(q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, u_k, u_v, h_k, h_v, d_o, d_mk, d_mv, compress_fn,
      mix_fn):
    return tuple(torch.empty_like(t) for t in (q, k, v, alpha, log_beta, gamma, m_k, m_v))


def _setup_context(ctx, inputs, output):
    q, k, v, alpha, log_beta, gamma, m_k, m_v, cu_seqlens, compress_fn, mix_fn = inputs
    ctx.save_for_backward(q, k, v, alpha, log_beta, gamma, m_k, m_v, *output[3:])
    ctx.cu_seqlens, ctx.names = cu_seqlens, (compress_fn, mix_fn)


def _backward(ctx, d_o, d_mk, d_mv, *_unused):
    q, k, v, alpha, log_beta, gamma, m_k, m_v, u_k, u_v, h_k, h_v = ctx.saved_tensors
    fill = lambda g, like: torch.zeros_like(like) if g is None else g.contiguous()  # noqa: E731
    grads = _exact_bwd_op(q, k, v, alpha, log_beta, gamma, m_k, m_v, ctx.cu_seqlens, u_k, u_v, h_k, h_v,
                          fill(d_o, v), fill(d_mk, m_k), fill(d_mv, m_v), *ctx.names)
    return tuple(grads) + (None,) * 3


exact_forward.register_autograd(_backward, setup_context=_setup_context)
