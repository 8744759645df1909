"""Where trellis_lm plugs into other programs: :mod:`.vllm` serves checkpoints with vLLM."""
