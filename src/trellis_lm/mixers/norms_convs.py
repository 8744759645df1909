"""Building blocks the mixers share: float32 upcasts, L2 and RMS norms, the causal short conv."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

L2_EPS = 1e-6
# Reach of the short conv in a row's first document: it may see all of the carried tail.
UNBOUNDED_REACH = 2**62


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision activations are upcast for norms and the op; float64 stays float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last axis."""
    # The norm is one reduction that writes no [..., D] temporary, as x.pow(2) would: a fresh
    # multi-megabyte temporary per call costs more than the arithmetic at prefill lengths.
    return x * torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + L2_EPS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last axis with ``weight``, computed in at least float32 (what
    :class:`TrellisRMSNorm` computes)."""
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64):
        # One call with the weight folded in, on every path: written out in Python, the same
        # operations measured level in a decode step (BENCHMARKS.md, issue 73), which runs
        # ScaledRMSNorm instead.
        return F.rms_norm(x, x.shape[-1:], weight, eps=eps)
    normed = F.rms_norm(at_least_float32(x), x.shape[-1:], eps=eps)
    return weight * normed.to(x.dtype)


class ScaledRMSNorm(NamedTuple):
    """:func:`rms_norm` by a weight ``w [D]`` as ``x / hypot(|x|, sqrt(D eps)) * (w sqrt(D))``, its
    constants made once (:meth:`of`; a decode span's, whose weights do not change): four
    operations where torch's CPU composite dispatches about fourteen, 6% of an eager decode step
    (BENCHMARKS.md, issue 73). The same function up to rounding, for ``x`` in the weight's dtype,
    float32 or float64; compiled, torch's (inductor fuses it into one loop either way, and the
    compiled step stays the one measured level with a compiled Llama)."""

    weight: torch.Tensor
    eps: float
    scaled_weight: torch.Tensor
    root: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor, eps: float) -> "ScaledRMSNorm":
        width = weight.shape[-1]
        with torch.no_grad():
            scaled = weight * math.sqrt(width)
        return cls(weight, eps, scaled, torch.tensor(math.sqrt(width * eps), dtype=weight.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return rms_norm(x, self.weight, self.eps)
        return x / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), self.root) * self.scaled_weight


class TrellisRMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in at least float32 (:func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def causal_conv(
    x: torch.Tensor,
    tail: Optional[torch.Tensor],
    weight: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    reach: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of ``x [B, T, C]`` after ``tail [B, width - 1, C]`` (zeros
    when ``None``) with the taps of ``weight [C, 1, width]`` (an ``nn.Conv1d`` weight, or
    several stacked along C so that one call convolves their channels together).

    With ``lengths [B]``, row b holds its tokens in ``x[b, :lengths[b]]`` (the rest is
    ignored) and its new tail ends after them. With ``reach [B, T]``, token t sees only the
    ``reach[b, t]`` inputs before it (the rest count as zeros), so packed documents do not
    leak into each other. Returns ``(y [B, T, C], new tail [B, width - 1, C])``.
    """
    batch, length, channels = x.shape
    width = weight.shape[-1]
    carried = width - 1
    if tail is None:
        tail = x.new_zeros(batch, carried, channels)
    seq = torch.cat([tail.to(x.dtype), x], dim=1)
    taps = weight[:, 0].to(x.dtype)  # [C, width]
    if reach is None and length >= 16:
        # Long inputs: one multiply-add per tap over shifted views of the sequence; it reads
        # [B, T, C] once per tap instead of building the [B, T, C, width] product below. In
        # place: y is this function's own, and no backward reads it.
        y = seq[:, :length] * taps[:, 0]
        for j in range(1, width):
            y.addcmul_(seq[:, j : j + length], taps[:, j])
    else:
        # Windows times taps, summed: three operations whatever T is. For decode-sized inputs
        # F.conv1d spends far longer setting up its kernel than in the arithmetic; this is the
        # same cross-correlation as nn.Conv1d.
        windows = seq.unfold(1, width, 1)  # [B, T, C, width], a view
        if reach is not None:
            # Tap j looks `width - 1 - j` inputs back; what lies before the document counts as zero.
            lookback = torch.arange(width - 1, -1, -1, device=x.device)
            taps = taps * (lookback <= reach[..., None])[..., None, :]  # [B, T, C, width]
        y = (windows * taps).sum(dim=-1)
    if lengths is None:  # every row's tokens fill x: the tail is the sequence's end
        # A view would keep all of `seq` alive in the cache: fine for a few tokens (a decode
        # step), a copy after a prefill (a clone: with one row the view counts as contiguous).
        new_tail = seq[:, length:]
        return y, (new_tail if length <= carried else new_tail.clone())
    index = lengths[:, None] + torch.arange(carried, device=x.device)
    new_tail = seq.gather(1, index[..., None].expand(-1, -1, channels))
    if reach is not None:
        # Tail entry i lies `carried - 1 - i` = lookback[i + 1] inputs before the row's last token; what lies
        # before that token's document is zero for the next call, as for a fresh conv.
        last_reach = reach.gather(1, (lengths - 1).clamp(min=0)[:, None])
        last_reach = torch.where(lengths[:, None] > 0, last_reach, UNBOUNDED_REACH)  # no token: tail unchanged
        new_tail = new_tail * (lookback[1:] <= last_reach)[..., None]
    return y, new_tail


def conv_step(x: torch.Tensor, tail: torch.Tensor, taps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv` of one token per row, ``x [B, 1, C]`` after ``tail [B, width - 1, C]``,
    with ``taps [width, C]`` (an ``nn.Conv1d`` weight's ``[:, 0]`` transposed, in ``x``'s dtype:
    what a decode step makes once per span). Three operations where :func:`causal_conv`'s general
    form takes eight; the same sum over the taps, in the same order. Returns ``(y [B, 1, C],
    new tail [B, width - 1, C])``, the tail a view of the window."""
    window = torch.cat([tail, x], dim=1)
    return (window * taps).sum(dim=1, keepdim=True), window[:, 1:]


class TrellisShortConv(nn.Conv1d):
    """Causal depthwise convolution over time that carries its last inputs across calls
    (:func:`causal_conv` with this module's taps)."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__(channels, channels, width, groups=channels, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        tail: Optional[torch.Tensor],
        lengths: Optional[torch.Tensor] = None,
        reach: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y [B, T, C], new tail)``; arguments as in :func:`causal_conv`."""
        return causal_conv(x, tail, self.weight, lengths, reach)

    def delay_taps(self, lag: int) -> torch.Tensor:
        """Taps ``[C, 1, width]`` that pass every channel's input from ``lag`` tokens back
        unchanged (``lag = 0``: the identity), on this conv's weight's device and dtype."""
        if not 0 <= lag < self.weight.shape[-1]:
            raise ValueError(f"lag must be in [0, {self.weight.shape[-1] - 1}] for a conv of width "
                             f"{self.weight.shape[-1]}, got {lag}")
        taps = torch.zeros_like(self.weight)
        taps[..., -1 - lag] = 1.0  # the last tap multiplies the current token
        return taps
