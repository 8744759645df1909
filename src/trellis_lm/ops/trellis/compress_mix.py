"""The compression functions ``phi`` and mixing functions ``f`` of the design page, with the
closed-form vector-Jacobian products of ``phi`` that the write rule needs.

Every function works on the last axis (the M memory slots) and broadcasts over the rest, so
the per-token reference and the chunk-parallel backend share them. The closed forms are
checked against autograd in ``tests/test_ops.py`` (``test_closed_form_vjp_matches_autograd``).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

EPS = 1e-6

COMPRESS_FNS = ("identity", "l2norm", "layernorm")
MIX_FNS = ("ln_silu", "l2_silu", "softmax")
# Where each write takes its inner gradient (design page, section 1): at the memory just before
# it ("exact": the per-token recurrence, whatever C) or at its chunk's start ("anchored").
WRITE_GRADIENTS = ("exact", "anchored")
_INPUT_GRAD_ONLY = [True, False, False]  # layer norm's backward: the input's gradient, no weight or bias
# The overload itself: calling the packet (``torch.ops.aten.native_layer_norm_backward``) resolves
# the overload on every call, a few microseconds that per-token loops pay each token.
_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default


def _layernorm(z: torch.Tensor) -> torch.Tensor:
    # torch's fused kernel: (z - mean) / sqrt(biased var + EPS), one operation instead of six.
    return F.layer_norm(z, z.shape[-1:], eps=EPS)


def _l2norm(z: torch.Tensor) -> torch.Tensor:
    return z * torch.rsqrt(z.pow(2).sum(dim=-1, keepdim=True) + EPS)


def layer_norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_hat, mean, rstd)`` over the last axis, no affine: torch's fused kernel. Autograd does
    not differentiate ``mean`` and ``rstd``: use them only where no graph is recorded."""
    return torch.native_layer_norm(x, x.shape[-1:], None, None, EPS)


def layer_norm_vjp(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``J^T grad`` of the affine-free layer norm at ``x`` (stats from :func:`layer_norm_stats`),
    torch's fused backward kernel."""
    return _LAYER_NORM_BACKWARD(grad, x, x.shape[-1:], mean, rstd, None, None, _INPUT_GRAD_ONLY)[0]


def reads_current_memory(compress_fn: str, write_gradient: str) -> bool:
    """Whether every write takes its residual at the memory just before it: ``"exact"`` writes,
    and ``identity`` whatever ``write_gradient`` says (design page, section 1)."""
    return write_gradient == "exact" or compress_fn == "identity"


def _layer_norm_residual(z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``compress_residual_vjp("layernorm", z, alpha)`` where no graph is recorded: layer norm's
    fused forward and backward kernels, called directly (per-token loops pay for every call)."""
    shape = z.shape[-1:]
    z_hat, mean, rstd = torch.native_layer_norm(z, shape, None, None, EPS)
    # z_hat is fresh: it becomes the residual e in place.
    return _LAYER_NORM_BACKWARD(z_hat.sub_(alpha), z, shape, mean, rstd, None, None, _INPUT_GRAD_ONLY)[0]


def residual_without_graph(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``compress_residual_vjp`` of ``name`` as a function of ``(z, alpha)``, for loops that call
    it once per token with no graph to record (the chunk form's forward substitution): the name
    is looked up once, not on every call."""
    if name == "layernorm":
        return _layer_norm_residual
    return functools.partial(compress_residual_vjp, name)


def compress_residual_vjp(name: str, z: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``vjp_phi(z, phi(z) - alpha)``: the gradient of ``||phi(z) - alpha||^2 / 2`` in ``z``.

    For ``layernorm`` with no graph to record (decoding, the chunk form's forward) the VJP *is*
    layer norm's backward: three fused kernels instead of the closed form's seven operations,
    which autograd differentiates when it records.

    Args:
        name: one of ``COMPRESS_FNS``.
        z: ``[..., M]`` the anchor's read-out ``A k``.
        alpha: ``[..., M]`` the compression target.
    Returns:
        ``[..., M]``, the vector ``u`` of the write ``M <- beta M - gamma outer(u, k)``.
    """
    if name == "identity":
        return z - alpha
    if name == "l2norm":
        # J^T e = (e - zh (zh . e)) / |z|, with |z| including eps so it matches phi exactly.
        inv_norm = torch.rsqrt(z.pow(2).sum(dim=-1, keepdim=True) + EPS)
        z_hat = z * inv_norm
        e = z_hat - alpha
        return (e - z_hat * (z_hat * e).sum(dim=-1, keepdim=True)) * inv_norm
    if name == "layernorm":
        if not (torch.is_grad_enabled() and (z.requires_grad or alpha.requires_grad)):
            return _layer_norm_residual(z, alpha)
        # J^T e = (e - mean(e) - zh mean(zh * e)) / sigma.
        centred = z - z.mean(dim=-1, keepdim=True)
        inv_sigma = torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + EPS)
        z_hat = centred * inv_sigma
        e = z_hat - alpha
        return (
            e - e.mean(dim=-1, keepdim=True) - z_hat * (z_hat * e).mean(dim=-1, keepdim=True)
        ) * inv_sigma
    raise ValueError(f"compress_fn must be one of {COMPRESS_FNS}, got {name!r}")


def mix(name: str, y: torch.Tensor) -> torch.Tensor:
    """The mixing function ``f`` applied to the pass-1 read-out ``y`` (``[..., M]``)."""
    if name == "ln_silu":
        return _layernorm(F.silu(y))
    if name == "l2_silu":
        return _l2norm(F.silu(y))
    if name == "softmax":
        return torch.softmax(y, dim=-1)
    raise ValueError(f"mix_fn must be one of {MIX_FNS}, got {name!r}")


def check_names(compress_fn: str, mix_fn: str, write_gradient: str = "anchored") -> None:
    """Raise a ``ValueError`` naming the argument when a function name is unknown."""
    if write_gradient not in WRITE_GRADIENTS:
        raise ValueError(f"write_gradient must be one of {WRITE_GRADIENTS}, got {write_gradient!r}")
    if compress_fn not in COMPRESS_FNS:
        raise ValueError(f"compress_fn must be one of {COMPRESS_FNS}, got {compress_fn!r}")
    if mix_fn not in MIX_FNS:
        raise ValueError(f"mix_fn must be one of {MIX_FNS}, got {mix_fn!r}")

