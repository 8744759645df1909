"""The generation cache of Trellis models (:class:`TrellisCache`): one entry per layer, of the
layer's kind (:mod:`.cache_entries`), the tokens seen, the fields that define the layers'
functions (so that a model refuses a cache made by another model, :meth:`TrellisCache.check_compatible`),
and the records that let a crop take recent tokens back. Its file: :mod:`.cache_files`.
"""

from __future__ import annotations

import copy
import os
import weakref
from contextlib import contextmanager
from dataclasses import fields
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from safetensors import safe_open
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast

from .cache_entries import LAYER_CACHES, CallRecords, LayerCache, MemoryEntry, MemoryLayerCache, StepRecord
from .cache_files import (
    CACHE_FILE, check_layers, check_signature, checked_path, config_of, file_dtype, layer_keys, read_header, write_entries,
)
from .configuration_trellis import TrellisConfig
from .layer_kinds import layer_signature

# The name transformers gives the generation cache, as an argument of `forward` and
# `prepare_inputs_for_generation`, a key of `generate()`'s model kwargs and a field of model
# outputs: `past_key_values` up to 5.23, `cache` from 5.24 on (read off the output classes, so
# no version number is compared). The models accept both names and write this one.
CACHE_ARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
CACHE_NAMES = ("cache", "past_key_values")

# The rollback window a cache gets when transformers asks it to record its past (assisted
# decoding): more than the drafts a verification feeds by default (20 and one token).
DEFAULT_ROLLBACK_WINDOW = 64

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

    def __init__(self, config: Union[TrellisConfig, Sequence[str]], rollback_window: int = 0) -> None:
        if hasattr(config, "layer_kinds"):
            kinds, signature = config.layer_kinds, layer_signature(config)
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
                tensors = [record.x, record.mask, *record.before.tensors().values()]
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

    def record_step(self, layer_idx: int, replay: Callable[[StepRecord], MemoryEntry], x: torch.Tensor,
                    mask: Optional[torch.Tensor], before: MemoryEntry, replayable: bool = True) -> None:
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

    def check_compatible(self, config: TrellisConfig) -> None:
        """Raise a ``ValueError`` naming the first difference between the layers this cache was
        made for and those of ``config``'s model: a continuation would otherwise be silently
        wrong (same shapes, another function) or fail deep inside a layer."""
        if self.kinds != config.layer_kinds:
            raise ValueError(
                f"the cache was made for layers {self.kinds}, the model has {config.layer_kinds} "
                "(config.mixer_types)"
            )
        check_signature(self.signature, config, "the cache was made")

    def bind(self, config: TrellisConfig) -> None:
        """Check the cache against ``config``'s model (:meth:`check_compatible`) and, when it
        records no model yet (made from a list of kinds, or read from a file without one), bind
        it to this one: a later model with other layer functions is then refused. A cache read
        from a file that records no model has its tensors checked against this model's layers
        here (shapes, dtypes, counters: what :meth:`load` could not check without a model)."""
        self.check_compatible(config)
        if self.signature is None:
            check_layers("the cache", self.kinds, self.seen_tokens, config,
                         [{name: (tuple(t.shape), file_dtype(t)) for name, t in layer.tensors().items()}
                          for layer in self.layers],
                         lambda index, name: self.layers[index].tensors()[name])
            self.signature = layer_signature(config)

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the cache to one safetensors file (tensors, layer kinds, token count, the
        fields its layers were made with)."""
        write_entries(path, CACHE_FILE, self.kinds, {i: layer.tensors() for i, layer in enumerate(self.layers)},
                      self.signature, seen=self.seen_tokens)

    @classmethod
    def load(
        cls, path: Union[str, os.PathLike], device: Union[str, torch.device, None] = None, config: Optional[TrellisConfig] = None
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
        where = checked_path(path, CACHE_FILE)
        with safe_open(where, framework="pt", device=str(device or "cpu")) as f:
            header = read_header(f.metadata() or {}, path, CACHE_FILE)
            kinds, seen, signature = header.kinds, header.seen, header.signature
            keys = layer_keys(f.keys(), path, len(kinds))
            per_layer = [keys.get(index, {}) for index in range(len(kinds))]
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
                config = config_of(signature, kinds, path)
            headers = [{name: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype())
                        for name, key in keys.items()} for keys in per_layer]
            tensors = check_layers(str(path), kinds, seen, config, headers,
                                   lambda index, name: f.get_tensor(per_layer[index][name]))
            cache.layers = [LAYER_CACHES[kind].from_tensors(layer) for kind, layer in zip(kinds, tensors)]
        cache.seen_tokens = seen
        return cache


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


__all__ = ["CACHE_ARG", "CACHE_NAMES", "CacheCall", "TrellisCache", "one_cache"]
