"""Where the tokens of several sequences go when an op processes them chunk by chunk.

Three layouts, shared by the ops' backends:

* the *grid* of the PyTorch chunk forms: every sequence on its own row, its token j at
  stream position ``offset + j``, chunks starting at multiples of C, each chunk a block of
  cells as wide as the fullest (row, chunk) pair, free cells filled with neutral inputs; rows
  that resume mid-chunk or have different lengths then share chunk boundaries;
* the *stream grid* (:func:`stream_grid_positions`): the same with every token at its stream
  position, for backends that lay carried tokens out before the new ones (KVM's window);
  :func:`to_chunks` lays a grid out ``[N, H, chunks, L]``; :func:`chunk_major_cells` and
  :func:`gather_cells` ``[chunks, N * H, L]``, for backends that loop over chunks;
* the *chunk plan* of the Triton kernels: a table of every (sequence, chunk) pair, so a grid of
  programs can take one chunk each without padding sequences to a common length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def _sequence_tokens(batch: int, length: int, cu_seqlens: Optional[torch.Tensor], device: torch.device):
    """``(lengths [N], seq_id [B * T], pos [B * T])``: each sequence's length, and every input
    token's sequence and index in it (tokens row-major over ``[B, T]``, or packed along T)."""
    if cu_seqlens is None:
        lengths = torch.full((batch,), length, dtype=torch.long, device=device)
        seq_id = torch.arange(batch, device=device).repeat_interleave(length)
        pos = torch.arange(length, device=device).repeat(batch)
    else:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
        pos = torch.arange(length, device=device) - cu_seqlens[seq_id]
    return lengths, seq_id, pos


def grid_positions(offset: torch.Tensor, batch: int, length: int, cu_seqlens: Optional[torch.Tensor], chunk_size: int):
    """Where every input token goes on the ``[N, chunks, L]`` grid, and each sequence's length.

    Sequence n's token j sits at position ``offset_n + j`` of its stream, in chunk
    ``(offset_n + j) // C``; every row shares these chunk boundaries. Inside its block of ``L``
    cells a chunk's tokens are packed from cell 0 (a resumed first chunk starts at its first
    real token), and the free cells after them are fillers. ``L`` is the most real tokens any
    row has in one chunk, so ``L <= min(C, T)``: the work and memory follow the tokens present,
    not ``C`` (a 5-token call at C = 10**9 uses 5-cell blocks).

    Args:
        offset: ``[N]`` each sequence's position within its first chunk.
        batch, length: the inputs' B and T (tokens in row-major order over ``[B, T]``, or
            packed along T with ``cu_seqlens`` and B = 1).
    Returns:
        ``(flat_index [B * T], lengths [N], chunks, L)``: token i goes to cell ``flat_index[i]``
        of the flattened ``[N * chunks * L]`` grid; ``chunks >= 1``.
    """
    lengths, seq_id, pos = _sequence_tokens(batch, length, cu_seqlens, offset.device)
    # Tokens in a row's first chunk, then in its fullest later chunk (at most C).
    first = torch.minimum(chunk_size - offset, lengths)
    later = (lengths - first).clamp(max=chunk_size)
    span, width = (int(x) for x in torch.stack([(offset + lengths).max(), torch.maximum(first, later).max()]).tolist())
    chunks, width = max(-(-span // chunk_size), 1), max(width, 1)
    stream = offset[seq_id] + pos
    chunk = torch.div(stream, chunk_size, rounding_mode="floor")
    cell = torch.where(chunk == 0, pos, stream - chunk * chunk_size)
    return (seq_id * chunks + chunk) * width + cell, lengths, chunks, width


def stream_grid_positions(
    offset: torch.Tensor, batch: int, length: int, cu_seqlens: Optional[torch.Tensor], chunk_size: int,
    min_cells: int = 0,
):
    """Where every input token goes on the *stream* grid ``[N, G]``, and each sequence's length.

    Unlike :func:`grid_positions`, a token sits at its stream position (``offset + j``), so a
    backend may place carried tokens in the cells before ``offset``; ``G`` is a multiple of C,
    so its cost follows C, and callers must bound C themselves.

    Args:
        offset: ``[N]`` each sequence's first grid cell: its position within its first chunk,
            or further on when the grid also holds carried tokens before the new ones.
        batch, length: the inputs' B and T (tokens in row-major order over ``[B, T]``, or
            packed along T with ``cu_seqlens`` and B = 1).
        min_cells: the grid holds at least this many cells per sequence.
    Returns:
        ``(flat_index [B * T], lengths [N], G)``: token i goes to cell ``flat_index[i]`` of the
        flattened ``[N * G]`` grid; ``G`` is a multiple of C.
    """
    lengths, seq_id, pos = _sequence_tokens(batch, length, cu_seqlens, offset.device)
    span = max(int((offset + lengths).max()), min_cells)
    grid = max(-(-span // chunk_size), 1) * chunk_size
    return seq_id * grid + offset[seq_id] + pos, lengths, grid


def to_chunks(x: torch.Tensor, flat_index: torch.Tensor, rows: int, chunks: int, width: int, fill: float = 0.0):
    """``[tokens, H, *rest]`` -> ``[N, H, chunks, L, *rest]``, free cells holding ``fill``."""
    cells = x.new_full((rows * chunks * width,) + tuple(x.shape[1:]), fill).index_copy(0, flat_index, x)
    cells = cells.view((rows, chunks, width) + tuple(x.shape[1:]))
    return cells.movedim(3, 1)


def from_chunks(o: torch.Tensor, flat_index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Inverse of :func:`to_chunks` for outputs: ``[N, H, chunks, L, D]`` -> ``[B, T, H, D]``."""
    rows, heads = o.shape[:2]
    o = o.movedim(1, 3).reshape((-1, heads, o.shape[-1]))[flat_index]
    return o.reshape(batch, length, heads, -1)


@dataclass
class ChunkPlan:
    """Sequences, their chunks, and a table of every chunk slot (all int64 tensors on the device).

    Sequence ``n`` covers flat tokens ``seq_start[n] .. seq_start[n] + seq_len[n]`` of the
    ``[B * T]`` token axis, resumes at ``offset[n]`` within a chunk, and has
    ``n_chunks[n]`` chunks stored from ``chunk_base[n]``; its chunk ``i`` covers its tokens
    ``max(i C - offset, 0) .. min((i + 1) C - offset, len)``. ``chunk_seq[j]`` /
    ``chunk_idx[j]`` name the sequence and chunk of slot ``j < slots`` (-1 for a spare slot):
    ``slots`` is a bound known from the shapes alone, so nothing waits on the device.
    """

    seq_start: torch.Tensor
    seq_len: torch.Tensor
    offset: torch.Tensor
    n_chunks: torch.Tensor
    chunk_base: torch.Tensor
    chunk_seq: torch.Tensor
    chunk_idx: torch.Tensor
    slots: int


def chunk_slots(rows: int, batch: int, length: int, chunk_size: int, packed: bool) -> int:
    """An upper bound on the number of chunks over all sequences, from the shapes alone."""
    if not packed:  # every row has T tokens and starts at some offset < C
        return batch * ((chunk_size - 2 + length) // chunk_size + 1)
    # A sequence of n >= 1 tokens has at most (n - 1) // C + 2 chunks.
    return length // chunk_size + 2 * rows


def make_plan(offset: torch.Tensor, batch: int, length: int, chunk_size: int, cu_seqlens: Optional[torch.Tensor]) -> ChunkPlan:
    """The :class:`ChunkPlan` of ``N = offset.numel()`` sequences laid out as the op's inputs."""
    device = offset.device
    rows = offset.numel()
    if cu_seqlens is None:
        seq_start = torch.arange(rows, device=device) * length
        seq_len = torch.full((rows,), length, dtype=torch.long, device=device)
    else:
        seq_start = cu_seqlens[:-1].to(device=device, dtype=torch.long)
        seq_len = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    offset = offset.to(torch.long)
    n_chunks = torch.where(seq_len > 0, torch.div(offset + seq_len - 1, chunk_size, rounding_mode="floor") + 1, 0)
    ends = n_chunks.cumsum(0)
    chunk_base = ends - n_chunks
    slots = chunk_slots(rows, batch, length, chunk_size, cu_seqlens is not None)
    j = torch.arange(slots, device=device)
    seq = torch.searchsorted(ends, j, right=True)
    valid = seq < rows
    seq_c = seq.clamp(max=rows - 1)
    chunk_seq = torch.where(valid, seq_c, -1)
    chunk_idx = torch.where(valid, j - chunk_base[seq_c], 0)
    return ChunkPlan(seq_start, seq_len, offset, n_chunks, chunk_base, chunk_seq, chunk_idx, slots)


def per_sequence(run, inputs: tuple, state, cu_seqlens: Optional[torch.Tensor]):
    """Run ``run(*inputs, state)`` once per packed sequence (the reference loops' varlen path).

    ``inputs`` are ``[1, T, ...]`` tensors packed along T; ``state`` an :class:`~.state.OpState`
    with one row per sequence. Returns the outputs concatenated along T and the final states.
    """
    if cu_seqlens is None:
        return run(*inputs, state)
    outputs, finals = [], []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, final = run(*(x[:, start:end] for x in inputs), state.map(lambda t: t[n : n + 1]))
        outputs.append(o)
        finals.append(final)
    return torch.cat(outputs, dim=1), type(state).cat(finals)


def chunk_major_cells(flat_index: torch.Tensor, rows: int, heads: int, grid: int, chunk_size: int) -> torch.Tensor:
    """Where every (token, head) goes in the chunk-major layout ``[chunks, N, H, C]``.

    The layout of backends that loop over chunks: one chunk of every sequence and head is one
    contiguous block, so the loop's slices and the batch of all later chunks need no copies.

    Args:
        flat_index: ``[tokens]`` cells of the ``[N * G]`` grid, from :func:`grid_positions`.
    Returns:
        ``[tokens * H]`` cells of the flattened ``[chunks * N * H * C]`` layout, token-major
        (the order of ``x.reshape(tokens * H, ...)`` for ``x [tokens, H, ...]``).
    """
    row, pos = flat_index // grid, flat_index % grid
    first = ((pos // chunk_size * rows + row) * heads) * chunk_size + pos % chunk_size  # head 0
    head_step = torch.arange(heads, device=flat_index.device) * chunk_size
    return (first[:, None] + head_step).reshape(-1)


def chunk_major_sources(cells: torch.Tensor, total: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The inverse of :func:`chunk_major_cells`: for each of the ``total`` cells of the flattened
    chunk-major layout, the (token, head) row it holds, and a ``[total]`` bool mask of the free
    cells (``None`` when every cell holds a token). Free cells point at row 0 (masked later)."""
    filled = cells.numel()
    source = torch.zeros(total, dtype=torch.long, device=cells.device)
    source.index_copy_(0, cells, torch.arange(filled, device=cells.device))
    if filled == total:
        return source, None
    return source, torch.ones(total, dtype=torch.bool, device=cells.device).index_fill_(0, cells, False)


def gather_cells(
    flat: torch.Tensor, source: torch.Tensor, free: Optional[torch.Tensor], start: int, end: int
) -> torch.Tensor:
    """Cells ``start .. end`` of the flattened chunk-major layout, read from ``flat [tokens * H, *rest]``
    (free cells zero). A gather rather than a zero fill and a scatter: on CPUs index_select runs
    several times faster than index_copy, and a backend can take the layout one block at a time."""
    out = flat.index_select(0, source[start:end])
    if free is not None:
        out.masked_fill_(free[start:end].view((-1,) + (1,) * (out.dim() - 1)), 0)
    return out


def from_chunk_major(o: torch.Tensor, cells: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Inverse of :func:`gather_cells` for outputs: ``[chunks, N * H, C, D]`` -> ``[B, T, H, D]``."""
    return o.reshape(-1, o.shape[-1]).index_select(0, cells).view(batch, length, -1, o.shape[-1])
