"""How vLLM reads a :class:`~trellis_lm.TrellisConfig`."""

from __future__ import annotations

from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase


class TrellisArchConvertor(ModelArchConfigConvertorBase):
    """vLLM's reading of the config, where ours differs from Llama's field names.

    ``num_key_value_heads`` is ``None`` in a config that leaves attention layers (if any) one
    key/value head per query head; vLLM wants the number (``TrellisConfig.key_value_heads``).
    """

    def get_total_num_kv_heads(self) -> int:
        return self.hf_text_config.key_value_heads
