"""The configuration fields a mixer reads, each with the check its value must pass.

Every mixer class lists the fields that define its function besides the model's width and
heads (:data:`MODEL_FIELDS`) as :class:`ConfigField` entries (``config_fields``).
:class:`~trellis_lm.TrellisConfig` builds its validation from the mixers of
:data:`trellis_lm.mixers.MIXERS` and a cache remembers the fields of the kinds its model has,
so adding a mixer (or a field of one) touches the mixer's module and that registry, not the
config. Fields that several mixers read are declared once here and listed by each of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

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
        legacy: for a field added after checkpoints were saved without it, the value those
            checkpoints (and their cache files) computed with; ``None`` otherwise. A saved
            config or cache signature that lacks the field is read with it, never with the
            field's default for new models.
    """

    name: str
    valid: Callable[[Any, Any], bool]
    expected: Union[str, Callable[[Any], str]]
    legacy: Any = None

    def describe(self, config: Any) -> str:
        return self.expected(config) if callable(self.expected) else self.expected


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(name: str, low: int, high: int, note: str = "") -> ConfigField:
    """An integer in ``[low, high]``."""
    return ConfigField(name, lambda v, _: is_int(v) and low <= v <= high, f"an integer in [{low}, {high}]{note}")


def choice(name: str, options: Sequence[str], legacy: Any = None) -> ConfigField:
    return ConfigField(name, lambda v, _: v in options, f"one of {tuple(options)}", legacy)


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
