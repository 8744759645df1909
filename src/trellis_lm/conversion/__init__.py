"""Turn a pretrained Llama-family model into a Trellis model, then distil the teacher into it.

:func:`convert_llama_to_trellis` copies what the two architectures share and initialises the
rest (:mod:`.llama`), from a checkpoint folder or a GGUF file (:mod:`.source`);
:func:`distill_layerwise` and :func:`distill_logits` are the two training stages
(:mod:`.distill`); :mod:`.cli` is the ``trellis-lm convert`` command. See
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
from .llama import NEW_MIXER_PARAMETERS, SUPPORTED_ARCHITECTURES, convert_llama_to_trellis

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "NEW_MIXER_PARAMETERS",
    "SUPPORTED_ARCHITECTURES",
    "TokenBlocks",
    "convert_llama_to_trellis",
    "distill_layerwise",
    "distill_logits",
    "distillation_arguments",
    "layerwise_errors",
    "logit_kl",
]
