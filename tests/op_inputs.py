"""Random op inputs shaped like the layer's (unit-norm q, k, v; gates in range) for the op tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trellis_lm.ops import TrellisState


def _generator(seed):
    """A generator of its own for ``seed``; ``None``: the global one, which tests/conftest.py seeds
    from each test's node id (tests/test_triton.py draws so)."""
    return None if seed is None else torch.Generator().manual_seed(seed)


def make_inputs(B, T, H, Dk, Dv, M, *, dtype=torch.float64, seed=None, requires_grad=False):
    """``(q, k, v, alpha, log_beta, gamma)`` with fresh random values, drawn from ``seed``'s generator."""
    gen = _generator(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    tensors = (
        F.normalize(rand(B, T, H, Dk), dim=-1),
        F.normalize(rand(B, T, H, Dk), dim=-1),
        F.normalize(rand(B, T, H, Dv), dim=-1),
        rand(B, T, H, M),
        F.logsigmoid(rand(B, T, H) + 3.0),
        torch.sigmoid(rand(B, T, H)),
    )
    return tuple(t.detach().requires_grad_(requires_grad) for t in tensors)


def make_state(N, H, Dk, Dv, M, *, chunk_size, dtype=torch.float64, seed=None, requires_grad=False) -> TrellisState:
    """A mid-sequence state: memories and anchors that differ, random offsets in [0, C), drawn
    from ``seed``'s generator."""
    gen = _generator(seed)
    tensors = [torch.randn(N, H, M, d, generator=gen, dtype=dtype).requires_grad_(requires_grad)
               for d in (Dk, Dv, Dk, Dv)]
    return TrellisState(*tensors, offset=torch.randint(0, chunk_size, (N,), generator=gen))


def make_kvm_inputs(B, T, H, Dk, Dv, *, dtype=torch.float64, seed=0, requires_grad=False):
    """``((q, k, v, gate), params)`` for ``kvm_attention``: LayerNormed q and k as the layer
    makes them, gates in [0.5, 1.5], and ``LN_s`` affine and temperatures away from their inits
    so that a gradient or a swapped argument shows."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q = F.layer_norm(rand(B, T, H, Dk), (Dk,))
    k = F.layer_norm(rand(B, T, H, Dk), (Dk,))
    gate = 0.5 + torch.rand(B, T, H, generator=gen, dtype=dtype)
    x = tuple(t.detach().requires_grad_(requires_grad) for t in (q, k, rand(B, T, H, Dv), gate))
    params = dict(norm_weight=1 + 0.3 * rand(H, Dk), norm_bias=0.3 * rand(H, Dk), temperature=1 + 0.3 * rand(H, 2))
    return x, {name: t.detach().requires_grad_(requires_grad) for name, t in params.items()}
