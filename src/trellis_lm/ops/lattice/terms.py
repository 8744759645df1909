"""The pieces of the write rule the backends share: the variants' terms and the retraction."""

from __future__ import annotations

import torch

# The paper's three losses (design page, section 1); "dec" is its best and the default.
LATTICE_VARIANTS = ("dec", "enc", "sim")


def check_variant(variant: object) -> str:
    if variant not in LATTICE_VARIANTS:
        raise ValueError(f"variant must be one of {LATTICE_VARIANTS}, got {variant!r}")
    return variant


def rownorm(u: torch.Tensor) -> torch.Tensor:
    """``u / |u|`` over the last axis: the retraction onto the sphere. No eps: the page divides by
    the computed norm, and a real slot never has norm below 1 (every step is orthogonal to it)."""
    return u / torch.linalg.vector_norm(u, dim=-1, keepdim=True)


def token_terms(variant: str, anchor: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor):
    """``(b, w)`` of one token, from the anchor.

    Args:
        anchor: ``[..., M, D]`` the state at the chunk start (unit rows).
        k: ``[..., M]`` write coefficients; v: ``[..., D]`` value; gamma: ``[...]`` step size.
    Returns:
        ``b [..., M]`` (each slot's step length) and ``w [..., D]`` (the direction, before the
        projection orthogonal to each slot).
    """
    g = gamma[..., None]
    if variant == "dec":  # |S^T k - v|^2: the reconstruction error is the direction
        return g * k, (k[..., None, :] @ anchor)[..., 0, :] - v
    if variant == "enc":  # |S v - k|^2: a scalar error per slot
        # S v as v's row times S's transpose: torch's CPU batched matmul is several times slower
        # as matrix @ column.
        return g * ((v[..., None, :] @ anchor.mT)[..., 0, :] - k), v
    return -g * k, v  # "sim": -(S v) . k
