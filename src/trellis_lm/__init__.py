"""trellis-lm: Trellis language models for Hugging Face transformers.

Importing the package registers the model with the transformers auto classes
(:func:`register_auto_classes`), so ``AutoConfig``, ``AutoModel``, ``AutoModelForCausalLM`` and
``AutoTokenizer`` load Trellis checkpoints without ``trust_remote_code`` (checkpoints also carry
their code for ``trust_remote_code=True`` where this package is not installed).

The ``trellis-lm`` command is the exception: its entry point (:mod:`trellis_lm_command`) imports
the package without the model stack (seconds of torch and transformers), so that ``--help`` and a
command line it cannot parse answer at once; the command registers once it runs. The names below
are read from their modules when first used.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

# Each name the package exports -> its module.
_EXPORTS = {
    "TrellisCache": "cache_trellis", "TrellisConfig": "configuration_trellis", "TrellisForCausalLM": "modeling_trellis",
    "TrellisModel": "modeling_trellis", "TrellisState": "ops", "trellis_attention": "ops",
    "TrellisTokenizerFast": "tokenization_trellis", "train_tokenizer": "tokenization_trellis",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def register_auto_classes() -> None:
    """Register the config, the models and the tokenizer with the transformers auto classes
    (again: a no-op)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    from .configuration_trellis import TrellisConfig
    from .modeling_trellis import TrellisForCausalLM, TrellisModel
    from .tokenization_trellis import TrellisTokenizerFast

    AutoConfig.register(TrellisConfig.model_type, TrellisConfig, exist_ok=True)
    AutoModel.register(TrellisConfig, TrellisModel, exist_ok=True)
    AutoModelForCausalLM.register(TrellisConfig, TrellisForCausalLM, exist_ok=True)
    AutoTokenizer.register(TrellisConfig, tokenizer_class=TrellisTokenizerFast, exist_ok=True)
    # Tokenizers save their (self-contained) module with them, for trust_remote_code loading.
    TrellisTokenizerFast.register_for_auto_class("AutoTokenizer")


if "trellis_lm_command" not in sys.modules:
    register_auto_classes()

__all__ = [
    "__version__",
    "TrellisCache",
    "TrellisConfig",
    "TrellisForCausalLM",
    "TrellisModel",
    "TrellisState",
    "TrellisTokenizerFast",
    "register_auto_classes",
    "train_tokenizer",
    "trellis_attention",
]
