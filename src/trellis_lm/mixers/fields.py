"""The configuration fields a mixer reads, each with the check its value must pass.

Every mixer class lists the fields that define its function besides the model's width and
heads (:data:`MODEL_FIELDS`) as :class:`ConfigField` entries (``config_fields``).
:class:`~trellis_lm.TrellisConfig` runs the checks of every registered mixer
(:data:`trellis_lm.mixers.MIXERS`) without importing one, and a cache remembers the fields of
the kinds its model has. A new field is declared twice over, each part once: as a field of
``TrellisConfig`` (its default and its description) and here or in its mixer's module (its
check). Fields that several mixers read are declared once here and listed by each of them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from ..configuration_trellis import TrellisConfig, is_int, is_real

# What every mixer's function depends on; the configuration checks these itself.
MODEL_FIELDS = ("hidden_size", "num_heads", "head_dim")


@dataclass(frozen=True)
class ConfigField:
    """A field of the configuration and what values the mixers accept for it.

    Attributes:
        name: the configuration attribute.
        valid: ``valid(value, config) -> bool`` (the config is there for checks against other
            fields, e.g. a size bounded by another).
        expected: the accepted values in words, for the ``ValueError``: a string, or a function
            of the config when the bound names another field's value.
    """

    name: str
    valid: Callable[[Any, TrellisConfig], bool]
    expected: Union[str, Callable[[TrellisConfig], str]]

    def describe(self, config: TrellisConfig) -> str:
        return self.expected(config) if callable(self.expected) else self.expected


def integer(name: str, low: int, high: int, note: str = "") -> ConfigField:
    """An integer in ``[low, high]``."""
    return ConfigField(name, lambda v, _: is_int(v) and low <= v <= high, f"an integer in [{low}, {high}]{note}")


def choice(name: str, options: Sequence[str]) -> ConfigField:
    return ConfigField(name, lambda v, _: v in options, f"one of {tuple(options)}")


def positive(name: str) -> ConfigField:
    """A finite number > 0 (inf passes "> 0" but zeroes a gate or a norm)."""
    return ConfigField(name, lambda v, _: is_real(v) and 0 < v < math.inf, "a finite number > 0")


def flag(name: str) -> ConfigField:
    return ConfigField(name, lambda v, _: isinstance(v, bool), "True or False")


# Read by more than one mixer. The size bounds keep per-row states and weights far from the
# int32 index range of the kernels, and a training chunk of L = min(C, T) tokens takes L x L
# blocks per head: beyond 2**16 one block is 16 GiB.
NUM_SLOTS = integer("num_slots", 1, 2**12)
CHUNK_SIZE = integer("chunk_size", 1, 2**16)
CONV_SIZE = integer("conv_size", 0, 2**10, " (0 disables the conv)")
ROPE_THETA = positive("rope_theta")
