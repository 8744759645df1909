"""Tensor parallelism: each of vLLM's ranks serves its share of every layer's heads.

Every mixer's work is per head (Trellis, Lattice and KVM keep one memory per head; attention
attends per head), so rank ``r`` of ``R`` builds the blocks of a config with ``num_heads / R``
heads (and ``num_key_value_heads / R``, and ``intermediate_size / R`` MLP columns):
:func:`rank_config`. Its layers are vLLM's parallel linear layers, which take their rows or
columns of the checkpoint's projections, and its per-head parameters take its heads
(:mod:`.parallel_layers`). A rank's memory slots hold only its heads' states: a sequence's
state is split across the ranks as its heads are.

Imported when vLLM builds its configuration (:mod:`.config`): nothing of vLLM's model layers here.
"""

from __future__ import annotations

from ...configuration_trellis import TrellisConfig
from .slots import memory_only


def rank_config(config: TrellisConfig, ranks: int) -> TrellisConfig:
    """The config of one rank's share of ``config``'s model (itself for one rank)."""
    if ranks == 1:
        return config
    refused = share_refused(config, ranks)
    if refused:
        raise ValueError(refused)
    fields = {"num_heads": config.num_heads // ranks, "intermediate_size": config.intermediate_size // ranks}
    if config.num_key_value_heads is not None:
        fields["num_key_value_heads"] = config.num_key_value_heads // ranks
    return type(config).from_dict({**config.to_dict(), **fields})


def share_refused(config: TrellisConfig, ranks: int) -> str:
    """Why ``config``'s model cannot be split across ``ranks`` ranks ('' when it can)."""
    counts = {"num_heads": config.num_heads, "intermediate_size": config.intermediate_size}
    if not memory_only(config.layer_kinds):  # attention layers split their key/value heads too
        counts["num_key_value_heads"] = config.key_value_heads
    uneven = [f"{name} = {count}" for name, count in counts.items() if count % ranks]
    if not uneven:
        return ""
    return (f"tensor_parallel_size = {ranks} must divide the heads and MLP width that its ranks share, "
            f"which {', '.join(uneven)} does not")
