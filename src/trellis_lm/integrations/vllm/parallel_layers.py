"""The served blocks' projections as vLLM's parallel linear layers.

Each block is trellis_lm's own :class:`~trellis_lm.modeling_trellis.TrellisDecoderLayer` (its
mixer's and MLP's code runs as in ``generate``), built for one rank's share of the heads
(:func:`~.parallel.rank_config`; the whole model on one rank), with its linear projections
replaced by vLLM's layers (:func:`parallel_block`):

- the projections a module reads of one input (its ``fusable_projections``: a mixer's q, k, v
  and gates, the MLP's gate and up) become one ``MergedColumnParallelLinear`` named after them
  (:func:`stack_name`: ``gate_up_proj``, ``q_k_v_proj``, ...), each projection one of its
  shards, which vLLM splits by output rows: a rank holds its heads' rows of every shard. The
  module reads their outputs from it through ``projection_stack`` (:class:`ParallelStack`), as
  it reads ``generate``'s stacked weights (:mod:`trellis_lm.projection_stacks`);
- the output projections (``o_proj``, ``down_proj``) become ``RowParallelLinear`` layers: a
  rank's product over its heads is its part of a sum that vLLM's all-reduce completes.

The checkpoint's tensors load through each parameter's ``weight_loader`` (the model's
``load_weights``): a projection's tensor goes to its shard of the stacked layer
(:class:`Destination`), a learned memory or other per-head parameter to a loader that takes
the rank's heads (:func:`head_share_loader`), norms whole. On a CPU, vLLM packs the stacked and
output layers' weights for oneDNN once they are loaded (``UnquantizedLinearMethod``).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Optional, Sequence

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.utils import set_weight_attrs

from ...configuration_trellis import TrellisConfig
from ...modeling_trellis import TrellisDecoderLayer

# The output projection of a block's two modules, by the module's name in the block.
OUTPUT_PROJECTIONS = {"self_attn": "o_proj", "mlp": "down_proj"}


def stack_name(names: Sequence[str]) -> str:
    """The name of the one layer holding the projections ``names``: ``("gate_proj", "up_proj")``
    -> ``"gate_up_proj"``."""
    return "_".join(name.removesuffix("_proj") for name in names) + "_proj"


def packed_modules(owners: Iterable[type]) -> dict[str, list[str]]:
    """vLLM's ``packed_modules_mapping`` of modules of the classes ``owners``: each stacked
    layer's name, with the projections it holds (those a config may leave out included)."""
    return {stack_name(owner.fusable_projections): list(owner.fusable_projections)
            for owner in owners if owner.fusable_projections}


class Destination(NamedTuple):
    """Where a checkpoint tensor loads: the model's parameter, its shard there (a stacked
    layer's index of the projection; ``None``: the whole parameter, or this rank's heads of
    it), and the shape the checkpoint holds (the whole model's)."""

    param: str
    shard: Optional[int]
    shape: torch.Size


class InStack(nn.Module):
    """Stands in for a projection held by its module's stacked layer (:class:`ParallelStack`):
    the module's code asks whether it exists and whether it has a bias (``bias``: this rank's
    slice of the stacked bias, or ``None``); its output is the stack's slice."""

    def __init__(self, name: str, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.name = name
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # projection_stacks.stacked hands the module its stack unless training, recording
        # gradients or under a global forward hook, none of which a served model does.
        raise RuntimeError(f"{self.name} is a slice of its module's stacked vLLM layer (its projection_stack), "
                           "which the module skipped: a served model is not trained or hooked")


class ParallelStack:
    """A module's projections of one input as a vLLM ``MergedColumnParallelLinear``: called on
    ``x [..., D]``, ``(product [..., sum of this rank's widths], each projection by name)``,
    what :func:`~trellis_lm.projection_stacks.stacked` returns for a ``LinearStack`` (here the
    biases are inside the product). ``weight`` is the layer's (vLLM's CPU packing leaves it
    empty, in the layer's dtype and device, which is what ``stacked`` reads of it)."""

    def __init__(self, layer: MergedColumnParallelLinear, names: Sequence[str], widths: Sequence[int]) -> None:
        self.layer, self.names, self.widths = layer, tuple(names), list(widths)

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = self.layer(x)
        return out, dict(zip(self.names, out.split(self.widths, dim=-1)))


def head_share_loader(dim: int) -> Callable[[nn.Parameter, torch.Tensor], None]:
    """A ``weight_loader`` copying this rank's slice along ``dim`` (the heads' dim) of the whole
    model's tensor: rank ``r`` of ``R`` holds heads ``r H / R`` to ``(r + 1) H / R``."""
    def load(param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[dim]
        param.data.copy_(loaded.narrow(dim, get_tensor_model_parallel_rank() * size, size))

    return load


def _stack(owner: nn.Module, path: str, ranks: int) -> dict[str, tuple[str, int]]:
    """Replace ``owner``'s ``fusable_projections`` (those it has) by one stacked vLLM layer
    split over ``ranks``; where their checkpoint tensors go (``path``: ``owner``'s name in the
    model): the stacked parameter and the shard."""
    names = [name for name in type(owner).fusable_projections if getattr(owner, name) is not None]
    linears = [getattr(owner, name) for name in names]
    layer_name = stack_name(type(owner).fusable_projections)
    layer = MergedColumnParallelLinear(linears[0].in_features, [m.out_features * ranks for m in linears],
                                       bias=any(m.bias is not None for m in linears), return_bias=False,
                                       params_dtype=linears[0].weight.dtype, prefix=f"{path}.{layer_name}")
    if layer.bias is not None:
        layer.bias.data.zero_()  # the shards of projections without a bias stay zero
    setattr(owner, layer_name, layer)
    widths = [m.out_features for m in linears]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    routes = {}
    for shard, (name, linear, offset) in enumerate(zip(names, linears, offsets)):
        bias = None if linear.bias is None else layer.bias[offset: offset + widths[shard]]
        setattr(owner, name, InStack(name, bias))
        for kind in ("weight", "bias") if linear.bias is not None else ("weight",):
            routes[f"{path}.{name}.{kind}"] = (f"{path}.{layer_name}.{kind}", shard)
    owner.projection_stack = ParallelStack(layer, names, widths)
    return routes


def parallel_block(layer: TrellisDecoderLayer, config: TrellisConfig, prefix: str) -> dict[str, Destination]:
    """Put vLLM's parallel layers in ``layer`` (a rank's block, see the module doc) and give its
    per-head parameters the loader of their share. Returns the destination of every tensor the
    checkpoint holds for the block (``prefix``: the block's name), its shape that of the whole
    model's block (``config``'s)."""
    with torch.device("meta"):
        whole = dict(TrellisDecoderLayer(config, layer.self_attn.layer_idx).named_parameters())
    ranks = get_tensor_model_parallel_world_size()
    routes: dict[str, tuple[str, int]] = {}
    for owner_name, output in OUTPUT_PROJECTIONS.items():
        owner = getattr(layer, owner_name)
        path = f"{prefix}.{owner_name}"
        if getattr(type(owner), "fusable_projections", ()):
            routes.update(_stack(owner, path, ranks))
        linear = getattr(owner, output)
        setattr(owner, output, RowParallelLinear(
            linear.in_features * ranks, linear.out_features, bias=linear.bias is not None, input_is_parallel=True,
            reduce_results=True, return_bias=False, params_dtype=linear.weight.dtype, prefix=f"{path}.{output}",
        ))
    for name, param in layer.named_parameters():
        if hasattr(param, "weight_loader"):  # a vLLM layer's
            continue
        split = [dim for dim, (a, b) in enumerate(zip(param.shape, whole[name].shape)) if a != b]
        if split:  # a per-head parameter (learned memories, short-conv taps, ...): its rank's heads
            set_weight_attrs(param, {"weight_loader": head_share_loader(split[0])})
    return {f"{prefix}.{name}": Destination(*routes.get(f"{prefix}.{name}", (f"{prefix}.{name}", None)), param.shape)
            for name, param in whole.items()}
