"""The hand-written backward of the chunk form (``ops/trellis/chunked_autograd.py``) against autograd
of the per-token reference in float64: both write gradients (``"exact"``, the models' default, and
``"anchored"``), every compress_fn x mix_fn, several C, T not a multiple of C, Dk != Dv (two
chains) and Dk == Dv (one stacked chain), M != D, mid-chunk initial states, gradients through the
final state and anchors, varlen, a full forget inside a chunk, and exact writes' substitution over
several blocks of a C = 64 chunk."""

from __future__ import annotations

import itertools

import pytest
import torch

from op_inputs import make_inputs, make_state
from trellis_lm.ops import COMPRESS_FNS, MIX_FNS, WRITE_GRADIENTS, TrellisState, trellis_attention
from trellis_lm.ops.trellis import chunked, chunked_autograd
from trellis_lm.ops.trellis.compress_mix import compress_residual_vjp

GRAD_TOL = dict(rtol=1e-8, atol=1e-9)
INPUTS = ["q", "k", "v", "alpha", "log_beta", "gamma"]
STATE = ["m_k", "m_v", "anchor_k", "anchor_v"]


def _loss_grads(backend, x, state, C, cf, mf, cu_seqlens=None, wg="anchored"):
    """Gradients of a random weighting of ``o`` and of every final-state tensor, in all inputs
    and all initial-state tensors (so the final state's and anchors' gradients are exercised;
    exact writes never read the initial anchors: theirs are zero)."""
    o, final = trellis_attention(*x, initial_state=state, chunk_size=C, compress_fn=cf, mix_fn=mf,
                                 cu_seqlens=cu_seqlens, write_gradient=wg, output_final_state=True, backend=backend)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    for name in STATE:
        t = getattr(final, name)
        loss = loss + (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
    return torch.autograd.grad(loss, list(x) + [getattr(state, name) for name in STATE], materialize_grads=True)


def _assert_grads_match(x, state, C, cf, mf, cu_seqlens=None, wg="anchored"):
    got = _loss_grads("torch", x, state, C, cf, mf, cu_seqlens, wg)
    expected = _loss_grads("reference", x, state, C, cf, mf, cu_seqlens, wg)
    for name, g, e in zip(INPUTS + STATE, got, expected):
        assert g.isfinite().all(), name
        torch.testing.assert_close(g, e, **GRAD_TOL, msg=lambda m: f"d/d{name}: {m}")
    return got


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("dims", [(3, 5, 4), (4, 4, 6)], ids=["two-chains", "stacked"])
@pytest.mark.parametrize("C", [1, 3, 16])
@pytest.mark.parametrize("cf,mf", list(itertools.product(COMPRESS_FNS, MIX_FNS)))
def test_backward_matches_reference_autograd(cf, mf, C, dims, wg):
    """T = 21 is a multiple of none of the C; the rows resume mid-chunk (random offsets)."""
    dk, dv, m = dims
    x = make_inputs(2, 21, 2, dk, dv, m, seed=C, requires_grad=True)
    state = make_state(2, 2, dk, dv, m, chunk_size=C, requires_grad=True, seed=C + 1)
    if C > 1:
        state.offset.copy_(torch.tensor([C - 1, C // 2]))
    got = _assert_grads_match(x, state, C, cf, mf, wg=wg)
    assert all(g.abs().max() > 0 for g in got[:8])  # every input and both memories get a gradient


@pytest.mark.parametrize("cf", ["layernorm", "l2norm"])
def test_exact_stacked_chain_backward_over_several_substitution_blocks(cf):
    """Exact writes at C = 64 (the default chunk): each chunk's residuals by forward substitution,
    in blocks of ``SUBSTITUTION_BLOCK`` tokens, and its VJP block by block, for one chain stacking
    the key and value passes (Dk == Dv). T = 83 from offsets 0 and 40: chunks of 64, 19, 24 and 59
    tokens, so a chunk's later blocks take the earlier blocks' terms (and the reverse)."""
    assert chunked_autograd.SUBSTITUTION_BLOCK < 24  # more than one block in the longer chunks
    x = make_inputs(2, 83, 2, 4, 4, 5, seed=64, requires_grad=True)
    state = make_state(2, 2, 4, 4, 5, chunk_size=64, requires_grad=True, seed=65)
    state.offset.copy_(torch.tensor([0, 40]))
    got = _assert_grads_match(x, state, 64, cf, "ln_silu", wg="exact")
    assert all(g.abs().max() > 0 for g in got[:8])
    assert all(g.abs().max() == 0 for g in got[8:])  # the initial anchors are never read


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("C", [3, 16])
@pytest.mark.parametrize("cf,mf", [("layernorm", "ln_silu"), ("l2norm", "softmax"), ("identity", "l2_silu")])
def test_varlen_backward_matches_reference(cf, mf, C, wg):
    lengths = [5, 0, 19, 3]
    x = make_inputs(1, sum(lengths), 2, 4, 4, 3, seed=7, requires_grad=True)
    state = make_state(len(lengths), 2, 4, 4, 3, chunk_size=C, requires_grad=True, seed=8)
    cu = torch.tensor([0] + lengths).cumsum(0)
    _assert_grads_match(x, state, C, cf, mf, cu, wg)


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("cf", COMPRESS_FNS)
def test_full_forget_inside_a_chunk_backward(cf, wg):
    C = 4
    x = list(make_inputs(2, 13, 2, 3, 5, 4, seed=3))
    lb = x[4].clone()
    lb[0, 6, :] = float("-inf")  # inside the second chunk, both heads
    lb[1, 9, 1] = float("-inf")  # inside the third chunk, one head
    x[4] = lb
    x = [t.requires_grad_() for t in x]
    state = TrellisState.at_chunk_start(*(torch.randn(2, 2, 4, d, dtype=torch.float64, requires_grad=True)
                                          for d in (3, 5)))
    _assert_grads_match(x, state, C, cf, "ln_silu", wg=wg)


@pytest.mark.parametrize("cf,mf", [("layernorm", "ln_silu"), ("l2norm", "softmax"), ("identity", "l2_silu")])
def test_gradcheck_against_finite_differences(cf, mf):
    x = make_inputs(1, 5, 1, 2, 3, 3, seed=11, requires_grad=True)
    state = make_state(1, 1, 2, 3, 3, chunk_size=2, requires_grad=True, seed=12)
    state.offset.fill_(1)

    def fn(*tensors):
        s = TrellisState(*tensors[6:], offset=state.offset)
        o, final = trellis_attention(*tensors[:6], initial_state=s, chunk_size=2, compress_fn=cf, mix_fn=mf,
                                     output_final_state=True, backend="torch")
        return o, final.m_k, final.anchor_v

    assert torch.autograd.gradcheck(fn, tuple(x) + tuple(getattr(state, n) for n in STATE), eps=1e-6, atol=1e-6)


def test_double_backward_raises_a_clear_error():
    x = make_inputs(1, 6, 1, 3, 3, 4, requires_grad=True, seed=0)
    o, _ = trellis_attention(*x, chunk_size=2, backend="torch")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(o.sum(), x[0], create_graph=True)


def test_forward_without_grad_equals_forward_with_grad(monkeypatch):
    """The no-grad forward reads out in groups of chunks and keeps no states; same numbers."""
    x = make_inputs(2, 23, 2, 4, 4, 5, seed=5)
    state = make_state(2, 2, 4, 4, 5, chunk_size=3, seed=6)
    with torch.no_grad():
        monkeypatch.setattr(chunked, "GROUP_ELEMENTS", 1)
        o_groups, s_groups = trellis_attention(*x, initial_state=state, chunk_size=3, output_final_state=True,
                                               backend="torch")
    x_grad = [t.clone().requires_grad_() for t in x]
    o, s = trellis_attention(*x_grad, initial_state=state, chunk_size=3, output_final_state=True, backend="torch")
    torch.testing.assert_close(o_groups, o, rtol=0, atol=1e-12)
    for name in STATE:
        torch.testing.assert_close(getattr(s_groups, name), getattr(s, name), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["layernorm", "l2norm"])
@pytest.mark.parametrize("M", [1, 2, 7])
def test_second_order_residual_vjp_matches_autograd(name, M):
    """The closed-form VJP of ``u = vjp_phi(z, phi(z) - alpha)`` that carries the state
    gradient through the anchors, against autograd of the closed form itself."""
    gen = torch.Generator().manual_seed(M)
    z, alpha, grad_u = (torch.randn(3, 4, M, generator=gen, dtype=torch.float64) for _ in range(3))
    z.requires_grad_()
    alpha.requires_grad_()
    u = compress_residual_vjp(name, z, alpha)
    expected_z, expected_alpha = torch.autograd.grad(u, (z, alpha), grad_u)
    parts = (torch.empty_like(z), z.new_empty(z.shape[:-1] + (1,)), torch.empty_like(z))
    with torch.no_grad():
        u_fast = chunked_autograd._residual(name, z, alpha, parts)
        got_z, got_alpha = torch.empty_like(z), torch.empty_like(z)
        terms = chunked_autograd._residual_vjp2_terms(name, *parts)
        chunked_autograd._residual_vjp2(name, *parts[:2], *terms, u_fast, grad_u, got_z, got_alpha)
    torch.testing.assert_close(u_fast, u.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_z, expected_z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_alpha, expected_alpha, rtol=1e-10, atol=1e-12)
