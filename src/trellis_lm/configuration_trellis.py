"""Configuration of Trellis language models (design page, section 5).

A leaf: it imports nothing of the model (mixers, ops, cache). The checks of the layer kinds'
fields are the mixers' (:mod:`.layer_kinds`), registered here as they are imported
(:func:`register_layer_checks`), so a config made after ``import trellis_lm`` refuses what any
registered kind refuses.

This file travels with checkpoints as remote code, so it imports only installed packages and
flat sibling modules (see :mod:`.remote_code`).
"""

from __future__ import annotations

import difflib
import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, Callable, ClassVar, Optional

from transformers import PreTrainedConfig

from .defaults import (CHUNK_SIZE, COMPRESS_FN, CONV_SIZE, KVM_BUDGET, KVM_BUDGET_EXPONENT, KVM_BUDGET_SATURATION,
                       KVM_BUDGET_SCALE, KVM_CHUNK_SIZE, KVM_SINKS, KVM_STATE_SIZE, KVM_WINDOW_CHUNKS, LATTICE_VARIANT,
                       MIX_FN, NUM_SLOTS, WRITE_GRADIENT)
from .remote_code import AUTO_MAP, code_is_packaged, export_code

# The kind of every layer of a config without `mixer_types`.
DEFAULT_KIND = "trellis"

# The checks of the layer kinds' fields (layer_kinds.check_layer_fields), registered as the
# mixers' registry is imported: the configuration imports nothing of the model. None where the
# model's code is not loaded (a checkpoint's config read as remote code before its model): the
# kinds' checks then run when the model is built.
_layer_checks: Optional[Callable[["TrellisConfig"], None]] = None


def register_layer_checks(checks: Callable[["TrellisConfig"], None]) -> None:
    """Make ``checks`` (raising a ``ValueError`` for a field the layer kinds refuse, setting
    ``layer_types``) part of every config's :meth:`TrellisConfig.check_fields`."""
    global _layer_checks
    _layer_checks = checks


def check_value(config: TrellisConfig, name: str, is_valid: Callable[[Any], bool], expected: str) -> None:
    """Raise ``ValueError("TrellisConfig.<name> must be <expected>, got <value>")`` unless
    ``is_valid(config.<name>)``."""
    value = getattr(config, name)
    if not is_valid(value):
        raise ValueError(f"TrellisConfig.{name} must be {expected}, got {value!r}")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Largest model-level sizes (the mixers bound their own). Work and memory follow the tokens
# present, not these numbers; the bounds keep weights far from the int32 index range the
# kernels use and name the field before any allocation fails.
MAX_SIZES = {
    "vocab_size": 2**24, "hidden_size": 2**18, "intermediate_size": 2**20, "num_hidden_layers": 2**12,
    "num_heads": 2**12, "head_dim": 2**12,
}


class TrellisConfig(PreTrainedConfig):
    """Hyper-parameters of a Trellis model. Every field is used by the model.

    Every layer has a token mixer of its own kind (``mixer_types``); a field that no layer of
    the model uses does not change the model.

    Args:
        vocab_size: number of token ids.
        hidden_size: width D of the residual stream.
        num_hidden_layers: number of blocks.
        mixer_types: one entry per layer, each ``"trellis"`` (design page ``trellis.md``),
            ``"lattice"`` (``lattice.md``), ``"kvm"`` (Key-Value Means, ``kvm.md``) or
            ``"attention"`` (causal softmax attention with RoPE); ``None`` (the default) means every layer is ``"trellis"`` (:attr:`layer_kinds`
            resolves it). The standard ``layer_types`` field is set from it (memory mixers as
            ``"linear_attention"``, attention as ``"full_attention"``).
        num_heads: heads H of every mixer (query heads of attention layers).
        head_dim: per-head width d of queries, keys and values (H * d need not equal D).
        num_slots: memory slots M per head (Trellis and Lattice).
        chunk_size: C of the memory ops. With ``write_gradient="exact"`` it is not part of
            Trellis's function and changes neither its numbers nor its speed (the backends lay
            the tokens out in chunks of their own; C counts the offset a cache records); with
            ``"anchored"`` it is part of the function (``docs/results_lm.md``). Lattice and the
            gated delta rule are exact at any C.
        compress_fn: Trellis's compression function phi, one of ``trellis_lm.ops.COMPRESS_FNS``.
        mix_fn: Trellis's mixing function f, one of ``trellis_lm.ops.MIX_FNS``.
        write_gradient: where each Trellis write takes its inner gradient (design page
            ``trellis.md``, sections 1-2): ``"exact"`` (default), at the memory just before it,
            the per-token recurrence at any ``chunk_size`` (C then does not enter the
            function); ``"anchored"``, at the memory as it was at the write's chunk start, stale
            inside a chunk, so C is part of the function. A ``config.json`` without this field
            (every checkpoint saved before it existed) is read as ``"anchored"``.
        lattice_variant: Lattice's write rule, one of ``trellis_lm.ops.LATTICE_VARIANTS``
            (``"dec"``, ``"enc"``, ``"sim"``).
        conv_size: width of the causal depthwise convolution on q and k of the memory mixers
            (default 2: the token and the one before, chosen by Trellis's defaults study; 4 before
            it, and in the Lattice studies); 0 disables it. A model built from scratch starts with
            q's conv passing the current token and k's the previous one (see ``MemoryMixer.init_weights``).
        use_forget_gate: learn Trellis's forget gate beta; when False, beta = 1.
        gate_logit_normalizer: log_beta = logsigmoid(beta_proj(x)) / gate_logit_normalizer.
        num_key_value_heads: key/value heads of attention layers (grouped-query attention);
            ``None`` means ``num_heads``. Must divide ``num_heads``.
        rope_theta: base of the rotary position embedding of attention layers (plain RoPE on
            all of ``head_dim``; positions count each row's real tokens).
        attention_bias: attention layers' q/k/v projections have biases (as Qwen2's).
        kvm_chunk_size: C of KVM layers (a chunk is folded into the state as a whole).
        kvm_window_chunks: KVM's window, in chunks: the most recent ``kvm_window_chunks * C``
            tokens are attended to exactly.
        kvm_rope_dims: channels of q and k (even, fewer than ``head_dim``) that KVM rotates, pairs
            (2i, 2i + 1) with ``rope_theta``; ``None``: half of ``head_dim``, rounded down to even.
            All of ``head_dim`` is refused (every state key would be the same vector; ``kvm.md``).
        kvm_sinks: KVM state rows that never take merges (attention sinks), < ``kvm_chunk_size``.
        kvm_state_size: KVM state rows: the budget for ``kvm_budget="fixed"``, the cap for the
            growable budgets; at least ``kvm_chunk_size``.
        kvm_budget: ``"fixed"`` (a constant-size cache), ``"power_law"`` or ``"saturation"``
            (growing with the tokens seen up to ``kvm_state_size``; design page ``kvm.md``, section 1).
        kvm_budget_scale, kvm_budget_exponent: ``"power_law"`` allows
            ``floor(kvm_budget_scale * t ** kvm_budget_exponent)`` state rows after t tokens
            (upstream 16 and 0.5).
        kvm_budget_saturation: ``"saturation"`` allows ``floor(N t / (N + t))`` rows, N this field
            (upstream 1024).
        kvm_budget_min: the growable budgets' floor, in rows; ``None`` (default) means
            ``kvm_chunk_size``, what the first fold seeds (upstream: 256 rows with chunks of 256).
            A floor at or above ``kvm_state_size`` makes them equal to ``"fixed"``.
        intermediate_size: hidden width of the SwiGLU MLP.
        rms_norm_eps: epsilon of every RMSNorm.
        initializer_range: standard deviation of the linear and embedding weights at init.
        tie_word_embeddings: share the input embedding with the LM head; off for models built from
            scratch (a tied head stalled MQAR training, ``docs/results_notes.md``); converted
            checkpoints keep their source's choice.
        pad_token_id, bos_token_id, eos_token_id: special token ids (generation reads them).
        use_cache: return a :class:`TrellisCache` from ``forward`` by default.
        op_backend: ``"auto"`` or a backend that every op of the model's layers has (the registry
            ``BACKENDS`` of each op: ``"reference"`` runs the per-token loop everywhere,
            ``"torch"`` the chunked PyTorch form, ``"triton"`` the Trellis kernels, which only
            the Trellis op has); passed as ``backend=`` to the ops. A named backend that cannot
            run a call (triton on a CPU tensor) raises a ``ValueError`` saying why.
        compile_decode: decode steps' runs of consecutive Trellis and Lattice blocks as one
            ``torch.compile``d function each on CPUs, and as CUDA graphs within ``generate()`` on
            GPUs (same numbers; what runs eagerly and why: :mod:`trellis_lm.compiled_decode`;
            speed: ``BENCHMARKS.md``, issues 39-40). Served by vLLM on a CPU: those mixers' rows
            of one token and of draft tokens, compiled as the model loads (``docs/serving.md``).
            Prefill and training are not affected.

    Reading far past the training length needs state passing in training (the recipes do it by
    default; a loop of one's own: :mod:`trellis_lm.state_passing`, ``docs/results_lm_extrapolation.md``).
    """

    model_type: ClassVar[str] = "trellis"
    # The fields every model uses whatever its layers; every other field is a layer kind's (its
    # mixer's `config_fields`). The model card lists these and those of the model's own kinds.
    model_level_fields: ClassVar[tuple[str, ...]] = (
        "vocab_size", "hidden_size", "num_hidden_layers", "mixer_types", "num_heads", "head_dim", "intermediate_size",
        "rms_norm_eps", "initializer_range", "tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id",
        "use_cache", "op_backend", "compile_decode",
    )
    # Fields added after checkpoints were saved without them, each with the value those
    # checkpoints computed with: what a saved config or cache signature that lacks the field
    # means (stated here, not by the mixers: a checkpoint's config is read before its model).
    saved_before: ClassVar[dict[str, Any]] = {"write_gradient": "anchored"}
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["cache", "past_key_values"]  # the name before and after transformers 5.24
    # Tools written for attention models read `num_attention_heads`.
    attribute_map: ClassVar[dict[str, str]] = {"num_attention_heads": "num_heads"}

    vocab_size: int = 32000
    hidden_size: int = 768
    num_hidden_layers: int = 12
    mixer_types: list[str] | None = None
    num_heads: int = 12
    head_dim: int = 64
    num_slots: int = NUM_SLOTS
    chunk_size: int = CHUNK_SIZE
    compress_fn: str = COMPRESS_FN
    mix_fn: str = MIX_FN
    write_gradient: str = WRITE_GRADIENT
    lattice_variant: str = LATTICE_VARIANT
    conv_size: int = CONV_SIZE
    use_forget_gate: bool = True
    gate_logit_normalizer: float = 16.0
    num_key_value_heads: int | None = None
    rope_theta: float = 10000.0
    attention_bias: bool = False
    kvm_chunk_size: int = KVM_CHUNK_SIZE
    kvm_window_chunks: int = KVM_WINDOW_CHUNKS
    kvm_rope_dims: int | None = None
    kvm_sinks: int = KVM_SINKS
    kvm_state_size: int = KVM_STATE_SIZE
    kvm_budget: str = KVM_BUDGET
    kvm_budget_scale: float = KVM_BUDGET_SCALE
    kvm_budget_exponent: float = KVM_BUDGET_EXPONENT
    kvm_budget_saturation: float = KVM_BUDGET_SATURATION
    kvm_budget_min: int | None = None
    intermediate_size: int = 2048
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    use_cache: bool = True
    op_backend: str = "auto"
    compile_decode: bool = False

    @classmethod
    def legacy_values(cls) -> dict[str, Any]:
        """Fields added after checkpoints were saved without them, each with the value those
        checkpoints computed with (:attr:`saved_before`): what a saved config or cache signature
        that lacks the field means."""
        return dict(cls.saved_before)

    @classmethod
    def completed(cls, saved: Mapping[str, Any], given: Iterable[str] = ()) -> dict[str, Any]:
        """The fields of a saved model (a ``config.json``, a cache or state file's signature), each
        field it lacks because it was saved before the field existed set to the value that model
        computed with (:meth:`legacy_values`, e.g. ``write_gradient="anchored"``), not to the
        default of new models. The one rule of every reader; ``given``: fields set otherwise
        (keyword arguments), left to them."""
        missing = {name: value for name, value in cls.legacy_values().items() if name not in saved and name not in given}
        return {**saved, **missing}

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> "TrellisConfig":
        """A saved config (``config.json``, what ``from_pretrained`` reads), read by
        :meth:`completed`; fields given as keyword arguments win."""
        return super().from_dict(cls.completed(config_dict, kwargs), **kwargs)

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> "TrellisConfig":
        """A saved ``config.json`` file, read as :meth:`from_dict` reads its fields."""
        return cls.from_dict(cls._dict_from_json_file(json_file))

    @classmethod
    def check_field_names(cls, names: Iterable[str]) -> None:
        """Raise a ``ValueError`` naming the first of ``names`` that is not a field of this class
        (transformers' own settings, which every config holds, are not its fields either), with
        the field it may be a misspelling of."""
        fields = {f.name for f in dataclasses.fields(cls)} - {f.name for f in dataclasses.fields(PreTrainedConfig)}
        for name in names:
            if name not in fields:
                close = difflib.get_close_matches(name, sorted(fields), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else " (TrellisConfig's docstring lists its fields)"
                raise ValueError(f"{name!r} is not a TrellisConfig field{hint}")

    def __post_init__(self, **kwargs: Any) -> None:
        given = kwargs.pop("layer_types", None)
        self.check_fields()
        # A saved config carries the layer_types derived when it was saved; an all-Trellis one
        # stays valid when num_hidden_layers is overridden on loading.
        stale_uniform = self.mixer_types is None and all(kind == "linear_attention" for kind in given or ())
        if _layer_checks is None and given is not None:
            self.layer_types = list(given)  # as saved, until a model's mixers set it (check_fields)
        elif given is not None and list(given) != self.layer_types and not stale_uniform:
            raise ValueError(
                f"TrellisConfig.layer_types is set from mixer_types ({self.layer_types}); got {list(given)}. "
                "Choose each layer's mixer with mixer_types."
            )
        super().__post_init__(**kwargs)

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's mixer: ``mixer_types``, or ``"trellis"`` (:data:`DEFAULT_KIND`) for every
        layer when it is ``None``."""
        return [DEFAULT_KIND] * self.num_hidden_layers if self.mixer_types is None else list(self.mixer_types)

    @property
    def kvm_rotary_dims(self) -> int:
        """Channels KVM layers rotate: ``kvm_rope_dims``, or half of ``head_dim`` (even)."""
        return self.head_dim // 4 * 2 if self.kvm_rope_dims is None else self.kvm_rope_dims

    @property
    def key_value_heads(self) -> int:
        """Key/value heads of attention layers (``num_key_value_heads``, or ``num_heads``)."""
        return self.num_heads if self.num_key_value_heads is None else self.num_key_value_heads

    def check_fields(self) -> None:
        """Raise a ``ValueError`` naming the first field whose value the model cannot use, and
        set ``layer_types`` from the mixers. Runs when the config is made and again when a
        model is built from it, so fields changed in between are checked too. The layer kinds'
        checks are those the mixers registered (:func:`register_layer_checks`); with none
        registered (the model's code not loaded) they wait for the model."""

        def check(name: str, is_valid: Callable[[Any], bool], expected: str) -> None:
            check_value(self, name, is_valid, expected)

        def is_token_id(value: Any) -> bool:
            return is_int(value) and 0 <= value < self.vocab_size

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "intermediate_size"):
            check(name, lambda v: is_int(v) and 1 <= v <= MAX_SIZES[name], f"an integer in [1, {MAX_SIZES[name]}]")
        if _layer_checks is not None:
            _layer_checks(self)
        for name in ("rms_norm_eps", "initializer_range"):
            # inf passes "> 0" but zeroes every norm: the model would output constants.
            check(name, lambda v: is_real(v) and 0 < v < math.inf, "a finite number > 0")
        for name in ("tie_word_embeddings", "use_cache", "compile_decode"):
            check(name, lambda v: isinstance(v, bool), "True or False")
        token_id = f"None or a token id in [0, vocab_size = {self.vocab_size})"
        for name in ("pad_token_id", "bos_token_id"):
            check(name, lambda v: v is None or is_token_id(v), token_id)
        check("eos_token_id", lambda v: v is None or is_token_id(v) or (isinstance(v, list) and all(map(is_token_id, v))),
              f"{token_id}, or a list of token ids")

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: Any) -> None:
        """Save ``config.json`` together with the model code, so the folder loads with
        ``trust_remote_code=True`` where ``trellis_lm`` is not installed.

        A model's ``save_pretrained`` calls this, so its checkpoints carry the code too.
        Loaded as remote code, the classes are registered for auto classes and transformers
        copies their (already flat) files itself.
        """
        if not code_is_packaged():
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, **kwargs)
        # The default kind's code too: a config made with no arguments has only layers of it, and
        # transformers before 5.11 makes one (to_diff_dict) whenever a config is printed or saved.
        export_code(save_directory, {*self.layer_kinds, DEFAULT_KIND})
        if push_to_hub:
            # The parent would upload before the code is written; `push_to_hub` saves afresh
            # (through this method) into a temporary folder and uploads all of it.
            hub_keys = ("commit_message", "private", "token", "create_pr", "revision")
            repo_id = kwargs.get("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, **{key: kwargs[key] for key in hub_keys if key in kwargs})


__all__ = ["TrellisConfig"]
