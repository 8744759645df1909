"""trellis-lm: Trellis language models for Hugging Face transformers.

Importing the package registers the model with the transformers auto classes, so
``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and ``AutoTokenizer`` load Trellis
checkpoints without ``trust_remote_code`` (checkpoints also carry their code for
``trust_remote_code=True`` where this package is not installed).
"""

__version__ = "0.1.0"

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from .cache_trellis import TrellisCache
from .configuration_trellis import TrellisConfig
from .modeling_trellis import TrellisForCausalLM, TrellisModel
from .ops import TrellisState, trellis_attention
from .tokenization_trellis import TrellisTokenizerFast, train_tokenizer

AutoConfig.register(TrellisConfig.model_type, TrellisConfig, exist_ok=True)
AutoModel.register(TrellisConfig, TrellisModel, exist_ok=True)
AutoModelForCausalLM.register(TrellisConfig, TrellisForCausalLM, exist_ok=True)
AutoTokenizer.register(TrellisConfig, tokenizer_class=TrellisTokenizerFast, exist_ok=True)
# Tokenizers save their (self-contained) module with them, for trust_remote_code loading.
TrellisTokenizerFast.register_for_auto_class("AutoTokenizer")

__all__ = [
    "__version__",
    "TrellisCache",
    "TrellisConfig",
    "TrellisForCausalLM",
    "TrellisModel",
    "TrellisState",
    "TrellisTokenizerFast",
    "train_tokenizer",
    "trellis_attention",
]
