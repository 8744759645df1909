"""The vLLM model class of Trellis checkpoints: every schedule of memory and attention layers.

The blocks are trellis_lm's own (:class:`~trellis_lm.modeling_trellis.TrellisDecoderLayer`,
same module names, so a checkpoint saved by ``save_pretrained`` loads as it is); each block
gets a *serving* child that runs its mixer on vLLM's flat batch:

- a memory layer (Trellis, Lattice, KVM) is a vLLM recurrent-state layer (``MambaBase``): its
  state lives in vLLM's state blocks, one per running sequence (and one per draft position under
  speculative decoding, as vLLM keeps them for its own recurrent layers), laid out as the mixer
  declares (:class:`~.slots.SlotLayout`), and :func:`~.slots.run_on_slots` runs the mixer's own
  function on the step's sequences;
- an attention layer projects and rotates as the mixer does and attends through vLLM's paged
  ``Attention`` (its KV cache, its CPU or GPU kernels).

The model runs eagerly (no ``torch.compile`` by vLLM, no CUDA graphs): the memory layers'
work per step is the ops' own (Triton kernels on a GPU), and a step's Python stays outside
any graph. A checkpoint saved with ``compile_decode`` has its Trellis and Lattice mixers' rows
of one token and of draft tokens compiled on a CPU (:func:`~.slots.compile_rows`, as the
weights load), the slot logic around them eager. The blocks' projections, the embedding and
the head are vLLM's parallel layers (:mod:`.parallel_layers`), which split the heads across
tensor-parallel ranks (:mod:`.parallel`); pipeline parallelism is refused (see ``docs/serving.md``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import get_temporal_copy_spec
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheSpec

from ...configuration_trellis import TrellisConfig
from ...layer_kinds import MIXERS
from ...mixers import MemoryMixer, Mixer
from ...mixers.norms_convs import TrellisRMSNorm
from ...modeling_trellis import TrellisDecoderLayer, TrellisMLP
from .allocator import keep_freed_memory
from .parallel import rank_config
from .parallel_layers import Destination, packed_modules, parallel_block
from .slots import SlotLayout, SlotStep, compile_rows, compiles_rows, plan_slots, prefill_once, run_on_slots
from .state_backend import StepGroup, register_backend, step_groups


def slot_layouts(config: TrellisConfig, dtype: torch.dtype) -> dict[str, SlotLayout]:
    """The slot layout of every memory kind among ``config``'s layers, by kind."""
    return {kind: SlotLayout(MIXERS[kind], config, dtype) for kind in dict.fromkeys(config.layer_kinds)
            if issubclass(MIXERS[kind], MemoryMixer)}


def served_config(vllm_config: VllmConfig) -> TrellisConfig:
    """The config of the model one rank serves (:func:`~.parallel.rank_config`)."""
    return rank_config(vllm_config.model_config.hf_config, vllm_config.parallel_config.tensor_parallel_size)


def engine_layouts(vllm_config: VllmConfig) -> dict[str, SlotLayout]:
    """:func:`slot_layouts` for the engine: a rank's heads."""
    return slot_layouts(served_config(vllm_config), vllm_config.model_config.dtype)


def _layer_metadata(prefix: str) -> Any:
    """This step's metadata of the layer named ``prefix`` (``None`` in vLLM's profiling runs)."""
    metadata = get_forward_context().attn_metadata
    return metadata.get(prefix) if isinstance(metadata, dict) else None


# The plans of the last step's metadata (vLLM makes one metadata object per step and group of
# layers, which its layers share): the step's checks, row orders and indices, made by its first
# memory layer and read by the others (a step's bookkeeping was a fifth of a 16-sequence decode
# step, four layers each making it; BENCHMARKS.md, issue 75). The metadata is held, so its id is
# not reused while its plans are.
_last_plans: dict[str, Any] = {"metadata": None, "plans": {}}


def step_plans(metadata: Any, count: int, tokens: int, compiled: bool) -> list[tuple[StepGroup, SlotStep]]:
    """The step's groups (:func:`~.state_backend.step_groups`) with their :func:`~.slots.plan_slots`
    for layers of ``count`` slots over ``tokens`` tokens, made once per step's ``metadata``."""
    if _last_plans["metadata"] is not metadata:
        _last_plans.update(metadata=metadata, plans={})
    key = (count, tokens, compiled)
    plans = _last_plans["plans"]
    if key not in plans:
        plans[key] = [(group, plan_slots(group.starts, group.computed, group.slots, group.accepted, count, tokens,
                                         compiled)) for group in step_groups(metadata)]
    return plans[key]


class MemoryStateLayer(nn.Module, MambaBase):
    """A memory mixer as a vLLM state layer; holds no weights (the mixer, its sibling, does).

    Args:
        mixer: the block's memory mixer.
        vllm_config: the engine's configuration.
        prefix: the layer's name (vLLM finds its state and metadata by it).
        layout: what a slot of the mixer's kind holds (:func:`slot_layouts`).
        page_bytes: the bytes every memory layer's slot is padded to (the largest kind's), so
            layers of different kinds share one page size.
    """

    def __init__(self, mixer: MemoryMixer, vllm_config: VllmConfig, prefix: str, layout: SlotLayout,
                 page_bytes: int) -> None:
        nn.Module.__init__(self)
        self._mixer = (mixer,)  # not a child module: the block owns it and its weights
        self.prefix = prefix
        self.layout = layout
        self.page_bytes = page_bytes
        self.kv_cache: tuple[torch.Tensor, ...] = ()
        self.slot_tensors: tuple[torch.Tensor, ...] = ()
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self

    @property
    def mixer(self) -> MemoryMixer:
        return self._mixer[0]

    # vLLM sees a slot as one run of bytes (one state "field"), which its copy function moves
    # whole; the layout reads the typed tensors from it.
    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return ((self.layout.nbytes,),)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return (torch.uint8,)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's pages (``[S, 1, 1, P]`` bytes): kept as vLLM binds them (its copy functions
        read ``kv_cache[0]``), and read as the layout's tensors (``slot_tensors``)."""
        super().bind_kv_cache(kv_cache)
        self.slot_tensors = self.layout.views(self.kv_cache[0])

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # vLLM's generic state-layer metadata: each sequence's state blocks, and under speculative
        # decoding the tokens its last row kept (state_backend.py).
        return register_backend()

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        spec = super().get_kv_cache_spec(vllm_config)
        return dataclasses.replace(spec, page_size_padded=max(spec.page_size_padded or 0, self.page_bytes))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [N, D]`` (the block's normed input) -> ``[N, D]``."""
        metadata = _layer_metadata(self.prefix)
        if metadata is None:  # a profiling run: no states, only the cost of the work
            return self.mixer(x[None])[0]
        out = torch.zeros_like(x)
        compiled = self.mixer.config.compile_decode and compiles_rows(self.mixer, x.device)
        for group, plan in step_plans(metadata, self.slot_tensors[0].shape[0], x.shape[0], compiled):
            run_on_slots(self.mixer, self.layout, self.slot_tensors, x, group.starts, group.computed, group.slots,
                         group.accepted, compiled=compiled, out=out, plan=plan)
        return out


class PagedAttentionLayer(nn.Module):
    """A softmax-attention mixer's projections and RoPE around vLLM's paged ``Attention``."""

    def __init__(self, mixer: Mixer, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = mixer.config
        self._mixer = (mixer,)  # not a child module: the block owns it and its weights
        self.attn = Attention(
            config.num_heads, config.head_dim, mixer.scaling, num_kv_heads=config.key_value_heads,
            cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn",
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x [N, D]`` at ``positions [N]`` -> ``[N, D]``."""
        mixer = self._mixer[0]
        tokens = x.shape[0]
        q, k, v = (t[0].transpose(0, 1).reshape(tokens, -1) for t in mixer.rotated_qkv(x[None], positions[None]))
        return mixer.o_proj(self.attn(q, k, v))


class TrellisStack(nn.Module):
    """Embeddings, blocks (each with its serving child ``serving``) and the final norm; the
    blocks of ``config``, a rank's share of the model (:mod:`.parallel`), on vLLM's parallel
    layers (:mod:`.parallel_layers`). ``destinations``: where each of the checkpoint's tensors
    under ``prefix`` loads."""

    def __init__(self, config: TrellisConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        whole = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(TrellisDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.destinations = {f"{prefix}.{name}": Destination(f"{prefix}.{name}", None, torch.Size(shape)) for name, shape in
                             (("embed_tokens.weight", (whole.vocab_size, whole.hidden_size)), ("norm.weight", (whole.hidden_size,)))}
        layouts = engine_layouts(vllm_config)
        page_bytes = max((layout.nbytes for layout in layouts.values()), default=0)
        for i, layer in enumerate(self.layers):
            self.destinations.update(parallel_block(layer, whole, f"{prefix}.layers.{i}"))
            name = f"{prefix}.layers.{i}.serving"
            mixer = layer.self_attn
            layer.serving = (MemoryStateLayer(mixer, vllm_config, name, layouts[mixer.kind], page_bytes)
                             if isinstance(mixer, MemoryMixer) else PagedAttentionLayer(mixer, vllm_config, name))

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            hidden = layer.around(hidden, lambda x, layer=layer: layer.serving(x, positions))
        return self.norm(hidden)


class TrellisForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """A Trellis checkpoint in vLLM (any ``mixer_types``; see the module doc).

    vLLM treats it as a hybrid model: the memory layers' states in its state slots, the
    attention layers (where there are any) in its paged KV cache.
    """

    # The projections each stacked layer holds (vLLM's declaration of them, :mod:`.parallel_layers`).
    packed_modules_mapping = packed_modules((*dict.fromkeys(MIXERS.values()), TrellisMLP))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        if vllm_config.device_config.device_type == "cpu":
            keep_freed_memory()  # a prefill step's temporaries, not faulted in again at every step
        self.draft_width = 1 + vllm_config.num_speculative_tokens
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = TrellisStack(served_config(vllm_config), vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        else:
            self.model.destinations["lm_head.weight"] = Destination("lm_head.weight", None, self.model.destinations[
                "model.embed_tokens.weight"].shape)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Optional[torch.Tensor], positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the checkpoint's tensors, by the names ``save_pretrained`` gave them, through
        the ``weight_loader`` of the parameter each goes to (its shard of a stacked layer, this
        rank's share: :mod:`.parallel_layers`). A name the model lacks, or a shape other than
        the whole model's, is an error (a tied head's copy is skipped)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            where = self.model.destinations.get(name)
            if where is None:
                raise ValueError(f"the checkpoint holds {name!r}, which a {type(self).__name__} with this config lacks")
            if tensor.shape != where.shape:
                raise ValueError(f"the checkpoint's {name!r} has shape {tuple(tensor.shape)}; a {type(self).__name__} "
                                 f"with this config takes {tuple(where.shape)}")
            param = params[where.param]
            load = getattr(param, "weight_loader", default_weight_loader)
            if where.shard is None:
                load(param, tensor)
            else:
                load(param, tensor, where.shard)
            loaded.add(where.param)
        return loaded

    def process_weights_after_loading(self) -> None:
        """What vLLM runs once every layer has processed its loaded weights (on a CPU: packed
        them for oneDNN): under ``compile_decode``, the memory layers' rows compiled now, through
        the packed products, not in a request's step (see docs/serving.md); under
        ``op_backend="compiled"``, one prefill through them, which compiles the op's substitution."""
        if not (self.config.compile_decode or self.config.op_backend == "compiled"):
            return
        self.eval()  # as vLLM runs it after loading (the compiled functions guard on the mode)
        like = self.model.embed_tokens.weight
        for layer in self.model.layers:
            if isinstance(layer.serving, MemoryStateLayer):
                if self.config.compile_decode:
                    compile_rows(layer.serving.mixer, layer.serving.layout, like, self.draft_width)
                if self.config.op_backend == "compiled":
                    prefill_once(layer.serving.mixer, layer.serving.layout, like)

    # What vLLM asks of a hybrid model class before building it: the state of one sequence in
    # one layer (the largest kind's slot, in bytes: every memory layer's page is that size) ...
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        layouts = engine_layouts(vllm_config)
        return ((max((layout.nbytes for layout in layouts.values()), default=0),),)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return (torch.uint8,)

    # ... and how to copy a state from one block to another (prefix caching's "align" mode):
    # a slot is one field, copied whole.
    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        return (get_temporal_copy_spec,)
