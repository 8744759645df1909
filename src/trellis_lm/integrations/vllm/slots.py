"""A memory layer over a server's state slots: the part of the vLLM plugin that needs no vLLM.

A server keeps each running sequence's layer state in a *slot*: row ``i`` of one tensor per
state field, allocated once for as many sequences as fit. A step of the server is a flat
batch of tokens (``x [N, D]``), the tokens of each sequence contiguous (``starts [R + 1]``,
decodes first in vLLM), each sequence's slot (``slots [R]``) and how many tokens it had
already taken in (``computed [R]``: 0 for a sequence's first call, whose slot holds whatever
an earlier sequence left there).

:class:`SlotLayout` says what a slot holds for a mixer kind, from the kind's own declaration
(``cache_layout``); :func:`run_on_slots` runs the layer's mixer on such a batch, continuing
each sequence from its slot and writing the state after its tokens back. It is the same
function (``MemoryMixer.mix``) that ``model.generate`` runs, so the two give the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ...cache_trellis import COLUMNS, ROWS, Dim, TensorSpec
from ...mixers.base import MemoryMixer
from ...mixers.tokens import ValidTokens

TAILS = ("q_tail", "k_tail")


@dataclass(frozen=True)
class SlotField:
    """One tensor of a slot: its name in the mixer's cache layout, shape (without the slot
    dim) and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class SlotLayout:
    """What one slot of a memory layer holds: every tensor of its kind's cache entry, at the
    largest size the configuration allows (buffers that grow with the tokens, KVM's window
    and state rows, are held at their bound), so a slot never grows.

    Short-conv tails are kept in the model's dtype, as the layer computes them; the op state
    in float32 (float64 for a float64 model), as the ops carry it; counters in int64. A slot is
    one run of bytes (a server allocates pages of bytes), each tensor at an offset aligned to
    ``ALIGN`` bytes: :meth:`views` reads a page as the typed tensors.

    Args:
        mixer_class: a :class:`~trellis_lm.mixers.MemoryMixer` subclass.
        config: the model's :class:`~trellis_lm.TrellisConfig`.
        dtype: the model's dtype.
    """

    ALIGN = 16

    def __init__(self, mixer_class: type[MemoryMixer], config: Any, dtype: torch.dtype) -> None:
        if not issubclass(mixer_class, MemoryMixer):
            raise TypeError(f"a slot layout is for memory mixers, got {mixer_class.__name__}")
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        state_names = set(mixer_class.state_layout(config))
        self.fields = tuple(
            SlotField(name, self._shape(name, spec), self._dtype(spec, state_dtype if name in state_names else dtype))
            for name, spec in mixer_class.cache_layout(config).items()
        )
        self.offsets, end = [], 0
        for f in self.fields:
            self.offsets.append(end)
            end += -(-_bytes(f) // self.ALIGN) * self.ALIGN
        self.nbytes = end  # of one slot
        self.state_names = tuple(mixer_class.state_class.field_names())
        self.mixer_class = mixer_class

    @staticmethod
    def _shape(name: str, spec: TensorSpec) -> tuple[int, ...]:
        if spec.dims[0] != ROWS:
            raise ValueError(f"cache tensor {name!r} has no row dim first: {spec.dims}")
        shape = []
        for dim in spec.dims[1:]:
            if isinstance(dim, Dim):
                if dim == COLUMNS or dim.most is None:
                    raise ValueError(f"cache tensor {name!r} grows with the context ({dim.name}): it cannot live in a slot")
                dim = dim.most
            shape.append(int(dim))
        return tuple(shape)

    @staticmethod
    def _dtype(spec: TensorSpec, float_dtype: torch.dtype) -> torch.dtype:
        return {"float": float_dtype, "int64": torch.int64, "bool": torch.bool}[spec.dtype]

    def views(self, pages: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The typed tensors ``[S, *shape]`` of every field over ``pages [S, P]`` (bytes, ``P >=
        nbytes``; a server's pages may be padded), in field order. Writing them writes the pages."""
        if pages.dim() != 2 or pages.element_size() != 1 or pages.shape[1] < self.nbytes:
            raise ValueError(f"pages must be [slots, >= {self.nbytes}] bytes, got {tuple(pages.shape)} {pages.dtype}")
        return tuple(
            pages[:, start:start + _bytes(f)].view(f.dtype).view(pages.shape[0], *f.shape)
            for f, start in zip(self.fields, self.offsets)
        )

    def allocate(self, slots: int, device: Optional[torch.device] = None) -> tuple[torch.Tensor, ...]:
        """The field tensors of ``slots`` zeroed slots (what a server allocates, for tests)."""
        return self.views(torch.zeros(slots, self.nbytes, dtype=torch.uint8, device=device))

    def read(self, tensors: Sequence[torch.Tensor], slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fields of ``slots [R]`` from the field tensors, by name (copies)."""
        return {f.name: t.index_select(0, slots) for f, t in zip(self.fields, tensors)}

    def write(self, tensors: Sequence[torch.Tensor], slots: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Store ``values`` (by name, ``[R, ...]`` no larger than a slot's fields, the rest zero)
        in ``slots [R]``."""
        for f, t in zip(self.fields, tensors):
            value = values[f.name].to(f.dtype)
            if tuple(value.shape[1:]) != f.shape:
                full = torch.zeros((value.shape[0], *f.shape), dtype=f.dtype, device=value.device)
                full[tuple(slice(0, n) for n in value.shape)] = value
                value = full
            t.index_copy_(0, slots, value)


def _bytes(field: SlotField) -> int:
    return torch.Size(field.shape).numel() * torch.empty((), dtype=field.dtype).element_size()


def run_on_slots(
    mixer: MemoryMixer,
    layout: SlotLayout,
    tensors: Sequence[torch.Tensor],
    x: torch.Tensor,
    starts: torch.Tensor,
    computed: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """The mixer on a server's flat batch, continuing each sequence from its slot.

    Sequences with one token (decodes) run as one batch of single tokens (the op's decode
    step); the others (prefills, whole prompts or chunks of them) as one right-padded batch,
    whose real tokens the op takes in one varlen call. A sequence with ``computed == 0``
    starts from the learned initial state whatever its slot holds.

    Args:
        mixer: the layer's memory mixer.
        layout: its slot layout; ``tensors`` the slot tensors ``[slots, *shape]`` (updated).
        x: ``[N, D]`` the mixer's input, sequences one after another (tokens past
            ``starts[-1]``, a server's padding, get zeros).
        starts: ``[R + 1]`` where each sequence's tokens start in ``x``.
        computed: ``[R]`` tokens each sequence had taken in before these.
        slots: ``[R]`` each sequence's slot.

    Returns:
        ``[N, D]`` the mixer's output.
    """
    out = torch.zeros_like(x)
    starts, computed, slots = (t.to(torch.long) for t in (starts, computed, slots))
    lengths = starts[1:] - starts[:-1]
    # One read-back for every check: a sequence of no or negative length would be skipped (its
    # tokens read by another), a negative count would start it from another state.
    if bool((lengths < 1).any() | (computed < 0).any() | (starts[0] < 0) | (starts[-1] > x.shape[0])):
        raise ValueError(
            f"starts must rise strictly from >= 0 to <= {x.shape[0]} tokens (each sequence at least one token) and "
            f"computed must be >= 0; got starts {starts.tolist()}, computed {computed.tolist()}"
        )
    single = lengths == 1
    for rows in (single.nonzero()[:, 0], (~single & (lengths > 0)).nonzero()[:, 0]):
        if rows.numel():
            _run_rows(mixer, layout, tensors, x, out, starts[rows], lengths[rows], computed[rows], slots[rows])
    return out


def _run_rows(mixer: MemoryMixer, layout: SlotLayout, tensors: Sequence[torch.Tensor], x: torch.Tensor,
              out: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, computed: torch.Tensor,
              slots: torch.Tensor) -> None:
    """Run ``R`` sequences (``starts``, ``lengths``, ``computed``, ``slots``: ``[R]``) as one
    right-padded batch ``[R, max length, D]``; write outputs into ``out`` and states back."""
    longest = int(lengths.max())
    offsets = torch.arange(longest, device=x.device)
    real = offsets < lengths[:, None]  # [R, L]
    index = (starts[:, None] + offsets).clamp(max=x.shape[0] - 1)
    rows = x[index]  # [R, L, D]; the padding positions hold other tokens, which `valid` skips
    padded = not bool(real.all())
    valid = ValidTokens.from_mask(real) if padded else None

    held = layout.read(tensors, slots)
    fresh = computed == 0
    state = layout.mixer_class.state_class(**{name: held[name] for name in layout.state_names})
    tails = [held.get(name) for name in TAILS]  # None for a kind without short convs (none in its layout)
    if bool(fresh.any()):
        state = mixer.mixed_state(state, ~fresh)
        tails = [None if t is None else t.masked_fill(fresh.view(-1, 1, 1), 0) for t in tails]

    y, q_tail, k_tail, new_state = mixer.mix(rows, valid, *tails, state, keep_state=True)
    q_tail, k_tail, new_state = mixer.carried_after(*tails, state, q_tail, k_tail, new_state, len(slots))
    if padded:
        out[index[real]] = y[real]
    else:  # every row full (decodes, equal chunks): no mask to gather by
        out[index] = y
    after = dict(new_state.tensors())
    if q_tail is not None:
        after.update(q_tail=q_tail, k_tail=k_tail)
    layout.write(tensors, slots, {f.name: after[f.name] for f in layout.fields})
