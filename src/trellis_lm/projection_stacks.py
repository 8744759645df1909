"""Linear projections of one input computed by one matmul, their weights stacked.

A module that reads several ``nn.Linear`` projections of the same input names them in its class
attribute ``fusable_projections`` (a memory mixer's q, k, v, gates and read-out gate; an
attention layer's q, k, v; the MLP's gate and up projections). One product with the weights
stacked then replaces several small ones: on a CPU a decode step's cost is mostly
per-operation overhead, so this is where a token's time goes.

Stacking the weights costs a copy of them, more than it saves on one token. So
:func:`stacked_projections` stacks them once for a span in which they do not change (one
``generate`` call, which holds it), and modules outside such a span stack on the fly only where
the call is large enough to pay for it (a memory mixer's prefill, see ``FUSE_MIN_TOKENS`` in
:mod:`.base`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


# Up to this many rows (tokens of all sequences) a stack adds its biases inside the matmul.
FEW_ROWS = 64


def plain_forward_hooks() -> bool:
    """Whether no global forward hook is registered (one would expect each module to be called)."""
    return not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


class LinearStack:
    """The projections ``names`` of a module as one matmul: ``weight`` is theirs stacked along
    the outputs (a copy as they were when it was made). Biases: for a few rows (a decode step)
    one stacked bias (zeros where a projection has none) in the same product, one operation
    less per bias; for more rows each bias added to its own slice, since a stacked one would be
    added to the whole ``[..., sum of outputs]`` product.

    Made by :meth:`of`, which refuses modules for which it might not be the same function as
    calling them.
    """

    def __init__(self, names: Sequence[str], modules: Sequence[nn.Linear]) -> None:
        self.names = tuple(names)
        self.widths = [m.out_features for m in modules]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in modules])
            self.biases = [None if m.bias is None else m.bias.detach() for m in modules]
            self.bias = None if all(b is None for b in self.biases) else torch.cat(
                [self.weight.new_zeros(m.out_features) if m.bias is None else m.bias for m in modules])

    @classmethod
    def of(cls, owner: nn.Module, names: Sequence[str], like: Optional[torch.Tensor] = None) -> Optional["LinearStack"]:
        """The stack of ``owner``'s projections among ``names`` that exist (an optional one may be
        ``None``), or ``None`` unless each is a plain ``nn.Linear`` without hooks (an adapter such
        as PEFT's LoRA wraps or replaces the module; a hook expects it to be called) and all
        share a dtype and device (those of ``like``, when given: nothing is copied for an input
        the stack could not take)."""
        present = [(name, getattr(owner, name)) for name in names if getattr(owner, name) is not None]
        for _, m in present:
            if type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks:
                return None
        kinds = {(p.dtype, p.device) for _, m in present for p in (m.weight, m.bias) if p is not None}
        if len(kinds) != 1 or (like is not None and kinds != {(like.dtype, like.device)}):
            return None
        return cls([name for name, _ in present], [m for _, m in present])

    def __call__(self, x: torch.Tensor, token_axis: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``x [..., D]`` -> the stacked product ``[..., sum of outputs]`` (its slices of projections
        without a bias are theirs exactly) and each projection (with its bias) by name. With
        ``token_axis``, both as ``[..., 1, *]``: a decode step's rows ``x [B, D]`` give what a
        mixer reads for one token, ``[B, 1, *]``, by one view of the product, not one per part
        (the product's input stays two-dimensional, see :func:`~trellis_lm.decode_step.advance_token`)."""
        # Compiled, one form for any number of rows (inductor fuses the bias add either way): a
        # branch on the row count would compile a server's batches on either side of it apart.
        if self.bias is not None and (torch.compiler.is_compiling() or x.shape[:-1].numel() < FEW_ROWS):
            out = F.linear(x, self.weight, self.bias)
            out = out.unsqueeze(-2) if token_axis else out
            return out, dict(zip(self.names, out.split_with_sizes(self.widths, dim=-1)))
        out = F.linear(x, self.weight)
        out = out.unsqueeze(-2) if token_axis else out
        # split_with_sizes is the operation itself; Tensor.split, a Python wrapper around it.
        parts = out.split_with_sizes(self.widths, dim=-1)
        return out, {name: part if bias is None else part + bias
                     for name, part, bias in zip(self.names, parts, self.biases)}


def stacked(module: nn.Module, x: torch.Tensor, on_the_fly: bool = False) -> Optional[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """``module``'s ``fusable_projections`` of ``x`` by one matmul (see :class:`LinearStack`), or
    ``None`` where the module should call its projections itself: while training or recording
    gradients, under a global forward hook, or without a stack made by
    :func:`stacked_projections` unless ``on_the_fly`` (then one is made for this call from the
    current weights, but not inside ``torch.compile``, which would copy the weights each call).
    A compiled decode step takes the stack as an input like the weights: one product in the
    graph, where inductor would leave the separate ones."""
    if module.training or torch.is_grad_enabled() or not plain_forward_hooks():
        return None
    stack = module.projection_stack
    # Compiling is asked first: ``on_the_fly``, read, would fix the row count it was worked out from.
    if stack is None and not torch.compiler.is_compiling() and on_the_fly:
        stack = LinearStack.of(module, module.fusable_projections, like=x)
    if stack is None or stack.weight.dtype != x.dtype or stack.weight.device != x.device:
        return None
    return stack(x)


@contextmanager
def stacked_projections(model: nn.Module) -> Iterator[None]:
    """Within the block, every module of ``model`` in eval mode that declares
    ``fusable_projections`` runs them by one matmul with weights stacked once, here.

    For a span in which the weights do not change, e.g. one ``generate`` call: the stacks are
    copies, so a weight changed inside the block is not seen until it ends. Nested blocks keep
    the outer one's stacks. Modules whose projections cannot be stacked (see
    :meth:`LinearStack.of`) call them as usual.
    """
    made = []
    try:
        for module in model.modules():
            if getattr(type(module), "fusable_projections", ()) and not module.training and module.projection_stack is None:
                module.projection_stack = LinearStack.of(module, module.fusable_projections)
                made.append(module)
        yield
    finally:
        for module in made:
            module.projection_stack = None
