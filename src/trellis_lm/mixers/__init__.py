"""The token mixers a block can hold, one module each, chosen per layer by ``config.mixer_types``.

Every mixer is a :class:`~.base.Mixer`: ``mixer(x [B, T, D], valid, cache) -> [B, T, D]`` with
its own kind of cache entry, registered in :data:`MIXERS` by kind as its class is defined.
:func:`build_mixer` makes the one a layer asks for.
"""

from __future__ import annotations

from ..configuration_trellis import DEFAULT_KIND, TrellisConfig
from .base import MIXERS, MemoryMixer, Mixer

# One line per kind, in this order: the order of MIXERS (registered as each class is defined),
# which messages list. A checkpoint's flat copy of this file keeps the lines of its own kinds
# only (see remote_code), so nothing else here may name a kind's module or class.
from .trellis import TrellisMixer, forget_gate_bias  # noqa: E402  (isort: skip)
from .lattice import LatticeMixer  # noqa: E402  (isort: skip)
from .attention import AttentionMixer  # noqa: E402  (isort: skip)
from .kvm import KVMMixer  # noqa: E402  (isort: skip)


def build_mixer(config: TrellisConfig, layer_idx: int) -> Mixer:
    """The mixer of layer ``layer_idx``: ``config.layer_kinds[layer_idx]``."""
    return MIXERS[config.layer_kinds[layer_idx]].from_config(config, layer_idx)


__all__ = ["AttentionMixer", "DEFAULT_KIND", "KVMMixer", "LatticeMixer", "MIXERS", "MemoryMixer", "Mixer", "TrellisMixer", "build_mixer", "forget_gate_bias"]
