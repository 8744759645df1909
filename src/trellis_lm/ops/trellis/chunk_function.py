"""The state chain and the read-outs of the chunk form (design page, section 2) as one
``torch.autograd.Function`` with a hand-written backward.

Autograd of the chunk loop records about twenty small nodes per chunk and, in the batched
read-outs, many large temporaries; this Function instead

* runs the forward with no graph, writing every chunk-start state into one buffer;
* computes the read-out VJP (``Yh``, ``H = f(Yh)``, ``O``) for all chunks in a few batched
  operations, reusing the forward's products, which gives the gradients of every chunk-start
  state and every ``U`` at once;
* carries the state gradient back through the chunks in one reverse loop: through
  ``S' = mu_L S - (w * U)^T X`` and through ``U``'s dependence on the anchor (the second-order
  terms of ``vjp_phi``, section 4), in closed form for ``layernorm`` and ``l2norm``; for
  ``identity`` ``U = W S^T - Z`` is linear in the state;
* and finally forms the input gradients batched over chunks.

The mixing function's VJP is closed-form for ``ln_silu`` (torch's fused layer-norm and SiLU
backward kernels); ``l2_silu`` and ``softmax`` take a local autograd VJP of the batched
read-out, which is exact and costs one re-evaluation of ``f``. Double backward is not
supported (:func:`torch.autograd.function.once_differentiable` raises a clear error).

Tensor layout (from :mod:`.chunked`): ``n`` chunks, ``NH`` (row, head) pairs, ``L`` cells per
chunk. A *chain* stacks ``P`` passes (1, or 2 = keys then values when ``Dk == Dv``) on the
batch axis, so its states are ``[P * NH, M, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .functions import EPS, compress_residual_vjp, mix


@dataclass(frozen=True)
class ChunkSpec:
    """The non-tensor arguments of :class:`ChunkFunction`.

    Attributes:
        compress_fn, mix_fn: names from :mod:`.functions`.
        passes: ``P`` of each chain (``(2,)`` for one stacked chain, ``(1, 1)`` for two).
        last_chunk: per row, the chunk whose start state is its final anchor.
        heads: H (``NH = rows * heads``).
        keep: whether a backward will follow (then every chunk-start state is kept; otherwise
            the read-outs run in groups of ``group`` chunks and the states are dropped).
        group: chunks per read-out group when not ``keep``.
    """

    compress_fn: str
    mix_fn: str
    passes: tuple
    last_chunk: tuple
    heads: int
    keep: bool
    group: int


def _layer_norm(x: torch.Tensor):
    """``(x_hat, mean, rstd)`` over the last axis, no affine, torch's fused kernel."""
    return torch.native_layer_norm(x, x.shape[-1:], None, None, EPS)


def _layer_norm_vjp(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``J^T grad`` of the affine-free layer norm at ``x`` (stats from :func:`_layer_norm`)."""
    return torch.ops.aten.native_layer_norm_backward(grad, x, x.shape[-1:], mean, rstd, None, None,
                                                     [True, False, False])[0]


def _residual(name: str, z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``vjp_phi(z, phi(z) - alpha)`` of :func:`.functions.compress_residual_vjp`; for
    ``layernorm`` in three fused kernels (the residual's VJP *is* layer norm's backward)."""
    if name == "layernorm":
        z_hat, mean, rstd = _layer_norm(z)
        return _layer_norm_vjp(z_hat - alpha, z, mean, rstd)
    return compress_residual_vjp(name, z, alpha)


def _residual_parts(name: str, z: torch.Tensor, alpha: torch.Tensor):
    """What the second-order VJP of :func:`_residual` needs, for a batch of ``z [..., M]``:
    ``(z_hat, r, e, t)`` with ``r = 1 / sigma`` (layernorm) or ``1 / |z|`` (l2norm),
    ``e = z_hat - alpha`` and ``t = red(z_hat * e)`` (``red`` = mean or sum, see
    :func:`_residual_vjp2`)."""
    if name == "layernorm":
        z_hat, _, r = _layer_norm(z)
        e = z_hat - alpha
        return z_hat, r, e, (z_hat * e).mean(-1, keepdim=True)
    r = torch.rsqrt(z.pow(2).sum(-1, keepdim=True) + EPS)
    z_hat = z * r
    e = z_hat - alpha
    return z_hat, r, e, (z_hat * e).sum(-1, keepdim=True)


def _residual_vjp2(name: str, z_hat, r, e, t, u, grad_u):
    """The VJP of ``u = vjp_phi(z, phi(z) - alpha)`` in ``z`` and in ``e`` (``d alpha = -d e``).

    Both closed forms have the shape ``u = r (cen(e) - z_hat red(z_hat e))`` with, for
    ``layernorm``, ``red`` = mean over M and ``cen(x) = x - mean(x)``, and for ``l2norm``
    ``red`` = sum and ``cen`` = identity; ``z_hat = cen(z) r`` and ``r`` depends on ``z``
    through ``red(cen(z)^2)``. Differentiating that one expression gives both VJPs.

    Args: ``[..., M]`` tensors (``r``, ``t`` ``[..., 1]``) from :func:`_residual_parts`, the
        forward's ``u`` and the incoming gradient ``grad_u``.
    Returns: ``(grad_z, grad_e)``.
    """
    centre = name == "layernorm"

    def red(x):
        return x.mean(-1, keepdim=True) if centre else x.sum(-1, keepdim=True)

    def cen(x):
        return x - x.mean(-1, keepdim=True) if centre else x

    w = grad_u * r
    s1 = red(w * z_hat)
    grad_e = torch.addcmul(cen(w), z_hat, s1, value=-1)
    # z_hat enters u directly (-z_hat t), through e = z_hat - alpha, and through t.
    grad_zh = torch.addcmul(grad_e, t, w, value=-1).addcmul_(e, s1, value=-1)
    # The explicit factor r of u: d r = red-sum of grad_u * u / r, and dr/dz = -r^3 cen(z) / n.
    scale = red(grad_u * u)
    grad_z = cen(grad_zh).addcmul_(z_hat, red(grad_zh * z_hat) + scale, value=-1).mul_(r)
    return grad_z, grad_e


def _mix_forward(name: str, y: torch.Tensor):
    """``H = f(y)`` and what :func:`_mix_vjp` needs."""
    if name == "ln_silu":
        s = torch.nn.functional.silu(y)
        h, mean, rstd = _layer_norm(s)
        return h, (y, s, mean, rstd)
    return mix(name, y), (y,)


def _mix_vjp(name: str, saved, grad_h: torch.Tensor) -> torch.Tensor:
    if name == "ln_silu":
        y, s, mean, rstd = saved
        return torch.ops.aten.silu_backward(_layer_norm_vjp(grad_h, s, mean, rstd), y)
    # Not hand-derived: autograd of the batched f alone (one re-evaluation, no per-chunk nodes).
    with torch.enable_grad():
        y = saved[0].detach().requires_grad_(True)
        return torch.autograd.grad(mix(name, y), y, grad_h)[0]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _split(spec: ChunkSpec, chain_tensors):
    """The flat per-chain tensors -> one dict per chain."""
    identity, out, i = spec.compress_fn == "identity", [], 0
    for passes in spec.passes:
        if identity:
            ch = dict(W=chain_tensors[i], Z=chain_tensors[i + 1])
            i += 2
        else:
            ch = dict(X=chain_tensors[i])
            i += 1
        ch.update(wX=chain_tensors[i], s0=chain_tensors[i + 1], a0=chain_tensors[i + 2], P=passes)
        i += 3
        out.append(ch)
    return out


class ChunkFunction(torch.autograd.Function):
    """``(O, final states, final anchors) = F(Q, K, V, mu, G, gap, A, mu_last, *chains)``.

    Args (all chunk-major, ``[n, NH, ...]``):
        Q, K: ``[n, NH, L, Dk]``; V: ``[n, NH, L, Dv]`` (the read-outs' operands).
        mu: ``[n, NH, L, 1]`` = ``exp(c_r)``; G: ``[n, NH, L]`` gammas; gap: ``[n, NH, L, L]``
            the in-chunk log decays ``c_r - c_i`` (-inf above the diagonal), so that
            ``D = exp(gap) * G[..., None, :]``.
        A: ``[n, NH, L, M]`` targets; mu_last: ``[n, NH, 1, 1]`` = ``exp(c_L)``.
        chains: per chain, ``X [n, P NH, L, D]`` (or, for ``identity``, ``W [n, P NH, L, D]``
            and ``Z [n, P NH, L, M]`` of :func:`.chunked.identity_residual_basis`),
            ``wX [n, P NH, L, D]``, the start state ``s0`` and anchor ``a0`` ``[P NH, M, D]``.
    Returns:
        ``O [n, NH, L, Dv]``, then per chain its final state and final anchor ``[P NH, M, D]``.
    """

    @staticmethod
    def forward(ctx, spec: ChunkSpec, Q, K, V, mu, G, gap, A, mu_last, *chain_tensors):
        chains = _split(spec, chain_tensors)
        n, nh, width, _ = Q.shape
        identity = spec.compress_fn == "identity"
        gexp = gap.exp()
        decay = gexp * G[..., None, :]  # D[r, i] = gamma_i exp(c_r - c_i), i <= r
        qk = Q @ _t(K)
        dqk = decay * qk
        mu_q = mu * Q
        group = n if spec.keep else spec.group
        out = V.new_empty(V.shape)
        finals, saved_chains = [], []
        for ch in chains:
            ch["anchor"] = ch["a0"].clone()
        states = [None] * len(chains)
        for lo in range(0, n, group):
            hi = min(n, lo + group)
            for i, ch in enumerate(chains):
                s0 = ch["s0"] if lo == 0 else states[i][-1]
                states[i] = buf = s0.new_empty((hi - lo + 1,) + s0.shape)
                buf[0] = s0
                ch["U"] = us = s0.new_empty((hi - lo,) + ch["wX"].shape[1:-1] + (A.shape[-1],))
                view = (ch["P"], nh) + s0.shape[-2:]
                for c in range(lo, hi):
                    s = buf[c - lo]
                    if identity:
                        torch.baddbmm(ch["Z"][c], ch["W"][c], _t(s), beta=-1, out=us[c - lo])
                    else:
                        z = (ch["X"][c] @ _t(ch["a0"] if c == 0 else s)).view(ch["P"], nh, width, -1)
                        us[c - lo] = _residual(spec.compress_fn, z, A[c]).view(us.shape[1:])
                    nxt = buf[c - lo + 1]
                    torch.mul(s.view(view), mu_last[c], out=nxt.view(view))
                    nxt.baddbmm_(_t(us[c - lo]), ch["wX"][c], alpha=-1)
                    if c in spec.last_chunk:  # the anchor some row ends in: this chunk's start
                        ends = torch.tensor([x == c for x in spec.last_chunk], device=s.device)
                        ends = ends.view(1, -1, 1).expand(ch["P"], -1, spec.heads).reshape(-1, 1, 1)
                        ch["anchor"] = torch.where(ends, ch["a0"] if c == 0 else s, ch["anchor"])
            starts, u_k, u_v = _read_parts(chains, states, nh)
            sl = slice(lo, hi)
            y = torch.matmul(mu_q[sl], _t(starts[0][:-1]))
            y.view(-1, *y.shape[-2:]).baddbmm_(dqk[sl].flatten(0, 1), u_k.flatten(0, 1), alpha=-1)
            h, mix_saved = _mix_forward(spec.mix_fn, y)
            p = h @ _t(u_v)
            e = decay[sl] * p
            o = torch.matmul(mu[sl] * h, starts[1][:-1])
            o.view(-1, *o.shape[-2:]).baddbmm_(e.flatten(0, 1), V[sl].flatten(0, 1), alpha=-1)
            out[sl] = o
        for i, ch in enumerate(chains):
            finals += [states[i][-1].clone(), ch["anchor"]]
        if spec.keep:
            ctx.spec = spec
            ctx.n_mix = len(mix_saved)
            ctx.save_for_backward(Q, K, V, mu, G, gexp, decay, qk, dqk, mu_q, A, mu_last, h, p, e, *mix_saved,
                                  *(t for ch, st in zip(chains, states)
                                    for t in ((ch["W"], ch["Z"]) if identity else (ch["X"],))
                                    + (ch["wX"], ch["a0"], st, ch["U"])))
        return (out, *finals)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o, *grad_finals):
        spec = ctx.spec
        if not spec.keep:
            raise RuntimeError("ChunkFunction: the forward ran without keeping its states (keep=False)")
        saved = ctx.saved_tensors
        Q, K, V, mu, G, gexp, decay, qk, dqk, mu_q, A, mu_last, h, p, e = saved[:15]
        mix_saved = saved[15:15 + ctx.n_mix]
        rest = saved[15 + ctx.n_mix:]
        identity = spec.compress_fn == "identity"
        per = 6 if identity else 5
        chains = []
        for i, passes in enumerate(spec.passes):
            t = rest[i * per:(i + 1) * per]
            ch = dict(W=t[0], Z=t[1]) if identity else dict(X=t[0])
            ch.update(wX=t[-4], a0=t[-3], S=t[-2], U=t[-1], P=passes)
            chains.append(ch)
        n, nh = Q.shape[:2]
        starts, u_k, u_v = _read_parts(chains, [ch["S"] for ch in chains], nh)
        st_k, st_v = starts[0][:-1], starts[1][:-1]

        # ---- the read-outs, batched over all chunks --------------------------------------
        g1 = torch.matmul(grad_o, _t(st_v))  # [n, NH, L, M]
        grad_mu = (h * g1).sum(-1, keepdim=True)
        grad_h = g1.mul_(mu)
        grad_st_v = torch.matmul(_t(mu * h), grad_o)
        grad_e = torch.matmul(grad_o, _t(V))  # minus the gradient of E = D * P
        grad_v = -torch.matmul(_t(e), grad_o)
        grad_ph = grad_e.mul(decay)  # minus the gradient of P = H U_v^T
        grad_h.view(-1, *grad_h.shape[-2:]).baddbmm_(grad_ph.flatten(0, 1), u_v.flatten(0, 1), alpha=-1)
        grad_u_v = -torch.matmul(_t(grad_ph), h)
        grad_y = _mix_vjp(spec.mix_fn, mix_saved, grad_h)
        grad_mu_q = torch.matmul(grad_y, st_k)
        grad_st_k = torch.matmul(_t(grad_y), mu_q)
        grad_dqk = torch.matmul(grad_y, _t(u_k))  # minus the gradient of D * Q K^T
        grad_u_k = -torch.matmul(_t(dqk), grad_y)
        # Minus the gradient of D, from O and from D * Q K^T; then D = exp(gap) * G.
        grad_decay = grad_e.mul_(p).addcmul_(grad_dqk, qk)
        grad_qk = grad_dqk.mul_(decay)  # minus
        grad_q = torch.addcmul(torch.matmul(grad_qk, K).neg_(), grad_mu_q, mu)
        grad_k = -torch.matmul(_t(grad_qk), Q)
        grad_mu += (grad_mu_q * Q).sum(-1, keepdim=True)
        grad_decay = grad_decay.mul_(gexp)
        grad_g = -grad_decay.sum(-2)
        grad_gap = grad_decay.mul_(G[..., None, :]).neg_()

        # ---- the state chains, one reverse loop over chunks each -------------------------
        if len(chains) == 1:
            grad_st = [torch.cat([grad_st_k, grad_st_v], dim=1)]
            grad_u = [torch.cat([grad_u_k, grad_u_v], dim=1)]
        else:
            grad_st, grad_u = [grad_st_k, grad_st_v], [grad_u_k, grad_u_v]
        grad_a = None if identity else torch.zeros_like(A)
        grad_mu_last = torch.zeros_like(mu_last)
        grads_chains = []
        for i, ch in enumerate(chains):
            d_st, d_u = grad_st[i], grad_u[i]  # both modified in place: they become the totals
            d_final, d_anchor = grad_finals[2 * i], grad_finals[2 * i + 1]
            passes, a0, S = ch["P"], ch["a0"], ch["S"]
            view = (passes, nh) + a0.shape[-2:]
            d_a0 = torch.zeros_like(a0)
            for c in sorted(set(spec.last_chunk)):
                ends = torch.tensor([x == c for x in spec.last_chunk], device=a0.device)
                ends = ends.view(1, -1, 1).expand(passes, -1, spec.heads).reshape(-1, 1, 1)
                target = d_a0 if c == 0 else d_st[c]
                target += torch.where(ends, d_anchor, 0.0)
            if not identity:
                anchors = S[:-1].clone()
                anchors[0] = a0
                z = torch.matmul(ch["X"], _t(anchors)).view(n, passes, nh, *d_u.shape[-2:])
                parts = _residual_parts(spec.compress_fn, z, A[:, None])
                parts = [x.flatten(1, 2) for x in parts]
                d_z = torch.empty_like(d_u)
                d_e = torch.empty_like(d_u)
            d_next = d_final  # the gradient of the state after chunk c
            for c in range(n - 1, -1, -1):
                d_u[c].baddbmm_(ch["wX"][c], _t(d_next), alpha=-1)
                d_st[c].view(view).addcmul_(mu_last[c], d_next.view(view))
                if identity:
                    d_st[c].baddbmm_(_t(d_u[c]), ch["W"][c])
                else:
                    d_z[c], d_e[c] = _residual_vjp2(spec.compress_fn, *(x[c] for x in parts), ch["U"][c], d_u[c])
                    if c > 0:
                        d_st[c].baddbmm_(_t(d_z[c]), ch["X"][c])
                d_next = d_st[c]
            # Batched over chunks: the gradients of mu_L and of wX (through S'), and of the inputs of U.
            d_after = torch.cat([d_st[1:], d_final[None]])
            grad_mu_last += (S[:-1] * d_after).view(n, passes, nh, -1).sum((1, 3))[..., None, None]
            d_wx = -torch.matmul(ch["U"], d_after)
            if identity:
                grads_chains += [torch.matmul(d_u, S[:-1]), d_u.neg_(), d_wx, d_st[0], d_a0]
            else:
                d_a0 += _t(d_z[0]) @ ch["X"][0]
                grad_a -= d_e.view(n, passes, nh, *d_e.shape[-2:]).sum(1)
                grads_chains += [torch.matmul(d_z, anchors), d_wx, d_st[0], d_a0]
        return (None, grad_q, grad_k, grad_v, grad_mu, grad_g, grad_gap, grad_a, grad_mu_last, *grads_chains)


def _read_parts(chains, states, nh):
    """The read-outs' operands from the chains: ``([S_k, S_v] [n + 1, NH, M, D], U_k, U_v)``,
    splitting a stacked chain's pass axis (its first NH are keys, the rest values)."""
    if len(chains) == 1:
        s, u = states[0], chains[0]["U"]
        return [s[:, :nh], s[:, nh:]], u[:, :nh], u[:, nh:]
    return states, chains[0]["U"], chains[1]["U"]
