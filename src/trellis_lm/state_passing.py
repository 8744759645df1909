"""State passing: train the memory layers on the states of long reads.

A model trained on windows of T tokens, each read from the learned initial memories, only ever
meets the states of a T-token read; reading further, it meets states it never trained on, and
its perplexity climbs (``docs/results_lm_extrapolation.md``: reading with a fresh state every 1024
tokens removes the whole degradation). State passing (Buitrago Ruiz and Gu, 2025, "Understanding
and Improving Length Generalization in Recurrent Models") starts each training row from the final
state of a row of the previous batch, detached (no gradient crosses batches): chained over steps,
rows start from the states of reads many windows long, at no extra compute. With probability
``1 - probability`` a row starts from the learned memories instead, so the start of a read keeps
being trained too.

What is carried, per layer kind: Trellis and Lattice layers their memories (with chunk anchors and
offset) and short-conv tails, KVM layers their means and window (with their token counters, so
RoPE positions continue as in a long read). Attention layers of a hybrid keep their window
semantics: they are never carried, each row attends to its own tokens only.

Use it with the Trainer (:class:`StatePassingCallback`, what the recipes' ``state_passing``
option adds), or in a loop of your own::

    passing = StatePassing(probability=0.9)
    with passing.attached(model):          # forward hooks on the model's TrellisModel
        for batch in batches:
            loss = model(**batch).loss     # rows start from the previous batch's final states
            ...

A loop that stops and resumes saves the carried states with its checkpoints
(:meth:`StatePassing.save`) and loads them into a ``StatePassing`` of the same seed before its
first resumed step (:meth:`StatePassing.load`; ``docs/architecture.md``, "State passing in a
training loop of one's own"); the callback does it for the Trainer.

The model itself holds nothing: the carried states live in the :class:`StatePassing` object, and
a model trained this way saves, loads and generates like any other. Rows are matched by index;
a batch with more rows than the previous one starts the extra rows fresh. In a row that packs
several documents (``position_ids`` restarting), only the row's first document starts from the
carried state; pad rows instead (the pretraining recipe does when state passing is on).
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
from safetensors import safe_open
from torch import nn
from transformers import Trainer, TrainerCallback

from .cache_entries import MemoryEntry, MemoryLayerCache
from .cache_files import (
    STATE_FILE, check_entry_headers, check_entry_values, check_signature, checked_path, layer_keys, read_header,
    write_entries,
)
from .cache_trellis import CACHE_NAMES, TrellisCache
from .layer_kinds import layer_signature
from .modeling_trellis import TrellisModel
from .ops.trellis.state import TrellisState

CHECKPOINT_NAME = "state_passing-rank{rank}.safetensors"
# The recipes' default (issue 35, docs/results_lm_extrapolation.md): p = 0.9 over the last 30% of
# the steps. In the study (2 seeds each, trained at 128 tokens) it took Trellis's perplexity at
# 4096-8192 tokens from 3.6x its first bucket's to 1.02x, for +2.5% at the training length;
# from the first step it cost 50% there, over the last fifth only it left the far buckets 1.6x.
DEFAULT_PROBABILITY = 0.9
DEFAULT_START_FRACTION = 0.7


def trellis_model(model: nn.Module) -> TrellisModel:
    """The :class:`TrellisModel` inside ``model`` (a causal LM, a PEFT or DDP wrapper, ...)."""
    found = next((m for m in model.modules() if isinstance(m, TrellisModel)), None)
    if found is None:
        raise ValueError(f"state passing needs a Trellis model; {type(model).__name__} holds no TrellisModel")
    return found


class StatePassing:
    """Carries each training row's final memory states to the next batch's rows.

    Args:
        probability: the chance that a row starts from a carried state (else from the learned
            initial memories); in ``(0, 1]``.
        seed: seeds the per-row draws (a resumed run continues their sequence).
        decay: ``None`` (the default): a row starts from the carried state as it is. A number
            ``d`` in ``[0, 1)``: from the carried memories moved toward the learned initial ones,
            ``M0 + d (M - M0)`` for each memory (anchors too; the short-conv tails, the last
            tokens' inputs, are kept), so rows meet states between a fresh read's and a long
            read's. Trellis layers only: Lattice's slots are unit vectors and KVM's state is
            tokens and means, which no such blend keeps (a model with them is refused when the
            first carried state is given).
    """

    def __init__(self, probability: float = 0.9, seed: int = 0, decay: Optional[float] = None) -> None:
        if isinstance(probability, bool) or not isinstance(probability, (int, float)) or not 0 < probability <= 1:
            raise ValueError(f"state passing's probability must be a number in (0, 1], got {probability!r}")
        if decay is not None and (isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1):
            raise ValueError(f"state passing's decay must be None or a number in [0, 1), got {decay!r}")
        self.probability = float(probability)
        self.decay = None if decay is None else float(decay)
        self.generator = torch.Generator().manual_seed(seed)
        # Per layer index, the memory entries of the last training batch's rows, and the fields
        # that define the function of the model that made them.
        self.carried: dict[int, MemoryEntry] = {}
        self.signature: Optional[dict[str, Any]] = None
        self.kinds: list[str] = []  # the layer kinds of the model that made them
        self._given: Optional[TrellisCache] = None  # the cache the running forward got from us

    @contextmanager
    def attached(self, model: nn.Module) -> Iterator["StatePassing"]:
        """Hooks for the block's duration: every forward of ``model``'s :class:`TrellisModel` in
        training mode without a cache of its own gets the carried states as its initial cache,
        and leaves its final states to the next one once the call of ``model`` itself returns
        (a call that raises, e.g. in its loss, leaves the carried states as they were).
        Evaluation forwards are untouched."""
        base = trellis_model(model)
        handles = [model.register_forward_pre_hook(self._call_begins),
                   base.register_forward_pre_hook(self._before, with_kwargs=True),
                   model.register_forward_hook(self._call_ends)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def initial_cache(self, model: TrellisModel, rows: int) -> TrellisCache:
        """A cache holding the initial state of ``rows`` rows: each row takes the carried state
        of the same row of the last batch with probability ``probability`` (rows the last batch
        did not have start fresh), else the learned initial memories. It counts no tokens, so
        attention masks span the batch's own tokens only."""
        cache = TrellisCache(model.config)
        if not self.carried:
            return cache
        take = torch.rand(rows, generator=self.generator) < self.probability
        for index, carried in self.carried.items():
            held = carried.state.rows
            keep = take & (torch.arange(rows) < held)
            if not bool(keep.any()):
                continue
            rows_of = torch.arange(rows).clamp(max=held - 1)
            picked = carried.map(lambda t: t.index_select(0, rows_of.to(t.device)))
            mixer = model.layers[index].self_attn
            if self.decay is not None:
                picked = self._toward_initial(mixer, picked, index, model.config.layer_kinds[index])
            cache.layers[index].hold(mixer.fresh_rows(picked, ~keep))
        return cache

    def _toward_initial(self, mixer: nn.Module, entry: MemoryEntry, index: int, kind: str) -> MemoryEntry:
        """``entry``'s memories moved toward ``mixer``'s learned initial ones by ``decay`` (see
        the class doc); a graph to the initial memories, as a fresh row's."""
        if not isinstance(entry.state, TrellisState):
            raise ValueError(f"state passing's decay blends Trellis memories only; layer {index} is a {kind} layer "
                             "(use decay=None with this model)")
        fresh = mixer.fresh_state(entry.state.rows).tensors()
        blended = {name: t if not t.is_floating_point() else fresh[name] + self.decay * (t - fresh[name])
                   for name, t in entry.state.tensors().items()}
        return entry._replace(state=TrellisState(**blended))

    def keep_final(self, cache: TrellisCache) -> None:
        """Keep the memory layers' entries of ``cache`` (detached) for the next batch."""
        self.signature, self.kinds = cache.signature, cache.kinds
        self.carried = {
            index: layer.entry.map(torch.Tensor.detach)
            for index, layer in enumerate(cache.layers)
            if isinstance(layer, MemoryLayerCache) and layer.state is not None
        }

    def _before(self, module: TrellisModel, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
        # A training forward without a cache of its own (an explicit cache is the caller's).
        if not (module.training and torch.is_grad_enabled()) or any(kwargs.get(n) is not None for n in CACHE_NAMES):
            return None
        inputs = next(t for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args) if t is not None)
        self._given = self.initial_cache(module, inputs.shape[0])
        return args, dict(kwargs, cache=self._given, use_cache=True)

    def _call_begins(self, module: nn.Module, args: tuple) -> None:
        self._given = None  # (what a call that raised left)

    def _call_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        # All or nothing: the states are kept only once the whole call (loss included) returned.
        if self._given is not None:
            self.keep_final(self._given)
        self._given = None

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the carried states, the draws' generator and the fields that define the model
        that made the states to one safetensors file."""
        layers = {index: entry.tensors() for index, entry in self.carried.items()}
        write_entries(path, STATE_FILE, self.kinds, layers, self.signature,
                      metadata={"probability": repr(self.probability)},
                      tensors={"generator": self.generator.get_state()})

    def load(self, path: Union[str, os.PathLike], model: nn.Module) -> None:
        """Read what :meth:`save` wrote, for ``model``: the file must hold the generator, and
        states of ``model``'s memory layers only, made by a model with the same layer functions
        (the fields the file records; files written before it recorded them are checked by
        shape), each of the shapes and dtypes the layer's mixer declares. Anything else is a
        ``ValueError`` naming the file and what differs; nothing is changed then."""
        where = checked_path(path, STATE_FILE)
        base = trellis_model(model)
        config = base.config
        device = next(base.parameters()).device
        # As a cache file is read: the header and every tensor's shape and dtype first, then the tensors.
        with safe_open(where, framework="pt") as f:
            header = read_header(f.metadata() or {}, where, STATE_FILE)
            shapes = {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
            generator = shapes.pop("generator", None)
            if generator is None or generator[1] != "U8" or len(generator[0]) != 1:
                raise ValueError(f"{where} holds no 'generator' (the per-row draws' random state, a uint8 vector): not a "
                                 "file StatePassing.save wrote")
            check_signature(header.signature, config, f"{where}: the states were carried")
            layers = {}
            for index, keys in sorted(layer_keys(shapes, where).items()):
                kind = config.layer_kinds[index] if index < len(config.layer_kinds) else None
                entry_class = base.layers[index].self_attn.cache_class if kind is not None else None
                if entry_class is None or not issubclass(entry_class, MemoryLayerCache):
                    raise ValueError(f"{where} holds a state for layer {index}, which is "
                                     f"{'not in the model' if kind is None else f'a {kind} layer, which carries none'} "
                                     f"(the model's layers: {config.layer_kinds})")
                layer = f"{where}: layer {index} ({kind})"
                check_entry_headers(layer, kind, {name: shapes[key] for name, key in keys.items()}, config, index)
                layers[index] = (layer, kind, entry_class, keys)
            if header.kinds is not None and header.kinds != config.layer_kinds:
                raise ValueError(f"{where}: the states were carried by a model with the layers {header.kinds}, this "
                                 f"model has {config.layer_kinds} (config.mixer_types)")
            carried = {}
            for index, (layer, kind, entry_class, keys) in layers.items():
                named = {name: f.get_tensor(key) for name, key in keys.items()}
                check_entry_values(layer, kind, named, config, index)
                carried[index] = entry_class.from_tensors({name: t.to(device) for name, t in named.items()}).entry
            generator = f.get_tensor("generator")
        self.generator.set_state(generator)
        self.carried, self.signature, self.kinds = carried, layer_signature(config), list(config.layer_kinds)


class StatePassingCallback(TrainerCallback):
    """State passing for a :class:`transformers.Trainer` run (see the module doc).

    Args:
        probability: the chance that a row starts from a carried state.
        start_fraction: state passing begins at this fraction of ``max_steps`` (0: from the first
            step). The recipes pass ``DEFAULT_START_FRACTION``, 0.7: over the last 30%, a
            post-training as the paper applies it, which in the language-modelling study kept
            perplexity at the training length within 2.5% where passing from the first step cost
            50% (``docs/results_lm_extrapolation.md``).
        seed: seeds the per-row draws (plus the process's rank).

    Attaches to the model when state passing begins and detaches when training ends; every
    checkpoint holds each process's carried states (``state_passing-rank{r}.safetensors``), and a
    run resumed from a checkpoint continues from them. Works with gradient accumulation (each
    micro-batch starts from the previous one's states), several processes (each carries its own
    rows) and activation checkpointing.
    """

    def __init__(self, probability: float = DEFAULT_PROBABILITY, start_fraction: float = 0.0, seed: int = 0) -> None:
        if isinstance(start_fraction, bool) or not isinstance(start_fraction, (int, float)) or not 0 <= start_fraction < 1:
            raise ValueError(f"state passing's start_fraction must be a number in [0, 1), got {start_fraction!r}")
        self.passing = StatePassing(probability, seed)  # checks the probability now, not at the first step
        self.start_fraction, self.seed = start_fraction, seed
        self._start = 0  # the first step that passes states (set when training begins)
        self._model: Optional[nn.Module] = None
        self._attached: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        rank = max(args.process_index, 0)
        self.passing = StatePassing(self.passing.probability, seed=self.seed + rank)
        self._start = int(self.start_fraction * state.max_steps)
        if state.global_step:  # a resumed run
            folder = resumed_checkpoint(args, state)
            saved = folder / CHECKPOINT_NAME.format(rank=rank)
            if saved.exists():
                self.passing.load(saved, model)
            elif state.global_step > self._start:  # (a checkpoint saved while states were passed has one)
                warnings.warn(
                    f"resuming from {folder}, which holds no {saved.name}: the states carried up to step "
                    f"{state.global_step} are lost, training rows start from the learned memories again",
                    RuntimeWarning, stacklevel=2,
                )
        self._model = model
        self.on_step_begin(args, state, control)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._attached is None and state.global_step >= self._start:
            self._attached = self.passing.attached(self._model)
            self._attached.__enter__()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self._attached is not None and folder.is_dir():
            self.passing.save(folder / CHECKPOINT_NAME.format(rank=max(args.process_index, 0)))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._attached is not None:
            self._attached.__exit__(None, None, None)
            self._attached = None


def resumed_checkpoint(args: Any, state: Any) -> Path:
    """The checkpoint folder the running Trainer resumed from (``state.global_step`` > 0).

    The Trainer tells its callbacks the state it restored, not where it read it: the folder is
    the ``resume_from_checkpoint`` argument its training loop holds (resolved, ``True`` made a
    path), read from the calling frames, which finds it wherever it is and whatever it is named.
    Where no Trainer frame holds one (callbacks called by a loop of one's own), it is the
    Trainer's own name for the step's checkpoint in ``args.output_dir``."""
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            folder = frame.f_locals.get("resume_from_checkpoint")
            if isinstance(folder, (str, os.PathLike)):
                return Path(folder)
        frame = frame.f_back
    return Path(args.output_dir) / f"checkpoint-{state.global_step}"


__all__ = ["StatePassing", "StatePassingCallback", "resumed_checkpoint", "trellis_model"]
