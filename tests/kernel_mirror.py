"""A PyTorch statement of exactly what the Triton backend computes, forward and manual backward.

The Triton kernels (:mod:`trellis_lm.ops.trellis.triton_chunk`) split the op into pieces that this module states in
plain PyTorch, one sequence and one chunk at a time, heads batched. It is the oracle the
kernel tests compare the pieces against (test code: the package never runs it).

Decomposition (design page, section 2; per head, per chunk of L tokens, start state ``S``,
anchor ``A`` = ``S`` except in the first chunk after a mid-chunk resume):

Forward
    1. *State chain* (sequential over chunks, keys and values independently):
       ``U = g(X A^T, alpha)``, ``S' = mu_L S - (w * U)^T X`` where ``g(z, a) = vjp_phi(z, phi(z) - a)``.
       The state at every chunk start is saved (``[chunks, H, M, D]``, the only saved tensor
       besides the inputs: O(T/C * M * D), never O(T * M * D)).
    2. *Output* (parallel over chunks, given the saved states): the two reads of section 2.

Backward (hand-derived; ``D[r,i] = gamma_i e^{c_r - c_i}``, ``w_i = gamma_i e^{c_L - c_i}``)
    1. *Local* (parallel over chunks): everything that does not depend on the gradient
       flowing back through later chunks' states: ``dq``; the parts of ``dk``, ``dv``, ``du``
       and the gate gradients coming from this chunk's outputs; and ``P``, ``R`` with
       ``P^T R`` this chunk's output contribution to ``dS``.
    2. *Chains* (sequential over chunks in reverse, keys and values independently): carry
       ``dS`` back: ``dU = dU_local - w * (X dS'^T)``, then through ``g`` (second-order terms
       through ``vjp_phi``: :func:`residual_vjp_backward`) into ``dX``, ``dalpha`` and the
       anchor, which is the chunk's start state (so its gradient joins ``dS``) or, in the
       first chunk after a mid-chunk resume, the initial anchor.
    3. ``dlog_beta`` is the reverse cumulative sum inside each chunk of ``dc``, the gradient
       in the log-decays ``c``.

At ``C = 1`` (every token its own chunk, the anchors the memories before it) the backward is
instead one reverse pass over the tokens (:func:`token_backward`, both passes at once): what the
recurrent backward kernel computes from memories it recomputes from checkpoints, so that it
keeps ``T / 64`` memories per sequence and head where step 1 of the forward would keep ``T``.
"""

from __future__ import annotations

import torch

from trellis_lm.ops.trellis.chunked import chunked_forward, log_decays
from trellis_lm.ops.trellis.compress_mix import EPS, compress_residual_vjp, mix
from trellis_lm.ops.trellis.state import TrellisState
from trellis_lm.ops.varlen import ChunkPlan, make_plan

# ---------------------------------------------------------------------------------------------
# Row-wise closed forms (last axis = the M slots).


def residual_vjp_backward(name: str, z: torch.Tensor, alpha: torch.Tensor, gu: torch.Tensor):
    """Backward of ``u = compress_residual_vjp(name, z, alpha)``: ``(dz, dalpha)`` for cotangent ``gu``.

    ``dz`` holds the second-order term through ``vjp_phi``. Written as reverse mode through
    the closed form of :func:`compress_residual_vjp`, step by step (the kernels do the same).
    """
    if name == "identity":
        return gu, -gu
    if name == "l2norm":
        r = torch.rsqrt((z * z).sum(-1, keepdim=True) + EPS)
        zh = z * r
        e = zh - alpha
        s = (zh * e).sum(-1, keepdim=True)
        gt = gu * r
        gr = (gu * (e - zh * s)).sum(-1, keepdim=True)
        gs = -(gt * zh).sum(-1, keepdim=True)
        ge = gt + gs * zh
        gzh = -gt * s + gs * e + ge
        gr = gr + (gzh * z).sum(-1, keepdim=True)
        return gzh * r - gr * r * r * r * z, -ge
    if name == "layernorm":
        m = z.shape[-1]
        c = z - z.mean(-1, keepdim=True)
        r = torch.rsqrt((c * c).mean(-1, keepdim=True) + EPS)
        zh = c * r
        e = zh - alpha
        me = e.mean(-1, keepdim=True)
        s = (zh * e).mean(-1, keepdim=True)
        gt = gu * r
        gr = (gu * (e - me - zh * s)).sum(-1, keepdim=True)
        gs = -(gt * zh).sum(-1, keepdim=True)
        ge = gt - gt.sum(-1, keepdim=True) / m + gs * zh / m
        gzh = -gt * s + gs * e / m + ge
        gr = gr + (gzh * c).sum(-1, keepdim=True)
        gc = gzh * r - gr * r * r * r * c / m
        return gc - gc.mean(-1, keepdim=True), -ge
    raise ValueError(f"unknown compress_fn {name!r}")


def mix_backward(name: str, y: torch.Tensor, gh: torch.Tensor) -> torch.Tensor:
    """Backward of ``h = mix(name, y)``: ``dy`` for cotangent ``gh``."""
    if name == "softmax":
        h = torch.softmax(y, dim=-1)
        return h * (gh - (h * gh).sum(-1, keepdim=True))
    sig = torch.sigmoid(y)
    s = y * sig
    ds = sig * (1 + y * (1 - sig))
    if name == "l2_silu":
        r = torch.rsqrt((s * s).sum(-1, keepdim=True) + EPS)
        h = s * r
        return (gh - h * (h * gh).sum(-1, keepdim=True)) * r * ds
    if name == "ln_silu":
        c = s - s.mean(-1, keepdim=True)
        r = torch.rsqrt((c * c).mean(-1, keepdim=True) + EPS)
        h = c * r
        return (gh - gh.mean(-1, keepdim=True) - h * (h * gh).mean(-1, keepdim=True)) * r * ds
    raise ValueError(f"unknown mix_fn {name!r}")


# ---------------------------------------------------------------------------------------------
# One chunk (heads batched: [H, L, *]).


def _gates(lb: torch.Tensor, g: torch.Tensor):
    """``(c, mu, E, D, wexp, w, mu_L)`` of one chunk from ``log_beta``, ``gamma`` ``[H, L]``."""
    # Each exponent summed directly over its tokens, as the kernels do (no inf - inf after a full forget).
    c, _, after, gap = log_decays(lb)
    E = gap.exp()
    wexp = after.exp()
    return c, c.exp(), E, E * g[..., None, :], wexp, g * wexp, c[..., -1].exp()


def _t(x):
    return x.transpose(-1, -2)


def chunk_output(q, k, v, a, lb, g, s_k, s_v, a_k, a_v, cf, mf):
    """The two reads of one chunk: ``o [H, L, Dv]`` (section 2)."""
    _, mu, _, D, _, _, _ = _gates(lb, g)
    u_k = compress_residual_vjp(cf, k @ _t(a_k), a)
    h = mix(mf, mu[..., None] * (q @ _t(s_k)) - (D * (q @ _t(k))) @ u_k)
    u_v = compress_residual_vjp(cf, v @ _t(a_v), a)
    return mu[..., None] * (h @ s_v) - (D * (h @ _t(u_v))) @ v


def chunk_state(x, a, lb, g, s, anchor, cf):
    """The state at the chunk's end: ``mu_L S - (w * U)^T X``."""
    _, _, _, _, _, w, mu_last = _gates(lb, g)
    u = compress_residual_vjp(cf, x @ _t(anchor), a)
    return mu_last[..., None, None] * s - _t(w[..., None] * u) @ x


def chunk_local_backward(q, k, v, a, lb, g, s_k, s_v, a_k, a_v, do, cf, mf):
    """Backward step 1 for one chunk: the gradients that need no later chunk.

    Returns a dict: ``dq`` (final), ``dk``, ``dv`` (this chunk's output part), ``du_k``,
    ``du_v`` (local part of the gradient in ``U``), ``p_k``, ``p_v`` (with ``r_k = q``,
    ``r_v = do``: ``dS_K += p_k^T q``, ``dS_V += p_v^T do``), ``dgamma`` and ``dc`` partials.
    """
    _, mu, E, D, _, _, _ = _gates(lb, g)
    mu1 = mu[..., None]
    z_k = k @ _t(a_k)
    u_k = compress_residual_vjp(cf, z_k, a)
    p = q @ _t(s_k)
    qk = q @ _t(k)
    y = mu1 * p - (D * qk) @ u_k
    h = mix(mf, y)
    u_v = compress_residual_vjp(cf, v @ _t(a_v), a)
    hs = h @ s_v
    hu = h @ _t(u_v)
    dov = do @ _t(v)
    d_hu = -D * dov
    d_d = -hu * dov
    dv = -_t(D * hu) @ do
    dmu = (hs * do).sum(-1)
    dh = mu1 * (do @ _t(s_v)) + d_hu @ u_v
    du_v = _t(d_hu) @ h
    dy = mix_backward(mf, y, dh)
    dmu = dmu + (p * dy).sum(-1)
    p_k = mu1 * dy
    d_qkd = -(dy @ _t(u_k))
    d_qk = D * d_qkd
    d_d = d_d + qk * d_qkd
    dq = p_k @ s_k + d_qk @ k
    dk = _t(d_qk) @ q
    du_k = -_t(D * qk) @ dy
    dgamma = (d_d * E).sum(-2)
    ddd = d_d * D
    dc = dmu * mu + ddd.sum(-1) - ddd.sum(-2)
    return dict(dq=dq, dk=dk, dv=dv, du_k=du_k, du_v=du_v, p_k=p_k, p_v=mu1 * h, dgamma=dgamma, dc=dc)


def chunk_chain_backward(x, a, lb, g, s, anchor, du_local, p, r, ds_next, cf):
    """Backward step 2 for one chunk and one pass (keys or values).

    ``ds_next`` is the gradient in the state at the chunk's end. Returns
    ``(dx, dalpha, dgamma, dc, ds_start, danchor)`` where ``ds_start`` holds every term but
    the anchor's (the caller adds ``danchor`` to it when the anchor is the start state).
    """
    _, _, _, _, wexp, w, mu_last = _gates(lb, g)
    z = x @ _t(anchor)
    u = compress_residual_vjp(cf, z, a)
    xds = x @ _t(ds_next)
    du = du_local - w[..., None] * xds
    dw = -(u * xds).sum(-1)
    dx = -(w[..., None] * u) @ ds_next
    dmu_last = (s * ds_next).sum((-1, -2))
    dz, dalpha = residual_vjp_backward(cf, z, a, du)
    dx = dx + dz @ anchor
    danchor = _t(dz) @ x
    dgamma = dw * wexp
    dc = -dw * w
    dc[..., -1] += (dw * w).sum(-1) + dmu_last * mu_last
    ds_start = mu_last[..., None, None] * ds_next + _t(p) @ r
    return dx, dalpha, dgamma, dc, ds_start, danchor


def _mv(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[H, P, R] @ [H, R]`` -> ``[H, P]``."""
    return (m @ x[..., None])[..., 0]


def token_backward(q, k, v, a, lb, g, s_k, s_v, do, g_k, g_v, cf, mf):
    """Backward through one token of the exact recurrence (``C = 1``: every token's anchors are
    the memories before it), heads batched: q, k ``[H, Dk]``, v, do ``[H, Dv]``, a ``[H, M]``,
    lb, g ``[H]``, the memories before the token ``s_k [H, M, Dk]``, ``s_v [H, M, Dv]``, and
    ``g_k``, ``g_v`` the gradients in the memories after it.

    Returns a dict: ``dq``, ``dk``, ``dv``, ``dalpha``, ``dlog_beta``, ``dgamma`` of the token,
    and ``g_k``, ``g_v``: the gradients in the memories before it. What the recurrent backward
    kernel computes per token, in reverse, from the memories it recomputes from checkpoints.
    """
    beta = lb.exp()
    z_k, z_v = _mv(s_k, k), _mv(s_v, v)
    u_k, u_v = compress_residual_vjp(cf, z_k, a), compress_residual_vjp(cf, z_v, a)
    b3, g3 = beta[:, None, None], g[:, None, None]
    s_k2 = b3 * s_k - g3 * u_k[..., None] * k[:, None, :]
    s_v2 = b3 * s_v - g3 * u_v[..., None] * v[:, None, :]
    y = _mv(s_k2, q)
    # Value read o = S_V'^T h, then the value write S_V' = beta S_V - gamma u_v v^T.
    g_v = g_v + mix(mf, y)[..., None] * do[:, None, :]
    dh = _mv(s_v2, do)
    gv = _mv(g_v, v)
    dbeta = (g_v * s_v).sum((-1, -2))
    dgamma = -(u_v * gv).sum(-1)
    dz_v, dalpha = residual_vjp_backward(cf, z_v, a, -g[:, None] * gv)
    dv = -g[:, None] * _mv(_t(g_v), u_v) + _mv(_t(s_v), dz_v)
    # Key read y = S_K' q, h = f(y), then the key write.
    dy = mix_backward(mf, y, dh)
    g_k = g_k + dy[..., None] * q[:, None, :]
    dq = _mv(_t(s_k2), dy)
    gk = _mv(g_k, k)
    dbeta = dbeta + (g_k * s_k).sum((-1, -2))
    dgamma = dgamma - (u_k * gk).sum(-1)
    dz_k, dalpha_k = residual_vjp_backward(cf, z_k, a, -g[:, None] * gk)
    dk = -g[:, None] * _mv(_t(g_k), u_k) + _mv(_t(s_k), dz_k)
    return dict(dq=dq, dk=dk, dv=dv, dalpha=dalpha + dalpha_k, dlog_beta=dbeta * beta, dgamma=dgamma,
                g_k=b3 * g_k + dz_k[..., None] * k[:, None, :], g_v=b3 * g_v + dz_v[..., None] * v[:, None, :])


def reverse_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.flip(-1).cumsum(-1).flip(-1)


# ---------------------------------------------------------------------------------------------
# Whole op, one sequence at a time.


def _flat(x):
    """``[B, T, H, *]`` -> ``[H, B * T, *]``."""
    return x.reshape((-1,) + tuple(x.shape[2:])).movedim(0, 1)


def _chunk_ranges(plan: ChunkPlan, n: int, chunk_size: int):
    """``(slot, start, end, first)`` in flat token indices for every chunk of sequence ``n``."""
    start, length, off = int(plan.seq_start[n]), int(plan.seq_len[n]), int(plan.offset[n])
    base = int(plan.chunk_base[n])
    for i in range(int(plan.n_chunks[n])):
        lo, hi = max(i * chunk_size - off, 0), min((i + 1) * chunk_size - off, length)
        yield base + i, start + lo, start + hi, i == 0


def mirror_forward(q, k, v, alpha, log_beta, gamma, state: TrellisState, chunk_size, cf, mf, cu_seqlens):
    """Forward; returns ``(o, final_state, h_k, h_v)`` with ``h_*[slot]`` the chunk-start states."""
    batch, length, heads, _ = q.shape
    plan = make_plan(state.offset, batch, length, chunk_size, cu_seqlens)
    Q, K, V, A, LB, G = (_flat(t) for t in (q, k, v, alpha, log_beta, gamma))
    h_k = q.new_zeros((plan.slots,) + tuple(state.m_k.shape[1:]))
    h_v = q.new_zeros((plan.slots,) + tuple(state.m_v.shape[1:]))
    o = torch.zeros_like(V)
    finals = []
    for n in range(plan.offset.numel()):
        s_k, s_v = state.m_k[n], state.m_v[n]
        a_k, a_v = state.anchor_k[n], state.anchor_v[n]
        for slot, lo, hi, first in _chunk_ranges(plan, n, chunk_size):
            if not (first and int(plan.offset[n]) > 0):
                a_k, a_v = s_k, s_v
            h_k[slot], h_v[slot] = s_k, s_v
            sl = slice(lo, hi)
            o[:, sl] = chunk_output(Q[:, sl], K[:, sl], V[:, sl], A[:, sl], LB[:, sl], G[:, sl], s_k, s_v, a_k, a_v, cf, mf)
            s_k = chunk_state(K[:, sl], A[:, sl], LB[:, sl], G[:, sl], s_k, a_k, cf)
            s_v = chunk_state(V[:, sl], A[:, sl], LB[:, sl], G[:, sl], s_v, a_v, cf)
        finals.append((s_k, s_v, a_k, a_v))
    final = TrellisState(*(torch.stack(t) for t in zip(*finals)), offset=(plan.offset + plan.seq_len) % chunk_size)
    o = o.movedim(0, 1).reshape(v.shape)
    return o, final, h_k, h_v


def mirror_backward(q, k, v, alpha, log_beta, gamma, state: TrellisState, chunk_size, cf, mf, cu_seqlens,
                    h_k, h_v, d_o, d_final: TrellisState):
    """Manual backward: gradients for ``(q, k, v, alpha, log_beta, gamma)`` and the initial state."""
    if chunk_size == 1:
        return mirror_token_backward(q, k, v, alpha, log_beta, gamma, state, cf, mf, cu_seqlens, h_k, h_v, d_o, d_final)
    batch, length, heads, _ = q.shape
    plan = make_plan(state.offset, batch, length, chunk_size, cu_seqlens)
    Q, K, V, A, LB, G, DO = (_flat(t) for t in (q, k, v, alpha, log_beta, gamma, d_o))
    grads = {name: torch.zeros_like(t) for name, t in (("q", Q), ("k", K), ("v", V), ("alpha", A), ("gamma", G))}
    dc = torch.zeros_like(LB)
    d_init = {name: torch.zeros_like(t) for name, t in state.tensors().items() if name != "offset"}
    for n in range(plan.offset.numel()):
        chunks = list(_chunk_ranges(plan, n, chunk_size))
        resumed = int(plan.offset[n]) > 0
        anchors = [(state.anchor_k[n], state.anchor_v[n]) if (first and resumed) else (h_k[slot], h_v[slot])
                   for slot, _, _, first in chunks]
        local = {}
        for (slot, lo, hi, _), (a_k, a_v) in zip(chunks, anchors):
            sl = slice(lo, hi)
            local[slot] = chunk_local_backward(Q[:, sl], K[:, sl], V[:, sl], A[:, sl], LB[:, sl], G[:, sl],
                                               h_k[slot], h_v[slot], a_k, a_v, DO[:, sl], cf, mf)
            grads["q"][:, sl] += local[slot]["dq"]
            grads["k"][:, sl] += local[slot]["dk"]
            grads["v"][:, sl] += local[slot]["dv"]
            grads["gamma"][:, sl] += local[slot]["dgamma"]
            dc[:, sl] += local[slot]["dc"]
        for pas, X, H_, R in (("k", K, h_k, Q), ("v", V, h_v, DO)):
            ds = d_final.tensors()["m_" + pas][n].clone()
            da = d_final.tensors()["anchor_" + pas][n].clone()
            for (slot, lo, hi, first), anchor in reversed(list(zip(chunks, anchors))):
                sl = slice(lo, hi)
                anchor = anchor[0 if pas == "k" else 1]
                dx, dal, dg, dcc, ds_start, danchor = chunk_chain_backward(
                    X[:, sl], A[:, sl], LB[:, sl], G[:, sl], H_[slot], anchor,
                    local[slot]["du_" + pas], local[slot]["p_" + pas], R[:, sl], ds, cf)
                danchor = danchor + da
                da = torch.zeros_like(da)
                grads[pas][:, sl] += dx
                grads["alpha"][:, sl] += dal
                grads["gamma"][:, sl] += dg
                dc[:, sl] += dcc
                if first and resumed:
                    d_init["anchor_" + pas][n] += danchor
                    ds = ds_start
                else:
                    ds = ds_start + danchor
            d_init["m_" + pas][n] += ds
            d_init["anchor_" + pas][n] += da  # no chunk: the final anchor is the initial one
    dlb = torch.zeros_like(LB)
    for n in range(plan.offset.numel()):
        for _, lo, hi, _ in _chunk_ranges(plan, n, chunk_size):
            dlb[:, lo:hi] = reverse_cumsum(dc[:, lo:hi])
    unflat = lambda x, like: x.movedim(0, 1).reshape(like.shape)  # noqa: E731
    out = (unflat(grads["q"], q), unflat(grads["k"], k), unflat(grads["v"], v), unflat(grads["alpha"], alpha),
           unflat(dlb, log_beta), unflat(grads["gamma"], gamma))
    return out + (d_init["m_k"], d_init["m_v"], d_init["anchor_k"], d_init["anchor_v"])


def mirror_token_backward(q, k, v, alpha, log_beta, gamma, state: TrellisState, cf, mf, cu_seqlens, h_k, h_v, d_o,
                          d_final: TrellisState):
    """The manual backward at ``C = 1`` (the recurrent backward kernel's decomposition): per
    sequence, tokens in reverse through :func:`token_backward`, from the memories before each
    token (``h_*[slot]``, every token its own chunk). The final anchors are the memories before
    the last token; an empty sequence hands its gradients through."""
    batch, length, heads, _ = q.shape
    plan = make_plan(state.offset, batch, length, 1, cu_seqlens)
    Q, K, V, A, LB, G, DO = (_flat(t) for t in (q, k, v, alpha, log_beta, gamma, d_o))
    names = ("dq", "dk", "dv", "dalpha", "dlog_beta", "dgamma")
    grads = {name: torch.zeros_like(t) for name, t in zip(names, (Q, K, V, A, LB, G))}
    d_init = {name: torch.zeros_like(t) for name, t in state.tensors().items() if name != "offset"}
    for n in range(plan.offset.numel()):
        g_k, g_v = d_final.m_k[n], d_final.m_v[n]
        tokens = list(_chunk_ranges(plan, n, 1))
        if not tokens:
            d_init["anchor_k"][n], d_init["anchor_v"][n] = d_final.anchor_k[n], d_final.anchor_v[n]
        for i, (slot, t, _, _) in enumerate(reversed(tokens)):
            step = token_backward(Q[:, t], K[:, t], V[:, t], A[:, t], LB[:, t], G[:, t], h_k[slot], h_v[slot],
                                  DO[:, t], g_k, g_v, cf, mf)
            for name in names:
                grads[name][:, t] = step[name]
            g_k, g_v = step["g_k"], step["g_v"]
            if i == 0:  # the final anchors are the memories before the last token
                g_k, g_v = g_k + d_final.anchor_k[n], g_v + d_final.anchor_v[n]
        d_init["m_k"][n], d_init["m_v"][n] = g_k, g_v
    unflat = lambda x, like: x.movedim(0, 1).reshape(like.shape)  # noqa: E731
    out = tuple(unflat(grads[name], like) for name, like in zip(names, (q, k, v, alpha, log_beta, gamma)))
    return out + (d_init["m_k"], d_init["m_v"], d_init["anchor_k"], d_init["anchor_v"])


class _MirrorFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, chunk_size, cf, mf, cu_seqlens):
        state = TrellisState(m_k, m_v, anchor_k, anchor_v, offset)
        o, final, h_k, h_v = mirror_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, cf, mf, cu_seqlens)
        ctx.save_for_backward(q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, h_k, h_v)
        ctx.args = (chunk_size, cf, mf, cu_seqlens)
        ctx.mark_non_differentiable(final.offset)
        return o, final.m_k, final.m_v, final.anchor_k, final.anchor_v, final.offset

    @staticmethod
    def backward(ctx, d_o, d_mk, d_mv, d_ak, d_av, _):
        q, k, v, alpha, log_beta, gamma, m_k, m_v, anchor_k, anchor_v, offset, h_k, h_v = ctx.saved_tensors
        chunk_size, cf, mf, cu_seqlens = ctx.args
        state = TrellisState(m_k, m_v, anchor_k, anchor_v, offset)
        zero = lambda g, t: torch.zeros_like(t) if g is None else g  # noqa: E731
        d_final = TrellisState(zero(d_mk, m_k), zero(d_mv, m_v), zero(d_ak, anchor_k), zero(d_av, anchor_v), offset)
        grads = mirror_backward(q, k, v, alpha, log_beta, gamma, state, chunk_size, cf, mf, cu_seqlens,
                                h_k, h_v, zero(d_o, v), d_final)
        return grads + (None,) * 5


def mirror_op(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens):
    """The mirror as a backend (same arguments and results as ``chunked_forward``), with the manual backward.

    ``identity`` and ``"exact"`` writes run ``chunked_forward`` (the kernels do neither
    identity's triangular solve nor the exact form's substitution)."""
    if compress_fn == "identity" or write_gradient == "exact":
        return chunked_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient,
                               cu_seqlens)
    o, m_k, m_v, a_k, a_v, off = _MirrorFunction.apply(
        q, k, v, alpha, log_beta, gamma, state.m_k, state.m_v, state.anchor_k, state.anchor_v, state.offset,
        chunk_size, compress_fn, mix_fn, cu_seqlens)
    return o, TrellisState(m_k, m_v, a_k, a_v, off)
