"""Convert a Llama-family checkpoint into a Trellis model that starts from its weights.

Trellis blocks have the Llama layout (design page, section 5), so everything outside the token
mixer is copied exactly, and the mixer keeps the teacher's q/k/v/o projections. What the
Trellis mixer adds (targets, gates, short convs, output gate and norm, initial memories) is
initialised by :func:`init_new_mixer_parameters`, which states each choice and why.

Supported sources are local folders of ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``, and GGUF files of those architectures (read by
transformers, dequantized; see :mod:`.source`). What a Trellis model cannot hold is either
dropped where it only shaped the attention pattern the mixer replaces (rotary embeddings,
Mistral/Qwen sliding windows, Qwen2's q/k/v biases, Qwen3's q/k norm weights; each logged), or
refused with a ``ValueError`` where dropping it would change a part that is copied exactly
(biases on ``o_proj`` or the MLP, a non-SiLU MLP).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Union

import torch
from transformers import GenerationConfig, PreTrainedConfig

from ..configuration_trellis import TrellisConfig
from ..mixers import TrellisAttention, forget_gate_bias
from ..modeling_trellis import TrellisForCausalLM
from ..remote_code import flat_sources
from .source import copy_tokenizer, locate_source

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# The mixer parameters a converted model does not take from the teacher (names under `self_attn`).
NEW_MIXER_PARAMETERS = (
    "alpha_proj", "beta_proj", "gamma_proj", "g_proj", "q_conv", "k_conv", "o_norm", "mk0", "mv0",
)

# Teacher tensors with the same name and shape in Trellis.
_COPIED = re.compile(
    r"model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
    r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
    r"model\.layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.weight|"
    r"model\.layers\.\d+\.self_attn\.(q_proj|o_proj)\.weight"
)
# Key/value projections of grouped-query attention: one teacher head serves several query heads.
_EXPANDED = re.compile(r"model\.layers\.\d+\.self_attn\.(k_proj|v_proj)\.weight")
# Parts of the attention that only shaped its softmax pattern; see `_dropped_parts`.
_DROPPED = re.compile(r"model\.layers\.\d+\.self_attn\.((q_proj|k_proj|v_proj)\.bias|(q_norm|k_norm)\.weight)")



def convert_llama_to_trellis(
    src: Union[str, Path],
    dst: Union[str, Path],
    *,
    num_slots: int = 64,
    chunk_size: int = 64,
    seed: int = 0,
    **overrides: Any,
) -> TrellisForCausalLM:
    """Convert the checkpoint folder or GGUF file ``src`` into a Trellis model, saved to ``dst`` and returned.

    Embeddings, norms, MLPs and the LM head are copied exactly (``tie_word_embeddings`` kept);
    ``q_proj``/``o_proj`` are copied and ``k_proj``/``v_proj`` ``[H_kv * d, D]`` are expanded to
    ``[H * d, D]`` by repeating each key/value head for the query heads it serves, so Trellis
    head h starts from the teacher's query head h and its key/value head. The new parameters are
    set by :func:`init_new_mixer_parameters`, so that before any training the model computes
    exactly the teacher with every attention output replaced by zero.

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
        dst: the output folder (created; files in it are overwritten).
        num_slots: memory slots M per head.
        chunk_size: the op's chunk size C.
        seed: seeds the random parts of the initialisation (targets, initial memories), so a
            conversion is reproducible.
        overrides: further :class:`TrellisConfig` fields (e.g. ``compress_fn``, ``conv_size``,
            ``gate_logit_normalizer``, ``op_backend``). Fields the teacher's weights fix
            (sizes, ``rms_norm_eps``, ``tie_word_embeddings``) may only repeat its values.

    Raises:
        ValueError: ``src`` is not a local folder or GGUF file (or a folder holds several GGUF
            files), is a GGUF file while the ``gguf`` package is missing, holds another
            architecture, or uses an option Trellis cannot carry (named in the message); an
            override is unknown or conflicts.
    """
    source, dst = locate_source(src), Path(dst)
    source_config = source.load_config()
    config = trellis_config_from(source_config, num_slots=num_slots, chunk_size=chunk_size, **overrides)
    for note in _dropped_parts(source_config):
        logger.warning("Converting %s: %s", source, note)

    teacher = source.load_model(dtype="auto")
    dtype = next(teacher.parameters()).dtype
    # Built in float32 and cast at the end: a half-precision teacher's values survive the round
    # trip exactly, and the new parameters are drawn at full precision.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = TrellisForCausalLM(config)
        load_teacher_weights(student, teacher.state_dict(), source_config)
        for layer in student.model.layers:
            init_new_mixer_parameters(layer.self_attn, layer.input_layernorm.weight)
    del teacher
    student.to(dtype).eval()

    if not source.is_gguf and (source.folder / "generation_config.json").is_file():
        student.generation_config = GenerationConfig.from_pretrained(source.folder)
    student.save_pretrained(dst)
    # The model code save_pretrained just wrote wins over same-named files of the source.
    copy_tokenizer(source, dst, keep=flat_sources())
    return student


def trellis_config_from(
    source_config: PreTrainedConfig, *, num_slots: int = 64, chunk_size: int = 64, **overrides: Any
) -> TrellisConfig:
    """The Trellis config of a converted ``source_config``; raises ``ValueError`` where it cannot be.

    Sizes, ``rms_norm_eps``, tied embeddings and the special token ids come from the source;
    ``num_heads`` and ``head_dim`` are its query heads and head size (keys and values are
    expanded to as many heads).
    """
    check_convertible(source_config)
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
    own_fields = {f.name for f in dataclasses.fields(TrellisConfig)}
    own_fields -= {f.name for f in dataclasses.fields(PreTrainedConfig)}
    unknown = sorted(set(overrides) - own_fields)
    if unknown:
        raise ValueError(f"unknown TrellisConfig field(s) {unknown}; fields are {sorted(own_fields)}")
    for name, value in overrides.items():
        if name in carried and value != carried[name]:
            raise ValueError(
                f"cannot set {name}={value!r}: the teacher's weights fix it to {carried[name]!r}"
                + (" (mismatched head dims)" if name in ("head_dim", "num_heads") else "")
            )
    fields = dict(
        carried,
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


def _dropped_parts(source_config: PreTrainedConfig) -> list[str]:
    """What the conversion leaves out of this source, one sentence each (logged as warnings)."""
    notes = ["rotary position embeddings are dropped: Trellis orders tokens by its short conv and recurrence"]
    if source_config.model_type == "qwen2":
        notes.append(
            "q/k/v_proj biases are dropped: Trellis projections have no bias and their input is RMS-normalised, "
            "so no weight can stand in for a constant; the distillation stages learn to do without them"
        )
    if source_config.model_type == "qwen3":
        notes.append(
            "q_norm/k_norm weights are dropped: Trellis L2-normalises each head's q and k (after SiLU) itself, "
            "which keeps their direction but not those per-channel scales"
        )
    uses_window = getattr(source_config, "use_sliding_window", True) and getattr(source_config, "sliding_window", None)
    if uses_window:
        notes.append(
            f"sliding_window={source_config.sliding_window} is dropped: a Trellis memory sees the whole past, "
            "fading by its forget gate"
        )
    return notes


def load_teacher_weights(
    student: TrellisForCausalLM, teacher_state: dict[str, torch.Tensor], source_config: PreTrainedConfig
) -> None:
    """Copy the teacher's tensors into ``student`` in place, accounting for every one of them.

    Raises ``ValueError`` on a tensor that is neither carried nor a documented drop, so a
    variant checkpoint with extra parameters is never converted silently.
    """
    n_rep = source_config.num_attention_heads // _kv_heads(source_config)
    head_dim = _head_dim(source_config)
    mapped: dict[str, torch.Tensor] = {}
    for name, tensor in teacher_state.items():
        if _EXPANDED.fullmatch(name):
            mapped[name] = repeat_kv_heads(tensor, n_rep, head_dim)
        elif _COPIED.fullmatch(name):
            if name != "lm_head.weight" or not student.config.tie_word_embeddings:
                mapped[name] = tensor
        elif not _DROPPED.fullmatch(name):
            raise ValueError(
                f"cannot convert teacher tensor {name!r} {tuple(tensor.shape)}: Trellis has no place for it"
            )
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


@torch.no_grad()
def init_new_mixer_parameters(attn: TrellisAttention, input_norm_weight: torch.Tensor) -> None:
    """Initialise what a Trellis mixer has beyond the teacher's q/k/v/o projections.

    The aim is a converted model that starts as a well-defined function and gives the
    distillation a well-conditioned op to shape:

    - ``g_proj = 0``: the output gate GELU(g_proj x) is exactly 0, so every mixer outputs 0 and
      the converted model *is* the teacher with its attention outputs removed. A gate of about 1,
      which would pass the memory read through unchanged, cannot be had without a bias (GELU of
      a bias-free linear map of an RMS-normalised input has no constant part), and a random gate
      would add context-free noise of the attention's own size to every layer. GELU'(0) = 1/2,
      so the gate still gets gradients at once (as a zero-initialised LoRA ``B`` or residual
      branch does) and the rest of the mixer right after the first step. Layer-wise errors start
      at exactly 1.0 in :func:`trellis_lm.conversion.layerwise_errors`.
    - ``q_conv``, ``k_conv`` = identity (last tap 1, others 0): q and k are then SiLU of the
      teacher's own (pre-rotary) projections; PyTorch's random conv default would mix four
      positions with random weights and scramble the carried projections. Training can still
      learn local mixing from there, which takes over part of what the rotary embedding did.
    - ``beta_proj``: weight 0, bias from :func:`forget_gate_bias`, i.e. the forget gate spread
      over heads from 0.9 to 0.999 (memory horizons of about 10 to 1000 tokens), like the mix
      of local and long-range heads in an attention layer. Independent of the input at first,
      so each head's horizon is known; the weight is trained.
    - ``gamma_proj``: weight 0, bias 0, i.e. the inner learning rate is 1/2 for every token: far
      above the forget rate (1 - beta <= 0.1), so what is written dominates the memory's decay,
      while a chunk of C stale-gradient updates stays moderate against entries of order 1.
    - ``alpha_proj`` ~ N(0, 1 / |w|^2) with ``w`` the block's ``input_layernorm`` weight: the
      mixer input is ``w * x_hat`` with ``x_hat`` of unit RMS, so each target entry has variance
      about 1 — the scale of what the LayerNorm compression outputs. The targets are then
      distinct, random codes per token that the key pass stores and the value pass reads back
      with. Targets near 0 (the generic 0.02 init on a small ``w``) would write almost nothing:
      the LayerNorm compression's gradient towards 0 is radial and its Jacobian removes it.
    - ``mk0``, ``mv0`` ~ N(0, 1), the model's own choice (design page, section 5): ``MK0 k`` then
      spreads with unit variance over the slots for a unit-norm k, so the compressions do not
      divide by about eps.
    - ``o_norm`` weight 1: the output per head has unit RMS before the gate, so the gate alone
      sets the output scale that the distillation learns.

    Args:
        attn: a freshly built mixer (its q/k/v/o projections are overwritten afterwards).
        input_norm_weight: ``[D]`` the teacher's ``input_layernorm`` weight of that block.
    """
    heads = attn.config.num_heads
    attn.g_proj.weight.zero_()
    for conv in (attn.q_conv, attn.k_conv):
        if conv is not None:
            conv.weight.zero_()
            conv.weight[..., -1] = 1.0
    if attn.beta_proj is not None:
        attn.beta_proj.weight.zero_()
        attn.beta_proj.bias.copy_(forget_gate_bias(heads, attn.config.gate_logit_normalizer))
    attn.gamma_proj.weight.zero_()
    attn.gamma_proj.bias.zero_()
    scale = input_norm_weight.float().norm().clamp_min(1e-6)
    attn.alpha_proj.weight.normal_(0.0, 1.0).div_(scale)
    attn.mk0.normal_(0.0, 1.0)
    attn.mv0.normal_(0.0, 1.0)
    attn.o_norm.weight.fill_(1.0)


def _is_new_or_tied(name: str, student: TrellisForCausalLM) -> bool:
    """A Trellis tensor the teacher does not provide: a new mixer parameter or a tied LM head."""
    if name == "lm_head.weight":
        return student.config.tie_word_embeddings
    parts = name.split(".")
    return "self_attn" in parts and parts[parts.index("self_attn") + 1] in NEW_MIXER_PARAMETERS


def _kv_heads(config: PreTrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


__all__ = [
    "NEW_MIXER_PARAMETERS",
    "SUPPORTED_ARCHITECTURES",
    "check_convertible",
    "convert_llama_to_trellis",
    "init_new_mixer_parameters",
    "load_teacher_weights",
    "repeat_kv_heads",
    "trellis_config_from",
]
