"""The generation cache of Trellis models: one entry per layer, of the layer's kind.

* A memory layer (Trellis, Lattice, KVM) carries the short-conv tails of q
  and k (the last ``conv_size - 1`` projected inputs of every row; KVM has none) and its op's
  state: a fixed size, whatever the number of tokens seen (design pages, section 6). KVM's
  buffers grow with its first tokens up to ``kvm_state_size`` rows and its window, and stay at
  that size from then on.
* An attention layer carries every key and value it has seen, as attention
  must, with which columns later tokens may see and how many real tokens each row holds.

The cache also counts the tokens (columns, padding included) it has seen, and remembers the
configuration fields that define its layers' functions, so that a model refuses a cache made
by another model (:meth:`TrellisCache.check_compatible`).
"""

from __future__ import annotations

import copy
import json
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Iterator, Mapping, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

from .ops.state import OpState

# The name transformers gives the generation cache, as an argument of `forward` and
# `prepare_inputs_for_generation`, a key of `generate()`'s model kwargs and a field of model
# outputs: `past_key_values` up to 5.23, `cache` from 5.24 on (read off the output classes, so
# no version number is compared). The models accept both names and write this one.
CACHE_ARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")

FORMAT = "trellis-cache"
# The rollback window a cache gets when transformers asks it to record its past (assisted
# decoding): more than the drafts a verification feeds by default (20 and one token).
DEFAULT_ROLLBACK_WINDOW = 64
# Version 1 (one kind of layer, no record of the model) is not read: its layer count could not
# be checked against anything before allocating.
FORMAT_VERSION = "2"


@dataclass(frozen=True)
class Dim:
    """A size of a cache tensor that is not fixed by the configuration alone.

    ``name`` ties sizes together: every dim of one name holds one value within a layer entry
    (``"rows"``: within the whole cache); ``"columns"`` must equal the tokens the cache has seen.
    ``most`` bounds it (buffers that grow with the tokens up to a configured size).
    """

    name: str
    most: Optional[int] = None


ROWS = Dim("rows")
COLUMNS = Dim("columns")


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of a layer's cache entry must be, as its mixer declares it
    (``Mixer.cache_layout``).

    Attributes:
        dims: each dim's size: an int (fixed by the configuration) or a :class:`Dim`.
        dtype: ``"float"`` (any floating dtype), ``"int64"`` or ``"bool"``.
        most: for counters, the largest value allowed: an int, or ``COLUMNS`` (the tokens seen).
    """

    dims: tuple[Union[int, Dim], ...]
    dtype: str = "float"
    most: Union[int, Dim, None] = None


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
    def value_problem(cls, tensors: dict[str, torch.Tensor], config: Any) -> Optional[str]:
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
        state = _all_or_none(cls.state_class.field_names(), tensors, f"a {cls.kind} layer's state")
        tails = _all_or_none(["q_tail", "k_tail"], tensors, f"a {cls.kind} layer's short-conv tails") or {}
        return cls(tails.get("q_tail"), tails.get("k_tail"), None if state is None else cls.state_class(**state))

    @classmethod
    def tensor_names(cls) -> list[str]:
        return ["q_tail", "k_tail", *cls.state_class.field_names()]

    def take_back(self, count: int, record: Optional["StepRecord"]) -> None:
        """The entry after the tokens ``record`` keeps (the calls a crop reaches into, cut
        before the ``count`` tokens taken back), recomputed from the entry before them through
        the replay function the layer's mixer recorded."""
        replay = record.replay()
        if replay is None:
            raise ValueError("cannot roll back: the model that filled this cache no longer exists")
        self.q_tail, self.k_tail, self.state = replay(record)

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
    def value_problem(cls, tensors: dict[str, torch.Tensor], config: Any) -> Optional[str]:
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
        replay: a weak reference to the function ``record -> (q_tail, k_tail, state)`` after
            the record's tokens (a mixer's bound ``replay``); calling it gives ``None`` once
            the model is gone.
        x: ``[B, T, D]`` the mixer's input in that call.
        mask: ``[B, T]`` bool, the real tokens, or ``None`` when all are real.
        before: the entry's ``(q_tail, k_tail, state)`` before the call.
    """

    replay: Callable[[], Optional[Callable[["StepRecord"], tuple[Any, Any, Any]]]]
    x: torch.Tensor
    mask: Optional[torch.Tensor]
    before: tuple[Any, Any, Any]

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


class CacheCall:
    """One forward call's view of a :class:`TrellisCache`: each layer reads its entry as it was
    when the call began (:meth:`before`) and writes the live one (:meth:`entry`).

    A layer run twice within a call reads the same inputs and writes the same outputs, which
    is what activation checkpointing does (it recomputes a block in the backward pass, after the
    block's first run has already replaced its entry). Cheap: entries' tensors are replaced,
    never written into, so the view holds references, not copies.
    """

    def __init__(self, cache: "TrellisCache") -> None:
        self.cache = cache
        self._before = [copy.copy(layer) for layer in cache.layers]

    @classmethod
    def of(cls, cache: Union["TrellisCache", "CacheCall", None]) -> Optional["CacheCall"]:
        """``cache`` as a call view (a plain cache gets a new one; ``None`` stays ``None``)."""
        return cache if cache is None or isinstance(cache, CacheCall) else cls(cache)

    def before(self, index: int) -> LayerCache:
        """Layer ``index``'s entry as it was when the call began (read it)."""
        return self._before[index]

    def entry(self, index: int) -> LayerCache:
        """Layer ``index``'s live entry (write the call's result into it)."""
        return self.cache.layers[index]


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


class TrellisCache(Cache):
    """The cache of a Trellis-family model: one entry per layer, of the layer's kind.

    ``generate()`` builds one by itself; pass one as ``cache`` (or ``past_key_values``) to continue a
    sequence, including one returned by an earlier ``generate(..., return_dict_in_generate=True)``
    or read back with :meth:`load`. Memory layers hold a fixed size whatever the context;
    attention layers grow by their keys and values.

    **Rolling back** (:meth:`crop`, what assisted and prompt-lookup decoding call after each
    verification) needs ``rollback_window`` > 0: the cache then keeps, for its recent forward
    calls (about ``rollback_window`` tokens of them), each memory layer's entry before each call
    and the calls' layer inputs, and a crop recomputes the kept tokens from the earliest entry it
    reaches. A call longer than the window is run by the model as an unrecorded head and a
    ``rollback_window``-token tail, so what is kept never grows with the context
    (:meth:`rollback_nbytes`).

    Args:
        config: the model's configuration (its ``layer_kinds`` give the entries, and the cache
            remembers the fields that define the layers, see :meth:`check_compatible`), or a
            plain sequence of layer kinds (no fields remembered).
        rollback_window: the most tokens a crop can take back (0: none, the cache is then not
            croppable and keeps nothing extra). ``generate()`` sets it for assisted and
            prompt-lookup decoding.
    """

    # The ops run Python control flow per call; `generate()` must not try to compile them, and
    # with a compileable cache it would also hand `forward` its masks as dicts.
    is_compileable = False

    def __init__(self, config: Any, rollback_window: int = 0) -> None:
        if hasattr(config, "layer_signature"):
            kinds, signature = config.layer_kinds, config.layer_signature()
        else:
            kinds, signature = list(config), None
        unknown = [(i, kind) for i, kind in enumerate(kinds) if kind not in LAYER_CACHES]
        if unknown:
            raise ValueError(f"layer kinds must be among {sorted(LAYER_CACHES)}; got {unknown[0][1]!r} at index {unknown[0][0]}")
        super().__init__(layers=[LAYER_CACHES[kind]() for kind in kinds])
        self.signature: Optional[dict[str, Any]] = signature
        self.seen_tokens = 0
        self.rollback_window = rollback_window
        # The recent forward calls a crop can take back, oldest first (see `crop`).
        self._calls: list[CallRecords] = []
        self._recording = True  # off within `unrecorded`

    @property
    def rollback_window(self) -> int:
        return self._rollback_window

    @rollback_window.setter
    def rollback_window(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"rollback_window must be an integer >= 0 (0: no rollback), got {value!r}")
        self._rollback_window = value

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kinds={self.kinds}, rows={self.batch_size}, "
            f"seen_tokens={self.seen_tokens}, nbytes={self.nbytes()})"
        )

    @property
    def kinds(self) -> list[str]:
        """Each layer's kind, in order."""
        return [layer.kind for layer in self.layers]

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can take tokens back (``rollback_window`` > 0); assisted
        decoding reads it (stated here too for transformers versions whose ``Cache`` lacks it)."""
        return self.rollback_window > 0

    def copy(self) -> "TrellisCache":
        """An independent copy (``copy.deepcopy`` does the same): e.g. a long prompt's cache, read
        once, then one copy per continuation. Its tensors are detached from autograd: a copy
        carries the state's values, not the graph that computed them."""
        return copy.deepcopy(self)

    def _rollback_tensors(self) -> dict[int, torch.Tensor]:
        """Every tensor the rollback records hold (inputs, masks, entries before), by id."""
        held: dict[int, torch.Tensor] = {}
        for call in self._calls:
            for record in filter(None, call.layers.values()):
                q_tail, k_tail, state = record.before
                tensors = [record.x, record.mask, q_tail, k_tail, *(state.tensors().values() if state is not None else ())]
                held.update({id(t): t for t in tensors if isinstance(t, torch.Tensor)})
        return held

    def rollback_nbytes(self) -> int:
        """Bytes held by the rollback records: the recorded layer inputs and the entries before
        the recorded calls (0 without a rollback window)."""
        return sum(t.numel() * t.element_size() for t in self._rollback_tensors().values())

    def __deepcopy__(self, memo: dict) -> "TrellisCache":
        # Tensors built under autograd cannot be deep-copied as they are; their values can.
        held = [t for layer in self.layers for t in layer.tensors().values()] + list(self._rollback_tensors().values())
        for tensor in held:
            memo.setdefault(id(tensor), tensor.detach().clone())
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied

    def activate_past_recording(self) -> None:
        """transformers' request that the cache be able to roll back (assisted decoding calls it
        before its first step): a cache without a rollback window gets the default one."""
        self.rollback_window = self.rollback_window or DEFAULT_ROLLBACK_WINDOW

    @property
    def records_calls(self) -> bool:
        """Whether the model records its calls into this cache for :meth:`crop` (a rollback
        window, and not within :meth:`unrecorded`)."""
        return self._rollback_window > 0 and self._recording

    def widen_rollback(self, tokens: int) -> None:
        """Keep at least ``tokens`` tokens to roll back (assisted decoding's next draft)."""
        self.rollback_window = max(self.rollback_window, tokens)

    @contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Within the block the model's calls are not recorded, and a crop could not reach
        before them: what was recorded is forgotten (it could no longer be replayed). For the
        head of a call longer than the rollback window, which is never taken back."""
        self.forget_steps()
        recording, self._recording = self._recording, False
        try:
            yield
        finally:
            self._recording = recording

    def begin_step(self, length: int) -> None:
        """Called by the model before its layers run on ``length`` new tokens (at most
        ``rollback_window``). The oldest calls are forgotten once the newer ones hold the
        window: a crop takes back at most ``rollback_window`` tokens, so what is kept is one
        entry per call and the inputs of about ``rollback_window`` tokens per memory layer."""
        self._calls.append(CallRecords(length, {}))
        while len(self._calls) > 1 and sum(c.length for c in self._calls[1:]) >= self.rollback_window:
            self._calls.pop(0)

    def record_step(self, layer_idx: int, replay: Callable[[StepRecord], tuple[Any, Any, Any]], x: torch.Tensor,
                    mask: Optional[torch.Tensor], before: tuple[Any, Any, Any], replayable: bool = True) -> None:
        """Called by a memory layer before it updates its entry, when :attr:`records_calls`:
        ``replay`` (a bound method of the layer, kept weakly) redoes the call from ``before``.
        ``replayable=False`` (packed documents) makes a crop into this call raise."""
        record = StepRecord(weakref.WeakMethod(replay), x, mask, before) if replayable else None
        self._calls[-1].layers[layer_idx] = record

    def crop(self, max_length: Union[int, torch.Tensor]) -> None:
        """Go back to the state after ``max_length`` tokens (> 0), or take ``-max_length``
        tokens back (<= 0, as transformers 5.24 calls it; 0 takes nothing back).

        ``max_length`` is a Python int or a 0-d integer tensor (read once); anything else is a
        ``TypeError``. Attention layers drop the columns; memory layers (their states and
        short-conv tails) are recomputed on the kept tokens from their entry before the earliest
        call the crop reaches into. Taking back more than the recorded calls hold (about
        ``rollback_window`` tokens), or any when ``rollback_window`` is 0, is a ``ValueError``.
        A crop that fails leaves the cache as it was.
        """
        max_length = _token_count(max_length)
        remove = -max_length if max_length <= 0 else self.seen_tokens - max_length
        if remove <= 0:
            return
        held = sum(c.length for c in self._calls)
        start, reached = len(self._calls), 0  # the earliest call the crop reaches into
        while reached < remove and start > 0:
            start -= 1
            reached += self._calls[start].length
        memory_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer, MemoryLayerCache)]
        calls = self._calls[start:]
        packed = any(c.layers.get(i, False) is None for c in calls for i in memory_layers)
        unrecorded = any(i not in c.layers for c in calls for i in memory_layers)
        if not self.is_croppable or remove > held or packed or unrecorded:
            why = ("packed documents are not replayed" if packed else f"rollback_window = {self.rollback_window}"
                   + ("" if self.is_croppable else "; 0 keeps nothing to roll back"))
            raise ValueError(
                f"cannot take back {remove} tokens: a TrellisCache rolls back its last {held} tokens ({why})"
            )
        records = {i: StepRecord.joined([c.layers[i] for c in calls]).first(reached - remove) for i in memory_layers}
        with self.all_or_nothing():
            for index, layer in enumerate(self.layers):
                layer.take_back(remove, records.get(index))
            keep = reached - remove
            self._calls[start:] = [CallRecords(keep, records)] if keep else []
            self.seen_tokens -= remove

    @contextmanager
    def all_or_nothing(self) -> Iterator[CacheCall]:
        """Run a block that updates the cache so that it either completes or leaves the cache
        as it was: on any exception (``KeyboardInterrupt`` included) every entry, the token
        count, the rollback records and the model binding are put back. Yields the call's view
        (:class:`CacheCall`), whose entries as the block began are also the backup: cheap, as
        layers replace their entries' tensors, never write into them."""
        call = CacheCall(self)
        calls = [CallRecords(c.length, dict(c.layers)) for c in self._calls]
        seen, signature, window = self.seen_tokens, self.signature, self._rollback_window
        try:
            yield call
        except BaseException:
            for index, layer in enumerate(self.layers):
                before = call.before(index)
                for f in fields(layer):
                    setattr(layer, f.name, getattr(before, f.name))
            self._calls, self.seen_tokens, self.signature, self._rollback_window = calls, seen, signature, window
            raise

    def forget_steps(self) -> None:
        """Drop what a crop would replay: after row operations (beams, selections), which change
        it, and before a call that is not recorded (the model's head of a long call)."""
        self._calls = []

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.forget_steps()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.forget_steps()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.forget_steps()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens (columns of ``input_ids``, padding included) the cache has taken in."""
        return self.seen_tokens

    def add_seen_tokens(self, count: int) -> None:
        """Called by the model once per forward, after every layer has updated."""
        self.seen_tokens += count

    @property
    def batch_size(self) -> Optional[int]:
        """Rows held, or ``None`` before the first forward."""
        # The first layer that holds any (every call writes every layer): read once per forward.
        return next((rows for rows in (layer.rows for layer in self.layers) if rows is not None), None)

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0
        self.forget_steps()

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant in the tokens seen unless the model has
        attention layers)."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors().values())

    def check_compatible(self, config: Any) -> None:
        """Raise a ``ValueError`` naming the first difference between the layers this cache was
        made for and those of ``config``'s model: a continuation would otherwise be silently
        wrong (same shapes, another function) or fail deep inside a layer."""
        if self.kinds != config.layer_kinds:
            raise ValueError(
                f"the cache was made for layers {self.kinds}, the model has {config.layer_kinds} "
                "(config.mixer_types)"
            )
        if self.signature is None:
            return
        # A field the file's model predates is read as what that model computed with.
        recorded = {**getattr(config, "legacy_values", dict)(), **self.signature}
        for name, value in config.layer_signature().items():
            if recorded.get(name) != value:
                raise ValueError(
                    f"the cache was made by a model with {name}={recorded.get(name)!r}, "
                    f"this model has {name}={value!r}"
                )

    def bind(self, config: Any) -> None:
        """Check the cache against ``config``'s model (:meth:`check_compatible`) and, when it
        records no model yet (made from a list of kinds, or read from a file without one), bind
        it to this one: a later model with other layer functions is then refused. A cache read
        from a file that records no model has its tensors checked against this model's layers
        here (shapes, dtypes, counters: what :meth:`load` could not check without a model)."""
        self.check_compatible(config)
        if self.signature is None:
            _check_layers("the cache", self.kinds, self.seen_tokens, config,
                          [{name: (tuple(t.shape), _file_dtype(t)) for name, t in layer.tensors().items()}
                           for layer in self.layers],
                          lambda index, name: self.layers[index].tensors()[name])
            self.signature = config.layer_signature()

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the cache to one safetensors file (tensors, layer kinds, token count, the
        fields its layers were made with)."""
        # safetensors refuses tensors sharing memory (a state's anchor may be its memory).
        tensors = {
            f"layers.{i}.{name}": t.detach().contiguous().clone().cpu()
            for i, layer in enumerate(self.layers)
            for name, t in layer.tensors().items()
        }
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "layer_kinds": json.dumps(self.kinds),
            "seen_tokens": str(self.seen_tokens),
            "signature": json.dumps(self.signature),
        }
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(
        cls, path: Union[str, os.PathLike], device: Union[str, torch.device, None] = None, config: Any = None
    ) -> "TrellisCache":
        """Read a cache written by :meth:`save`, onto ``device`` (default: CPU).

        The file's header is checked against its tensors before any tensor is read: every layer
        holds its whole entry once the cache has seen tokens (and none before), no tensor is
        unknown, and every tensor's shape and dtype is the one the layer's mixer declares
        (``Mixer.cache_layout``: attention columns equal ``seen_tokens``, op states are float32 or
        float64, counters are integers); counters are then checked against their bounds and each
        other. The layers' sizes come from the model the file records (its metadata
        ``signature``), or from ``config`` (the model's config: the file must then record the
        same model, and one that records none is refused).

        Without ``config``, a file that records no model (``signature: null``, e.g. a cache made
        from a list of kinds) can only be checked for what holds whatever the sizes (names,
        dtypes, ranks, rows, columns, counters against the token count); the rest is checked
        when the cache binds to the first model that uses it, before that model reads it.
        """
        if os.path.isdir(path):
            raise ValueError(f"{path} is a folder: expected a cache file written by TrellisCache.save")
        with safe_open(os.fspath(path), framework="pt", device=str(device or "cpu")) as f:
            metadata = f.metadata() or {}
            kinds, seen, signature = _read_header(metadata, path)
            per_layer: list[dict[str, str]] = [{} for _ in kinds]
            for key in f.keys():
                parts = key.split(".", 2)
                if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or int(parts[1]) >= len(kinds):
                    raise ValueError(f"{path}: tensor {key!r} is not 'layers.<index < {len(kinds)}>.<name>'")
                per_layer[int(parts[1])][parts[2]] = key
            cache = cls(kinds)
            cache.signature = signature
            if config is not None:
                if signature is None:
                    raise ValueError(
                        f"{path} records no model (metadata 'signature' is null), so it cannot be checked against "
                        "this one: load it without config= (it is then checked by the first model that uses it)"
                    )
                cache.check_compatible(config)
            elif signature is not None:
                config = _config_of(signature, kinds, path)
            headers = [{name: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype())
                        for name, key in keys.items()} for keys in per_layer]
            tensors = _check_layers(str(path), kinds, seen, config, headers,
                                    lambda index, name: f.get_tensor(per_layer[index][name]))
            cache.layers = [LAYER_CACHES[kind].from_tensors(layer) for kind, layer in zip(kinds, tensors)]
        cache.seen_tokens = seen
        return cache


# safetensors' dtype names, by the kinds a TensorSpec names; an op state's floats are float32 or
# float64 (the ops carry them so in every model dtype).
FILE_DTYPES = {"float": {"F16", "BF16", "F32", "F64"}, "int64": {"I64"}, "bool": {"BOOL"}}
STATE_FLOATS = {"F32", "F64"}
_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.int64: "I64", torch.bool: "BOOL"}


def _file_dtype(tensor: torch.Tensor) -> str:
    """``tensor``'s dtype as safetensors names it (others by torch's name, which no spec accepts)."""
    return _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))


def _config_of(signature: dict, kinds: list[str], path: Any) -> Any:
    """The configuration of the model a cache file records (its metadata ``signature``), which
    gives its layers' sizes: built and checked as any config is."""
    from .configuration_trellis import TrellisConfig  # (it imports the mixers, which import this module)

    if signature.get("mixer_types") != kinds:
        raise ValueError(f"{path}: metadata 'signature' records the layers {signature.get('mixer_types')!r}, "
                         f"'layer_kinds' {kinds}")
    fields = {name: value for name, value in signature.items() if name != "mixer_types"}
    try:
        return TrellisConfig(num_hidden_layers=len(kinds), mixer_types=kinds, **fields)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: metadata 'signature' is not a model this code can build: {error}") from None


def _check_layers(where: str, kinds: list[str], seen: int, config: Any,
                  headers: list[dict[str, tuple[tuple[int, ...], str]]],
                  read: Callable[[int, str], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Check a cache's entries, one ``name -> (shape, safetensors dtype)`` dict per layer of
    ``kinds``, against the layouts of ``config``'s model (``None``: only what holds whatever the
    sizes), all of them before any tensor is read; then read each (``read(layer, name)``) and
    check its counters and values. Returns the tensors per layer; raises a ``ValueError``
    starting with ``where`` and naming the layer."""
    exact = config is not None
    layouts = config.cache_layouts() if exact else _loose_layouts(kinds)
    sizes: dict[str, Optional[int]] = {"rows": None}
    for index, (kind, layer) in enumerate(zip(kinds, headers)):
        _check_entry(f"{where}: layer {index} ({kind})", kind, layer, seen, layouts[index], sizes, exact)
    read_layers = []
    for index, (kind, layer) in enumerate(zip(kinds, headers)):
        tensors = {name: read(index, name) for name in layer}
        _check_counters(f"{where}: layer {index} ({kind})", tensors, layouts[index], seen, exact)
        problem = LAYER_CACHES[kind].value_problem(tensors, config) if tensors else None
        if problem:
            raise ValueError(f"{where}: layer {index} ({kind}): {problem}")
        read_layers.append(tensors)
    return read_layers


def check_entry_tensors(where: str, kind: str, tensors: dict[str, torch.Tensor], config: Any, index: int) -> None:
    """Check the tensors of one memory layer's entry (e.g. a state carried between training
    batches) against layer ``index`` of ``config``'s model, which is of ``kind``: names, shapes,
    dtypes, counters (those bounded by the tokens seen, not known here, only from below) and
    their agreement. Raises a ``ValueError`` starting with ``where``."""
    layout = config.cache_layouts()[index]
    headers = {name: (tuple(t.shape), _file_dtype(t)) for name, t in tensors.items()}
    _check_entry(where, kind, headers, None, layout, {"rows": None}, exact=True)
    _check_counters(where, tensors, layout, None)
    problem = LAYER_CACHES[kind].value_problem(tensors, config)
    if problem:
        raise ValueError(f"{where}: {problem}")


def _loose_layouts(kinds: list[str]) -> list[dict[str, TensorSpec]]:
    """The layouts of ``kinds`` in a model of default sizes: their names, ranks, dtypes and named
    dims hold whatever the sizes (a check without the model reads nothing else of them)."""
    from .configuration_trellis import TrellisConfig  # (it imports the mixers, which import this module)

    return TrellisConfig(num_hidden_layers=len(kinds), mixer_types=kinds).cache_layouts()


def _check_entry(where: str, kind: str, headers: dict[str, tuple[tuple[int, ...], str]], seen: Optional[int],
                 layout: dict[str, TensorSpec], sizes: dict[str, Optional[int]], exact: bool) -> None:
    """Check one layer's tensors (``name -> (shape, safetensors dtype)``) against what its kind
    holds and the ``layout`` its mixer declares (``exact``: for the model's sizes; else only
    names, ranks, dtypes and the dims a name ties together); ``sizes`` carries the batch rows from
    layer to layer; ``seen``: the tokens the entry has seen (``None``: not known, an entry that
    holds tensors has seen some). Raises a ``ValueError`` starting with ``where``."""
    entry = LAYER_CACHES[kind]
    known = layout.keys() if exact else entry.tensor_names()
    unknown = sorted(set(headers) - set(known))
    if unknown:
        raise ValueError(f"{where} holds an unknown tensor {unknown[0]!r}; its entry holds {sorted(known)}")
    if seen is not None and not seen:
        if headers:
            raise ValueError(f"{where} holds tensors {sorted(headers)}, but the cache has seen no tokens (seen_tokens = 0)")
        return
    if not headers:
        raise ValueError(
            f"{where} holds no state, although the cache has seen {seen} tokens (seen_tokens): the layer would "
            "silently restart from its initial memories"
        )
    required = list(layout) if exact else entry.required_names()
    missing = [name for name in required if name not in headers]
    if missing:
        raise ValueError(
            f"{where}: a {kind} layer's state needs tensors {required}, the file holds {sorted(headers)} (missing {missing})"
        )
    state = set(entry.state_names())
    layer_sizes = dict(sizes, columns=seen)
    for name, (shape, dtype) in headers.items():
        spec = layout.get(name)
        if spec is None:  # (a tail, checked against a model without short convs: the model checks it)
            continue
        allowed = STATE_FLOATS if spec.dtype == "float" and name in state else FILE_DTYPES[spec.dtype]
        if dtype not in allowed:
            raise ValueError(f"{where} tensor {name!r} has dtype {dtype}, the model needs one of {sorted(allowed)}")
        fits = len(shape) == len(spec.dims)
        for size, dim in zip(shape, spec.dims) if fits else ():
            if isinstance(dim, int):
                fits = fits and (size == dim or not exact)
            else:
                fits = fits and (dim.most is None or size <= dim.most or not exact)
                fits = fits and layer_sizes.get(dim.name) in (None, size)
                layer_sizes[dim.name] = size
        if not fits:
            raise ValueError(
                f"{where} tensor {name!r} has shape {list(shape)}, the model needs {_describe(spec.dims, exact)} "
                f"(rows = {sizes['rows'] or 'as the other tensors'}"
                + (f", columns = seen_tokens = {seen})" if seen is not None else ")")
            )
    sizes["rows"] = layer_sizes.get("rows", sizes["rows"])


def _describe(dims: tuple[Union[int, Dim], ...], exact: bool = True) -> str:
    def one(dim: Union[int, Dim]) -> str:
        if isinstance(dim, int):
            return str(dim) if exact else "a size of the model"
        return dim.name + (f" <= {dim.most}" if dim.most is not None and exact else "")

    return "[" + ", ".join(map(one, dims)) + "]"


def _check_counters(where: str, tensors: dict[str, torch.Tensor], layout: dict[str, TensorSpec], seen: Optional[int],
                    exact: bool = True) -> None:
    """Counters (``TensorSpec.most``) must lie in ``[0, most]``: a state's offsets and token
    counts index into its buffers (``most`` from the model's sizes is checked when ``exact``;
    ``COLUMNS``, the tokens seen, always)."""
    for name, spec in layout.items():
        if spec.most is None or name not in tensors or tensors[name].numel() == 0:
            continue
        most = seen if spec.most is COLUMNS else spec.most if exact else None  # (seen None: not known)
        low, high = int(tensors[name].min()), int(tensors[name].max())
        if low < 0 or (most is not None and high > most):
            bound = f"seen_tokens = {seen}" if spec.most is COLUMNS else str(most) if exact else "the model's bound"
            raise ValueError(f"{where} tensor {name!r} holds values in [{low}, {high}], allowed: [0, {bound}]")


def _token_count(value: Any) -> int:
    """``value`` as a Python int: an int, or a 0-d integer tensor (what some transformers
    versions pass), read once; a bool, a float or anything else is a ``TypeError``."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value.item())
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"max_length must be an int or a 0-d integer tensor, got {value!r}")


def one_cache(cache: Any, past_key_values: Any) -> Any:
    """The cache given under either of its names (:data:`CACHE_NAMES`), or ``None``; both at
    once is a ``ValueError`` (which one should win is not ours to guess)."""
    if cache is not None and past_key_values is not None:
        raise ValueError("pass the cache once, as `cache` or as `past_key_values` (the same argument), not both")
    return cache if cache is not None else past_key_values


def _read_header(metadata: Mapping[str, str], path: Any) -> tuple[list[str], int, Optional[dict]]:
    """``(layer kinds, seen tokens, signature)`` from a cache file's metadata, checked."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} is not a Trellis cache file (metadata format: {metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path} holds cache format version {version!r}, this code reads {FORMAT_VERSION!r} "
            "(re-create the cache by running the model on the text again)"
        )

    def field(name: str, parse: Callable[[str], Any], expected: str) -> Any:
        try:
            return parse(metadata[name])
        except (KeyError, ValueError, TypeError) as error:
            raise ValueError(f"{path}: metadata {name!r} must be {expected}, got {metadata.get(name)!r}") from error

    def count(text: str) -> int:
        if not text.isdigit():
            raise ValueError(text)
        return int(text)

    seen = field("seen_tokens", count, "a whole number >= 0")

    def kinds_list(text: str) -> list[str]:
        kinds = json.loads(text)
        if not isinstance(kinds, list) or not all(kind in LAYER_CACHES for kind in kinds):
            raise ValueError(text)
        return kinds

    def signature(text: str) -> Optional[dict]:
        value = json.loads(text)
        if value is not None and not isinstance(value, dict):
            raise ValueError(text)
        return value

    kinds = field("layer_kinds", kinds_list, f"a JSON list of layer kinds among {sorted(LAYER_CACHES)}")
    return kinds, seen, field("signature", signature, "a JSON object or null")


__all__ = [
    "CACHE_ARG", "CACHE_NAMES", "one_cache", "AttentionLayerCache", "check_entry_tensors", "CacheCall", "LayerCache", "MemoryLayerCache", "TrellisCache",
    "register_layer_cache", "same_definition",
]
