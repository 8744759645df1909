"""Names that differ between the transformers versions the tests run on (the newest, and the
lowest supported one in CI's second job; the README's compatibility section lists them)."""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments

from trellis_lm.cache_trellis import CACHE_ARG

# `activation_checkpointing` (5.23 on) replaced `gradient_checkpointing`, which still works there.
CHECKPOINTING_ARG = (
    "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def cache_of(output: Any) -> Any:
    """The cache a model output or a ``generate`` result carries (``.cache`` from 5.24 on,
    ``.past_key_values`` before), read without the deprecation warning of the old name."""
    return getattr(output, CACHE_ARG)


def enable_checkpointing(model: Any) -> None:
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def is_checkpointing(model: Any) -> bool:
    return getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
