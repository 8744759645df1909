"""The chunk-parallel form of the design page, section 2, in batched PyTorch.

Every sequence is laid on a grid whose chunks start at multiples of C (``varlen.grid_positions``:
each chunk a block of at most ``min(C, T)`` cells, its tokens in order). Free cells hold zero
inputs, so gamma = 0 and
``b = 0`` for every variant: they leave ``U`` untouched, and their reads (q = 0) are discarded.
Rows that resume mid-chunk, rows of different length (``cu_seqlens``) and rows that resume at a
chunk boundary thus share one set of chunk boundaries and are processed together.

Only the chain of states needs a loop over chunks: each chunk's terms are taken at its anchor,
which is the previous chunk's final ``rownorm(U)``. The loop computes just what the next anchor
needs, ``U' = U0 + c_L A - B^T W`` with ``c_L,i = a_i . (B^T W)_i`` (two small matmuls for dec
and enc; none for sim, whose ``B^T W`` is anchor-free and computed for all chunks at once); the
cumulative sums, the norms and the reads are computed afterwards for blocks of chunks at once,
as a few larger batched matmuls.

Layout: chunk-major with sequences and heads flattened, ``[chunks, N * H, L, *]``, so that one
chunk is a contiguous 3-D batch for ``bmm`` and a block of chunks is one contiguous slice. Each
input is laid out by one gather, and cut into chunks and blocks by one ``unbind`` or ``split``:
autograd then has one node per tensor for each, not one per chunk.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..varlen import chunk_major_cells, chunk_major_sources, from_chunk_major, gather_cells, grid_positions
from .state import LatticeState
from .terms import rownorm

# Elements of one batched read's temporaries on CPUs, counted per (sequence, head, chunk) as
# ``L (M + D + L) + M D``: enough for efficient batched matmuls, few enough that the temporaries
# stay small. Measured at B = 1, H = 4, M = D = C = 64 (blocks of 4, 8, 16 and all 31 later
# chunks): 8 chunks was fastest; with all chunks at once the fresh multi-megabyte buffers cost
# page faults comparable to the arithmetic. Counting elements rather than matrices keeps a block
# of one-token chunks (C = 1) from being a few tiny matmuls. On GPUs every later chunk goes in
# one batch: there, launches cost more than memory.
READ_ELEMENTS = 1 << 19


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[chunks, R, ...]`` -> ``[chunks * R, ...]`` (a view: the stacks are contiguous)."""
    return x.reshape((-1,) + tuple(x.shape[2:]))


def _reads(Q, B, W, A, u0: Optional[torch.Tensor], pair: torch.Tensor,
           Z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The outputs of a batch of chunks, given their terms and anchors (design page, section 2).

    Args:
        Q, B: ``[X, C, M]`` reads and step lengths; W ``[X, C, D]`` step directions.
        A: ``[X, M, D]`` the anchors (unit rows).
        u0: ``[X, M, D]`` the accumulations the chunks start from, or ``None`` when they start at
            their anchors (unit rows). Then ``a . u0 = |u0|^2 = 1`` and ``W U0^T = Z``, and the
            norm reduces to ``1 + |P sum b w|^2``: the same formula up to rounding (~1e-16), fewer passes.
        pair: ``[C, C]`` ``2`` below the diagonal, ``1`` on it, ``0`` above (made once per call).
        Z: ``[X, C, M]`` ``W A^T`` when the caller has it (enc), else computed here.
    Returns:
        ``[X, C, D]``.
    """
    if Z is None:
        Z = W @ A.transpose(-1, -2)
    cs = (B * Z).cumsum_(-2)  # c: [X, C, M]
    # (2 tril(F, -1) + diag(F)) B in one matmul: the increments of |sum_{j<=p} b_j w_j|^2.
    # In-place steps below only where autograd keeps nothing of the overwritten tensor: every
    # fresh buffer costs page faults on CPUs.
    quad = (B * ((W @ W.transpose(-1, -2)).mul_(pair) @ B)).cumsum_(-2)
    if u0 is None:
        # quad - c^2 is the projected sum's squared norm: it cancels in low precision, hence the
        # clamp. |a|^2 is 1: the anchors are rownorm's outputs, whose |a|^2 is constant, so its
        # gradient is zero too (up to rounding, ~1e-16, as the value).
        # Q / sqrt rather than Q * rsqrt: rsqrt's backward takes a cube through pow, slow on CPUs.
        Qt = Q / (quad.addcmul_(cs, cs, value=-1).relu_() + 1).sqrt_()
        x = torch.addcmul(Qt, Qt, cs) @ A  # Qt U0 + (Qt c) A with U0 = A
    else:
        a_sq = (A * A).sum(-1)[:, None, :]
        # |X - c a|^2 (X = sum_j b_j w_j): quad - c^2 for a unit anchor, and exact off the sphere
        # too, so the gradient in a carried anchor is exact in every direction, not only along it.
        proj = (quad - cs * cs * (2 - a_sq)).clamp(min=0)
        n2 = (
            (u0 * u0).sum(-1)[:, None, :]
            + 2 * cs * (A * u0).sum(-1)[:, None, :]
            - 2 * (B * (W @ u0.transpose(-1, -2))).cumsum(-2)
            + proj
        )  # |u_p,i|^2, >= 1
        Qt = Q / n2.sqrt()
        x = Qt @ u0 + (Qt * cs) @ A
    return x.baddbmm_((Qt @ B.transpose(-1, -2)).tril_(), W, alpha=-1)  # - tril(Qt B^T) W


def chunked_forward(q, k, v, gamma, state, chunk_size, variant, cu_seqlens):
    """Backend ``"torch"``; arguments as validated by :func:`~.dispatch.lattice_attention`."""
    batch, length, heads, slots = q.shape
    dim = v.shape[-1]
    rows, chunk = state.offset.numel(), chunk_size
    # Blocks of `cells_per_chunk` <= min(C, T) cells: the work follows the tokens present, not C.
    flat_index, lengths, n_chunks, cells_per_chunk = grid_positions(state.offset, batch, length, cu_seqlens, chunk)
    width = rows * heads  # R, the (sequence, head) pairs
    total = n_chunks * width * cells_per_chunk
    cells = chunk_major_cells(flat_index, rows, heads, n_chunks * cells_per_chunk, cells_per_chunk)
    source, free = chunk_major_sources(cells, total)
    # Each input is laid out whole, by one gather: per-block gathers would each get a backward
    # node that scatters into a zero-filled gradient as large as the whole input.
    Q, K, V, G = (
        gather_cells(x.reshape((batch * length * heads,) + tuple(x.shape[3:])), source, free, 0, total).view(
            (n_chunks, width, cells_per_chunk) + tuple(x.shape[3:])
        )
        for x in (q, k, v, gamma)
    )  # Q, K: [chunks, R, L, M]; V: [chunks, R, L, D]; G: [chunks, R, L]
    G = G[..., None]
    # For dec and sim, b does not depend on the anchor (nor w for enc and sim); sim's whole step
    # B^T W = B^T V is anchor-free too, so it runs as one batched matmul for all chunks.
    B = G * K if variant == "dec" else -G * K if variant == "sim" else None
    # Per-chunk views by one unbind each: indexing [i] in the loop would give every chunk a
    # backward node that scatters into a zero-filled tensor as large as all chunks.
    if variant == "dec":
        per_chunk = zip(K.unbind(0), V.unbind(0), B.transpose(-1, -2).unbind(0))
    elif variant == "enc":
        per_chunk = zip(K.unbind(0), V.unbind(0), G.unbind(0))
    else:
        per_chunk = ((s,) for s in (B.transpose(-1, -2) @ V).unbind(0))

    # Rows that resume at a chunk boundary start from rownorm(U) (A = U = S); the others keep both.
    at_start = (state.offset == 0)[:, None, None, None]
    s = rownorm(state.memory)
    u = torch.where(at_start, s, state.memory).reshape(width, slots, dim)
    a = torch.where(at_start, s, state.anchor).reshape(width, slots, dim)
    u_first = u
    # Each sequence's state after its last chunk (later chunks only renormalise a finished row).
    last_chunk = (state.offset + lengths - 1).clamp(min=0) // chunk
    ragged = bool((last_chunk != n_chunks - 1).any())
    last = last_chunk.repeat_interleave(heads)[:, None, None]
    final_u, final_a = u, a

    # The loop runs only the chain of states: U' = U0 + c_L A - B^T W, where c_L,i = sum_p b_pi
    # (a_i . w_p) = a_i . (B^T W)_i. It keeps each chunk's anchor (and, where they depend on
    # it, its w, or its b and Z) for the reads, which run afterwards in batches of chunks.
    anchors, ws, bs, zs = [], [], [], []
    for i, inputs in enumerate(per_chunk):
        if i > 0:
            a = u = rownorm(u)
        if variant == "dec":
            Kc, Vc, Btc = inputs
            Wc = torch.baddbmm(Vc, Kc, a, beta=-1)  # A^T k - v per token
            ws.append(Wc)
            step = Btc @ Wc  # [R, M, D]
        elif variant == "enc":
            Kc, Vc, Gc = inputs
            Zc = Vc @ a.transpose(-1, -2)  # A v, the encoder's reconstruction
            Bc = Gc * (Zc - Kc)
            zs.append(Zc)
            bs.append(Bc)
            step = Bc.transpose(-1, -2) @ Vc
        else:
            (step,) = inputs
        anchors.append(a)
        u = torch.addcmul(u - step, torch.linalg.vecdot(step, a)[..., None], a)
        if ragged:
            ends_here = last == i
            final_u, final_a = torch.where(ends_here, u, final_u), torch.where(ends_here, a, final_a)
        else:
            final_u, final_a = u, a

    # Reads: the first chunk alone when some row resumes mid-chunk (it starts from the carried U,
    # not its anchor), then blocks of chunks that start at their anchors. Blocks are cut by one
    # split per tensor (one backward node each, not one per block).
    own_first = not bool(at_start.all())
    per = width * (cells_per_chunk * (slots + dim + cells_per_chunk) + slots * dim)
    block = max(1, READ_ELEMENTS // per) if q.device.type == "cpu" else n_chunks
    rest = n_chunks - int(own_first)
    sizes = [1] * own_first + [block] * (rest // block) + [rest % block] * (rest % block > 0)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    ones = torch.ones(cells_per_chunk, cells_per_chunk, dtype=q.dtype, device=q.device)
    pair = ones.tril(-1) + ones.tril()
    if variant == "dec":
        Bs, Ws = B.split(sizes), [torch.stack(ws[lo : lo + n]) for lo, n in zip(starts, sizes)]
    elif variant == "enc":
        Bs, Ws = [torch.stack(bs[lo : lo + n]) for lo, n in zip(starts, sizes)], V.split(sizes)
    else:
        Bs, Ws = B.split(sizes), V.split(sizes)
    outputs = []
    for j, (lo, n, Qb, Bb, Wb) in enumerate(zip(starts, sizes, Q.split(sizes), Bs, Ws)):
        Z = _flat(torch.stack(zs[lo : lo + n])) if variant == "enc" else None
        u0 = u_first if own_first and j == 0 else None
        outputs.append(_reads(_flat(Qb), _flat(Bb), _flat(Wb), _flat(torch.stack(anchors[lo : lo + n])), u0, pair, Z))
    o = from_chunk_major(torch.cat(outputs), cells, batch, length)

    # A sequence with no tokens hands its initial state back untouched.
    empty = (lengths == 0)[:, None, None, None]
    final = LatticeState(
        torch.where(empty, state.memory, final_u.view(state.memory.shape)),
        torch.where(empty, state.anchor, final_a.view(state.anchor.shape)),
        (state.offset + lengths) % chunk,
    )
    return o, final
