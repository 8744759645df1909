"""What every token mixer shares, and the plumbing of the memory mixers.

A mixer is the ``self_attn`` module of a block: ``mixer(x [B, T, D], valid, cache) -> [B, T, D]``,
reading its own entry ``cache.layers[layer_idx]`` (of the class ``cache_class``) as it was when
the model's call began and replacing it (see :class:`~trellis_lm.cache_trellis.CacheCall`).

A *memory mixer* (Trellis, Lattice, KVM) projects q and k (through causal short convs where
the layer has them), calls its op on each row's real tokens and reads the op's output out
(Trellis and Lattice through a per-head RMSNorm and a GELU gate). :class:`MemoryMixer` holds that
plumbing once; a subclass says which op it runs, what the op's other inputs are, and what its
state is before the first token.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization

from ..cache_entries import LayerCache, MemoryEntry, MemoryLayerCache, register_layer_cache, same_definition
from ..cache_layout import ROWS, TensorSpec
from ..cache_trellis import CacheCall, TrellisCache
from ..configuration_trellis import TrellisConfig
from ..layer_kinds import MIXERS
from ..ops.checks import as_dtype
from ..ops.state import OpState
from ..ops.registry import BackendRegistry
from ..projection_stacks import LinearStack, stacked
from .fields import MODEL_FIELDS, ConfigField
from .norms_convs import TrellisRMSNorm, TrellisShortConv, at_least_float32, causal_conv, l2_normalize
from .valid_tokens import PackedSequences, ValidTokens

# Outside a span with stacks made once (generate's), fewer tokens than this per call run the
# projections one by one: stacking their weights then costs more than the matmuls (BENCHMARKS.md,
# "Figures behind code comments").
FUSE_MIN_TOKENS = 64


class Projections:
    """A mixer's input ``x [B, T, D]`` with its linear projections, looked up by module name.

    ``fused`` holds the projections that one stacked matmul computed (see
    :meth:`MemoryMixer._fused_projections`); any other name calls the module on ``x``.
    ``values``: the normalised values (:meth:`values`) where the caller has them already (a
    decode step normalises them with q and k). Passed from step to step of a call as a value, so
    a mixer keeps no per-call state on itself.
    """

    def __init__(self, mixer: nn.Module, x: torch.Tensor, fused: Optional[dict[str, torch.Tensor]] = None,
                 values: Optional[torch.Tensor] = None) -> None:
        self.mixer, self.x, self.fused, self._values = mixer, x, fused or {}, values

    def __getitem__(self, name: str) -> torch.Tensor:
        """``getattr(mixer, name)(x)``, or its slice of the fused matmul."""
        if name in self.fused:
            return self.fused[name]
        return getattr(self.mixer, name)(self.x)

    def values(self) -> torch.Tensor:
        """``v_proj``'s output per head, L2-normalised in at least float32: ``[B, T, H, head_dim]``,
        the values of the slot memories (Trellis, Lattice)."""
        if self._values is not None:
            return self._values
        v = self["v_proj"]
        return l2_normalize(at_least_float32(v).view(*v.shape[:-1], self.mixer.num_heads, -1))

    def side_by_side(self, first: str, second: str) -> tuple[torch.Tensor, list[int]]:
        """The two projections concatenated on the last dim (one slice of the fused matmul when
        it holds both, adjacent), and their widths."""
        joined = self.fused.get(f"{first}+{second}")
        if joined is not None:
            return joined, [self.fused[first].shape[-1], self.fused[second].shape[-1]]
        a, b = self[first], self[second]
        return torch.cat([a, b], dim=-1), [a.shape[-1], b.shape[-1]]


# Model-level fields a standalone layer may be given besides its kind's (see Mixer.standalone_config).
STANDALONE_SETTINGS = ("rms_norm_eps", "initializer_range", "op_backend", "compile_decode")

class Mixer(nn.Module):
    """Base of the token mixers.

    A subclass that sets ``kind`` is registered in :data:`MIXERS` (the configuration's, which
    reads the kind's declarations from the class and imports no mixer), and its cache entry with
    the cache, when it is defined: a kind defined anywhere, a test file included, is usable by
    name in ``config.mixer_types``; the cache, the model card and the conversion read the kinds
    from there too.

    Args:
        config: the model's :class:`~trellis_lm.TrellisConfig`.
        layer_idx: the block's index (its entry in the cache).
    """

    kind: ClassVar[str]
    cache_class: ClassVar[type[LayerCache]]
    # transformers' name for the layer in the standard `layer_types` config field.
    layer_type: ClassVar[str] = "linear_attention"
    # The config fields the mixer's function depends on besides MODEL_FIELDS, with their checks
    # (see .fields): the configuration validates them and a cache remembers them.
    config_fields: ClassVar[tuple[ConfigField, ...]] = ()
    # Checks of model-wide fields that hold only where a layer of this kind exists.
    layer_checks: ClassVar[tuple[ConfigField, ...]] = ()
    # The backends of the op the mixer runs (None: no op); config.op_backend must be one of them.
    backends: ClassVar[Optional[BackendRegistry]] = None
    # Conversion from a softmax-attention teacher (trellis_lm.conversion): how each teacher
    # projection becomes this mixer's ("copy": as it is; "heads": keys and values repeated to
    # every query head; "slots": as "heads", then projected to the slots), None for a kind that
    # conversion does not make; and the parameters the teacher does not give (names under the
    # mixer: what the distillation's first stage trains), set by `init_from_attention`.
    teacher_parts: ClassVar[Optional[dict[str, str]]] = None
    new_parameters: ClassVar[tuple[str, ...]] = ()
    # How the model card names the kind, and whether its cache grows with the context.
    display_name: ClassVar[str]
    grows_with_context: ClassVar[bool] = False
    # Whether `config.compile_decode` may compile this mixer's block in a single-token step (see
    # trellis_lm.compiled_decode): a memory mixer whose `mix` is free of data-dependent Python
    # control flow and whose carried state has a fixed shape (not attention's growing keys).
    compilable: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A class that names its kind is a concrete mixer: its cache entry serves that kind.
        super().__init_subclass__(**kwargs)
        if "kind" in vars(cls):
            known = MIXERS.get(cls.kind)
            if known is not None and not same_definition(known, cls):
                raise ValueError(f"mixer kind {cls.kind!r} is already {known.__qualname__}")
            register_layer_cache(cls.kind, cls.cache_class)
            MIXERS[cls.kind] = cls

    @classmethod
    def signature_fields(cls) -> tuple[str, ...]:
        """The names of every config field that defines this mixer's function."""
        return MODEL_FIELDS + tuple(f.name for f in cls.config_fields)

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__()
        standalone = config is None
        if isinstance(config, Mapping):
            raise TypeError(f"{type(self).__name__}() takes a TrellisConfig as config, got a {type(config).__name__}: "
                            f"pass a dict's fields as keyword arguments, {type(self).__name__}(**fields)")
        if standalone:
            config = self.standalone_config(**arguments)
        elif arguments:
            raise TypeError(f"{type(self).__name__}() takes a config or keyword arguments, not both "
                            f"(got config and {sorted(arguments)})")
        self.config = config
        self.layer_idx = layer_idx
        self._standalone = standalone

    @classmethod
    def from_config(cls, config: TrellisConfig, layer_idx: int) -> "Mixer":
        """Layer ``layer_idx`` of the model of ``config`` (a :class:`~trellis_lm.TrellisConfig`):
        how the model builds its mixers; the model initialises the weights."""
        return cls(config, layer_idx)

    @classmethod
    def standalone_arguments(cls) -> tuple[str, ...]:
        """The keyword arguments a standalone layer takes: the model-level sizes, this kind's
        fields and the settings a layer reads."""
        return tuple(dict.fromkeys((*cls.signature_fields(), *STANDALONE_SETTINGS)))

    @classmethod
    def standalone_config(cls, **arguments: Any) -> TrellisConfig:
        """The configuration of a one-layer model of this kind from explicit arguments (see
        :meth:`standalone_arguments`; those not given take the config's defaults), checked as
        any config is. ``hidden_size``, ``num_heads`` and ``head_dim`` are required."""
        allowed = cls.standalone_arguments()
        unknown = sorted(set(arguments) - set(allowed))
        if unknown:
            raise TypeError(f"{cls.__name__}() got unexpected keyword arguments {unknown}; it takes {list(allowed)}")
        missing = [name for name in MODEL_FIELDS if name not in arguments]
        if missing:
            raise TypeError(f"{cls.__name__}() needs the keyword arguments {missing} (or a config)")
        return TrellisConfig(num_hidden_layers=1, mixer_types=[cls.kind], **arguments)

    def _init_if_standalone(self) -> None:
        """Initialise a layer made from explicit arguments as a model would (a model initialises
        its layers itself, after building them all): the last line of a mixer's ``__init__``."""
        if not self._standalone:
            return
        for module in self.modules():
            init_module(module, self.config.initializer_range, initialization)

    def forward(self, x: torch.Tensor, valid: Optional[ValidTokens] = None,
                cache: Union[TrellisCache, CacheCall, None] = None) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; ``valid`` marks real tokens and packed documents
        (``None``: all real, one document per row). With a cache (or one call's view of it,
        :class:`~trellis_lm.cache_trellis.CacheCall`) the layer continues its entry and
        replaces it with the state after ``x``."""
        raise NotImplementedError

    def checked_call(self, x: torch.Tensor, cache: Union[TrellisCache, CacheCall, None]) -> Optional[CacheCall]:
        """``cache`` as one call's view (:class:`~trellis_lm.cache_trellis.CacheCall`), after checking
        what a layer called on its own can be given wrong: ``x`` must be ``[B, T >= 1, hidden_size]``
        and the cache must hold an entry of this kind at ``layer_idx``. A model checks its inputs
        before its layers see them; these checks cost a few attribute reads per call."""
        hidden = self.config.hidden_size
        if x.dim() != 3 or x.shape[1] == 0 or x.shape[2] != hidden:
            raise ValueError(f"{type(self).__name__} takes x [batch, tokens >= 1, hidden_size = {hidden}], "
                             f"got shape {tuple(x.shape)}")
        call = CacheCall.of(cache)
        if call is not None:
            layers = call.cache.layers
            if self.layer_idx >= len(layers) or layers[self.layer_idx].kind != self.kind:
                held = [layer.kind for layer in layers]
                raise ValueError(f"{type(self).__name__} with layer_idx = {self.layer_idx} reads entry {self.layer_idx} "
                                 f"of its cache, whose entries are {held}: make the cache from this layer's "
                                 "config (TrellisCache(layer.config)), or give the layer its index in that cache")
        return call

    def init_weights(self, init: Any) -> None:
        """Initialise what the generic ``nn.Linear`` / ``nn.Embedding`` rules do not cover, with
        transformers' ``initialization`` helpers (they skip tensors a checkpoint loaded)."""

    def init_from_attention(self, input_norm_weight: Optional[torch.Tensor]) -> None:
        """Initialise :attr:`new_parameters` for a layer converted from a teacher's attention
        (its block's ``input_layernorm`` weight ``[D]`` given); nothing where there are none."""

    @classmethod
    def describe_cache(cls, config: TrellisConfig) -> str:
        """What a layer of this kind keeps per sequence in ``config``'s model, in words (the
        model card: "keep ...")."""
        raise NotImplementedError

    @classmethod
    def cache_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """Every tensor of this kind's cache entry in ``config``'s model, by name: its shape and
        dtype once the layer has seen tokens (what :meth:`TrellisCache.load` checks a file against)."""
        raise NotImplementedError


@torch.no_grad()
def init_module(module: nn.Module, std: float, init: Any) -> None:
    """The generic initialisation of one module (not its children), with transformers'
    ``initialization`` helpers ``init``: linear and embedding weights normal with ``std``, biases
    zero, RMSNorm weights one, and a mixer's own rule (``init_weights``) for what these leave.
    Models apply it to every module (``_init_weights``); a standalone mixer to its own."""
    if isinstance(module, nn.Linear):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, TrellisRMSNorm):
        init.ones_(module.weight)
    elif isinstance(module, Mixer):
        module.init_weights(init)


# Up to this many elements, eagerly on a CPU without autograd, GELU is x erfc(-x / sqrt 2) / 2 by
# torch's vectorised erfc: four operations that cost a decode step 0.92-0.99 of torch's gelu kernel
# at 192 to 24,576 elements, the largest measured (BENCHMARKS.md, issue 73;
# benchmarks/bench_step_choices.py). Above it (a prefill's), the kernel's one pass over the data.
ERFC_GELU_MAX = 24576
_MINUS_SQRT_HALF = -math.sqrt(0.5)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact GELU ``x * Phi(x)``: torch's kernel, or ``x erfc(-x / sqrt 2) / 2`` for a decode
    step's few elements on a CPU (``ERFC_GELU_MAX``); the same function up to rounding."""
    # Compiling is asked first: the element count, read, would be a guard (a compilation per size).
    if (not torch.compiler.is_compiling() and x.device.type == "cpu" and not torch.is_grad_enabled()
            and x.numel() <= ERFC_GELU_MAX):
        return torch.mul(x, _MINUS_SQRT_HALF).erfc_().mul_(x).mul_(0.5)
    return F.gelu(x)


def gated_output(g: torch.Tensor, normed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A memory mixer's read-out before ``o_proj``: GELU of ``g_proj``'s output ``g [..., H d]``
    times the per-head normed op output ``normed [..., H, d]`` (as many tokens), shaped as ``g``
    and in ``dtype`` (the mixer input's)."""
    gate, normed = gelu(g), normed.view(g.shape)
    # Without autograd, into `gate` (this function's own tensor): one [..., H d] allocation less.
    gated = gate.mul_(normed) if not torch.is_grad_enabled() else normed * gate
    return as_dtype(gated, dtype, gated.device)


class MemoryMixer(Mixer):
    """Short convs on q and k, the op on real tokens, gated RMSNorm output (see module doc).

    Subclasses set ``state_class`` and ``cache_class``, call :meth:`_build_qkv` (or create
    ``q_proj``, ``k_proj`` and ``v_proj``), create ``o_proj``, call :meth:`_build_convs` (and
    :meth:`_build_output` for the gated read-out), and implement :meth:`op_inputs`,
    :meth:`fresh_state` and :meth:`op_settings`.
    """

    state_class: ClassVar[type[OpState]]
    cache_class: ClassVar[type[MemoryLayerCache]]
    # The op's public function (trellis_lm.ops), called by run_op, and its unchecked decode step;
    # for a compilable mixer also that step with its backend chosen once (device, dtype, settings
    # -> step), what a decode span runs (trellis_lm.decode_step).
    op: ClassVar[Callable[..., tuple[torch.Tensor, Optional[OpState]]]]
    step_op: ClassVar[Callable[..., tuple[torch.Tensor, OpState]]]
    step_for: ClassVar[Callable[..., Callable[..., tuple[torch.Tensor, OpState]]]]
    # Projections of x that may run as one matmul (see :meth:`_fused_projections`), in order;
    # when q_proj and k_proj come first, the fused q and k are one slice (see :meth:`_queries_keys`).
    fusable_projections: ClassVar[tuple[str, ...]] = ()
    # Whether op_inputs takes q and k through SiLU and a per-head L2 norm: then both are done
    # here, in one call each on q and k side by side, and op_inputs receives them done.
    silu_l2_qk: ClassVar[bool] = False
    # The config field giving the per-head width of q and k (their short convs' channels are
    # num_heads times it); None for a mixer without short convs.
    qk_width: ClassVar[Optional[str]] = None

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__(config, layer_idx, **arguments)
        # Read per call in decode steps, where the config's attribute lookup costs what an operation does.
        self.num_heads: int = self.config.num_heads
        # No short convs unless the subclass builds them (:meth:`_build_convs`).
        self.q_conv: Optional[TrellisShortConv] = None
        self.k_conv: Optional[TrellisShortConv] = None
        # Set only within `stacked_projections` (a generate call).
        self.projection_stack: Optional[LinearStack] = None

    def init_weights(self, init: Any) -> None:
        """Short convs of a model built from scratch: the query passes the current token and the
        key the one before it (the current one for a width-1 conv), an induction-head start.

        The memory then starts out writing "previous token -> current token" and reading with
        the current token, so recalling what followed an earlier occurrence needs no search
        over the taps. With PyTorch's default (Kaiming-uniform taps) every recurrent mixer sat
        on MQAR's elimination plateau (it guesses among the values not yet asked for, with no
        key binding) in every seed and rate of the CPU study; with these taps Trellis binds keys
        in every seed measured there and at 256 tokens / 16 pairs (docs/results_notes.md). The
        taps are trained like any weight.
        Conversion sets identity taps for both instead, to keep the teacher's q-k alignment.
        """
        if self.q_conv is not None:
            init.copy_(self.q_conv.weight, self.q_conv.delay_taps(0))
            init.copy_(self.k_conv.weight, self.k_conv.delay_taps(min(1, self.k_conv.weight.shape[-1] - 1)))

    @torch.no_grad()
    def _start_silent(self) -> None:
        """A converted layer's start (Trellis, Lattice): a zero output gate, identity short convs
        and a unit output norm, so the mixer outputs exactly 0 (see their ``init_from_attention``)."""
        self.g_proj.weight.zero_()
        for conv in (self.q_conv, self.k_conv):
            if conv is not None:
                conv.weight.copy_(conv.delay_taps(0))
        self.o_norm.weight.fill_(1.0)

    @classmethod
    def conv_channels(cls, config: TrellisConfig) -> Optional[tuple[int, int]]:
        """The channels of the short convs on q and k: ``num_heads`` times the config field
        ``qk_width`` each (``None``: the mixer has no convs)."""
        if cls.qk_width is None:
            return None
        width = config.num_heads * getattr(config, cls.qk_width)
        return width, width

    @classmethod
    def state_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """The op state's tensors (see :meth:`cache_layout`)."""
        raise NotImplementedError

    @classmethod
    def unread_state(cls, config: TrellisConfig) -> dict[str, str]:
        """Op-state fields that ``config``'s op never reads, each with a field of the same shape
        and dtype to hand in its place: what a store of states (a server's slots) need not keep.
        None by default."""
        return {}

    @classmethod
    def describe_cache(cls, config: TrellisConfig) -> str:
        """A memory of ``num_slots`` slots per head (Trellis, Lattice)."""
        return f"a fixed-size memory per head ({config.num_heads} heads x {config.num_slots} slots)"

    @classmethod
    def cache_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """The short-conv tails ``[B, conv_size - 1, channels]`` (where the layer has convs),
        then the op state's tensors."""
        channels = cls.conv_channels(config)
        tails = {}
        if channels is not None and config.conv_size > 0:
            tails = {name: TensorSpec((ROWS, config.conv_size - 1, width)) for name, width in zip(("q_tail", "k_tail"), channels)}
        return {**tails, **cls.state_layout(config)}

    def _build_qkv(self) -> None:
        """The bias-free projections of x to q and k (``num_heads`` times the config field
        ``qk_width`` each; ``head_dim`` for a mixer without short convs) and to v (``num_heads *
        head_dim``)."""
        config = self.config
        hidden, heads = config.hidden_size, config.num_heads
        width = getattr(config, self.qk_width or "head_dim")
        self.q_proj = nn.Linear(hidden, heads * width, bias=False)
        self.k_proj = nn.Linear(hidden, heads * width, bias=False)
        self.v_proj = nn.Linear(hidden, heads * config.head_dim, bias=False)

    def _build_convs(self) -> None:
        """Short convs of ``config.conv_size`` taps (0: none) on q and k."""
        width = self.config.conv_size
        q_channels, k_channels = self.conv_channels(self.config)
        self.q_conv = TrellisShortConv(q_channels, width) if width > 0 else None
        self.k_conv = TrellisShortConv(k_channels, width) if width > 0 else None

    def _build_output(self) -> None:
        """The read-out: per-head RMSNorm of the op's output, times GELU(g_proj(x)), o_proj."""
        hidden, heads, dim = self.config.hidden_size, self.config.num_heads, self.config.head_dim
        self.g_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.o_norm = TrellisRMSNorm(dim, self.config.rms_norm_eps)

    def op_inputs(self, proj: "Projections", q: torch.Tensor, k: torch.Tensor, valid: Optional[ValidTokens],
                  state: Optional[OpState]) -> tuple[torch.Tensor, ...]:
        """The op's per-token inputs ``[B, T, H, *]``, q first, k second, the value third (its
        shape is the output's), from the projections of ``proj.x [B, T, D]`` and the convolved
        ``q``, ``k`` (``valid`` and the carried ``state`` for mixers whose inputs depend on
        positions)."""
        raise NotImplementedError

    def fresh_state(self, rows: int) -> OpState:
        """The op state of ``rows`` sequences before their first token (learned initial
        memories, expanded)."""
        raise NotImplementedError

    def read_out(self, proj: "Projections", o: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` from the op's output ``o [B, T, H, d]``: per-head RMSNorm, times
        GELU(g_proj(x)), then ``o_proj``."""
        return self.o_proj(gated_output(proj["g_proj"], self.o_norm(o), proj.x.dtype))

    def op_settings(self) -> dict[str, Any]:
        """The op's keyword arguments besides the per-call ones: its settings from the config,
        and parameters of the layer the op takes as arguments."""
        raise NotImplementedError

    def run_op(self, inputs: tuple[torch.Tensor, ...], initial_state: OpState, keep_state: bool,
               cu_seqlens: Optional[torch.Tensor], consume_state: bool = False,
               ) -> tuple[torch.Tensor, Optional[OpState]]:
        """Call the op (``op``) on ``inputs`` with :meth:`op_settings` and ``config.op_backend``;
        ``consume_state``: the caller gives ``initial_state``'s tensors up, which a decode step may
        then write in place (see :func:`~trellis_lm.ops.trellis_step`).

        Without the op's value checks (``check_values=False``): inside a model the gates come
        from sigmoids, log-sigmoids over a positive normalizer and exponentials, so only NaN
        activations could leave their ranges, and a model treats those the same on every path
        (attention and memory layers, prefill and decode): they propagate to the logits, as in
        transformers' models, and ``generate`` stops at the first non-finite logits. The checks
        would also read values back from the device once per layer and call. A carried state's
        counters are the op's own, or were checked when a cache file was loaded.
        """
        if keep_state and cu_seqlens is None and self._decode_step(inputs, initial_state):
            return type(self).step_op(*inputs, state=initial_state, backend=self.config.op_backend,
                                      consume_state=consume_state, **self.op_settings())
        return type(self).op(
            *inputs, initial_state=initial_state, output_final_state=keep_state, cu_seqlens=cu_seqlens,
            backend=self.config.op_backend, check_values=False, **self.op_settings(),
        )

    def _decode_step(self, inputs: tuple[torch.Tensor, ...], state: OpState) -> bool:
        """Whether the op's unchecked decode step (``step_op``) may run this call: one token per
        row after an earlier call of the layer (its state carried), every input already in the
        compute dtype of that state, autocast off; eagerly (a compiled step traces the op)."""
        q = inputs[0]
        if q.shape[1] != 1 or not isinstance(state, self.state_class) or torch.compiler.is_compiling():
            return False
        dtype = state.lead.dtype
        return (dtype in (torch.float32, torch.float64) and all(t.dtype == dtype for t in inputs)
                and not torch.is_autocast_enabled(q.device.type))

    def forward(self, x: torch.Tensor, valid: Optional[ValidTokens] = None,
                cache: Union[TrellisCache, CacheCall, None] = None) -> torch.Tensor:
        call = self.checked_call(x, cache)
        if call is None:
            return self.mix(x, valid, MemoryEntry(None, None, None), keep_state=False)[0]
        carried = self.carried(call)
        if call.cache.records_calls:
            packed = valid is not None and valid.has_documents
            call.cache.record_step(self.layer_idx, self.replay, x, None if valid is None else valid.mask, carried,
                                   replayable=not packed)
        out, after = self.advance(x, valid, carried)
        self.keep(call, after)
        return out

    def carried(self, call: CacheCall) -> MemoryEntry:
        """This layer's entry as ``call`` began."""
        return call.before(self.layer_idx).entry

    def keep(self, call: CacheCall, entry: MemoryEntry) -> None:
        """Make ``entry`` (what :meth:`advance` returned) this layer's live entry of ``call``."""
        call.entry(self.layer_idx).hold(entry)

    def advance(self, x: torch.Tensor, valid: Union[ValidTokens, PackedSequences, None], entry: MemoryEntry,
                with_output: bool = True, consume_state: bool = False) -> tuple[Optional[torch.Tensor], MemoryEntry]:
        """The layer on ``x [B, T, D]`` continuing ``entry``: ``(y [B, T, D], the entry after
        x)``, ``y`` ``None`` when not ``with_output`` (a replay wants the entry only: the
        read-out's projections are skipped). What every caller that carries an entry runs: the
        cache's forward, a crop's replay, the compiled decode step, the vLLM slots. With
        :class:`PackedSequences` (``x [1, T, D]``, ``entry`` of R rows, state given: a server's
        prompt chunks, each after its own slot's state) the entry after has one row per
        sequence, and the projections, convs and op run once on the T tokens, no padding.

        The entry after holds the new tails (when the layer has a conv) and the new state; where
        no row had a real token, the old state stands, or the initial one, copied, so that every
        layer that has seen a call holds a whole state. ``consume_state``: the caller reads
        ``entry``'s state no more (a server's slots), which a decode step may then write in place
        (:func:`~trellis_lm.ops.trellis_step`): the entry after may hold its tensors."""
        y, (q_tail, k_tail, state) = self.mix(x, valid, entry, keep_state=True, with_output=with_output,
                                              consume_state=consume_state)
        if self.q_conv is None:
            q_tail, k_tail = entry.q_tail, entry.k_tail
        if state is None:
            state = entry.state if entry.state is not None else self.fresh_state(x.shape[0]).map(torch.clone)
        return y, MemoryEntry(q_tail, k_tail, state)

    @torch.no_grad()
    def advance_each(self, x: torch.Tensor, entry: MemoryEntry) -> tuple[torch.Tensor, list[MemoryEntry]]:
        """The layer on ``x [B, T, D]`` (``T`` real tokens in every row) continuing ``entry`` (a
        whole one, state given): ``y [B, T, D]`` and the entry after *each* token, ``T`` of them:
        what a server verifying draft tokens keeps, to continue after however many it accepts
        (the vLLM slots). Projections, convs and read-out run once on the ``T`` tokens; the op
        runs a token at a time (its decode step), the same function as :meth:`advance`."""
        proj = Projections(self, x, self._fused_projections(x))
        q, k, _, _ = self._queries_keys(proj, None, entry.q_tail, entry.k_tail)
        inputs = self.op_inputs(proj, q, k, None, entry.state)
        tails = self._tails_after_each(proj, entry)
        state, outputs, entries = entry.state, [], []
        for t in range(x.shape[1]):
            o, state = self.run_op(tuple(i[:, t: t + 1] for i in inputs), state, True, None)
            outputs.append(o)
            entries.append(MemoryEntry(*tails[t], state))
        return self.read_out(proj, torch.cat(outputs, dim=1)), entries

    def _tails_after_each(self, proj: "Projections", entry: MemoryEntry) -> list[tuple[Any, Any]]:
        """The short convs' tails ``(q_tail, k_tail)`` after each of ``proj``'s tokens: the last
        ``width - 1`` conv inputs up to it (``entry``'s tails before the first)."""
        length = proj.x.shape[1]
        if self.q_conv is None:
            return [(entry.q_tail, entry.k_tail)] * length
        qk, split = proj.side_by_side("q_proj", "k_proj")
        carried = self.q_conv.weight.shape[-1] - 1
        tail = (qk.new_zeros(qk.shape[0], carried, qk.shape[-1]) if entry.q_tail is None
                else torch.cat([entry.q_tail, entry.k_tail], dim=-1).to(qk.dtype))
        seq = torch.cat([tail, qk], dim=1)
        return [tuple(seq[:, t + 1: t + 1 + carried].split(split, dim=-1)) for t in range(length)]

    def fresh_rows(self, entry: MemoryEntry, fresh: torch.Tensor) -> MemoryEntry:
        """``entry`` (state ``[N]`` rows given) with the rows where ``fresh [N]`` (bool) is True
        reset to a sequence's start: the learned initial memories, empty (zero) conv tails. What
        state passing's rows that start afresh and a server's new sequences in reused slots get."""
        keep = ~fresh
        q_tail, k_tail = (None if t is None else t.masked_fill(fresh.to(t.device).view(-1, 1, 1), 0)
                          for t in (entry.q_tail, entry.k_tail))
        return MemoryEntry(q_tail, k_tail, self.mixed_state(entry.state, keep))

    @torch.no_grad()
    def replay(self, record: Any) -> MemoryEntry:
        """The entry after the tokens of ``record`` (:class:`~trellis_lm.cache_entries.StepRecord`)
        from its entry before them: what :meth:`TrellisCache.crop` puts back. The same function
        as the calls that first ran them."""
        if record.x.shape[1] == 0:
            return record.before
        mask = record.mask
        valid = None if mask is None or bool(mask.all()) else ValidTokens.from_mask(mask)
        return self.advance(record.x, valid, record.before, with_output=False)[1]

    def mix(
        self,
        x: torch.Tensor,
        valid: Union[ValidTokens, PackedSequences, None],
        entry: MemoryEntry,
        keep_state: bool,
        with_output: bool = True,
        consume_state: bool = False,
    ) -> tuple[Optional[torch.Tensor], MemoryEntry]:
        """The mixer as a function of what a cache carries: ``x [B, T, D]`` after ``entry``'s
        short-conv tails (``None`` for zeros) and op state (``None``: the learned initial
        memories). Returns ``y [B, T, D]`` (``None`` when not ``with_output``) and what the op
        and convs leave: the new tails and final state, the state ``None`` when not
        ``keep_state`` or when no row had a real token (:meth:`advance` makes the entry after
        from it). ``consume_state``: see :meth:`advance`."""
        proj = Projections(self, x, self._fused_projections(x))
        q, k, q_tail, k_tail = self._queries_keys(proj, valid, entry.q_tail, entry.k_tail)
        inputs = self.op_inputs(proj, q, k, valid, entry.state)
        o, state = self._attend(inputs, self._initial_state(entry.state, valid, x.shape[0]), valid, keep_state,
                                consume_state)
        return (self.read_out(proj, o) if with_output else None), MemoryEntry(q_tail, k_tail, state)

    def _queries_keys(
        self, proj: "Projections", valid: Union[ValidTokens, PackedSequences, None], q_tail: Optional[torch.Tensor],
        k_tail: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(q, k, q_tail, k_tail)``: the projections through the short convs (and, with
        ``silu_l2_qk``, SiLU and the per-head L2 norm, as ``[B, T, H, *]``).

        q and k go side by side through one conv (their taps stacked) and one activation, which
        halves the operations of the part a decode step spends most of its calls on.
        """
        if self.q_conv is None and not self.silu_l2_qk:
            return proj["q_proj"], proj["k_proj"], q_tail, k_tail
        qk, split = proj.side_by_side("q_proj", "k_proj")
        if self.q_conv is not None:
            taps = torch.cat([self.q_conv.weight, self.k_conv.weight])
            tail = None if q_tail is None else torch.cat([q_tail, k_tail], dim=-1)
            if valid is None:
                qk, tail = causal_conv(qk, tail, taps)
            elif isinstance(valid, PackedSequences):
                qk, tail = valid.conv(qk, tail, taps)
            else:  # over each row's real tokens only, so padding never enters it
                qk, tail = causal_conv(valid.compact(qk), tail, taps, valid.lengths, valid.reach)
                qk = valid.restore(qk)
            q_tail, k_tail = tail.split(split, dim=-1)
        q, k, _ = self.activated_qk(qk, split)
        return q, k, q_tail, k_tail

    def activated_qk(self, qk: torch.Tensor, split: list[int], values: Optional[torch.Tensor] = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(q, k, v)``: q and k from ``qk [B, T, q width + k width]`` (after the short convs;
        ``split`` their widths): with ``silu_l2_qk``, through SiLU and the per-head L2 norm as
        ``[B, T, H, *]``, in place without autograd (``qk`` is the caller's own: the conv's output,
        the fused projections' or a cat); else split as they are. ``v`` is ``None`` unless
        ``values`` (``v_proj``'s output ``[B, T, H head_dim]``, a decode step's) is given with the
        width of q and k per head: it then joins them in one L2 norm and comes back normalised as
        :meth:`Projections.values` would give it (``[B, T, H, head_dim]``), five operations fewer a token."""
        if not self.silu_l2_qk:
            q, k = qk.split(split, dim=-1)
            return q, k, None
        batch, length, _ = qk.shape
        heads = self.num_heads
        qk = F.silu(at_least_float32(qk), inplace=not torch.is_grad_enabled())
        if values is not None and values.shape[-1] == split[0]:
            qkv = torch.cat([qk, at_least_float32(values)], dim=-1)
            q, k, v = l2_normalize(qkv.view(batch, length, 3 * heads, -1)).split_with_sizes([heads] * 3, dim=2)
            return q, k, v
        # split, not a view's unbind: compiled, unbind bounded the row count (a compilation more).
        q, k = l2_normalize(qk.view(batch, length, 2 * heads, -1)).split(heads, dim=2)
        return q, k, None

    def _fused_projections(self, x: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        """Every projection of ``fusable_projections`` by one matmul, or ``None`` (see
        :func:`~trellis_lm.projection_stacks.stacked`: inference only, with the stack :func:`~trellis_lm.projection_stacks.stacked_projections`
        made for a ``generate`` call, or one made afresh for calls of at least ``FUSE_MIN_TOKENS``
        tokens, which always reflects the current weights). With q_proj and k_proj leading the
        stack and without biases, ``"q_proj+k_proj"`` is both side by side (one slice)."""
        if not self.fusable_projections:
            return None
        result = stacked(self, x, on_the_fly=x.shape[:-1].numel() >= FUSE_MIN_TOKENS)
        if result is None:
            return None
        out, fused = result
        if list(fused)[:2] == ["q_proj", "k_proj"] and self.q_proj.bias is None and self.k_proj.bias is None:
            fused["q_proj+k_proj"] = out[..., : fused["q_proj"].shape[-1] + fused["k_proj"].shape[-1]]
        return fused

    def _initial_state(self, carried: Optional[OpState], valid: Union[ValidTokens, PackedSequences, None],
                       batch: int) -> OpState:
        """The op's initial state: one per row, or one per packed document.

        A row continues ``carried`` (its cache entry) or starts from the learned memories;
        documents after a row's first always start from the learned memories; each of
        :class:`PackedSequences` continues its own row of ``carried``.
        """
        if valid is None or isinstance(valid, PackedSequences) or not valid.has_documents:
            return carried if carried is not None else self.fresh_state(batch)
        if carried is None:
            return self.fresh_state(valid.seq_rows.numel())
        per_seq = carried.map(lambda t: t.index_select(0, valid.seq_rows.to(t.device)))
        return self.mixed_state(per_seq, valid.continues_row)

    def mixed_state(self, carried: OpState, keep: torch.Tensor) -> OpState:
        """The state of ``carried``'s rows where ``keep [N]`` (bool) is True, the learned initial
        memories elsewhere (what packed documents after a row's first, and state passing's fresh
        rows, start from)."""
        fresh = self.fresh_state(keep.numel())
        # One layout for both (KVM's buffers grow with the tokens seen): `cat` aligns them.
        both = self.state_class.cat([carried, fresh])
        carried, fresh = both.map(lambda t: t[: keep.numel()]), both.map(lambda t: t[keep.numel() :])
        keep = keep.to(carried.lead.device)
        return self.state_class(**{
            name: torch.where(keep.view(-1, *(1,) * (t.dim() - 1)), t, fresh.tensors()[name])
            for name, t in carried.tensors().items()
        })

    def _attend(
        self, inputs: tuple[torch.Tensor, ...], initial_state: OpState, valid: Union[ValidTokens, PackedSequences, None],
        keep_state: bool, consume_state: bool = False,
    ) -> tuple[torch.Tensor, Optional[OpState]]:
        """Run the op; with padding, once on the real tokens packed as one sequence per row.

        Returns ``o [B, T, H, d]`` (zeros at padding) and the final state, one per row (a row's
        last document's; one per sequence of :class:`PackedSequences`, which run as they lie),
        ``None`` when not kept or when no row had a token (the state is then unchanged).
        """
        if valid is None or isinstance(valid, PackedSequences):
            cu_seqlens = None if valid is None else valid.cu_seqlens
            return self.run_op(inputs, initial_state, keep_state, cu_seqlens, consume_state)
        value = inputs[2]
        # The op answers in the queries' dtype, which under CUDA autocast can differ from the
        # values' (norms run in float32 there, projections in bf16).
        o = value.new_zeros(value.shape, dtype=inputs[0].dtype)
        if not bool(valid.lengths.any()):
            return o, None
        packed = tuple(t[valid.mask].unsqueeze(0) for t in inputs)
        o_packed, final_state = self.run_op(packed, initial_state, keep_state, valid.cu_seqlens)
        o[valid.mask] = o_packed[0]
        if final_state is not None and valid.has_documents:
            final_state = final_state.map(lambda t: t.index_select(0, valid.last_seqs.to(t.device)))
        return o, final_state


def chunked_memory_layout(config: TrellisConfig, memories: Sequence[str]) -> dict[str, TensorSpec]:
    """The state layout of a chunked slot-memory op (Trellis, Lattice): ``[B, H, M, d]`` memories
    named ``memories``, then the ``[B]`` offset within the chunk, in ``[0, chunk_size)``."""
    memory = TensorSpec((ROWS, config.num_heads, config.num_slots, config.head_dim))
    return {**dict.fromkeys(memories, memory), "offset": TensorSpec((ROWS,), "int64", most=config.chunk_size - 1)}
