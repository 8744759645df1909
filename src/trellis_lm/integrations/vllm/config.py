"""How vLLM reads a :class:`~trellis_lm.TrellisConfig`, and what the plugin refuses to serve."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase


class TrellisArchConvertor(ModelArchConfigConvertorBase):
    """vLLM's reading of the config, where ours differs from Llama's field names.

    ``num_key_value_heads`` is ``None`` in a config that leaves attention layers (if any) one
    key/value head per query head; vLLM wants the number (``TrellisConfig.key_value_heads``).
    """

    def get_total_num_kv_heads(self) -> int:
        return self.hf_text_config.key_value_heads


class TrellisServingChecks(VerifyAndUpdateConfig):
    """Refuses, when vLLM builds its configuration, what the plugin does not serve: a request
    there gets a clear error at ``LLM(...)`` / server start, not a crash (or wrong tokens) in
    the engine later."""

    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        if vllm_config.speculative_config is not None:
            raise ValueError(
                "speculative decoding (speculative_config) is not supported for Trellis checkpoints in vLLM: "
                "the memory layers would need the state after each accepted draft token, which the plugin does not "
                "keep yet (docs/serving.md); serve without it, or use model.generate(prompt_lookup_num_tokens=...)"
            )
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size = {parallel.tensor_parallel_size} and pipeline_parallel_size = "
                f"{parallel.pipeline_parallel_size}: Trellis checkpoints are served by one process in vLLM "
                "(both must be 1; docs/serving.md)"
            )
