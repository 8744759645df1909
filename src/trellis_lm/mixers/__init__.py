"""The token mixers a block can hold, one module each, chosen per layer by ``config.mixer_types``.

Every mixer is a :class:`~.base.Mixer`: ``mixer(x [B, T, D], valid, cache) -> [B, T, D]`` with
its own kind of cache entry. :func:`build_mixer` makes the one a layer asks for.
"""

from __future__ import annotations

from typing import Any

from .attention import AttentionMixer
from .base import MemoryMixer, Mixer
from .kvm import KVMAttention
from .lattice import LatticeAttention
from .trellis import TrellisAttention, forget_gate_bias

MIXERS: dict[str, type[Mixer]] = {cls.kind: cls for cls in (TrellisAttention, LatticeAttention, AttentionMixer, KVMAttention)}


def build_mixer(config: Any, layer_idx: int) -> Mixer:
    """The mixer of layer ``layer_idx``: ``config.layer_kinds[layer_idx]``."""
    return MIXERS[config.layer_kinds[layer_idx]](config, layer_idx)


__all__ = ["AttentionMixer", "KVMAttention", "LatticeAttention", "MIXERS", "MemoryMixer", "Mixer", "TrellisAttention", "build_mixer", "forget_gate_bias"]
