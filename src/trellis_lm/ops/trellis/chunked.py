"""The chunk-parallel form of the design page, section 2, in batched PyTorch.

Every sequence is laid on a grid whose chunks start at multiples of C (:func:`grid_positions`):
a chunk's tokens fill a block of L cells from cell 0, where L is the most real tokens any row
has in one chunk (so L <= min(C, T): a short call costs what its tokens cost, whatever C).
The free cells are fillers with gamma = 0 and log_beta = 0, which leave the memories
untouched, so rows that resume mid-chunk, rows of different length (``cu_seqlens``) and rows
that resume at a chunk boundary all share one set of chunk boundaries and are processed
together. Within a chunk the state-independent parts (decays, the masked ``D * Q K^T``, and
for ``identity`` the triangular solve) are computed for all chunks at once; only the chain
from one chunk's state to the next (each chunk's ``U`` and the next start state, both passes
in one set of operations when ``Dk == Dv``) runs as a Python loop over chunks. The read-outs
(``Yh``, ``H = f(Yh)``, ``O``) need only each chunk's start state and ``U``, so they run after
the loop, batched over groups of chunks (:data:`GROUP_ELEMENTS` bounds a group's stacked
states, so ``C = 1`` over a long input does not hold one state per token at once).
"""

from __future__ import annotations

import torch

from ..varlen import grid_positions
from .chunked_autograd import ChunkFunction, ChunkSpec, in_chunk_log_gaps
from .state import TrellisState


def log_decays(log_beta: torch.Tensor, with_gap: bool = True):
    """The in-chunk log decays of section 2, each summed directly over its own tokens.

    A difference of cumulative sums (``c_r - c_i``) is ``inf - inf`` = NaN once a full forget
    (``log_beta = -inf``) has entered both sums; a direct sum is ``-inf``, whose exp is the exact 0.

    Args:
        log_beta: ``[..., L]`` one chunk's log forget gates (fillers 0).
        with_gap: also compute ``gap`` (else ``None``).
    Returns:
        ``c [..., L]`` with ``c_r = sum_{j <= r} lb_j``; ``before [..., L]`` = ``c_{r-1}`` (0 at r = 0);
        ``after [..., L]`` = ``sum_{j > i} lb_j`` (= ``c_L - c_i``); ``gap [..., L, L]`` of
        :func:`.chunked_autograd.in_chunk_log_gaps`.
    """
    zero = log_beta.new_zeros(log_beta.shape[:-1] + (1,))
    c = log_beta.cumsum(-1)
    before = torch.cat([zero, c[..., :-1]], dim=-1)
    after = torch.cat([log_beta.flip(-1).cumsum(-1).flip(-1)[..., 1:], zero], dim=-1)
    return c, before, after, (in_chunk_log_gaps(log_beta) if with_gap else None)


def identity_residual_basis(x: torch.Tensor, alpha: torch.Tensor, gamma: torch.Tensor, before: torch.Tensor,
                            gap: torch.Tensor):
    """``identity`` residuals at the current state, in the form ``U = W S^T - Z`` (section 2).

    With residuals taken before each token's write, ``u_r = M_{r-1} x_r - alpha_r`` and
    ``M_{r-1} = e^{c_{r-1}} S - sum_{i<r} gamma_i e^{c_{r-1} - c_i} u_i x_i^T``, so
    ``(I + Lm) U = diag(e^{before}) X S^T - A`` with the strictly lower
    ``Lm[r, i] = gamma_i e^{c_{r-1} - c_i} (x_r . x_i)``. One unit-lower-triangular solve,
    batched over every leading dim (rows, heads, chunks), gives ``W`` and ``Z`` for all chunks
    before their start states are known.

    Args:
        x: ``[..., L, D]`` keys (or values); alpha ``[..., L, M]``; gamma, before ``[..., L]``;
        gap: ``[..., L, L]`` from :func:`log_decays`.
    Returns:
        ``(W [..., L, D], Z [..., L, M])``.
    """
    dim = x.shape[-1]
    # gap[r - 1, i] = c_{r-1} - c_i for i < r (row 0 has no earlier token).
    prev = torch.cat([torch.full_like(gap[..., :1, :], float("-inf")), gap[..., :-1, :]], dim=-2)
    lower = prev.exp() * gamma[..., None, :] * (x @ x.transpose(-1, -2))
    scaled = before.exp()[..., None] * x
    rhs = torch.cat([scaled, alpha.expand(scaled.shape[:-1] + alpha.shape[-1:])], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    return solved[..., :dim], solved[..., dim:]


def _chunk_major(x: torch.Tensor, flat_index, rows: int, chunks: int, width: int) -> torch.Tensor:
    """``[tokens, H, *rest]`` -> ``[chunks, N * H, L, *rest]`` (the grid of :func:`grid_positions`,
    chunk-major, so the loop's per-chunk slices are contiguous), free cells holding zeros.
    ``flat_index=None``: every cell holds the token of the same index (no free cells)."""
    heads, rest = x.shape[1], tuple(x.shape[2:])
    cells = x if flat_index is None else x.new_zeros((rows * chunks * width, heads) + rest).index_copy(0, flat_index, x)
    cells = cells.view((rows, chunks, width, heads) + rest)
    order = (1, 0, 3, 2) + tuple(range(4, 4 + len(rest)))
    # Contiguous: each batched product would otherwise copy a strided view (chunks and heads
    # do not merge into one batch stride) on its own.
    return cells.permute(order).reshape((chunks, rows * heads, width) + rest).contiguous()


def _from_chunk_major(o: torch.Tensor, flat_index: torch.Tensor, rows: int, heads: int, batch: int, length: int):
    """Inverse of :func:`_chunk_major` for outputs: ``[chunks, N * H, L, D]`` -> ``[B, T, H, D]``."""
    chunks, _, width, dim = o.shape
    o = o.view(chunks, rows, heads, width, dim).permute(1, 0, 3, 2, 4)
    if flat_index is None:
        return o.reshape(batch, length, heads, dim)
    return o.reshape(-1, heads, dim)[flat_index].view(batch, length, heads, dim)


# The chunk length of exact writes (not identity) whatever the call's C: the training step of the
# study's model was fastest at 16 and 32 among 8, 16, 32 and 64 (BENCHMARKS.md, "Training speed of
# the exact chunk form"); longer chunks pay for their L x L substitution terms.
EXACT_LAYOUT_CHUNK = 32

# Without grad, read-outs are computed for groups of chunks at once; a group's stacked chunk-start
# states hold at most about this many elements (so C = 1 over a long input does not stack one state
# per token). With a backward to follow, every start state is kept for it anyway: one group.
GROUP_ELEMENTS = 1 << 22


def chunked_forward(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient,
                    cu_seqlens, *, compiled: bool = False):
    """Backend ``"torch"`` (and ``"compiled"``: ``compiled=True``); arguments as validated by
    :func:`trellis_lm.ops.trellis_attention`.

    Two phases. The sequential loop over chunks runs only the state chain: each chunk's ``U``
    (from its anchor) and the next chunk-start state. The read-outs ``Yh``, ``H = f(Yh)`` and
    ``O`` of section 2 need only a chunk's start state and its ``U``, so they are computed
    afterwards for a whole group of chunks in a few batched operations. When ``Dk == Dv`` the
    key and value passes share the loop: their memories are stacked along the batch axis, so
    each chunk costs one set of operations for both. Both phases run inside
    :class:`.chunked_autograd.ChunkFunction`, whose hand-written backward replaces autograd of the
    loop; only the state-independent set-up here (layout, decays, the ``identity`` solve) is
    differentiated by autograd.

    ``"exact"`` writes with ``layernorm``/``l2norm`` take each residual at the memory just before
    the write: inside the chain loop, a chunk's ``U`` is then a forward substitution over its
    tokens on M-vectors (design page, section 2b), not one batched residual at the anchor. Their
    function does not depend on C, so they run in chunks of :data:`EXACT_LAYOUT_CHUNK` tokens from
    each sequence's first token here, whatever ``chunk_size`` (which still counts the offset of
    the state handed back). ``compiled``: their chunks of that full width run each substitution
    as one compiled kernel (:mod:`.compiled_substitution`); shorter ones, and every other
    setting, run as with ``"torch"``.
    """
    batch, length, heads, _ = q.shape
    dk, dv = q.shape[-1], v.shape[-1]
    identity = compress_fn == "identity"
    exact = write_gradient == "exact"
    substituted = exact and not identity  # identity's exact residuals come from its solve
    rows = state.offset.numel()
    nh = rows * heads
    # Exact writes compute one function whatever the layout: their chunks are EXACT_LAYOUT_CHUNK
    # tokens from the call's first token (C only counts the offset handed back).
    chunk, offset = (EXACT_LAYOUT_CHUNK, torch.zeros_like(state.offset)) if substituted else (chunk_size, state.offset)
    flat_index, lengths, chunks, width = grid_positions(offset, batch, length, cu_seqlens, chunk)
    if rows * chunks * width == batch * length and not bool(offset.any()):
        # Every sequence (a row, or a packed document) fills its chunks from a chunk start: the grid
        # is the input's own order, and the scatter into it and the gather back are skipped.
        flat_index = None
    Q, K, V, A, LB, G = (
        _chunk_major(x.reshape((batch * length,) + tuple(x.shape[2:])), flat_index, rows, chunks, width)
        for x in (q, k, v, alpha, log_beta, gamma)
    )  # Q: [chunks, N * H, L, Dk]; LB, G: [chunks, N * H, L]

    # State-independent per-chunk quantities, for all chunks at once (decays in log space).
    cum, before, after, gap = log_decays(LB, with_gap=identity)
    mu = cum.exp()[..., None]  # [chunks, NH, L, 1]
    mu_last = cum[..., -1:].exp()[..., None]  # [chunks, NH, 1, 1]
    w = (G * after.exp())[..., None]  # [chunks, NH, L, 1]

    # Rows that resume at a chunk boundary take their anchor from the state itself.
    at_start = (offset == 0)[:, None, None, None]
    a_k = torch.where(at_start, state.m_k, state.anchor_k)
    a_v = torch.where(at_start, state.m_v, state.anchor_v)
    # The chains of the loop. With Dk == Dv one chain carries both passes, stacked on a pass
    # axis P = 2 (keys, then values) that the per-(row, head) gates and targets broadcast over.
    if dk == dv:
        chains = [(torch.stack([K, V], dim=1), torch.stack([state.m_k, state.m_v]), torch.stack([a_k, a_v]))]
    else:
        chains = [(K[:, None], state.m_k[None], a_k[None]), (V[:, None], state.m_v[None], a_v[None])]
    chain_tensors = []
    for X, s0, a0 in chains:  # X [chunks, P, NH, L, D]; s0, a0 [P, N, H, M, D]
        if identity:  # residuals at the current state: U = W S^T - Z, whatever the anchors
            w_x, z_x = identity_residual_basis(X, A[:, None], G[:, None], before[:, None], gap[:, None])
            chain_tensors += [w_x.flatten(1, 2), z_x.flatten(1, 2)]
        elif substituted:  # its Lm is made inside the Function from the read-outs' decays
            chain_tensors.append(before.exp()[..., None])
        chain_tensors += [X.flatten(1, 2), s0.flatten(0, 2), a0.flatten(0, 2)]

    inputs = (Q, K, V, mu, G, LB, A, mu_last, w, *chain_tensors)
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    state_elements = sum(s0.numel() for _, s0, _ in chains)
    spec = ChunkSpec(
        compress_fn=compress_fn, mix_fn=mix_fn, substituted=substituted, passes=tuple(X.shape[1] for X, _, _ in chains),
        last_chunk=tuple(((offset + lengths - 1).clamp(min=0) // chunk).tolist()), heads=heads,
        keep=keep, group=max(1, GROUP_ELEMENTS // max(1, state_elements)),
        compiled=compiled and substituted and width == EXACT_LAYOUT_CHUNK,
    )
    o, *finals = ChunkFunction.apply(spec, *inputs)  # o [chunks, NH, L, Dv]
    if len(chains) == 1:
        s_k, s_v = finals[0][:nh], finals[0][nh:]
        f_k, f_v = finals[1][:nh], finals[1][nh:]
    else:
        s_k, f_k, s_v, f_v = finals
    s_k, s_v = s_k.view(state.m_k.shape), s_v.view(state.m_v.shape)
    f_k, f_v = f_k.view(state.m_k.shape), f_v.view(state.m_v.shape)
    if exact:  # nothing reads the anchors: they follow the memories (design page, section 3)
        f_k, f_v = s_k, s_v
    # A sequence with no tokens hands its initial state back untouched, anchors included.
    empty = (lengths == 0)[:, None, None, None]
    final = TrellisState(
        s_k,
        s_v,
        torch.where(empty, state.anchor_k, f_k),
        torch.where(empty, state.anchor_v, f_v),
        (state.offset + lengths) % chunk_size,
    )
    return _from_chunk_major(o, flat_index, rows, heads, batch, length), final
