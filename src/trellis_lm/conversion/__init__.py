"""Turn a pretrained Llama-family model into a Trellis model, then distil the teacher into it.

:func:`convert_llama_to_trellis` copies what the two architectures share and initialises the
rest (:mod:`.llama`; optionally keeping some layers as softmax attention, or making the others
Lattice layers), from a checkpoint folder or a GGUF file (:mod:`.source`);
:func:`distill_layerwise` and :func:`distill_logits` are the two training stages
(:mod:`.distill`); :func:`conversion_costs` prices converting each layer, to choose which ones a
hybrid keeps as attention (:mod:`.layer_choice`); :func:`convert_and_distill` is the whole run of
the ``trellis-lm convert`` command (:mod:`.pipeline`), which :mod:`.cli` parses its arguments for. See
``docs/conversion.md``.
"""

from .distill import (
    DEFAULT_LORA_TARGETS,
    TokenBlocks,
    distill_layerwise,
    distill_logits,
    distillation_arguments,
    layerwise_errors,
    logit_kl,
)
from .layer_choice import choose_attention_layers, conversion_costs, keep_as_attention
from .llama import (
    CONVERTED_MIXERS,
    NEW_LATTICE_PARAMETERS,
    NEW_MIXER_PARAMETERS,
    SUPPORTED_ARCHITECTURES,
    convert_llama_to_trellis,
    converted_layers,
    layer_mixers,
)
from .pipeline import ConversionOptions, DistillOptions, convert_and_distill

__all__ = [
    "CONVERTED_MIXERS",
    "ConversionOptions",
    "DEFAULT_LORA_TARGETS",
    "DistillOptions",
    "NEW_LATTICE_PARAMETERS",
    "NEW_MIXER_PARAMETERS",
    "SUPPORTED_ARCHITECTURES",
    "TokenBlocks",
    "choose_attention_layers",
    "conversion_costs",
    "convert_and_distill",
    "convert_llama_to_trellis",
    "converted_layers",
    "distill_layerwise",
    "distill_logits",
    "distillation_arguments",
    "keep_as_attention",
    "layer_mixers",
    "layerwise_errors",
    "logit_kl",
]
