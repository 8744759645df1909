"""What each layer of a Trellis model carries in its cache: the entry classes, one per kind.

* A memory layer (Trellis, Lattice, KVM) carries a :class:`MemoryEntry`: the short-conv tails of q
  and k (the last ``conv_size - 1`` projected inputs of every row; KVM has none) and its op's
  state: a fixed size, whatever the number of tokens seen (design pages, section 6). KVM's
  buffers grow with its first tokens up to ``kvm_state_size`` rows and its window, and stay at
  that size from then on.
* An attention layer carries every key and value it has seen, as attention
  must, with which columns later tokens may see and how many real tokens each row holds.

Each kind's mixer registers its entry class here as it is defined (:data:`LAYER_CACHES`); the
rollback records (:class:`StepRecord`) are what a memory entry needs to redo recent calls.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, ClassVar, NamedTuple, Optional, Sequence

import torch

from .configuration_trellis import TrellisConfig
from .ops.state import OpState


class MemoryEntry(NamedTuple):
    """What a memory layer carries from one call to the next (the fields of its
    :class:`MemoryLayerCache`), as one value: what its mixer continues and returns
    (``MemoryMixer.advance``).

    Attributes:
        q_tail, k_tail: ``[B, conv_size - 1, channels]`` the last projected q / k inputs of each
            row, in the activation dtype (``None``: zeros, or no short conv in the layer).
        state: the op's state with ``N = B`` rows (``None``: the learned initial memories).
    """

    q_tail: Optional[torch.Tensor]
    k_tail: Optional[torch.Tensor]
    state: Optional[OpState]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MemoryEntry":
        """``fn`` applied to every tensor held (all have the rows on dim 0), in the order of
        :meth:`tensors`."""
        return MemoryEntry(*(None if t is None else fn(t) for t in (self.q_tail, self.k_tail)),
                           None if self.state is None else self.state.map(fn))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The entry's flat form: every tensor held, by name: the tails present (``q_tail``,
        ``k_tail``), then the state's fields under their own names. What a cache or state file
        holds of the layer (``layers.<index>.<name>``), what a compiled step takes, what a
        rollback record counts."""
        held = {name: t for name, t in (("q_tail", self.q_tail), ("k_tail", self.k_tail)) if t is not None}
        if self.state is not None:
            held.update(self.state.tensors())
        return held

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], state_class: type[OpState], what: str) -> "MemoryEntry":
        """Inverse of :meth:`tensors` for a state of ``state_class``; raises a ``ValueError``
        naming ``what`` (the layer) when the state or the tails are incomplete."""
        state = _all_or_none(state_class.field_names(), tensors, f"{what}'s state")
        tails = _all_or_none(["q_tail", "k_tail"], tensors, f"{what}'s short-conv tails") or {}
        return cls(tails.get("q_tail"), tails.get("k_tail"), None if state is None else state_class(**state))


class LayerCache:
    """What one layer carries from one forward call to the next; empty before its first call.

    Subclasses are dataclasses whose fields are tensors or op states (``None`` while empty),
    every tensor with the batch on dim 0.
    """

    kind: ClassVar[str]
    # What the generic `Cache` methods ask of their layers.
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name (an op state's fields under their own names)."""
        held: dict[str, torch.Tensor] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, OpState):
                held.update(value.tensors())
            elif value is not None:
                held[f.name] = value
        return held

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every tensor; all of them have the batch on dim 0."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                setattr(self, f.name, value.map(fn) if isinstance(value, OpState) else fn(value))

    @property
    def rows(self) -> Optional[int]:
        """Rows held, or ``None`` while empty."""
        held = self.tensors()
        return next(iter(held.values())).shape[0] if held else None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, None)

    def take_back(self, count: int, record: Optional["StepRecord"]) -> None:
        """Go back ``count`` tokens (see :meth:`TrellisCache.crop`), given the ``record`` of the
        calls a crop reaches into (``None`` for entries that need none)."""
        raise NotImplementedError

    def get_max_length(self) -> int:
        return -1  # no limit on the tokens it can take

    @classmethod
    def tensor_names(cls) -> list[str]:
        """Every name :meth:`tensors` may hold (the file's tensor names, after the layer's index)."""
        return [f.name for f in fields(cls)]

    @classmethod
    def required_names(cls) -> list[str]:
        """The names a non-empty entry holds whatever the configuration."""
        return cls.tensor_names()

    @classmethod
    def state_names(cls) -> list[str]:
        """The names of an op state's tensors (float32, or float64 in a float64 model)."""
        return []

    @classmethod
    def value_problem(cls, tensors: dict[str, torch.Tensor], config: Optional[TrellisConfig]) -> Optional[str]:
        """What makes a whole entry read from a file impossible for its kind, beyond each
        tensor's own bounds (``TensorSpec.most``): counters that disagree with each other or
        with the buffers they index. ``None`` when nothing is found; ``config`` is the model's
        (``None``: the checks that need it are left to the model that binds the cache)."""
        return None


def _all_or_none(names: list[str], tensors: dict[str, torch.Tensor], what: str) -> Optional[dict[str, torch.Tensor]]:
    """The tensors named ``names``, all of them or (when none is there) ``None``."""
    present = [n for n in names if n in tensors]
    if present and len(present) != len(names):
        raise ValueError(f"{what} needs tensors {names}, the file holds {present}")
    return {n: tensors[n] for n in names} if present else None


@dataclass
class MemoryLayerCache(LayerCache):
    """A memory layer's entry, of a kind that names its op's state class (``state_class``):
    a subclass per kind, declared beside the kind's mixer.

    Attributes:
        q_tail, k_tail: ``[B, conv_size - 1, channels]`` the last projected q / k inputs of each
            row, in the activation dtype (``None`` also when the model has no short conv).
        state: the op's state (an instance of ``state_class``), with ``N = B`` rows.
    """

    q_tail: Optional[torch.Tensor] = None
    k_tail: Optional[torch.Tensor] = None
    state: Optional[OpState] = None

    state_class: ClassVar[type[OpState]]

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "MemoryLayerCache":
        """Inverse of :meth:`tensors`; raises ``ValueError`` when a state is incomplete."""
        return cls(*MemoryEntry.from_tensors(tensors, cls.state_class, f"a {cls.kind} layer"))

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.entry.tensors()

    @classmethod
    def tensor_names(cls) -> list[str]:
        return ["q_tail", "k_tail", *cls.state_class.field_names()]

    @property
    def entry(self) -> MemoryEntry:
        """The three fields as one value."""
        return MemoryEntry(self.q_tail, self.k_tail, self.state)

    def hold(self, entry: MemoryEntry) -> None:
        """Make ``entry`` what this layer carries (its tensors are taken, not copied)."""
        self.q_tail, self.k_tail, self.state = entry

    def take_back(self, count: int, record: Optional["StepRecord"]) -> None:
        """The entry after the tokens ``record`` keeps (the calls a crop reaches into, cut
        before the ``count`` tokens taken back), recomputed from the entry before them through
        the replay function the layer's mixer recorded."""
        replay = record.replay()
        if replay is None:
            raise ValueError("cannot roll back: the model that filled this cache no longer exists")
        self.hold(replay(record))

    @classmethod
    def required_names(cls) -> list[str]:
        return cls.state_class.field_names()  # the tails: only where the model has a short conv

    @classmethod
    def state_names(cls) -> list[str]:
        return cls.state_class.field_names()


@dataclass
class AttentionLayerCache(LayerCache):
    """A softmax-attention layer's entry; it grows with the columns seen.

    Attributes:
        keys, values: ``[B, H_kv, S, d]`` every column's key (after RoPE) and value, in the
            activation dtype.
        visible: ``[B, S]`` bool, True where a later token may attend: real tokens of each
            row's current document (padding and finished packed documents are False).
        positions: ``[B]`` int64, real tokens of each row's current document (the next
            token's RoPE position).
    """

    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    visible: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "AttentionLayerCache":
        """Inverse of :meth:`tensors`; raises ``ValueError`` when the entry is incomplete."""
        return cls(**(_all_or_none([f.name for f in fields(cls)], tensors, "an attention layer's entry") or {}))

    @classmethod
    def value_problem(cls, tensors: dict[str, torch.Tensor], config: Optional[TrellisConfig]) -> Optional[str]:
        """A row's next position counts its visible columns (the real tokens of its document)."""
        visible = tensors["visible"].sum(dim=1)
        if not torch.equal(tensors["positions"], visible):
            return (f"tensor 'positions' holds {tensors['positions'].tolist()}, but the rows' visible columns count "
                    f"{visible.tolist()} (a row's next position is its visible real tokens)")
        return None

    def take_back(self, count: int, record: Optional["StepRecord"]) -> None:
        """Forget the last ``count`` columns, as ``DynamicCache`` crops (the real tokens among
        them leave the rows' position counts too); an attention entry needs no record."""
        if self.keys is None or count == 0:
            return
        self.positions = self.positions - self.visible[:, -count:].sum(dim=1)
        self.keys, self.values = self.keys[:, :, :-count], self.values[:, :, :-count]
        self.visible = self.visible[:, :-count]


@dataclass
class StepRecord:
    """What a memory layer needs to redo one of the cache's recent forward calls: the function
    that redoes it, as the layer's mixer registered it (weakly referenced, so that a copied
    cache does not copy the model, nor keep it alive), the call's inputs and the layer's entry
    before it (the tensors themselves: the mixers replace an entry's tensors rather than
    writing into them, so keeping them costs no copy).

    Attributes:
        replay: a weak reference to the function ``record -> MemoryEntry`` after
            the record's tokens (a mixer's bound ``replay``); calling it gives ``None`` once
            the model is gone.
        x: ``[B, T, D]`` the mixer's input in that call.
        mask: ``[B, T]`` bool, the real tokens, or ``None`` when all are real.
        before: the layer's entry before the call.
    """

    replay: Callable[[], Optional[Callable[["StepRecord"], MemoryEntry]]]
    x: torch.Tensor
    mask: Optional[torch.Tensor]
    before: MemoryEntry

    @classmethod
    def joined(cls, records: Sequence["StepRecord"]) -> "StepRecord":
        """Consecutive calls as one: the first one's entry before, the inputs end to end."""
        masks = [r.mask if r.mask is not None else torch.ones(r.x.shape[:2], dtype=torch.bool, device=r.x.device)
                 for r in records]
        any_padding = any(r.mask is not None for r in records)
        return cls(records[0].replay, torch.cat([r.x for r in records], dim=1),
                   torch.cat(masks, dim=1) if any_padding else None, records[0].before)

    def first(self, count: int) -> "StepRecord":
        """The record of the call's first ``count`` tokens."""
        return StepRecord(self.replay, self.x[:, :count], None if self.mask is None else self.mask[:, :count], self.before)


@dataclass
class CallRecords:
    """One forward call that a crop may take back: its length and each memory layer's record
    (``None`` where the layer read packed documents, which are not replayed)."""

    length: int
    layers: dict[int, Optional[StepRecord]]


# Each layer kind's entry class, registered by the kind's mixer as it is defined
# (`Mixer.__init_subclass__`): the cache knows no kind by name.
LAYER_CACHES: dict[str, type[LayerCache]] = {}


def register_layer_cache(kind: str, entry: type[LayerCache]) -> None:
    """Make ``entry`` the cache entry of layers of ``kind`` (what :class:`TrellisCache` builds
    for them and reads from files), and ``entry.kind`` the kind. An entry class serves one
    kind, and a kind has one entry class: anything else is a ``ValueError``."""
    known = LAYER_CACHES.get(kind)
    if known is not None and not same_definition(known, entry):
        raise ValueError(f"layer kind {kind!r} already has the cache entry {known.__qualname__}")
    if "kind" in vars(entry) and entry.kind != kind:
        raise ValueError(f"{entry.__qualname__} is already the cache entry of {entry.kind!r} layers, not {kind!r}")
    entry.kind = kind
    LAYER_CACHES[kind] = entry


def same_definition(a: type, b: type) -> bool:
    """Whether two classes are one definition run twice (a module imported again, as
    transformers' remote-code loader may): the later one may replace the earlier."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)
