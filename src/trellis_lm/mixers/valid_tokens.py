"""Which tokens of a batch are real, and which packed document each belongs to."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from .norms_convs import UNBOUNDED_REACH


@dataclass
class ValidTokens:
    """The real tokens of a batch, the documents they form, and how to gather them row by row.

    Padding (zeros of the attention mask) is skipped. A row may also hold several documents
    packed one after the other (``position_ids`` restarting at 0, as transformers'
    ``DataCollatorWithFlattening`` makes them): each later document starts from the initial
    memories, and its short conv sees nothing before it. A row's first document continues
    whatever the row held before (the cache, or the initial memories).

    The op runs once on ``x[mask]``: N sequences (documents; every row has at least one,
    possibly empty) packed in row-major order.

    Attributes:
        mask: ``[B, T]`` bool, True at real tokens.
        lengths: ``[B]`` real tokens per row.
        cu_seqlens: ``[N + 1]`` start of each sequence in ``x[mask]`` (the op's packed layout).
        order: ``[B, T]`` a per-row permutation that puts the row's real tokens first, in order.
        seq_rows: ``[N]`` the row of each sequence.
        continues_row: ``[N]`` bool, True for each row's first sequence.
        last_seqs: ``[B]`` index of each row's last sequence (whose final state the row keeps).
        reach: ``[B, T]`` in the compacted order of :meth:`compact`, how many earlier inputs each
            token's short conv may see (its index in its document; unbounded in a row's first
            document), or ``None`` when no row holds a second document.
        doc_starts: ``[B, T]`` bool in the input order, True at a real token that starts a
            document after its row's first, or ``None`` when no row holds a second document.
    """

    mask: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    order: torch.Tensor
    seq_rows: torch.Tensor
    continues_row: torch.Tensor
    last_seqs: torch.Tensor
    reach: Optional[torch.Tensor] = None
    doc_starts: Optional[torch.Tensor] = None

    @classmethod
    def from_mask(cls, mask: torch.Tensor, doc_starts: Optional[torch.Tensor] = None) -> "ValidTokens":
        """From ``mask [B, T]`` and, optionally, ``doc_starts [B, T]`` (True at a real token that
        starts a new document; never at a row's first real token)."""
        batch, length = mask.shape
        lengths = mask.sum(dim=1)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        row_offsets = F.pad(lengths.cumsum(0), (1, 0))
        rows = torch.arange(batch, device=mask.device)
        if doc_starts is None:
            return cls(mask, lengths, row_offsets, order, rows, torch.ones_like(mask[:, 0]), rows)
        starts = doc_starts.gather(1, order)  # real tokens come first after compaction
        seq_flags = starts.clone()
        seq_flags[:, 0] = True  # every row opens a sequence, an empty one for an all-padding row
        seq_rows, seq_cols = seq_flags.nonzero(as_tuple=True)  # row-major: sequences in packed order
        cu_seqlens = torch.cat([row_offsets[seq_rows] + seq_cols, row_offsets[-1:]])
        last_seqs = seq_flags.sum(dim=1).cumsum(0) - 1
        positions = torch.arange(length, device=mask.device).expand(batch, -1)
        doc_start = torch.where(starts, positions, 0).cummax(dim=1).values
        in_first_doc = starts.cumsum(dim=1) == 0
        reach = torch.where(in_first_doc, torch.full_like(positions, UNBOUNDED_REACH), positions - doc_start)
        return cls(mask, lengths, cu_seqlens, order, seq_rows, seq_cols == 0, last_seqs, reach, doc_starts)

    @classmethod
    def from_attention_mask(
        cls, attention_mask: Any, batch: int, length: int, past: int = 0, starts: Optional[torch.Tensor] = None
    ) -> Optional["ValidTokens"]:
        """Read the current ``length`` tokens' validity and documents; ``None`` when all tokens
        are real and form one document per row.

        ``attention_mask`` as :func:`real_tokens` reads it; ``starts`` (``[B or 1, T]`` bool, from
        :func:`document_starts`) marks tokens that open a packed document; it counts only at a
        real token that is not its row's first real token.
        """
        return cls.from_real(real_tokens(attention_mask, batch, length, past), starts, batch, length)

    @classmethod
    def from_real(cls, real: Optional[torch.Tensor], starts: Optional[torch.Tensor], batch: Optional[int] = None,
                  length: Optional[int] = None) -> Optional["ValidTokens"]:
        """From the real tokens ``real [B, T]`` (``None``: all real, then ``starts`` or ``batch``
        and ``length`` give the shape) and the document ``starts`` (see :meth:`from_attention_mask`)."""
        if real is None and starts is None:
            return None
        if real is None:
            real = torch.ones(batch or starts.shape[0], length or starts.shape[1], dtype=torch.bool, device=starts.device)
        doc_starts = None
        if starts is not None:
            doc_starts = real & starts.to(real.device) & (real.cumsum(dim=1) > 1)
            doc_starts = doc_starts if bool(doc_starts.any()) else None
        if doc_starts is None and bool(real.all()):
            return None
        return cls.from_mask(real, doc_starts)

    @property
    def has_documents(self) -> bool:
        """True when some row holds more than one document."""
        return self.reach is not None

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "ValidTokens":
        """A copy on ``device`` (accelerate calls this when blocks sit on several devices)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return ValidTokens(**{
            name: None if t is None else t.to(device, non_blocking=non_blocking) for name, t in moved.items()
        })

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> the same with each row's real tokens moved to its front."""
        return x.gather(1, self._index_like(x))

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`compact`."""
        return torch.empty_like(x).scatter_(1, self._index_like(x), x)

    def _index_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.order.view(self.order.shape + (1,) * (x.dim() - 2)).expand_as(x)


@dataclass(frozen=True)
class PackedSequences:
    """R sequences one after another along a single row of T tokens, each continuing an entry of
    its own (a server's prompt chunks, each after its slot's state): unlike :class:`ValidTokens`'
    packed documents, every sequence, not only the first, continues what it carried.

    Attributes:
        cu_seqlens: ``[R + 1]`` where each sequence starts along the row (the op's packed layout).
        seq_id: ``[T]`` each token's sequence.
        pos: ``[T]`` each token's index in its sequence.
    """

    cu_seqlens: torch.Tensor
    seq_id: torch.Tensor
    pos: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> "PackedSequences":
        """Sequences of ``lengths [R]`` (each at least 1) tokens, in that order."""
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0))
        seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        pos = torch.arange(seq_id.numel(), device=lengths.device) - cu_seqlens[seq_id]
        return cls(cu_seqlens, seq_id, pos)

    def positions(self, past: torch.Tensor) -> torch.Tensor:
        """``[1, T]`` each token's position in its sequence's stream, after ``past [R]`` tokens."""
        return (past[self.seq_id] + self.pos)[None]

    def conv(self, x: torch.Tensor, tails: Optional[torch.Tensor], weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~.norms_convs.causal_conv` of every sequence of ``x [1, T, C]`` after its own
        ``tails [R, width - 1, C]`` (zeros when ``None``): ``(y [1, T, C], tails after [R, width - 1, C])``.

        Each tap's inputs are the row shifted by its reach, where a sequence's first tokens read
        their own tail instead: a copy of the row per tap, and a few rows taken from the tails
        (the sequences' first tokens), not the whole row scattered into a longer one and back."""
        rows, channels, carried = self.cu_seqlens.numel() - 1, x.shape[-1], weight.shape[-1] - 1
        tails = x.new_zeros(rows, carried, channels) if tails is None else tails.to(x.dtype)
        taps = weight[:, 0].to(x.dtype)  # [C, width]; tap j weighs the input `carried - j` tokens back
        tokens = x[0]

        def inputs(back: int) -> torch.Tensor:  # each token's input `back` tokens before it
            if back == 0:
                return tokens
            kept = max(tokens.shape[0] - back, 0)
            shifted = torch.cat([tokens.new_zeros(tokens.shape[0] - kept, channels), tokens[:kept]])
            first = (self.pos < back).nonzero()[:, 0]  # tokens whose input lies in their sequence's tail
            shifted[first] = tails[self.seq_id[first], carried - back + self.pos[first]]
            return shifted

        # The taps in causal_conv's order (furthest input first): the same sums, rounded alike.
        y = inputs(carried) * taps[:, 0]
        for tap in range(1, carried + 1):
            y.addcmul_(inputs(carried - tap), taps[:, tap])
        # A sequence's new tail: the last `carried` inputs of its tail followed by its tokens.
        back_from_end = torch.arange(carried, 0, -1, device=x.device)  # [carried]
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        reach = lengths[:, None] - back_from_end  # [R, carried], index in the sequence (< 0: in the tail)
        from_tokens = tokens[(self.cu_seqlens[:-1, None] + reach).clamp(min=0)]
        from_tails = tails.gather(1, (reach + carried).clamp(0, carried - 1)[..., None].expand(-1, -1, channels))
        return y[None], torch.where((reach >= 0)[..., None], from_tokens, from_tails)


def real_tokens(attention_mask: Any, batch: int, length: int, past: int = 0) -> Optional[torch.Tensor]:
    """``[B, T]`` bool, True at the current ``length`` tokens that are real, or ``None`` when
    no mask was given.

    ``attention_mask`` is ``None``, a ``[B, past + T]`` tensor of 1 (real) and 0 (padding) (its
    last T columns are the current tokens; ``past`` is what the cache has taken in, and another
    width is a ``ValueError``), or a dict holding such a tensor (``generate`` passes masks as
    ``{"<layer type>": mask}`` for some caches).
    """
    if isinstance(attention_mask, dict):
        attention_mask = next((m for m in attention_mask.values() if isinstance(m, torch.Tensor)), None)
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] != past + length:
        raise ValueError(
            f"attention_mask must be a 2-D padding mask [B = {batch}, past + T = {past} + {length}] with 0 at "
            f"padding (past: the tokens the cache has taken in), got shape {tuple(attention_mask.shape)}"
        )
    current = attention_mask[:, past:]
    if current.dtype != torch.bool and bool(((current != 0) & (current != 1)).any()):
        # -1, 0.5 or NaN would silently count as real tokens.
        raise ValueError(
            "attention_mask must hold 1 at real tokens and 0 at padding, got values "
            f"{sorted(set(current.flatten().tolist()))[:8]}"
        )
    return current.bool()


def _previous_real(real: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` the index of the last real token before each token in its row (-1: none)."""
    index = torch.arange(real.shape[1], device=real.device).expand_as(real)
    last = torch.where(real, index, -1).cummax(dim=1).values
    return F.pad(last[:, :-1], (1, 0), value=-1)


def document_starts(
    batch: int,
    length: int,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None,
    seq_idx: Optional[torch.Tensor] = None,
    *,
    real: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """``[B, T]`` bool, True at the real tokens that start a packed document among the
    current ``length`` tokens, from whichever of transformers' packing conventions the caller
    gave; ``None`` when none was given. Several given must agree, else a ``ValueError``: a
    disagreement means the documents are not what one of them says.

    Boundaries are read at the real tokens (``real [B, T]``, ``None``: all are real), so a
    document that starts with padding starts at its first real token:

    * ``position_ids`` ``[B or 1, T]`` or ``[B or 1, past + T]``: a real token whose position is
      not above the previous real token's starts a document (0 after anything does; padding's
      positions are not read, so left padding counted in the positions changes nothing);
    * ``cu_seq_lens_q`` / ``cu_seq_lens_k`` ``[N + 1]`` integer (flash-attention packing, batch
      1): document offsets rising from 0 to T, and ``max_length_q`` / ``max_length_k`` the
      longest one;
    * ``seq_idx`` ``[B or 1, T]`` integer, non-decreasing along each row: each token's document
      index; a change starts a document.
    """
    given = [t for t in (position_ids, cu_seq_lens_q, cu_seq_lens_k, seq_idx) if isinstance(t, torch.Tensor)]
    if not given and max_length_q is None and max_length_k is None:
        return None
    if real is None:
        real = torch.ones(batch, length, dtype=torch.bool, device=given[0].device if given else None)
    previous = _previous_real(real)
    # A row's first real token continues the row (the cache, or the initial memories): only
    # real tokens after another can start a document.
    can_start = real & (previous >= 0)

    def at_real_tokens(flags: torch.Tensor) -> torch.Tensor:
        """Start flags at any token -> at the first real token at or after each flag."""
        count = flags.expand(batch, -1).to(real.device).long().cumsum(dim=1)
        return can_start & (count > count.gather(1, previous.clamp(min=0)))

    candidates: dict[str, torch.Tensor] = {}
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] < length:
            raise ValueError(
                f"position_ids must be 2-D [B = {batch} or 1, T = {length} or past + T], restarting at 0 where a "
                f"packed document starts, got shape {tuple(position_ids.shape)}"
            )
        positions = position_ids[:, -length:].expand(batch, -1).to(real.device)
        candidates["position_ids"] = can_start & (positions <= positions.gather(1, previous.clamp(min=0)))
    for name, offsets, longest in (("cu_seq_lens_q", cu_seq_lens_q, max_length_q), ("cu_seq_lens_k", cu_seq_lens_k, max_length_k)):
        if offsets is None:
            if longest is not None:
                raise ValueError(f"max_length_{name[-1]} is only read with {name} (flash-attention packing)")
            continue
        if isinstance(offsets, torch.Tensor) and (offsets.is_floating_point() or offsets.dtype == torch.bool):
            raise ValueError(f"{name} must be a 1-D integer tensor of document offsets, got dtype {offsets.dtype}")
        bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 else None
        if batch != 1 or not bounds or bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"{name} must be a 1-D tensor of document offsets rising from 0 to T = {length} with a batch of 1, "
                f"got {bounds if bounds is not None else offsets!r} with a batch of {batch}"
            )
        if longest is not None and int(longest) != max(b - a for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"max_length_{name[-1]} = {longest} is not the longest document of {name} ({bounds})")
        flags = torch.zeros(1, length, dtype=torch.bool, device=offsets.device)
        flags[0, [b for b in bounds[:-1] if b < length]] = True
        candidates[name] = at_real_tokens(flags)
    if seq_idx is not None:
        if seq_idx.dim() != 2 or seq_idx.shape[0] not in (1, batch) or seq_idx.shape[1] != length:
            raise ValueError(f"seq_idx must be 2-D [B = {batch} or 1, T = {length}], got shape {tuple(seq_idx.shape)}")
        steps = seq_idx[:, 1:] - seq_idx[:, :-1] if not (seq_idx.is_floating_point() or seq_idx.dtype == torch.bool) else None
        if steps is None or bool((steps < 0).any()):
            raise ValueError(
                "seq_idx must hold integer document indices, non-decreasing along each row (one document after "
                f"another), got {seq_idx.tolist() if seq_idx.numel() <= 32 else seq_idx.dtype}"
            )
        candidates["seq_idx"] = at_real_tokens(F.pad(steps != 0, (1, 0), value=True))
    if not candidates:
        return None
    (first, starts), *others = candidates.items()
    for name, flags in others:
        if not torch.equal(starts, flags):
            raise ValueError(f"{name} and {first} describe different packed documents")
    return starts


def token_positions(valid: Union[ValidTokens, PackedSequences, None], past: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, T]`` the position of every current token among its document's real tokens.

    A row's first document continues after the ``past [B]`` real tokens it has already seen;
    later documents count from 0. Padding tokens get the position of the next real token
    (they are never read). :class:`PackedSequences` (``B = 1``) each continue their own ``past``.
    """
    if valid is None:
        return past[:, None] + torch.arange(length, device=past.device)
    if isinstance(valid, PackedSequences):
        return valid.positions(past)
    rank = valid.mask.long().cumsum(dim=1) - valid.mask.long()  # real tokens before each token
    if valid.doc_starts is None:
        return past[:, None] + rank
    start_rank = torch.where(valid.doc_starts, rank, -1).cummax(dim=1).values
    return torch.where(start_rank >= 0, rank - start_rank, past[:, None] + rank)


def last_document(valid: Optional[ValidTokens], length: int, device: torch.device) -> torch.Tensor:
    """``[B, T]`` bool, True at the real tokens of each row's last document: what a later call
    on the same rows continues."""
    if valid is None:
        return torch.ones(1, length, dtype=torch.bool, device=device)
    if valid.doc_starts is None:
        return valid.mask
    later_starts = valid.doc_starts.flip(1).cumsum(dim=1).flip(1) - valid.doc_starts.long()
    return valid.mask & (later_starts == 0)
