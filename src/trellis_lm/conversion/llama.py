"""Convert a Llama-family checkpoint into a Trellis model that starts from its weights.

Trellis blocks have the Llama layout (design page, section 5), so everything outside the token
mixer is copied exactly. Each teacher attention layer becomes one of three mixers:

- a **Trellis** mixer (the default), which keeps the teacher's q/k/v/o projections; what it
  adds (targets, gates, short convs, output gate and norm, initial memories) is initialised by
  the mixer's own ``init_from_attention``, which states each choice and why;
- a **Lattice** mixer (``mixer="lattice"``), which keeps v/o and takes its slot coefficients
  from the teacher's q/k (:func:`project_to_slots`); the rest is set by its
  ``init_from_attention``;
- a **kept softmax attention** layer (``keep_attention=[...]`` or ``attention_every=N``),
  copied exactly (its own key/value heads, Qwen2's q/k/v biases, the teacher's ``rope_theta``),
  so it computes what the teacher's layer computes.

Supported sources are local folders of ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``, and GGUF files of those architectures (read by
transformers, dequantized; see :mod:`.source`). What a converted (memory) layer cannot hold is
either dropped where it only shaped the attention pattern the mixer replaces (rotary
embeddings, Mistral/Qwen sliding windows, Qwen2's q/k/v biases, Qwen3's q/k norm weights; each
logged), or refused with a ``ValueError`` where dropping it would change a part that is copied
exactly (biases on ``o_proj`` or the MLP, a non-SiLU MLP). A kept attention layer must be
reproducible exactly, so a teacher whose attention the attention mixer cannot compute (a RoPE
other than the default one over all of ``head_dim``, a sliding window, Qwen3's q/k norms) is
refused when layers are kept.
"""

from __future__ import annotations

import logging
import numbers
import re
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from transformers import GenerationConfig, PreTrainedConfig

from ..configuration_trellis import TrellisConfig
from ..mixers import DEFAULT_KIND, MIXERS, AttentionMixer, LatticeAttention, TrellisAttention
from ..modeling_trellis import TrellisForCausalLM
from ..remote_code import flat_sources
from .source import TeacherSource, copy_tokenizer, locate_source, path_overlap

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# A kept layer: softmax attention, copied from the teacher.
KEPT_KIND = AttentionMixer.kind
# What a converted (not kept) attention layer may become: the kinds whose mixers declare how
# they take a teacher's attention (`teacher_parts`).
CONVERTED_MIXERS = tuple(kind for kind, m in MIXERS.items() if m.teacher_parts is not None and kind != KEPT_KIND)
# The mixer parameters a converted layer does not take from the teacher (names under `self_attn`),
# per kind, as the mixers declare them; a kept attention layer is all teacher.
NEW_PARAMETERS = {kind: MIXERS[kind].new_parameters for kind in (*CONVERTED_MIXERS, KEPT_KIND)}
NEW_MIXER_PARAMETERS = TrellisAttention.new_parameters
NEW_LATTICE_PARAMETERS = LatticeAttention.new_parameters

# Teacher tensors outside the token mixer, with the same name and shape in Trellis.
_SHARED = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight"
)
# Teacher attention tensors: (layer, part, weight or bias).
_ATTENTION = re.compile(r"model\.layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj|q_norm|k_norm)\.(weight|bias)")
# Attention parts that only shaped the softmax pattern a memory mixer replaces; see `_dropped_parts`.
_DROPPED_PARTS = {
    ("q_proj", "bias"), ("k_proj", "bias"), ("v_proj", "bias"), ("q_norm", "weight"), ("k_norm", "weight"),
}


def convert_llama_to_trellis(
    src: Union[str, Path],
    dst: Union[str, Path],
    *,
    num_slots: int = 64,
    chunk_size: int = 16,
    seed: int = 0,
    mixer: str = DEFAULT_KIND,
    keep_attention: Optional[Sequence[int]] = None,
    attention_every: Optional[int] = None,
    **overrides: Any,
) -> TrellisForCausalLM:
    """Convert the checkpoint folder or GGUF file ``src`` into a Trellis model, saved to ``dst`` and returned.

    Embeddings, norms, MLPs and the LM head are copied exactly (``tie_word_embeddings`` kept).
    Each teacher attention layer becomes:

    - with ``mixer="trellis"`` (default), a Trellis mixer: ``q_proj``/``o_proj`` are copied and
      ``k_proj``/``v_proj`` ``[H_kv * d, D]`` are expanded to ``[H * d, D]`` by repeating each
      key/value head for the query heads it serves, so Trellis head h starts from the teacher's
      query head h and its key/value head;
    - with ``mixer="lattice"``, a Lattice mixer: ``o_proj`` copied, ``v_proj`` expanded as above,
      and ``q_proj``/``k_proj`` (expanded) mapped to the M slot coefficients by
      :func:`project_to_slots` (copied unchanged when ``num_slots == head_dim``);
    - for the layers named by ``keep_attention`` or ``attention_every``, a softmax attention
      layer (``mixer_types[i] = "attention"``) with the teacher's q/k/v/o projections copied
      exactly, its own ``num_key_value_heads``, Qwen2's q/k/v biases (``attention_bias=True``)
      and its ``rope_theta``: that layer computes exactly what the teacher's does.

    The new parameters are set by the mixers' ``init_from_attention`` (``TrellisAttention``,
    ``LatticeAttention``), so that before any training the model
    computes exactly the teacher with the attention outputs of its converted layers replaced
    by zero (kept layers unchanged).

    ``dst`` receives the weights (in the teacher's dtype), the config and the model code (so it
    loads with ``AutoModelForCausalLM``, also with ``trust_remote_code=True`` alone), the
    tokenizer files and chat template copied byte for byte together with any tokenizer code
    their ``auto_map`` names, and the generation config. From a GGUF file, the weights are the
    dequantized ones in float32, and the tokenizer is the one transformers builds from the
    file's metadata (with its chat template), saved with ``save_pretrained``.

    Args:
        src: a local folder of a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``
            or ``Qwen3ForCausalLM`` checkpoint; or a GGUF file of one of those architectures, or a
            folder without ``config.json`` holding exactly one (needs the ``gguf`` package).
        dst: the output folder (created; files in it are overwritten). It may not be, hold or lie
            inside the source (symlinks followed): a ``ValueError`` before anything is written.
        num_slots: memory slots M per head.
        chunk_size: the op's chunk size C.
        seed: seeds the random parts of the initialisation (targets, initial memories, slot
            projections), so a conversion is reproducible.
        mixer: what the converted layers become, ``"trellis"`` or ``"lattice"``.
        keep_attention: 0-based indices of the teacher layers that stay softmax attention
            layers (distinct, each in ``[0, num_hidden_layers)``).
        attention_every: keep every N-th layer as attention: layers ``N - 1, 2N - 1, ...``
            (so ``N = 1`` keeps them all, ``N = 4`` keeps 3, 7, 11, ...). Exclusive with
            ``keep_attention``.
        overrides: further :class:`TrellisConfig` fields (e.g. ``compress_fn``, ``conv_size``,
            ``gate_logit_normalizer``, ``op_backend``). Fields the teacher's weights fix
            (sizes, ``rms_norm_eps``, ``tie_word_embeddings``, and with kept layers
            ``num_key_value_heads``, ``rope_theta``, ``attention_bias``) may only repeat its
            values; ``mixer_types`` is set by the three arguments above.

    Raises:
        ValueError: ``src`` is not a local folder or GGUF file (or a folder holds several GGUF
            files), is a GGUF file while the ``gguf`` package is missing, holds another
            architecture, or uses an option Trellis cannot carry (named in the message); an
            override is unknown or conflicts; ``mixer``, ``keep_attention`` or
            ``attention_every`` is invalid (named), or layers are kept from a teacher whose
            attention the attention mixer cannot reproduce exactly.
    """
    source, dst = locate_source(src), Path(dst)
    source_config, config = _converted_config(
        source, num_slots=num_slots, chunk_size=chunk_size, mixer=mixer, keep_attention=keep_attention,
        attention_every=attention_every, **overrides,
    )
    # Checked after the config: a folder that holds no convertible checkpoint is named as such,
    # even when DST lies inside it.
    relation = path_overlap(dst, source.path)
    if relation:
        raise ValueError(f"dst {dst} {relation} the source {src}: a conversion never writes into its source")
    return _write_converted(source, source_config, config, dst, seed)


def convert_source(source: TeacherSource, dst: Union[str, Path], *, seed: int = 0, **options: Any) -> TrellisForCausalLM:
    """:func:`convert_llama_to_trellis` of a source already located (:func:`~.source.locate_source`),
    into a ``dst`` that the caller has already refused to be, hold or lie inside the source: the
    convert-and-distil pipeline locates and checks once, then writes beside DST (and converts a
    second time for a hybrid chosen after stage 1). ``options`` are the other keyword arguments of
    :func:`convert_llama_to_trellis`; it raises what that raises, but for the source and ``dst``.
    """
    source_config, config = _converted_config(source, **options)
    return _write_converted(source, source_config, config, Path(dst), seed)


def _converted_config(source: TeacherSource, **options: Any) -> tuple[PreTrainedConfig, TrellisConfig]:
    """The source's config and the Trellis config converting it with ``options`` gives; what the
    converted layers drop is logged."""
    source_config = source.load_config()
    config = trellis_config_from(source_config, **options)
    for note in _dropped_parts(source_config, config.layer_kinds):
        logger.warning("Converting %s: %s", source, note)
    return source_config, config


def _write_converted(source: TeacherSource, source_config: PreTrainedConfig, config: TrellisConfig, dst: Path,
                     seed: int) -> TrellisForCausalLM:
    """Build the model of ``config`` from the teacher's weights, save it with the tokenizer to ``dst``."""
    teacher = source.load_model(dtype="auto")
    dtype = next(teacher.parameters()).dtype
    # Built in float32 and cast at the end: a half-precision teacher's values survive the round
    # trip exactly, and the new parameters are drawn at full precision.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = TrellisForCausalLM(config)
        load_teacher_weights(student, teacher.state_dict(), source_config)
        for layer in student.model.layers:
            layer.self_attn.init_from_attention(layer.input_layernorm.weight)
    del teacher
    student.to(dtype).eval()

    if not source.is_gguf and (source.folder / "generation_config.json").is_file():
        student.generation_config = GenerationConfig.from_pretrained(source.folder)
    student.save_pretrained(dst)
    # The model code save_pretrained just wrote wins over same-named files of the source.
    copy_tokenizer(source, dst, keep=flat_sources())
    return student


def layer_mixers(
    num_layers: int,
    *,
    mixer: str = DEFAULT_KIND,
    keep_attention: Optional[Sequence[int]] = None,
    attention_every: Optional[int] = None,
) -> list[str]:
    """Each layer's mixer kind: ``"attention"`` for the kept layers, ``mixer`` for the others.

    ``attention_every=N`` keeps layers ``N - 1, 2N - 1, ...`` (every N-th, counting from 1).
    Raises ``ValueError`` naming the argument: ``mixer`` not in :data:`CONVERTED_MIXERS`, both
    of ``keep_attention`` and ``attention_every`` given, an index that is not an integer, out
    of ``[0, num_layers)`` or repeated, ``attention_every`` not an integer >= 1 or keeping no
    layer (greater than ``num_layers``).
    """
    if mixer not in CONVERTED_MIXERS:
        raise ValueError(f"mixer must be one of {CONVERTED_MIXERS}, got {mixer!r}")
    if keep_attention is not None and attention_every is not None:
        raise ValueError("keep_attention and attention_every are mutually exclusive: pass one of them")
    kept: list[int] = []
    if keep_attention is not None:
        if isinstance(keep_attention, (str, bytes)) or not isinstance(keep_attention, Sequence):
            raise ValueError(f"keep_attention must be a sequence of layer indices, got {keep_attention!r}")
        for index in keep_attention:
            if not isinstance(index, numbers.Integral) or isinstance(index, bool):
                raise ValueError(f"keep_attention must hold integer layer indices, got {index!r}")
            index = int(index)  # e.g. numpy integers
            if not 0 <= index < num_layers:
                raise ValueError(
                    f"keep_attention index {index} is out of range: the teacher has layers 0 to {num_layers - 1}"
                )
            if index in kept:
                raise ValueError(f"keep_attention lists layer {index} more than once")
            kept.append(index)
    elif attention_every is not None:
        if not isinstance(attention_every, int) or isinstance(attention_every, bool) or attention_every < 1:
            raise ValueError(f"attention_every must be an integer >= 1, got {attention_every!r}")
        if attention_every > num_layers:
            raise ValueError(
                f"attention_every={attention_every} keeps no layer: the teacher has {num_layers} layers "
                f"(every N-th layer is kept: N - 1, 2N - 1, ...)"
            )
        kept = list(range(attention_every - 1, num_layers, attention_every))
    return [KEPT_KIND if i in kept else mixer for i in range(num_layers)]


def trellis_config_from(
    source_config: PreTrainedConfig,
    *,
    num_slots: int = 64,
    chunk_size: int = 16,
    mixer: str = DEFAULT_KIND,
    keep_attention: Optional[Sequence[int]] = None,
    attention_every: Optional[int] = None,
    **overrides: Any,
) -> TrellisConfig:
    """The Trellis config of a converted ``source_config``; raises ``ValueError`` where it cannot be.

    Sizes, ``rms_norm_eps``, tied embeddings and the special token ids come from the source;
    ``num_heads`` and ``head_dim`` are its query heads and head size (memory mixers expand keys
    and values to as many heads). ``mixer_types`` comes from :func:`layer_mixers` (``None``
    when every layer is Trellis); with kept attention layers, ``num_key_value_heads``,
    ``rope_theta`` and ``attention_bias`` come from the source too.
    """
    check_convertible(source_config)
    if "mixer_types" in overrides:
        raise ValueError("cannot set mixer_types: choose the layers with mixer=, keep_attention= or attention_every=")
    kinds = layer_mixers(
        source_config.num_hidden_layers, mixer=mixer, keep_attention=keep_attention, attention_every=attention_every
    )
    heads = source_config.num_attention_heads
    carried = dict(
        vocab_size=source_config.vocab_size,
        hidden_size=source_config.hidden_size,
        num_hidden_layers=source_config.num_hidden_layers,
        num_heads=heads,
        head_dim=_head_dim(source_config),
        intermediate_size=source_config.intermediate_size,
        rms_norm_eps=source_config.rms_norm_eps,
        tie_word_embeddings=bool(source_config.tie_word_embeddings),
    )
    kept = [i for i, kind in enumerate(kinds) if kind == KEPT_KIND]
    if kept:
        argument = "keep_attention" if keep_attention is not None else "attention_every"
        carried.update(
            num_key_value_heads=_kv_heads(source_config),
            rope_theta=float(check_keepable(source_config, kept, argument)),
            # Qwen2's q/k/v projections always have biases (its o_proj none); Llama's and
            # Mistral's have none (attention_bias=True, with an o_proj bias, is refused).
            attention_bias=source_config.model_type == "qwen2",
        )
    TrellisConfig.check_field_names(overrides)
    for name, value in overrides.items():
        if name in carried and value != carried[name]:
            raise ValueError(
                f"cannot set {name}={value!r}: the teacher's weights fix it to {carried[name]!r}"
                + (" (mismatched head dims)" if name in ("head_dim", "num_heads") else "")
            )
    fields = dict(
        carried,
        mixer_types=None if all(kind == DEFAULT_KIND for kind in kinds) else kinds,
        num_slots=num_slots,
        chunk_size=chunk_size,
        initializer_range=getattr(source_config, "initializer_range", 0.02),
        pad_token_id=source_config.pad_token_id,
        bos_token_id=source_config.bos_token_id,
        eos_token_id=source_config.eos_token_id,
    )
    fields.update(overrides)
    config = TrellisConfig(**fields)
    if source_config.dtype is not None:
        config.dtype = source_config.dtype
    return config


def check_convertible(source_config: PreTrainedConfig) -> None:
    """Raise ``ValueError`` naming the first thing about ``source_config`` Trellis cannot carry."""
    model_type = getattr(source_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture: model_type {model_type!r} (architectures "
            f"{getattr(source_config, 'architectures', None)}); supported: {sorted(SUPPORTED_ARCHITECTURES.values())}"
        )
    expected = SUPPORTED_ARCHITECTURES[model_type]
    architectures = getattr(source_config, "architectures", None) or [expected]
    if expected not in architectures:
        raise ValueError(f"unsupported architecture {architectures}: only {expected} is converted for {model_type!r}")
    if getattr(source_config, "hidden_act", "silu") != "silu":
        raise ValueError(
            f"unsupported option hidden_act={source_config.hidden_act!r}: the Trellis MLP is SwiGLU (silu)"
        )
    if getattr(source_config, "mlp_bias", False):
        raise ValueError("unsupported option mlp_bias=True: the Trellis MLP has no biases, and it is copied exactly")
    # Llama and Qwen3 put this bias on o_proj too: a constant added to the residual stream,
    # which no bias-free Trellis parameter can produce. (Qwen2's q/k/v-only biases are dropped.)
    if model_type != "qwen2" and getattr(source_config, "attention_bias", False):
        raise ValueError(
            "unsupported option attention_bias=True: the bias of o_proj adds a constant to the residual stream, "
            "and Trellis projections have no bias"
        )
    heads, kv_heads = source_config.num_attention_heads, _kv_heads(source_config)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")


def check_keepable(source_config: PreTrainedConfig, kept: Sequence[int], argument: str = "keep_attention") -> float:
    """The ``rope_theta`` of ``source_config``'s attention, after checking that the attention
    mixer reproduces its layers ``kept`` exactly; otherwise a ``ValueError`` naming ``argument``
    and the reason.

    The attention mixer computes Llama attention with plain RoPE (``rope_type`` ``"default"``)
    on all of ``head_dim``, over the whole past. Refused: Qwen3's per-head q/k RMSNorm, any
    other RoPE type (``llama3``, ``linear``, ``yarn``, ...) or a partial rotary factor, and a
    sliding window in a kept layer (the mixer would see further back than the teacher).
    """
    def refuse(reason: str) -> ValueError:
        return ValueError(f"{argument}: cannot keep layer(s) {list(kept)} as softmax attention: {reason}")

    if source_config.model_type == "qwen3":
        raise refuse(
            "Qwen3 attention applies RMSNorm to each head's q and k (q_norm/k_norm), which the attention mixer "
            "does not; convert every layer instead"
        )
    rope = getattr(source_config, "rope_parameters", None) or getattr(source_config, "rope_scaling", None) or {}
    rope = dict(rope)
    if rope and all(isinstance(value, dict) for value in rope.values()):
        # Per-layer-type parameters (as transformers nests them for some models).
        params = [dict(value) for value in rope.values()]
    else:
        params = [rope]
    thetas = set()
    for param in params:
        rope_type = param.get("rope_type", param.get("type", "default"))
        if rope_type != "default":
            raise refuse(
                f"its RoPE is of type {rope_type!r} (rope_parameters={rope}); the attention mixer applies only the "
                "default RoPE, with rope_theta"
            )
        partial = param.get("partial_rotary_factor", getattr(source_config, "partial_rotary_factor", None))
        if partial is not None and partial != 1.0:
            raise refuse(f"partial_rotary_factor={partial}: the attention mixer rotates all of head_dim")
        theta = param.get("rope_theta", getattr(source_config, "rope_theta", None))
        if theta is None:
            raise refuse("the teacher config gives no rope_theta")
        thetas.add(float(theta))
    if len(thetas) > 1:
        raise refuse(f"its layers use different rope_theta values {sorted(thetas)}; the model has one")
    layer_types = getattr(source_config, "layer_types", None)
    window = getattr(source_config, "sliding_window", None)
    for index in kept:
        sliding = (
            layer_types[index] == "sliding_attention" if layer_types
            else bool(window) and getattr(source_config, "use_sliding_window", True)
        )
        if sliding:
            raise refuse(
                f"layer {index} attends within a sliding window (sliding_window={window}); the attention mixer "
                "sees the whole past"
            )
    if _head_dim(source_config) % 2:
        raise refuse(f"head_dim={_head_dim(source_config)} is odd; RoPE rotates channel pairs")
    return thetas.pop()


def _dropped_parts(source_config: PreTrainedConfig, kinds: Sequence[str]) -> list[str]:
    """What the conversion leaves out of this source's converted layers, one sentence each
    (logged as warnings); nothing when every layer is kept as attention."""
    converted = [i for i, kind in enumerate(kinds) if kind != KEPT_KIND]
    if not converted:
        return []
    where = "" if len(converted) == len(kinds) else f" in the converted layers {converted}"
    notes = [f"rotary position embeddings are dropped{where}: memory mixers order tokens by their short conv "
             "and recurrence"]
    if source_config.model_type == "qwen2":
        notes.append(
            f"q/k/v_proj biases are dropped{where}: memory-mixer projections have no bias and their input is "
            "RMS-normalised, so no weight can stand in for a constant; the distillation stages learn to do without them"
        )
    if source_config.model_type == "qwen3":
        notes.append(
            f"q_norm/k_norm weights are dropped{where}: memory mixers L2-normalise each head's q and k (after SiLU) "
            "themselves, which keeps their direction but not those per-channel scales"
        )
    uses_window = getattr(source_config, "use_sliding_window", True) and getattr(source_config, "sliding_window", None)
    if uses_window:
        notes.append(
            f"sliding_window={source_config.sliding_window} is dropped{where}: a memory sees the whole past, "
            "fading by its forget gate"
        )
    return notes


def load_teacher_weights(
    student: TrellisForCausalLM, teacher_state: dict[str, torch.Tensor], source_config: PreTrainedConfig
) -> None:
    """Copy the teacher's tensors into ``student`` in place, accounting for every one of them.

    What each attention tensor becomes depends on the student layer's kind (see
    :func:`convert_llama_to_trellis`). Raises ``ValueError`` on a tensor that is neither
    carried nor a documented drop, so a variant checkpoint with extra parameters is never
    converted silently. Lattice slot projections draw from torch's global generator (the
    conversion seeds it).
    """
    kinds = student.config.layer_kinds
    n_rep = source_config.num_attention_heads // _kv_heads(source_config)
    heads, head_dim = source_config.num_attention_heads, _head_dim(source_config)
    projections: dict[int, torch.Tensor] = {}
    mapped: dict[str, torch.Tensor] = {}
    for name, tensor in teacher_state.items():
        if _SHARED.fullmatch(name):
            if name != "lm_head.weight" or not student.config.tie_word_embeddings:
                mapped[name] = tensor
            continue
        match = _ATTENTION.fullmatch(name)
        kind = kinds[int(match.group(1))] if match and int(match.group(1)) < len(kinds) else None
        if kind is None:
            raise ValueError(
                f"cannot convert teacher tensor {name!r} {tuple(tensor.shape)}: Trellis has no place for it"
            )
        layer, part, what = int(match.group(1)), match.group(2), match.group(3)
        if kind == KEPT_KIND:
            # A kept layer: every projection as it is; q/k norms were refused by check_keepable.
            if part in ("q_norm", "k_norm") or (part == "o_proj" and what == "bias"):
                raise ValueError(f"cannot keep teacher tensor {name!r}: the attention mixer has no place for it")
            mapped[name] = tensor
        elif (part, what) in _DROPPED_PARTS:
            continue
        elif what == "bias":
            raise ValueError(
                f"cannot convert teacher tensor {name!r} {tuple(tensor.shape)}: Trellis has no place for it"
            )
        elif MIXERS[kind].teacher_parts[part] == "copy":
            mapped[name] = tensor
        else:  # "heads", or "slots": the query heads' rows, projected to the slots
            weight = repeat_kv_heads(tensor, n_rep, head_dim) if part in ("k_proj", "v_proj") else tensor
            if MIXERS[kind].teacher_parts[part] == "slots":
                if layer not in projections:
                    projections[layer] = slot_projection(student.config.num_slots, head_dim)
                weight = project_to_slots(weight, projections[layer], heads)
            mapped[name] = weight
    target = student.state_dict()
    missing = [n for n in target if n not in mapped and not _is_new_or_tied(n, student)]
    if missing:
        raise ValueError(f"the teacher checkpoint lacks {missing[:4]}{'...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, tensor in mapped.items():
            if target[name].shape != tensor.shape:
                raise ValueError(f"{name}: teacher shape {tuple(tensor.shape)}, Trellis {tuple(target[name].shape)}")
            target[name].copy_(tensor)


def repeat_kv_heads(weight: torch.Tensor, n_rep: int, head_dim: int) -> torch.Tensor:
    """``[H_kv * d, D]`` -> ``[H_kv * n_rep * d, D]``: row block h of the result is teacher head
    ``h // n_rep``, the key/value head grouped-query attention pairs with query head h."""
    kv_heads = weight.shape[0] // head_dim
    return weight.view(kv_heads, head_dim, -1).repeat_interleave(n_rep, dim=0).reshape(kv_heads * n_rep * head_dim, -1)


def slot_projection(num_slots: int, head_dim: int) -> torch.Tensor:
    """``P [M, d]`` float64 mapping a head's query/key channels to its M slot coefficients.

    The identity when ``M == d``. Otherwise a random matrix with orthonormal columns (``M > d``:
    ``P^T P = I``, so ``(P q) . (P k) = q . k``) or orthonormal rows (``M < d``: the scores of
    an M-dimensional subspace of the key space), drawn from torch's global generator.
    """
    if num_slots == head_dim:
        return torch.eye(head_dim, dtype=torch.float64)
    basis, _ = torch.linalg.qr(torch.randn(max(num_slots, head_dim), min(num_slots, head_dim), dtype=torch.float64))
    return basis if num_slots > head_dim else basis.T


def project_to_slots(weight: torch.Tensor, projection: torch.Tensor, heads: int) -> torch.Tensor:
    """``[H * d, D]`` -> ``[H * M, D]``: each head's rows mapped by ``projection [M, d]``.

    Why this is a sensible start for a Lattice mixer: its state is M unit slots ``s_i``; a
    token writes its value into slot i in proportion to its key coefficient ``k_i`` and reads
    ``sum_i q_i s_i``, so slot i accumulates ``sum_t k_{t,i} v_t`` and the read is about
    ``sum_t (q . k_t) v_t``: linear attention whose feature index is the slot. Taking q and k
    from the teacher's (pre-rotary) projections, through the same ``P`` for both, makes the
    slot a token is read from the one a matching key wrote to. With ``M == d`` (``P = I``) the
    coefficients are SiLU of the teacher's own channels.
    """
    dim = projection.shape[1]
    rows = projection @ weight.to(torch.float64).view(heads, dim, -1)  # [H, M, D]
    return rows.reshape(-1, weight.shape[-1]).to(weight.dtype)


def new_parameter_names(kind: str) -> tuple[str, ...]:
    """The parameters (module names under ``self_attn``) a converted layer of this mixer kind
    does not take from the teacher: what stage 1 trains. Empty for kept attention layers."""
    if kind not in NEW_PARAMETERS:
        raise ValueError(f"layers of kind {kind!r} are not made by conversion; kinds are {sorted(NEW_PARAMETERS)}")
    return NEW_PARAMETERS[kind]


def converted_layers(model: TrellisForCausalLM) -> list[int]:
    """Indices of the layers whose mixer replaced the teacher's attention (every layer that is
    not softmax attention): those stage 1 trains and reports."""
    return [i for i, kind in enumerate(model.config.layer_kinds) if kind != KEPT_KIND]


def _is_new_or_tied(name: str, student: TrellisForCausalLM) -> bool:
    """A Trellis tensor the teacher does not provide: a new mixer parameter or a tied LM head."""
    if name == "lm_head.weight":
        return student.config.tie_word_embeddings
    parts = name.split(".")
    if "self_attn" not in parts:
        return False
    kind = student.config.layer_kinds[int(parts[parts.index("layers") + 1])]
    return parts[parts.index("self_attn") + 1] in NEW_PARAMETERS.get(kind, ())


def _kv_heads(config: PreTrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


__all__ = [
    "CONVERTED_MIXERS",
    "NEW_LATTICE_PARAMETERS",
    "NEW_MIXER_PARAMETERS",
    "NEW_PARAMETERS",
    "SUPPORTED_ARCHITECTURES",
    "check_convertible",
    "check_keepable",
    "convert_llama_to_trellis",
    "convert_source",
    "converted_layers",
    "layer_mixers",
    "load_teacher_weights",
    "new_parameter_names",
    "project_to_slots",
    "repeat_kv_heads",
    "slot_projection",
    "trellis_config_from",
]
