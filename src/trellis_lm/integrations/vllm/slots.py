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

Speculative decoding, as vLLM lays it out for its own recurrent layers: a sequence verifying
drafts has a row of slots (``slots [R, W]``, W = 1 + the drafts), its state is read from the
slot after the tokens the server accepted last time (``accepted [R]``: column ``accepted - 1``),
and the state after each token of its row goes to the slot of that token's column, which the
layer runs one at a time (the op's decode step, the function ``generate`` decodes with). The
next step continues from the slot of the last token the server kept, so a rejected draft never
enters a state and nothing is computed twice; and a prefix cache finds the state at a block
boundary in the slot of the token that ends there. A slot also counts the tokens its state
has taken in, which a continuing sequence's ``computed`` must equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch

from ...cache_entries import MemoryEntry
from ...cache_layout import COLUMNS, ROWS, Dim, TensorSpec
from ...configuration_trellis import TrellisConfig
from ...layer_kinds import MIXERS
from ...mixers.base import MemoryMixer
from ...mixers.valid_tokens import PackedSequences
from ...ops.trellis.chunked import EXACT_LAYOUT_CHUNK
from .compiled_rows import advanced_compiled


def memory_only(layer_kinds: Sequence[str]) -> bool:
    """Whether every layer of these kinds keeps a memory state (no attention layer: no KV blocks)."""
    return all(issubclass(MIXERS[kind], MemoryMixer) for kind in layer_kinds)


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
    and state rows, are held at their bound), so a slot never grows; then ``tokens``, the
    tokens that entry has taken in.

    State fields the configuration's op never reads (``unread_state`` of the kind: a Trellis
    layer's anchors under ``"exact"`` writes) are not kept; a read hands in the field the kind
    names in their place. Short-conv tails are kept in the model's dtype, as the layer computes
    them; the op state in float32 (float64 for a float64 model), as the ops carry it; counters in
    int64. A slot is one run of bytes (a server allocates pages of bytes), each tensor at an
    offset aligned to ``ALIGN`` bytes: :meth:`views` reads a page as the typed tensors.

    Args:
        mixer_class: a :class:`~trellis_lm.mixers.MemoryMixer` subclass.
        config: the model's :class:`~trellis_lm.TrellisConfig`.
        dtype: the model's dtype.
    """

    ALIGN = 16

    def __init__(self, mixer_class: type[MemoryMixer], config: TrellisConfig, dtype: torch.dtype) -> None:
        if not issubclass(mixer_class, MemoryMixer):
            raise TypeError(f"a slot layout is for memory mixers, got {mixer_class.__name__}")
        state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        state_names = set(mixer_class.state_layout(config))
        self.stand_ins = mixer_class.unread_state(config)
        entry = tuple(
            SlotField(name, self._shape(name, spec), self._dtype(spec, state_dtype if name in state_names else dtype))
            for name, spec in mixer_class.cache_layout(config).items() if name not in self.stand_ins
        )
        self.entry_names = tuple(f.name for f in entry)
        self.fields = (*entry, SlotField("tokens", (), torch.int64))
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

    def read(self, tensors: Sequence[torch.Tensor], slots: Union[torch.Tensor, int], names: Sequence[str],
             rows: int = 0) -> dict[str, torch.Tensor]:
        """The fields ``names`` of ``slots [R]`` from the field tensors, by name: copies; or, for
        ``slots`` an int (a run of ``rows`` slots from there, see :func:`slot_run`), views of them."""
        return {f.name: t[slots: slots + rows] if isinstance(slots, int) else t.index_select(0, slots)
                for f, t in zip(self.fields, tensors) if f.name in names}

    def write(self, tensors: Sequence[torch.Tensor], slots: Union[torch.Tensor, int],
              values: dict[str, torch.Tensor]) -> None:
        """Store ``values`` (by name, ``[R, ...]`` no larger than a slot's fields, the rest zero)
        in ``slots [R]`` (or the run of slots from an int); fields not in ``values`` are left as
        they are."""
        for f, t in zip(self.fields, tensors):
            if f.name in values:
                value = self.fit(f.shape, f.dtype, values[f.name], f.name)
                if isinstance(slots, int):
                    t[slots: slots + value.shape[0]].copy_(value)
                else:
                    t.index_copy_(0, slots, value)

    @staticmethod
    def fit(shape: tuple[int, ...], dtype: torch.dtype, value: torch.Tensor, name: str = "value") -> torch.Tensor:
        """``value [R, ...]`` as ``[R, *shape]`` of ``dtype``: zeros past a buffer that has not
        grown to the slot's bound (KVM's window and state rows). A value larger than the slot in
        some dim, or of another rank, is a ``ValueError`` naming the field ``name``: a slot never grows."""
        value = value.to(dtype)
        if tuple(value.shape[1:]) == shape:
            return value
        if value.dim() != len(shape) + 1 or any(n > most for n, most in zip(value.shape[1:], shape)):
            raise ValueError(f"{name}: an entry of shape {list(value.shape[1:])} (per sequence) does not fit its slot's "
                             f"{list(shape)}")
        full = torch.zeros((value.shape[0], *shape), dtype=dtype, device=value.device)
        full[tuple(slice(0, n) for n in value.shape)] = value
        return full


def _bytes(field: SlotField) -> int:
    return torch.Size(field.shape).numel() * torch.empty((), dtype=field.dtype).element_size()


class SlotRows(NamedTuple):
    """Sequences of a step that run as one batch (see :func:`run_on_slots`), and what every layer
    reads and writes for them, worked out once (:func:`plan_slots`): ``starts``, ``lengths``,
    ``computed``, ``read`` ``[R]`` and ``write [R, W]`` as there; ``read_run`` / ``write_run`` the
    first slot where the rows read / write column 0 of a run of slots (:func:`slot_run`), else
    ``None``; ``fresh [R]`` the rows that start from the learned state, ``None`` when none does;
    ``rewrites``: each row writes the slot it read; ``tokens [R]`` the tokens each has taken in
    after the step; ``index`` and ``real``: the rows' tokens in the step's (``[R, L]`` padded, as
    :func:`_padded` gives them), or for ``packed`` rows ``index [tokens]`` with ``packed`` their
    :class:`~trellis_lm.mixers.valid_tokens.PackedSequences`."""

    kind: str  # "single" (one token each), "drafts" (rows of at most W), "packed" (prompt chunks)
    starts: torch.Tensor
    lengths: torch.Tensor
    computed: torch.Tensor
    read: torch.Tensor
    write: torch.Tensor
    read_run: Optional[int]
    write_run: Optional[int]
    fresh: Optional[torch.Tensor]
    rewrites: bool
    tokens: torch.Tensor
    index: torch.Tensor
    real: Optional[torch.Tensor]
    packed: Optional[PackedSequences]


class SlotStep(NamedTuple):
    """What :func:`run_on_slots` works out from a step's sequences before it reads a layer's slots,
    the same for every memory layer of the step (one server step runs several): made once by
    :func:`plan_slots`, checked there (all but the slots' token counts, which each layer checks in
    its own slots). ``key``: the arguments it was made for besides the sequences (slot count,
    tokens, compiled), which a layer's call must share."""

    key: tuple[int, int, bool]
    starts: torch.Tensor
    computed: torch.Tensor
    accepted: torch.Tensor
    write: torch.Tensor
    read: torch.Tensor  # [R] the slot each sequence continues from, within [0, count)
    continuing: torch.Tensor  # [R] computed > 0
    batches: tuple[SlotRows, ...]


def plan_slots(starts: torch.Tensor, computed: torch.Tensor, slots: torch.Tensor, accepted: Optional[torch.Tensor],
               count: int, tokens: int, compiled: bool) -> SlotStep:
    """The :class:`SlotStep` of a batch of ``tokens`` tokens over ``count`` slots (arguments as
    :func:`run_on_slots` takes them; ``compiled``: whether the rows run compiled, which pads rows
    of drafts to W tokens). Raises the ``ValueError`` of a malformed batch (see there)."""
    starts, computed, write = (t.to(torch.long) for t in (starts, computed, slots))
    write = write if write.dim() == 2 else write[:, None]
    accepted = torch.ones_like(computed) if accepted is None else accepted.to(torch.long)
    rows, width = write.shape
    if starts.dim() != 1 or computed.shape != (rows,) or accepted.shape != (rows,) or len(starts) != rows + 1:
        raise ValueError(f"starts must be [R + 1], computed and accepted [R], slots [R] or [R, W]; got "
                         f"{list(starts.shape)}, {list(computed.shape)}, {list(accepted.shape)}, {list(slots.shape)}")
    lengths = starts[1:] - starts[:-1]
    read = write.gather(1, (accepted - 1).clamp(0, width - 1)[:, None])[:, 0]
    # The slots each row writes: its tokens' columns, or column 0 for a row longer than W.
    writes = torch.arange(width, device=write.device) < torch.where(lengths <= width, lengths, 1)[:, None]
    written = write[writes].sort().values
    # One read-back for every check: a sequence of no or negative length would be skipped (its
    # tokens read by another), a negative count would start it from another state, two
    # sequences on one slot would overwrite each other's state, a slot out of range index another.
    misread = ((lengths < 1).any() | (computed < 0).any() | (starts[0] < 0) | (starts[-1] > tokens)
               | (accepted < 1).any() | (accepted > width).any())
    shared = (written[1:] == written[:-1]).any()
    outside = ((write < 0) | (write >= count)).any()
    if bool(misread | shared | outside):
        _refuse_batch(bool(misread), bool(shared), bool(outside), tokens, count, width, starts, computed, accepted,
                      write, None)
    single = lengths == 1
    drafts = ~single & (lengths <= width)
    batches = []
    for kind, chosen in (("single", single), ("drafts", drafts), ("packed", ~single & ~drafts)):
        chosen = chosen.nonzero()[:, 0]
        if chosen.numel():
            chosen = chosen[read[chosen].argsort()]  # a batch's rows in any order: by slot, so its slots may form a run
            batches.append(_slot_rows(kind, starts[chosen], lengths[chosen], computed[chosen], read[chosen],
                                      write[chosen], tokens, padded_to=width if compiled and kind == "drafts" else 0))
    return SlotStep((count, tokens, compiled), starts, computed, accepted, write, read, computed > 0, tuple(batches))


def _slot_rows(kind: str, starts: torch.Tensor, lengths: torch.Tensor, computed: torch.Tensor, read: torch.Tensor,
               write: torch.Tensor, tokens: int, padded_to: int) -> SlotRows:
    fresh = computed == 0
    packed, real = None, None
    if kind == "packed":
        packed = PackedSequences.from_lengths(lengths)
        index = starts[packed.seq_id] + packed.pos
    else:
        index, real = _padded(starts, lengths, tokens, padded_to)
    return SlotRows(kind, starts, lengths, computed, read, write, slot_run(read), slot_run(write[:, 0]),
                    fresh if bool(fresh.any()) else None, bool((read == write[:, 0]).all()), computed + lengths,
                    index, real, packed)


def run_on_slots(
    mixer: MemoryMixer,
    layout: SlotLayout,
    tensors: Sequence[torch.Tensor],
    x: torch.Tensor,
    starts: torch.Tensor,
    computed: torch.Tensor,
    slots: torch.Tensor,
    accepted: Optional[torch.Tensor] = None,
    compiled: bool = False,
    out: Optional[torch.Tensor] = None,
    plan: Optional[SlotStep] = None,
) -> torch.Tensor:
    """The mixer on a server's flat batch, continuing each sequence from its slot.

    Sequences with one token (decodes) run as one batch of single tokens (the op's decode
    step); the others (prefills, whole prompts or chunks of them) packed along one row, each
    after its own slot's state, without padding: one call of each projection and of the op
    (``cu_seqlens``) for all of them. A sequence with
    ``computed == 0`` starts from the learned initial state whatever its slot holds. Under
    speculative decoding (``slots [R, W]``, see the module doc) rows of 2 to W tokens run a token
    at a time, the entry after each stored in its column's slot.

    Args:
        mixer: the layer's memory mixer.
        layout: its slot layout; ``tensors`` the slot tensors ``[slots, *shape]`` (updated).
        x: ``[N, D]`` the mixer's input, sequences one after another (tokens outside
            ``starts``' sequences, a server's padding or another call's, are not read).
        starts: ``[R + 1]`` where each sequence's tokens start in ``x``.
        computed: ``[R]`` tokens each sequence had taken in before these; a continuing
            sequence's slot must hold the state after as many (a ``RuntimeError`` otherwise).
        slots: ``[R]`` each sequence's slot, read and written; or ``[R, W]``: a row of W slots,
            read at column ``accepted - 1``, the entry after the row's t-th token written at
            column t (a row longer than W writes the entry after its last token at column 0).
        accepted: ``[R]`` in ``[1, W]``, with ``slots [R, W]``: the tokens each sequence's last
            row kept (``None``: 1 each).
        compiled: run the rows of single tokens and the rows of drafts through ``torch.compile``
            (:func:`~.compiled_rows.advanced_compiled`: the mixer's own functions,
            where :func:`compiles_rows`); rows of drafts are then padded to W tokens, one shape
            to compile.
        out: ``[N, D]`` to write the outputs into (``None``: a new tensor, zero outside the sequences).
        plan: :func:`plan_slots` of these arguments, made once for the step's layers (``None``:
            made here); a plan made for another slot count, token count or ``compiled`` is refused.

    Returns:
        ``out``, the mixer's output at every sequence's tokens.
    """
    out = torch.zeros_like(x) if out is None else out
    compiled = compiled and compiles_rows(mixer, x.device)
    count = tensors[0].shape[0]
    if plan is None:
        plan = plan_slots(starts, computed, slots, accepted, count, x.shape[0], compiled)
    elif plan.key != (count, x.shape[0], compiled):
        raise ValueError(f"plan was made for (slots, tokens, compiled) = {plan.key}, this call has "
                         f"{(count, x.shape[0], compiled)}")
    # A state after another number of tokens would continue as if it were this one's.
    held = layout.read(tensors, plan.read, ("tokens",))["tokens"]
    if bool((plan.continuing & (held != plan.computed)).any()):
        _refuse_batch(False, False, False, x.shape[0], count, plan.write.shape[1], plan.starts, plan.computed,
                      plan.accepted, plan.write, held)
    for rows in plan.batches:
        (_run_packed if rows.kind == "packed" else _run_rows)(mixer, layout, tensors, x, out, rows, compiled)
    return out


def compiles_rows(mixer: MemoryMixer, device: torch.device) -> bool:
    """Whether :func:`run_on_slots` with ``compiled=True`` runs ``mixer``'s rows of single tokens
    and held rows on ``device`` compiled: for a ``compilable`` mixer (Trellis and Lattice, not KVM)
    on a CPU. On a GPU they run eagerly (the ops' own kernels): nothing is compiled there."""
    return mixer.compilable and device.type == "cpu"


def _refuse_batch(misread: bool, shared: bool, outside: bool, tokens: int, count: int, width: int,
                  starts: torch.Tensor, computed: torch.Tensor, accepted: torch.Tensor, slots: torch.Tensor,
                  held: Optional[torch.Tensor]) -> None:
    """The error of a batch :func:`run_on_slots` would misread (see there): a ``ValueError`` for
    a malformed batch, a ``RuntimeError`` for a slot that holds another state than the sequence's."""
    if misread:
        raise ValueError(
            f"starts must rise strictly from >= 0 to <= {tokens} tokens (each sequence at least one token), computed "
            f"must be >= 0 and accepted in [1, {width}]; got starts {starts.tolist()}, computed {computed.tolist()}, "
            f"accepted {accepted.tolist()}"
        )
    listed = slots.tolist() if width > 1 else slots[:, 0].tolist()
    if shared:
        lengths = (starts[1:] - starts[:-1]).tolist()
        owners = {}
        for i, (row, length) in enumerate(zip(slots.tolist(), lengths)):
            for slot in row[: length if length <= width else 1]:
                if slot in owners:
                    raise ValueError(f"sequences {owners[slot]} and {i} are both given slot {slot}: each sequence needs "
                                     f"a slot of its own (their states would overwrite each other); got slots {listed}")
                owners[slot] = i
    if outside:
        raise ValueError(f"slots must lie in [0, {count}) (the slots the tensors hold), got {listed}")
    row = int(((computed > 0) & (held != computed)).nonzero()[0, 0])
    raise RuntimeError(
        f"sequence {row} continues after {int(computed[row])} tokens, but the slot it reads holds the state after "
        f"{int(held[row])}: the slot was not written by this sequence's last step (or a prefix cache's copy)"
    )


def compile_rows(mixer: MemoryMixer, layout: SlotLayout, like: torch.Tensor, width: int = 1) -> None:
    """Compile what :func:`run_on_slots` runs compiled for ``mixer`` (``compiled=True``): rows of
    a single token and, for ``width > 1`` (speculative decoding's rows of slots), rows of drafts
    padded to ``width`` tokens, in a batch of one row and of several (torch.compile's two shapes
    of a batch); inputs of ``like``'s dtype and device. What a server calls as it loads the
    model, so that no step of a request compiles (nothing where :func:`compiles_rows` says no)."""
    if not compiles_rows(mixer, like.device):
        return
    with torch.no_grad():
        for rows in (1, 2):
            entry = fresh_entry(mixer, layout, rows, like.device)
            for length in (1, width) if width > 1 else (1,):
                advanced_compiled(mixer, like.new_zeros(rows, length, like.shape[-1]), entry, each=length > 1)


# Tokens of each of the two prompts a loading server prefills once (:func:`prefill_once`): two
# whole chunks of the chunk form's layout of exact writes, the chunks the compiled backend compiles.
WARM_PROMPT_TOKENS = 2 * EXACT_LAYOUT_CHUNK


def prefill_once(mixer: MemoryMixer, layout: SlotLayout, like: torch.Tensor) -> None:
    """Prefill two prompts of :data:`WARM_PROMPT_TOKENS` tokens, packed as a server's step packs
    them, and drop the result: what a server under ``op_backend="compiled"`` calls as it loads the
    model, so that the op's compiled substitution compiles then (once: any number of prompts
    shares it), not in a request's step."""
    lengths = torch.full((2,), WARM_PROMPT_TOKENS, device=like.device)
    # In inference mode, as vLLM runs its steps: the compiled function guards on whether its
    # tensors are inference tensors (a warm-up under no_grad compiled once more in the first step).
    with torch.inference_mode():
        mixer.advance(like.new_zeros(1, 2 * WARM_PROMPT_TOKENS, like.shape[-1]), PackedSequences.from_lengths(lengths),
                      fresh_entry(mixer, layout, 2, like.device))


def fresh_entry(mixer: MemoryMixer, layout: SlotLayout, rows: int, device: Optional[torch.device] = None) -> MemoryEntry:
    """The entry ``rows`` sequences start from, as :func:`run_on_slots` hands it to the mixer
    (the layout's stand-ins in place of the state fields it does not keep)."""
    held = layout.read(layout.allocate(rows, device), 0, layout.entry_names, rows)
    fresh = mixer.fresh_rows(_held_entry(layout, held), torch.ones(rows, dtype=torch.bool, device=device))
    return _held_entry(layout, fresh.tensors())


def slot_run(slots: torch.Tensor) -> Optional[int]:
    """The first of ``slots [R]`` when they are consecutive and ascending (a server that hands
    out slots in order gives sequences started together such a run, in some order), else ``None``."""
    first = int(slots[0])
    return first if bool((slots == torch.arange(first, first + len(slots), device=slots.device)).all()) else None


def _run_rows(mixer: MemoryMixer, layout: SlotLayout, tensors: Sequence[torch.Tensor], x: torch.Tensor,
              out: torch.Tensor, rows: SlotRows, compiled: bool) -> None:
    """Run single tokens or rows of drafts, at most W tokens each, as one right-padded batch
    ``[R, L, D]`` (``rows.index``); write outputs into ``out`` and states to their slots.
    ``compiled``: see :func:`run_on_slots`."""
    batch = x[rows.index]
    held, entry = _read_entries(mixer, layout, tensors, rows)
    if batch.shape[1] > 1:
        _run_each(mixer, layout, tensors, batch, out, rows, entry, compiled)
        return
    if compiled:
        y, after = advanced_compiled(mixer, batch, entry, each=False)
    else:
        # Where every row writes the slot it read and the slots were read as views, the state
        # those views hold is given up: a step that writes it in place leaves nothing to write back.
        in_place = rows.rewrites and rows.read_run is not None
        y, after = mixer.advance(batch, None, entry, consume_state=in_place)
    out[rows.index] = y
    _write_entries(layout, tensors, held, after, rows)


def _run_packed(mixer: MemoryMixer, layout: SlotLayout, tensors: Sequence[torch.Tensor], x: torch.Tensor,
                out: torch.Tensor, rows: SlotRows, compiled: bool) -> None:
    """Run prompt chunks (each writes column 0 of its row of ``rows.write``) packed along one row
    (:class:`~trellis_lm.mixers.valid_tokens.PackedSequences` through
    :meth:`~trellis_lm.mixers.base.MemoryMixer.advance`), eagerly whatever ``compiled``: no
    padding, one call of every projection and of the op."""
    held, entry = _read_entries(mixer, layout, tensors, rows)
    y, after = mixer.advance(x[rows.index][None], rows.packed, entry)
    out[rows.index] = y[0]
    _write_entries(layout, tensors, held, after, rows)


def _read_entries(mixer: MemoryMixer, layout: SlotLayout, tensors: Sequence[torch.Tensor], rows: SlotRows,
                  ) -> tuple[dict[str, torch.Tensor], MemoryEntry]:
    """The slots ``rows.read`` as held (by field) and as the entries the sequences continue: those
    of ``rows.fresh`` from their start."""
    # A run of slots is read as views, not copies (the ops only read the state they are given).
    held = layout.read(tensors, rows.read if rows.read_run is None else rows.read_run, layout.entry_names,
                       len(rows.read))
    entry = _held_entry(layout, held)
    if rows.fresh is not None:
        entry = _held_entry(layout, mixer.fresh_rows(entry, rows.fresh).tensors())  # the stand-ins stand in again
    return held, entry


def _write_entries(layout: SlotLayout, tensors: Sequence[torch.Tensor], held: dict[str, torch.Tensor],
                   after: MemoryEntry, rows: SlotRows) -> None:
    """Write the entries ``after`` to column 0 of ``rows.write`` with ``rows.tokens``; ``held``:
    what :func:`_read_entries` read."""
    after = after.tensors()
    if rows.rewrites:
        # A tensor the mixer returned as it was given is what the slots hold already (a decode
        # step's anchors between chunk starts, KVM's state rows between folds, a state written in
        # place into the views it was read as): not written.
        after = {name: t for name, t in after.items() if t is not held.get(name)}
    layout.write(tensors, rows.write[:, 0] if rows.write_run is None else rows.write_run, {**after, "tokens": rows.tokens})


def _run_each(mixer: MemoryMixer, layout: SlotLayout, tensors: Sequence[torch.Tensor], batch: torch.Tensor,
              out: torch.Tensor, rows: SlotRows, entry: MemoryEntry, compiled: bool) -> None:
    """Rows that may hold drafts (``batch [R, L, D]``, ``L <= W``): the entry after each real
    token (``rows.real [R, L]``) stored in its column's slot of ``rows.write [R, W]``. A row shorter
    than ``L`` runs on through padding (tokens of other rows): its entries there are not stored,
    its outputs not written."""
    y, entries = advanced_compiled(mixer, batch, entry, each=True) if compiled else mixer.advance_each(batch, entry)
    real = rows.real
    out[rows.index[real]] = y[real]
    # One write per field for every token's entry: on a CPU a step's cost is mostly per-operation.
    named = [after.tensors() for after in entries]
    stacked = {name: torch.stack([e[name] for e in named], dim=1) for name in named[0]}  # [R, L, ...]
    stacked["tokens"] = rows.computed[:, None] + torch.arange(1, batch.shape[1] + 1, device=rows.computed.device)
    layout.write(tensors, rows.write[:, : batch.shape[1]][real], {name: t[real] for name, t in stacked.items()})


def _padded(starts: torch.Tensor, lengths: torch.Tensor, tokens: int, padded_to: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``index [R, L]`` into a step's ``tokens`` tokens of the rows from ``starts`` (``L``: the
    longest of ``lengths``, at least ``padded_to``), and the ``real [R, L]`` mask of their tokens
    (the padding positions hold other tokens, which :func:`_run_each` does not keep)."""
    offsets = torch.arange(max(int(lengths.max()), padded_to), device=starts.device)
    real = offsets < lengths[:, None]
    index = (starts[:, None] + offsets).clamp(max=tokens - 1)
    return index, real


def _held_entry(layout: SlotLayout, held: dict[str, torch.Tensor]) -> MemoryEntry:
    """The memory entry of slots read as ``held`` (its flat form, :meth:`MemoryEntry.tensors`,
    without the state's stand-ins, which read the fields they stand for)."""
    named = {**held, **{name: held[stand_in] for name, stand_in in layout.stand_ins.items()}}
    return MemoryEntry.from_tensors(named, layout.mixer_class.state_class, layout.mixer_class.__name__)
