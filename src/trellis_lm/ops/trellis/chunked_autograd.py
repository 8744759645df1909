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
  ``identity`` ``U = W S^T - Z`` is linear in the state; for ``"exact"`` writes
  (``substituted``) ``U`` is a forward substitution over each chunk's tokens, and its VJP the
  reverse substitution (:func:`_substitute`, :func:`_unsubstitute`);
* and finally forms the input gradients batched over chunks.

The mixing function's VJP is closed-form for ``ln_silu`` and ``softmax`` (torch's fused
layer-norm, SiLU and softmax backward kernels); ``l2_silu`` takes a local autograd VJP of the
batched read-out, which is exact and costs one re-evaluation of ``f``. Double backward is not
supported: a backward with ``create_graph=True`` raises a ``RuntimeError`` (rather than
silently returning first derivatives that do not depend on the inputs).

Tensor layout (from :mod:`.chunked`): ``n`` chunks, ``NH`` (row, head) pairs, ``L`` cells per
chunk. A *chain* stacks ``P`` passes (1, or 2 = keys then values when ``Dk == Dv``) on the
batch axis, so its states are ``[P * NH, M, D]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .compiled_substitution import compiled_substitute
from .compress_mix import (
    EPS, compress_residual_vjp, layer_norm_stats, layer_norm_vjp, mix, residual_without_graph,
)


@dataclass(frozen=True)
class ChunkSpec:
    """The non-tensor arguments of :class:`ChunkFunction`.

    Attributes:
        compress_fn, mix_fn: names from :mod:`.compress_mix`.
        substituted: ``"exact"`` writes with ``layernorm``/``l2norm``: each chunk's ``U`` by
            forward substitution from its start state (the chain tensor ``eb``; ``Lm`` is made
            here from the decays and the keys' Gram matrix, see :func:`_residual_lower`).
        passes: ``P`` of each chain (``(2,)`` for one stacked chain, ``(1, 1)`` for two).
        last_chunk: per row, the chunk whose start state is its final anchor.
        heads: H (``NH = rows * heads``).
        keep: whether a backward will follow (then every chunk-start state is kept; otherwise
            the read-outs run in groups of ``group`` chunks and the states are dropped).
        group: chunks per read-out group when not ``keep``.
        compiled: ``substituted`` chunks run their substitution as one compiled kernel
            (:mod:`.compiled_substitution`; backend ``"compiled"``), else the eager loop.
    """

    compress_fn: str
    mix_fn: str
    substituted: bool
    passes: tuple
    last_chunk: tuple
    heads: int
    keep: bool
    group: int
    compiled: bool = False


def in_chunk_log_gaps(log_beta: torch.Tensor) -> torch.Tensor:
    """``gap [..., L, L]``: ``gap[r, i] = sum_{i < j <= r} lb_j`` (= ``c_r - c_i``) for i <= r and
    -inf above the diagonal, each a direct sum (no ``inf - inf``), in one allocation.

    Args:
        log_beta: ``[..., L]`` one chunk's log forget gates.
    """
    size = log_beta.shape[-1]
    rows = torch.arange(size, device=log_beta.device)
    # Token j = row r' enters gap[r, i] for i < r' <= r: its gate fills row r' left of the
    # diagonal, and a cumulative sum down the rows carries it to every later row.
    gap = torch.where(rows[:, None] > rows[None, :], log_beta[..., :, None], 0.0).cumsum_(-2)
    return gap.masked_fill_(rows[:, None] < rows[None, :], float("-inf"))


def _residual(name: str, z: torch.Tensor, alpha: torch.Tensor, parts=None) -> torch.Tensor:
    """``vjp_phi(z, phi(z) - alpha)`` of :func:`.compress_mix.compress_residual_vjp`, optionally
    leaving its parts in buffers (``layernorm``: the same three fused kernels, with ``out=``).

    ``parts``: optional buffers ``(z_hat, r, e)`` shaped like ``z`` (``r`` ``[..., 1]``) that
    receive ``phi(z)``, ``1 / sigma`` (or ``1 / |z|``) and ``e = z_hat - alpha``, which
    :func:`_residual_vjp2` needs (``layernorm`` and ``l2norm`` only).
    """
    if parts is None:
        return compress_residual_vjp(name, z, alpha)  # no graph here: its fused layer-norm path
    z_hat, r, e = parts
    if name == "layernorm":
        mean = r.new_empty(r.shape)
        torch.ops.aten.native_layer_norm.out(z, z.shape[-1:], None, None, EPS, out0=z_hat, out1=mean, out2=r)
        return layer_norm_vjp(torch.sub(z_hat, alpha, out=e), z, mean, r)
    torch.rsqrt(z.pow(2).sum(-1, keepdim=True).add_(EPS), out=r)
    torch.sub(torch.mul(z, r, out=z_hat), alpha, out=e)
    return torch.addcmul(e, z_hat, (z_hat * e).sum(-1, keepdim=True), value=-1).mul_(r)


def _residual_vjp2_terms(name: str, z_hat: torch.Tensor, r: torch.Tensor, e: torch.Tensor):
    """The per-row terms of :func:`_residual_vjp2`, for a batch at once.

    Both closed forms have the shape ``u = r (cen(e) - z_hat t)``, ``t = red(z_hat e)``, with,
    for ``layernorm``, ``red`` = mean over M and ``cen(x) = x - mean(x)`` (so ``red(z_hat) = 0``),
    and for ``l2norm`` ``red`` = sum and ``cen`` = identity; ``z_hat = cen(z) r``,
    ``e = z_hat - alpha``, and ``r`` depends on ``z`` through ``red(cen(z)^2)``. Differentiating
    that one expression, with ``q = red(z_hat^2)``, gives for an incoming gradient ``g``
    ``dz = a cen(g) - b red(g z_hat) - r z_hat red(g u)`` and ``dalpha = r (z_hat red(g z_hat) - cen(g))``
    with ``a = r^2 (1 - t)`` and ``b = r^2 (cen(z_hat + e) + z_hat (1 - 2 t - q))``.

    Args: ``z_hat, e [..., M]`` and ``r [..., 1]`` as :func:`_residual` leaves them in its ``parts``.
    Returns: ``(a [..., 1], b [..., M])``.
    """
    centre = name == "layernorm"
    scale = 1 / z_hat.shape[-1] if centre else 1.0
    t = _dot(z_hat, e).mul_(scale)
    q = _dot(z_hat, z_hat).mul_(scale)
    r2 = r * r
    b = e - e.mean(-1, keepdim=True) if centre else e.clone()  # e is saved: a second backward reads it
    b.addcmul_(z_hat, (2 - q).sub_(t, alpha=2)).mul_(r2)
    return r2.mul_(1 - t), b


def _residual_vjp2(name: str, z_hat, r, a, b, u, grad_u, out_z, out_alpha) -> None:
    """The VJP of ``u = vjp_phi(z, phi(z) - alpha)`` in ``z`` and ``alpha`` (formulas in
    :func:`_residual_vjp2_terms`, which gives ``a`` and ``b``), written to ``out_z`` and
    ``out_alpha``; ``[..., M]`` tensors (``r``, ``a`` ``[..., 1]``) and the forward's ``u``."""
    centre = name == "layernorm"
    scale = 1 / z_hat.shape[-1] if centre else 1.0  # red = mean or sum
    g_zh = _dot(grad_u, z_hat).mul_(scale)
    g_u = _dot(grad_u, u).mul_(scale)
    cen_g = grad_u - grad_u.mean(-1, keepdim=True) if centre else grad_u
    torch.mul(cen_g, a, out=out_z).addcmul_(b, g_zh, value=-1).addcmul_(z_hat, g_u.mul_(r), value=-1)
    torch.mul(z_hat, g_zh, out=out_alpha).sub_(cen_g).mul_(r)


def _alpha_vjp(name: str, z_hat, r, grad_u, out_alpha) -> None:
    """The ``alpha`` part of :func:`_residual_vjp2` alone: ``r (z_hat red(g z_hat) - cen(g))``."""
    centre = name == "layernorm"
    g_zh = _dot(grad_u, z_hat).mul_(1 / z_hat.shape[-1] if centre else 1.0)
    cen_g = grad_u - grad_u.mean(-1, keepdim=True) if centre else grad_u
    torch.mul(z_hat, g_zh, out=out_alpha).sub_(cen_g).mul_(r)


# Tokens per block of the substitution loops: each block's terms from earlier blocks come from one
# batched product, and only its own tokens are substituted one at a time (L * B / 2 element updates
# per row instead of L^2 / 2; measured fastest on the CPU among 8, 16 and 32 at L = 64).
SUBSTITUTION_BLOCK = 16


def _substitute(name: str, z: torch.Tensor, lower: torch.Tensor, alpha: torch.Tensor, u: torch.Tensor) -> None:
    """One chunk's ``U`` for ``"exact"`` writes, by forward substitution over its tokens.

    The memory before token r reads ``z_r = e^{c_{r-1}} S x_r - sum_{i<r} Lm[r, i] u_i`` at
    ``x_r``, and ``u_r = vjp_phi(z_r, phi(z_r) - alpha_r)`` (design page, section 2): a loop over
    the L tokens on M-vectors. The tokens go in blocks of :data:`SUBSTITUTION_BLOCK`: a block's
    read-outs first take the terms of all earlier blocks in one batched product; inside the
    block, token-major copies keep every step's operands contiguous, and each ``u_r``'s term is
    pushed into the block's later read-outs at once.

    Args:
        z: ``[P, NH, L, M]``, ``e^{c_{r-1}} S x_r`` on entry and ``z_r`` on return.
        lower: ``[P, NH, L, L]`` ``Lm`` of :func:`_residual_lower`.
        alpha: ``[NH, L, M]`` targets (shared by the passes).
        u: ``[P, NH, L, M]`` receives ``U``.
    """
    passes, nh, width, slots = z.shape
    residual = residual_without_graph(name)
    z_rows, lower_rows, u_rows = z.view(-1, width, slots), lower.view(-1, width, width), u.view(-1, width, slots)
    for lo in range(0, width, SUBSTITUTION_BLOCK):
        hi = min(width, lo + SUBSTITUTION_BLOCK)
        block = z_rows[:, lo:hi]
        if lo:
            block = torch.baddbmm(block, lower_rows[:, lo:hi, :lo], u_rows[:, :lo], alpha=-1)
        reads = block.view(passes, nh, hi - lo, slots).permute(2, 0, 1, 3).contiguous()  # [b, P, NH, M]
        # push[i][r] = Lm[..., r, i], zero for r <= i (Lm is strictly lower).
        push = lower[..., lo:hi, lo:hi].permute(3, 2, 0, 1)[..., None].contiguous().unbind(0)
        targets = alpha[:, lo:hi].transpose(0, 1).contiguous()  # [b, NH, M]
        # Views made in one call each, u_r kept as computed and stacked once, and u_r's term added
        # to the block's later read-outs only (at 128 (row, head) pairs of 32 slots, adding it to
        # every row cost twice the slices' calls).
        rows, row_targets, us = reads.unbind(0), targets.unbind(0), []
        for r in range(hi - lo - 1):
            us.append(residual(rows[r], row_targets[r]))
            reads[r + 1:].addcmul_(push[r][r + 1:], us[r], value=-1)
        us.append(residual(rows[-1], row_targets[-1]))
        z[..., lo:hi, :] = reads.permute(1, 2, 0, 3)
        u[..., lo:hi, :] = torch.stack(us).permute(1, 2, 0, 3)


def _unsubstitute(name: str, z_hat, r, a, b, u, lower, grad_u, out_z, out_alpha) -> None:
    """The VJP of :func:`_substitute` for one chunk, a reverse substitution over its tokens.

    ``z_j`` depends on ``u_r`` (r < j) through ``-Lm[j, r] u_r``, so the gradient reaching ``u_r``
    is ``g_r = grad_u_r - sum_{j>r} Lm[j, r] dz_j``, and ``dz_r = J_r^T g_r`` with ``J_r`` the
    Jacobian of ``u_r`` in ``z_r``. ``J_r^T g = a cen(g) - b red(g z_hat) - r z_hat red(g u)``
    (:func:`_residual_vjp2_terms`) is a scaled ``g`` less k = 3 (``l2norm``: 2) rows, each
    weighted by one reduction of ``g``: ``c = red(g [1 | z_hat | u])`` and ``dz = a g - c [a; b;
    r z_hat]``. Per token that is a product and a sum for ``c`` and for the rows, all k at once
    on a ``[k, P NH, M]`` stack (on a CPU several times cheaper than batched products of a row and
    k columns, whose cost is per matrix). Blocks as in :func:`_substitute`, last first: a block's
    ``g`` takes the terms of all later blocks in one batched product.

    Args (all ``[P NH, L, *]``; ``r`` and ``a`` ``[..., 1]``): the residual parts ``z_hat``,
    ``r``, ``a``, ``b``, the forward's ``u`` and ``lower`` (``Lm``); ``grad_u`` (the gradient at
    ``U`` from the reads and the next state; overwritten with ``g``). Writes ``dz`` to
    ``out_z`` and the gradient at the targets to ``out_alpha``.
    """
    width, slots = u.shape[-2:]
    centre = name == "layernorm"
    scale = 1 / slots if centre else 1.0  # red = mean or sum
    columns, rows = [z_hat * scale, u * scale], [b, r * z_hat]
    if centre:  # red(g 1) is cen's mean, taken off a g
        columns.insert(0, torch.full_like(u, scale))
        rows.insert(0, a.expand(u.shape))
    # Token-major: each token's stacks are contiguous [k, P NH, M] blocks.
    project = torch.stack([x.transpose(0, 1) for x in columns], 1)  # [L, k, P NH, M]
    rebuild = torch.stack([x.transpose(0, 1) for x in rows], 1).neg_()
    scales = a.transpose(0, 1).contiguous()  # [L, P NH, 1]
    for lo in reversed(range(0, width, SUBSTITUTION_BLOCK)):
        hi = min(width, lo + SUBSTITUTION_BLOCK)
        block = grad_u[:, lo:hi]
        if hi < width:
            block = torch.baddbmm(block, _t(lower[:, hi:, lo:hi]), out_z[:, hi:], alpha=-1)
        grads = block.transpose(0, 1).contiguous()  # [b, P NH, M]
        # pull[j][i] = Lm[:, j, i] for the block's rows i < j (j's dz reaches only earlier rows).
        pull = lower[:, lo:hi, lo:hi].permute(1, 2, 0)[..., None].contiguous().unbind(0)
        dz = torch.empty_like(grads)
        for t in range(hi - lo - 1, -1, -1):
            g, k = grads[t], lo + t
            coefficients = (g * project[k]).sum(-1, keepdim=True)  # [k, P NH, 1]
            torch.addcmul((coefficients * rebuild[k]).sum(0), g, scales[k], out=dz[t])
            if t:
                grads[:t].addcmul_(pull[t][:t], dz[t], value=-1)
        out_z[:, lo:hi] = dz.transpose(0, 1)
        grad_u[:, lo:hi] = grads.transpose(0, 1)
    _alpha_vjp(name, z_hat, r, grad_u, out_alpha)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1, keepdim=True)`` without a product temporary: ``vecdot``, on the CPU about
    twice as fast as a batched matrix product of rows and columns."""
    return torch.linalg.vecdot(a, b).unsqueeze(-1)


def _mix_forward(name: str, y: torch.Tensor):
    """``H = f(y)`` and what :func:`_mix_vjp` needs."""
    if name == "ln_silu":
        s = torch.nn.functional.silu(y)
        h, mean, rstd = layer_norm_stats(s)
        return h, (y, mean, rstd)  # SiLU(y) is redone in the backward rather than kept
    if name == "softmax":
        h = torch.softmax(y, dim=-1)
        return h, (h,)  # its backward reads the output alone
    return mix(name, y), (y,)


def _mix_vjp(name: str, saved, grad_h: torch.Tensor) -> torch.Tensor:
    """``J_f^T grad_h``; may overwrite ``grad_h`` (with the result)."""
    if name == "ln_silu":
        y, mean, rstd = saved
        grad_s = layer_norm_vjp(grad_h, torch.nn.functional.silu(y), mean, rstd)
        return torch.ops.aten.silu_backward.grad_input(grad_s, y, grad_input=grad_h)
    if name == "softmax":  # h * (grad_h - sum(h * grad_h)), one fused kernel
        (h,) = saved
        return torch.ops.aten._softmax_backward_data(grad_h, h, -1, h.dtype)
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
        ch = {}
        if identity:
            ch.update(W=chain_tensors[i], Z=chain_tensors[i + 1])
            i += 2
        elif spec.substituted:
            ch.update(eb=chain_tensors[i])
            i += 1
        ch.update(X=chain_tensors[i], s0=chain_tensors[i + 1], a0=chain_tensors[i + 2], P=passes)
        i += 3
        out.append(ch)
    return out


class ChunkFunction(torch.autograd.Function):
    """``(O, final states, final anchors) = F(spec, Q, K, V, mu, G, LB, A, mu_last, w, *chains)``.

    Args (all chunk-major, ``[n, NH, ...]``):
        Q, K: ``[n, NH, L, Dk]``; V: ``[n, NH, L, Dv]`` (the read-outs' operands).
        mu: ``[n, NH, L, 1]`` = ``exp(c_r)``; G, LB: ``[n, NH, L]`` gammas and log gates
            (``D = exp(gap) * G[..., None, :]`` with gap of :func:`in_chunk_log_gaps`).
        A: ``[n, NH, L, M]`` targets; mu_last: ``[n, NH, 1, 1]`` = ``exp(c_L)``.
        w: ``[n, NH, L, 1]`` the write weights ``gamma_i exp(c_L - c_i)`` of ``S'``.
        chains: per chain, for ``identity`` first ``W [n, P NH, L, D]`` and ``Z [n, P NH, L, M]``
            of :func:`.chunked.identity_residual_basis`, for ``substituted`` first
            ``eb [n, NH, L, 1]`` = ``exp(c_{r-1})``; then the keys/values
            ``X [n, P NH, L, D]``, the start state ``s0`` and the anchor ``a0`` ``[P NH, M, D]``.
    Returns:
        ``O [n, NH, L, Dv]``, then per chain its final state and final anchor ``[P NH, M, D]``.
    """

    @staticmethod
    def forward(ctx, spec: ChunkSpec, Q, K, V, mu, G, LB, A, mu_last, w, *chain_tensors):
        chains = _split(spec, chain_tensors)
        n, nh, width, _ = Q.shape
        slots = A.shape[-1]
        identity = spec.compress_fn == "identity"
        keep_parts = spec.keep and not identity  # what the backward's second-order terms need
        gexp = in_chunk_log_gaps(LB).exp_()
        # Without a backward to follow, products overwrite their operands (fewer fresh buffers).
        decay = gexp * G[..., None, :] if spec.keep else gexp.mul_(G[..., None, :])  # gamma_i exp(c_r - c_i)
        qk = Q @ _t(K)
        dqk = decay * qk if spec.keep else qk.mul_(decay)
        group = n if spec.keep else spec.group
        substitute = functools.partial(compiled_substitute, block=SUBSTITUTION_BLOCK) if spec.compiled else _substitute
        outs, states = [], [None] * len(chains)
        for ch in chains:
            ch["anchor"] = ch["a0"].clone()
            if spec.substituted:
                ch["lower"] = _residual_lower(ch["X"], decay, ch["P"])[1]
        for lo in range(0, n, group):
            hi = min(n, lo + group)
            for i, ch in enumerate(chains):
                s0 = ch["s0"] if lo == 0 else states[i][-1]
                rows_shape = (hi - lo,) + ch["X"].shape[1:-1]
                # The chunk-start states and U (and, for the backward, the residual parts).
                shapes = [(hi - lo + 1,) + s0.shape, rows_shape + (slots,)]
                if keep_parts:
                    shapes += [rows_shape + (slots,), rows_shape + (slots,), rows_shape + (1,)]
                buf, us, *parts_bufs = _carve(s0, shapes)
                if keep_parts:
                    ch["zh"], ch["e"], ch["r"] = parts_bufs
                states[i], ch["U"] = buf, us
                buf[0] = s0
                view = (ch["P"], nh) + s0.shape[-2:]
                for c in range(lo, hi):
                    s, u = buf[c - lo], us[c - lo]
                    if identity:
                        torch.baddbmm(ch["Z"][c], ch["W"][c], _t(s), beta=-1, out=u)
                    elif spec.substituted:
                        z = torch.matmul(ch["X"][c], _t(s)).view(ch["P"], nh, width, slots).mul_(ch["eb"][c])
                        substitute(spec.compress_fn, z, ch["lower"][c].view(ch["P"], nh, width, width), A[c],
                                   u.view(z.shape))
                        if keep_parts:  # the residuals' parts, for all tokens at once (u is kept)
                            parts = tuple(ch[k][c].view(z.shape[:-1] + ch[k].shape[-1:]) for k in ("zh", "r", "e"))
                            _residual(spec.compress_fn, z, A[c], parts)
                    else:
                        z = (ch["X"][c] @ _t(ch["a0"] if c == 0 else s)).view(ch["P"], nh, width, slots)
                        parts = None
                        if keep_parts:
                            parts = tuple(ch[k][c].view(z.shape[:-1] + ch[k].shape[-1:]) for k in ("zh", "r", "e"))
                        u.copy_(_residual(spec.compress_fn, z, A[c], parts).view(u.shape))
                    nxt = buf[c - lo + 1]
                    torch.mul(s.view(view), mu_last[c], out=nxt.view(view))
                    wu = (u.view(ch["P"], nh, width, slots) * w[c]).view(u.shape)  # (w * U)^T X = U^T (w * X)
                    nxt.baddbmm_(_t(wu), ch["X"][c], alpha=-1)
                    if c in spec.last_chunk:  # the anchor some row ends in: this chunk's start
                        ends = _ends(spec, c, ch["P"], s.device)
                        ch["anchor"] = torch.where(ends, ch["a0"] if c == 0 else s, ch["anchor"])
            st_k, st_v, u_k, u_v = _read_parts(chains, states, nh)
            sl = slice(lo, hi)
            y = torch.matmul(Q[sl], _t(st_k)).mul_(mu[sl])
            _flat(y).baddbmm_(_flat(dqk[sl]), _flat(u_k), alpha=-1)
            h, mix_saved = _mix_forward(spec.mix_fn, y)
            p = h @ _t(u_v)
            ep = decay[sl] * p if spec.keep else p.mul_(decay[sl])
            o = torch.matmul(h, st_v).mul_(mu[sl])
            _flat(o).baddbmm_(_flat(ep), _flat(V[sl]), alpha=-1)
            outs.append(o)
        finals = []
        for i, ch in enumerate(chains):
            finals += [states[i][-1].clone(), ch["anchor"]]
        if spec.keep:
            ctx.spec, ctx.n_mix = spec, len(mix_saved)
            # Products cheap to redo (D, D * QK^T, mu * Q, mu * H, D * P, the split halves of a
            # stacked chain) are not kept: every kept tensor lives through the whole backward and
            # raises its peak memory (and fresh pages cost time here).
            tensors = [Q, K, V, mu, G, gexp, qk, A, mu_last, w, h, p, *mix_saved]
            for ch, st in zip(chains, states):
                tensors += [ch[k] for k in _chain_saved(spec)[:-2]] + [st, ch["U"]]
            ctx.save_for_backward(*tensors)
        return (outs[0] if len(outs) == 1 else torch.cat(outs), *finals)

    @staticmethod
    def backward(ctx, grad_o, *grad_finals):
        if torch.is_grad_enabled():  # create_graph=True: the engine runs backwards with grad mode on
            raise RuntimeError(
                "trellis_attention(backend='torch'): double backward (create_graph=True) is not supported "
                "by the chunk form's hand-written backward; use backend='reference' for higher derivatives"
            )
        # The op computes in its compute dtype: a backward run inside an autocast region (as the
        # forward may be) must not let autocast drop its products to a lower precision.
        with torch.autocast(grad_o.device.type, enabled=False):
            return _chunk_backward(ctx, grad_o, *grad_finals)


def _chunk_backward(ctx, grad_o: torch.Tensor, *grad_finals: torch.Tensor) -> tuple:
    """The body of :meth:`ChunkFunction.backward` (see the module docstring)."""
    spec = ctx.spec
    grad_o = grad_o.contiguous()  # o.sum()'s gradient is an expanded scalar: each product would copy it
    saved = ctx.saved_tensors
    Q, K, V, mu, G, gexp, qk, A, mu_last, w, h, p = saved[:12]
    mix_saved, rest = saved[12:12 + ctx.n_mix], saved[12 + ctx.n_mix:]
    identity = spec.compress_fn == "identity"
    names = _chain_saved(spec)
    chains = [dict(zip(names, rest[i * len(names):(i + 1) * len(names)]), P=passes)
              for i, passes in enumerate(spec.passes)]
    n, nh = Q.shape[:2]
    st_k, st_v, u_k, u_v = _read_parts(chains, [ch["S"] for ch in chains], nh)

    # ---- the read-outs, batched over all chunks (signs folded into in-place negations) ----
    g1 = torch.matmul(grad_o, _t(st_v))  # [n, NH, L, M]
    grad_mu = _dot(h, g1)
    grad_h = g1.mul_(mu)
    decay = gexp * G[..., None, :]
    grad_st_v = torch.matmul(_t(h), grad_o * mu)
    grad_e = torch.matmul(grad_o, _t(V))  # minus the gradient of E = D * P
    grad_v = torch.matmul(_t(decay * p), grad_o).neg_()
    grad_ph = grad_e * decay  # minus the gradient of P = H U_v^T
    _flat(grad_h).baddbmm_(_flat(grad_ph), _flat(u_v), alpha=-1)
    grad_u_v = torch.matmul(_t(grad_ph), h).neg_()
    grad_y = _mix_vjp(spec.mix_fn, mix_saved, grad_h)
    grad_mu_q = torch.matmul(grad_y, st_k)
    grad_st_k = torch.matmul(_t(grad_y), mu * Q)
    grad_dqk = torch.matmul(grad_y, _t(u_k))  # minus the gradient of D * Q K^T
    grad_u_k = torch.matmul(_t(decay * qk), grad_y).neg_()
    # Minus the gradient of D, from O and from D * Q K^T; then D = exp(gap) * G.
    grad_decay = grad_e.mul_(p).addcmul_(grad_dqk, qk)
    grad_qk = grad_dqk.mul_(decay)  # minus
    grad_mu += _dot(grad_mu_q, Q)
    grad_q = grad_mu_q.mul_(mu)
    _flat(grad_q).baddbmm_(_flat(grad_qk), _flat(K), alpha=-1)
    grad_k = torch.matmul(_t(grad_qk), Q).neg_()
    # Free the read-outs' temporaries before the chains' buffers are allocated (D stays for
    # the exact writes' Lm, and grad_decay for their share of it).
    del st_k, st_v, u_k, u_v, grad_ph, grad_y, grad_qk

    # ---- the state chains, one reverse loop over chunks each ----------------------------
    if len(chains) == 1:
        st_parts, u_parts = [[grad_st_k, grad_st_v]], [[grad_u_k, grad_u_v]]
    else:
        st_parts, u_parts = [[grad_st_k], [grad_st_v]], [[grad_u_k], [grad_u_v]]
    grad_a = None if identity else torch.empty_like(A)
    grad_mu_last, grad_w = torch.zeros_like(mu_last), torch.zeros_like(w)
    grads_chains = []
    for i, ch in enumerate(chains):
        d_final, d_anchor = grad_finals[2 * i], grad_finals[2 * i + 1]
        passes, a0, S, U = ch["P"], ch["a0"], ch["S"], ch["U"]
        view = (passes, nh) + a0.shape[-2:]
        # A row's final anchor is the start state of its last chunk (a0 for chunk 0).
        d_a0, anchor_grads = torch.zeros_like(a0), {}
        for c in sorted(set(spec.last_chunk)):
            masked = torch.where(_ends(spec, c, passes, a0.device), d_anchor, 0.0)
            if c == 0:
                d_a0 += masked
            else:
                anchor_grads[c] = masked
        # d_after: the gradient of the state after each chunk; d_u_all (identity) or d_z.
        d_after, d_u_all = _carve(S, [S[1:].shape, U.shape])
        d_after[-1] = d_final
        if not identity:
            d_z, d_alpha = d_u_all, U.new_empty(U.shape[1:])
            terms = _residual_vjp2_terms(spec.compress_fn, ch["zh"], ch["r"], ch["e"])
        if spec.substituted:
            gram, lower = _residual_lower(ch["X"], decay, passes)
        for c in range(n - 1, -1, -1):
            d_next = d_after[c]
            d_u = _gather(u_parts[i], c, d_u_all[c] if identity else None)
            x_ds = (ch["X"][c] @ _t(d_next)).view(view[:2] + d_u.shape[-2:])
            d_u.view(x_ds.shape).addcmul_(w[c], x_ds, value=-1)
            d_cur = _gather(st_parts[i], c, d_after[c - 1] if c > 0 else None)  # grad of S_c
            d_cur.view(view).addcmul_(mu_last[c], d_next.view(view))
            if c in anchor_grads:
                d_cur += anchor_grads[c]
            if identity:
                d_cur.baddbmm_(_t(d_u), ch["W"][c])
                continue
            if spec.substituted:
                _unsubstitute(spec.compress_fn, ch["zh"][c], ch["r"][c], *(x[c] for x in terms), U[c],
                              lower[c], d_u, d_z[c], d_alpha)
            else:
                _residual_vjp2(spec.compress_fn, ch["zh"][c], ch["r"][c], *(x[c] for x in terms), U[c], d_u, d_z[c],
                               d_alpha)
            if passes == 2:  # a stacked chain: keys and values share the target
                torch.add(d_alpha[:nh], d_alpha[nh:], out=grad_a[c])
            elif i == 0:
                grad_a[c] = d_alpha
            else:
                grad_a[c] += d_alpha
            if spec.substituted:  # z = e^{c_{r-1}} X S^T (+ earlier tokens' terms) from the start state
                d_cur.baddbmm_(_t((d_z[c].view(view[:2] + d_z.shape[-2:]) * ch["eb"][c]).view(d_z[c].shape)),
                               ch["X"][c])
            elif c > 0:
                d_cur.baddbmm_(_t(d_z[c]), ch["X"][c])
        d_s0 = d_cur
        # Batched over chunks: the gradients of mu_L, w and X through S' = mu_L S - U^T (w X),
        # and of U's inputs.
        pass_view = (n, passes, nh) + U.shape[-2:-1]
        grad_mu_last += _dot(S[:-1].flatten(-2), d_after.flatten(-2)).view(pass_view[:3]).sum(1)[..., None, None]
        u_ds = torch.matmul(U, d_after)  # minus the gradient of w X
        grad_w -= _dot(ch["X"], u_ds).view(pass_view + (1,)).sum(1)
        if identity:
            d_x = u_ds.view(pass_view + (-1,)).mul_(w[:, None]).neg_().view(u_ds.shape)
            grads_chains += [torch.matmul(d_u_all, S[:-1]), d_u_all.neg_(), d_x, d_s0, d_a0]
        elif spec.substituted:
            # z_r = eb_r x_r S^T - sum_{i<r} Lm[r, i] u_i, with S each chunk's start state.
            d_zs = torch.matmul(d_z, S[:-1]).view(pass_view + (-1,))  # [n, P, NH, L, D]
            d_eb = _dot(d_zs, ch["X"].view(d_zs.shape)).sum(1)
            d_x = d_zs.mul_(ch["eb"][:, None]).addcmul_(w[:, None], u_ds.view(d_zs.shape), value=-1).view(ch["X"].shape)
            # Lm[r, i] = D[r-1, i] (x_r . x_i) and dLm[r, i] = -dz_r . u_i (i < r): to D (grad_decay
            # holds minus its gradient) and to the Gram matrix of X.
            d_lower = torch.matmul(d_z, _t(U)).neg_().tril_(-1)
            per_pass = d_lower.view((n, passes, nh) + d_lower.shape[-2:])
            grad_decay[..., :-1, :] -= (per_pass[..., 1:, :] * gram.view(per_pass.shape)[..., 1:, :]).sum(1)
            per_pass[..., 1:, :].mul_(decay[:, None, :, :-1, :])
            d_x.add_(torch.matmul(d_lower + _t(d_lower), ch["X"]))
            grads_chains += [d_eb, d_x, d_s0, d_a0]
        else:
            d_x = torch.empty_like(ch["X"])
            if n > 1:
                torch.matmul(d_z[1:], S[1:-1], out=d_x[1:])
            torch.matmul(d_z[0], a0, out=d_x[0])
            d_x.view(pass_view + (-1,)).addcmul_(w[:, None], u_ds.view(pass_view + (-1,)), value=-1)
            d_a0.baddbmm_(_t(d_z[0]), ch["X"][0])
            grads_chains += [d_x, d_s0, d_a0]
    # D = exp(gap) * G.
    grad_decay.mul_(gexp)
    grad_g = grad_decay.sum(-2).neg_()
    grad_gap = grad_decay.mul_(G[..., None, :]).neg_()
    # gap[r, i] = c_r - c_i where it is finite (elsewhere D and its gradient are 0), so
    # dc = row sums - column sums, and lb_j enters every c_r with r >= j.
    grad_lb = (grad_gap.sum(-1) - grad_gap.sum(-2)).flip(-1).cumsum(-1).flip(-1)
    return (None, grad_q, grad_k, grad_v, grad_mu, grad_g, grad_lb, grad_a, grad_mu_last, grad_w, *grads_chains)


def _residual_lower(X: torch.Tensor, decay: torch.Tensor, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Gram, Lm)`` of a chain, ``[n, P NH, L, L]`` each: ``Gram = X X^T`` and the exact writes'
    ``Lm[r, i] = D[r-1, i] (x_r . x_i)`` (design page, section 2b; zero on and above the
    diagonal), from the read-outs' ``D = decay [n, NH, L, L]`` (``D[r, i] = gamma_i e^{c_r - c_i}``)."""
    gram = X @ _t(X)
    lower = torch.zeros_like(gram)
    shape = (gram.shape[0], passes, -1) + gram.shape[-2:]
    torch.mul(gram.view(shape)[..., 1:, :], decay[:, None, :, :-1, :], out=lower.view(shape)[..., 1:, :])
    return gram, lower


def _chain_saved(spec: ChunkSpec) -> tuple:
    """The names of a chain's tensors the backward keeps (the last two: states and ``U``)."""
    if spec.compress_fn == "identity":
        return "W", "X", "a0", "S", "U"
    return ("eb",) * spec.substituted + ("X", "zh", "r", "e", "a0", "S", "U")


def _carve(like: torch.Tensor, shapes) -> list:
    """Uninitialised tensors of the given shapes, views into one allocation: a few large blocks
    rather than many, so that freed memory is reused instead of returned to the system and
    faulted in again on the next call (each fresh page costs time on a CPU)."""
    sizes = [torch.Size(shape).numel() for shape in shapes]
    block = like.new_empty(sum(sizes))
    return [part.view(shape) for part, shape in zip(block.split(sizes), shapes)]


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[..., a, b]`` -> ``[batch, a, b]`` for ``bmm``; a view when ``x`` is contiguous."""
    return x.reshape(-1, *x.shape[-2:])


def _ends(spec: ChunkSpec, c: int, passes: int, device) -> torch.Tensor:
    """``[P NH, 1, 1]``: the rows whose last chunk is ``c`` (their final anchor is its start)."""
    ends = torch.tensor([x == c for x in spec.last_chunk], device=device)
    return ends.view(1, -1, 1).expand(passes, -1, spec.heads).reshape(-1, 1, 1)


def _gather(parts, c: int, out=None) -> torch.Tensor:
    """Chunk ``c`` of the per-pass gradients, stacked on the pass axis (into ``out`` if given);
    a single part is returned as its own view, which the caller may update in place."""
    if len(parts) == 1 and out is None:
        return parts[0][c]
    if out is None:
        return torch.cat([x[c] for x in parts])
    return torch.cat([x[c] for x in parts], out=out)


def _read_parts(chains, states, nh):
    """The read-outs' operands ``(S_k, S_v [n, NH, M, D], U_k, U_v [n, NH, L, M])``, each
    contiguous: a stacked chain's pass axis (its first NH are keys, the rest values) is split
    by one copy each, rather than by a copy inside every product that reads it."""
    if len(chains) == 1:
        s, u = states[0][:-1], chains[0]["U"]
        return s[:, :nh].contiguous(), s[:, nh:].contiguous(), u[:, :nh].contiguous(), u[:, nh:].contiguous()
    return states[0][:-1], states[1][:-1], chains[0]["U"], chains[1]["U"]
