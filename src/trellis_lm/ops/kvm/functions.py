"""Small pieces both backends share: the state budget and the options that define the op."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BUDGETS = ("fixed", "power_law", "saturation")
LN_EPS = 1e-5  # every LayerNorm of the design page
# The page reads a value row as r * SV / |SV|; the clamp only keeps an all-zero sum finite.
VALUE_EPS = 1e-12


def ln_s(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The state LayerNorm ``LN_s`` (design page, section 1) over the last axis of ``x [..., H,
    L, Dk]``, with the per-head affine ``weight``, ``bias [H, Dk]``."""
    return F.layer_norm(x, x.shape[-1:], eps=LN_EPS) * weight[:, None, :] + bias[:, None, :]


@dataclass(frozen=True)
class KVMConfig:
    """The hyper-parameters of one call, as validated by :func:`~.dispatch.kvm_attention`.

    ``state_size`` is the most state rows a sequence holds: the budget ``M`` when ``budget ==
    "fixed"``, the cap otherwise (the buffers grow to it with the tokens folded).
    """

    chunk_size: int
    window_chunks: int
    rope_dims: int
    sinks: int
    state_size: int
    budget: str
    budget_scale: float
    budget_exponent: float
    budget_saturation: float
    budget_round: int
    budget_min: int

    @property
    def window(self) -> int:
        """W, the most tokens the window holds."""
        return self.window_chunks * self.chunk_size


def appended_rows(config: KVMConfig, position: torch.Tensor, avail: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """How many tokens a later fold appends (``n_app`` of the page), per sequence.

    Args:
        position: ``[N]`` int64, the position ``t`` of the token whose chunk start triggers the fold.
        avail: ``[N]`` int64, tokens covered once this fold is done (state plus overflow).
        used: ``[N]`` int64, state rows before the fold.
    Returns:
        ``[N]`` int64 in ``[0, chunk_size]``.
    """
    if config.budget == "fixed":
        target = torch.full_like(used, config.state_size)
    else:
        t = position.to(torch.float64)
        if config.budget == "power_law":
            raw = config.budget_scale * t.pow(config.budget_exponent)
        else:
            raw = config.budget_saturation * t / (config.budget_saturation + t)
        target = raw.floor().to(torch.long)
        target = torch.div(target, config.budget_round, rounding_mode="floor") * config.budget_round
        target = target.clamp(min=config.budget_min)
    target = torch.minimum(torch.minimum(target, avail), torch.full_like(target, config.state_size))
    target = torch.maximum(target, used)  # the state never shrinks
    return (target - used).clamp(max=config.chunk_size)
