"""Tensor parallelism: each of vLLM's ranks serves its share of every layer's heads.

Every mixer's work is per head (Trellis, Lattice and KVM keep one memory per head; attention
attends per head), so rank ``r`` of ``R`` builds the model of a config with ``num_heads / R``
heads (and ``num_key_value_heads / R``, and ``intermediate_size / R`` MLP columns):
:func:`rank_config`. Its projections into heads (and into the MLP's columns) are slices of
the checkpoint's along their output dim, its learned memories and per-head parameters
slices along the head dim, and its output projections (``o_proj``, ``down_proj``) slices
along their input dim: :func:`rank_share` finds the dim by the shapes. The output
projections' products are partial sums over the ranks' heads; vLLM's all-reduce adds them
(:class:`ReducedLinear`). Norms, embeddings and the head are whole on every rank.

A rank's memory slots hold only its heads' states: a sequence's state is split across the
ranks as its heads are.
"""

from __future__ import annotations


import torch
from torch import nn
from vllm.distributed import tensor_model_parallel_all_reduce

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


def rank_share(full: torch.Tensor, shape: torch.Size, rank: int, ranks: int, name: str) -> torch.Tensor:
    """Rank ``rank``'s part of the checkpoint's tensor ``full``, for a parameter of ``shape``:
    ``full`` itself where the shapes agree (a whole parameter), else its ``rank``-th slice along
    the one dim that is ``ranks`` times the parameter's."""
    if full.shape == shape:
        return full
    split = [dim for dim, (a, b) in enumerate(zip(full.shape, shape)) if a != b]
    if full.dim() != len(shape) or len(split) != 1 or full.shape[split[0]] != ranks * shape[split[0]]:
        raise ValueError(f"the checkpoint's {name!r} has shape {tuple(full.shape)}, which is neither the parameter's "
                         f"{tuple(shape)} nor {ranks} of it along one dim")
    dim = split[0]
    return full.narrow(dim, rank * shape[dim], shape[dim])


class ReducedLinear(nn.Linear):
    """A linear layer whose input features are split across the ranks (an output projection
    over the rank's heads): its product is this rank's part of the sum, which vLLM's
    all-reduce completes. Same parameters as the ``nn.Linear`` it replaces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(super().forward(x))


def reduce_outputs(layer: nn.Module) -> None:
    """Replace the output projections of a block (its mixer's ``o_proj``, its MLP's
    ``down_proj``) by :class:`ReducedLinear` layers of the same shape."""
    for owner, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
        linear = getattr(owner, name)
        setattr(owner, name, ReducedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                           dtype=linear.weight.dtype, device=linear.weight.device))
