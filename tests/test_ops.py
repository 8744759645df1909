"""The op: every backend against the per-token reference of the design page (float64)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from op_inputs import make_inputs, make_state
from trellis_lm.ops import TRELLIS_BACKENDS as BACKENDS, COMPRESS_FNS, MIX_FNS, WRITE_GRADIENTS, TrellisState, trellis_attention
from trellis_lm.ops.registry import OpCall
from trellis_lm.ops.trellis.compress_mix import EPS, compress_residual_vjp, mix

# Every registered backend besides the loop that runs float64 CPU calls of every setting here
# (a new backend gets these tests by registering; Triton's kernels are float32: tests/test_triton.py).
FAST_BACKENDS = [
    name for name, backend in BACKENDS.items()
    if name != "reference" and all(
        backend.refusal(OpCall(torch.device("cpu"), torch.float64, 8, False, {"compress_fn": cf, "chunk_size": 4})) is None
        for cf in COMPRESS_FNS
    )
]
TOL = dict(rtol=1e-9, atol=1e-9)


def assert_states_close(a: TrellisState, b: TrellisState, **tol) -> None:
    for name, x in a.tensors().items():
        torch.testing.assert_close(x, b.tensors()[name], **(tol or TOL), msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# An independent statement of the design page: one (row, head) at a time, phi's VJP by autograd.
# It checks the reference (and through it the closed-form VJPs the backends share).


def _phi(name, z):
    if name == "identity":
        return z
    if name == "l2norm":
        return z / torch.sqrt((z * z).sum() + 1e-6)
    centred = z - z.mean()
    return centred / torch.sqrt((centred * centred).mean() + 1e-6)


def _f(name, y):
    if name == "softmax":
        return torch.softmax(y, dim=-1)
    s = F.silu(y)
    if name == "l2_silu":
        return s / torch.sqrt((s * s).sum() + 1e-6)
    centred = s - s.mean()
    return centred / torch.sqrt((centred * centred).mean() + 1e-6)


def naive(q, k, v, alpha, log_beta, gamma, m_k, m_v, C, cf, mf, write_gradient="anchored"):
    B, T, H, _ = q.shape
    out = torch.zeros_like(v)
    for b, h in itertools.product(range(B), range(H)):
        MK, MV = m_k[b, h].clone(), m_v[b, h].clone()
        for p in range(T):
            if p % C == 0:
                AK, AV = MK.clone(), MV.clone()
            if cf == "identity" or write_gradient == "exact":  # residuals at the current state (section 1)
                AK, AV = MK, MV
            beta, g, a = log_beta[b, p, h].exp(), gamma[b, p, h], alpha[b, p, h]
            zk = AK @ k[b, p, h]
            uk = torch.func.vjp(lambda z: _phi(cf, z), zk)[1](_phi(cf, zk) - a)[0]
            MK = beta * MK - g * torch.outer(uk, k[b, p, h])
            hh = _f(mf, MK @ q[b, p, h])
            zv = AV @ v[b, p, h]
            uv = torch.func.vjp(lambda z: _phi(cf, z), zv)[1](_phi(cf, zv) - a)[0]
            MV = beta * MV - g * torch.outer(uv, v[b, p, h])
            out[b, p, h] = MV.T @ hh
    return out


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("cf,mf", [("layernorm", "ln_silu"), ("l2norm", "softmax"), ("identity", "l2_silu")])
@pytest.mark.parametrize("C", [1, 3])
def test_reference_matches_the_design_page_statement(cf, mf, C, wg):
    x = make_inputs(1, 7, 2, 3, 4, 5, seed=0)
    m_k, m_v = torch.randn(1, 2, 5, 3, dtype=torch.float64), torch.randn(1, 2, 5, 4, dtype=torch.float64)
    o, _ = trellis_attention(*x, initial_state=(m_k, m_v), chunk_size=C, compress_fn=cf, mix_fn=mf, write_gradient=wg,
                             backend="reference")
    torch.testing.assert_close(o, naive(*x, m_k, m_v, C, cf, mf, wg), **TOL)


@pytest.mark.parametrize("name", COMPRESS_FNS)
@pytest.mark.parametrize("M", [1, 2, 7])
def test_closed_form_vjp_matches_autograd(name, M):
    z = torch.randn(4, M, dtype=torch.float64, requires_grad=True)
    alpha = torch.randn(4, M, dtype=torch.float64)
    def compress(z):  # the page's phi, row by row
        return torch.vmap(lambda row: _phi(name, row))(z)

    target = compress(z) - alpha
    (expected,) = torch.autograd.grad(compress(z), z, target.detach())
    torch.testing.assert_close(compress_residual_vjp(name, z, alpha), expected, **TOL)


def test_mix_functions_have_their_defining_properties():
    y = torch.randn(3, 9, dtype=torch.float64)
    torch.testing.assert_close(mix("softmax", y).sum(-1), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(mix("l2_silu", y).norm(dim=-1), torch.ones(3, dtype=torch.float64), rtol=1e-5, atol=0)
    ln = mix("ln_silu", y)
    torch.testing.assert_close(ln.mean(-1), torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-12)
    # Unit variance up to the eps under the root: var / (var + EPS) exactly. (Against 1 with a fixed
    # tolerance it failed for about 1 draw in 200, whose silu(y) had a small variance.)
    spread = F.silu(y).var(-1, unbiased=False)
    torch.testing.assert_close(ln.var(-1, unbiased=False), spread / (spread + EPS), rtol=1e-10, atol=0)


# ---------------------------------------------------------------------------------------------
# Fast backends == reference.


def run(backend, x, **kw):
    return trellis_attention(*x, backend=backend, output_final_state=True, **kw)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("mf", MIX_FNS)
@pytest.mark.parametrize("cf", COMPRESS_FNS)
@pytest.mark.parametrize("C", [1, 3, 16, 64])
def test_fast_backend_matches_reference(backend, C, cf, mf, wg):
    x = make_inputs(2, 37, 2, 5, 7, 6, seed=0)
    state = (torch.randn(2, 2, 6, 5, dtype=torch.float64), torch.randn(2, 2, 6, 7, dtype=torch.float64))
    kw = dict(initial_state=state, chunk_size=C, compress_fn=cf, mix_fn=mf, write_gradient=wg)
    o_ref, s_ref = run("reference", x, **kw)
    o, s = run(backend, x, **kw)
    assert o_ref.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("B,T,H,Dk,Dv,M,C", [
    (1, 1, 1, 1, 1, 1, 1),      # everything of size one
    (1, 1, 3, 4, 4, 5, 64),     # one token, a chunk much longer than the input
    (3, 65, 1, 3, 2, 7, 64),    # one token past a chunk
    (2, 10, 2, 9, 3, 2, 10),    # T equal to the chunk
    (1, 33, 2, 6, 6, 3, 32),
])
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
def test_odd_sizes(backend, B, T, H, Dk, Dv, M, C, wg):
    x = make_inputs(B, T, H, Dk, Dv, M, seed=0)
    state = make_state(B, H, Dk, Dv, M, chunk_size=C, seed=1)
    o_ref, s_ref = run("reference", x, initial_state=state, chunk_size=C, write_gradient=wg)
    o, s = run(backend, x, initial_state=state, chunk_size=C, write_gradient=wg)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
def test_zero_initial_state_is_none(backend):
    x = make_inputs(2, 9, 2, 4, 4, 3, seed=0)
    zeros = (torch.zeros(2, 2, 3, 4, dtype=torch.float64),) * 2
    o_none, s_none = run(backend, x, chunk_size=4, compress_fn="identity")
    o_zero, s_zero = run(backend, x, initial_state=zeros, chunk_size=4, compress_fn="identity")
    torch.testing.assert_close(o_none, o_zero, **TOL)
    assert_states_close(s_none, s_zero)


def test_chunk_size_changes_the_function():
    """Guards the comparisons above: a backend that ignored chunk_size would be caught."""
    x = make_inputs(1, 12, 1, 4, 4, 3, seed=0)
    state = (torch.randn(1, 1, 3, 4, dtype=torch.float64),) * 2
    o1, _ = run("reference", x, initial_state=state, chunk_size=1, write_gradient="anchored")
    o4, _ = run("reference", x, initial_state=state, chunk_size=4, write_gradient="anchored")
    assert (o1 - o4).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("C", [1, 4, 5])
def test_resume_at_every_split(backend, C, wg):
    T = 13
    x = make_inputs(2, T, 2, 3, 5, 4, seed=0)
    state = make_state(2, 2, 3, 5, 4, chunk_size=C, seed=1)
    o_all, s_all = run("reference", x, initial_state=state, chunk_size=C, write_gradient=wg)
    for split in range(1, T):
        o1, s1 = run(backend, [t[:, :split] for t in x], initial_state=state, chunk_size=C, write_gradient=wg)
        o2, s2 = run(backend, [t[:, split:] for t in x], initial_state=s1, chunk_size=C, write_gradient=wg)
        torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, **TOL)
        assert_states_close(s2, s_all)


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("C", [1, 3, 8])
@pytest.mark.parametrize("lengths", [[5, 0, 9, 1, 3], [8, 8, 8], [64, 64]])  # the last two: whole chunks
def test_varlen_equals_each_sequence_alone(backend, C, wg, lengths):
    N = len(lengths)
    x = make_inputs(1, sum(lengths), 2, 4, 3, 5, seed=0)
    state = make_state(N, 2, 4, 3, 5, chunk_size=C, seed=1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = run(backend, x, initial_state=state, chunk_size=C, cu_seqlens=cu, write_gradient=wg)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        row_state = state.map(lambda t: t[n : n + 1])
        if end == start:  # an empty sequence hands its state back untouched
            assert_states_close(s.map(lambda t: t[n : n + 1]), row_state)
            continue
        o_n, s_n = run("reference", [t[:, start:end] for t in x], initial_state=row_state, chunk_size=C,
                       write_gradient=wg)
        torch.testing.assert_close(o[:, start:end], o_n, **TOL)
        assert_states_close(s.map(lambda t: t[n : n + 1]), s_n)


# ---------------------------------------------------------------------------------------------
# Gradients: autograd of the reference (float64) is the ground truth.


def _grads(backend, x, state, C, cf, mf, cu_seqlens=None, wg="anchored"):
    o, s = run(backend, x, initial_state=state, chunk_size=C, compress_fn=cf, mix_fn=mf, cu_seqlens=cu_seqlens,
               write_gradient=wg)
    gen = torch.Generator().manual_seed(0)
    # A random projection of every output and of the final state, anchors included.
    outs = [o] + [t for name, t in s.tensors().items() if name != "offset"]
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outs)
    leaves = list(x) + [t for name, t in state.tensors().items() if name != "offset"]
    # "exact" writes never read the initial anchors: their gradient is zero.
    return torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("C,cf,mf", [
    (1, "layernorm", "ln_silu"), (4, "layernorm", "ln_silu"), (5, "l2norm", "softmax"),
    (3, "identity", "l2_silu"), (16, "layernorm", "softmax"), (7, "l2norm", "l2_silu"),
])
def test_gradients_match_reference(backend, C, cf, mf, wg):
    x = make_inputs(2, 11, 2, 3, 4, 5, requires_grad=True, seed=0)
    state = make_state(2, 2, 3, 4, 5, chunk_size=C, requires_grad=True, seed=1)
    expected = _grads("reference", x, state, C, cf, mf, wg=wg)
    got = _grads(backend, x, state, C, cf, mf, wg=wg)
    names = ["q", "k", "v", "alpha", "log_beta", "gamma", "m_k", "m_v", "anchor_k", "anchor_v"]
    for name, g, e in zip(names, got, expected):
        assert e.abs().max() > 0 or name.startswith("anchor"), name
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9, msg=lambda m: f"d/d{name}: {m}")


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("cf,mf", list(itertools.product(COMPRESS_FNS, MIX_FNS)))
def test_single_token_step_matches_reference(cf, mf, wg):
    """The decode step (``torch``/``auto`` with T == 1) against the loop, values and gradients;
    rows at a chunk start (offset 0: anchors replaced) and mid-chunk (anchors kept)."""
    from trellis_lm.ops.trellis.step import step_forward

    one_token = OpCall(torch.device("cpu"), torch.float64, 1, False, {"compress_fn": cf, "chunk_size": 4})
    assert BACKENDS.function("torch", one_token) is step_forward
    x = make_inputs(3, 1, 2, 3, 5, 7, requires_grad=True, seed=0)
    state = make_state(3, 2, 3, 5, 7, chunk_size=4, requires_grad=True, seed=1)
    state.offset.copy_(torch.tensor([0, 2, 3]))
    kw = dict(chunk_size=4, compress_fn=cf, mix_fn=mf, write_gradient=wg)
    o, final = run("torch", x, initial_state=state, **kw)
    o_ref, final_ref = run("reference", x, initial_state=state, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(final, final_ref)
    assert final.offset.tolist() == [1, 3, 0]
    expected = _grads("reference", x, state, 4, cf, mf, wg=wg)
    for g, e in zip(_grads("torch", x, state, 4, cf, mf, wg=wg), expected):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)
    # The mid-chunk rows' anchors get gradients (read, or handed back as the final anchors) when
    # anchored; exact writes never read them and hand back their memories as the anchors.
    assert (expected[-2].abs().max() > 0) == (wg == "anchored")


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_gradients_flow_through_anchors(backend):
    """Mid-chunk resume: the first chunk's writes are taken at the given anchors."""
    x = make_inputs(1, 6, 1, 3, 3, 4, requires_grad=True, seed=0)
    state = make_state(1, 1, 3, 3, 4, chunk_size=4, requires_grad=True, seed=1)
    state.offset.fill_(2)
    grads = _grads(backend, x, state, 4, "layernorm", "ln_silu")
    expected = _grads("reference", x, state, 4, "layernorm", "ln_silu")
    assert grads[-2].abs().max() > 1e-3 and grads[-1].abs().max() > 1e-3
    torch.testing.assert_close(grads[-2], expected[-2], rtol=1e-8, atol=1e-9)
    torch.testing.assert_close(grads[-1], expected[-1], rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
def test_varlen_gradients_match_reference(backend, wg):
    lengths = [4, 0, 7]
    x = make_inputs(1, sum(lengths), 2, 3, 3, 4, requires_grad=True, seed=0)
    state = make_state(3, 2, 3, 3, 4, chunk_size=3, requires_grad=True, seed=1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    got = _grads(backend, x, state, 3, "layernorm", "ln_silu", cu, wg)
    expected = _grads("reference", x, state, 3, "layernorm", "ln_silu", cu, wg)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize("backend", ["reference"] + FAST_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_keep_float32_state(backend, dtype):
    x64 = make_inputs(2, 20, 2, 8, 8, 6, seed=0)
    state = (torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8))
    x = [t.to(dtype) for t in x64]
    o, s = run(backend, x, initial_state=state, chunk_size=8)
    assert o.dtype == dtype and s.m_k.dtype == torch.float32 and s.anchor_v.dtype == torch.float32
    # Against float64 on the same (rounded) inputs: only the op's own arithmetic differs.
    o_ref, _ = run("reference", [t.double() for t in x], initial_state=[t.double() for t in state], chunk_size=8)
    err = (o.double() - o_ref).norm() / o_ref.norm()
    assert err < {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.


def _call(**changes):
    x = dict(zip(["q", "k", "v", "alpha", "log_beta", "gamma"], make_inputs(2, 5, 2, 3, 4, 6, seed=0)))
    kw = dict(chunk_size=4)
    for key, value in changes.items():
        (x if key in x else kw)[key] = value(x) if callable(value) and key in x else value
    return trellis_attention(**x, **kw)


@pytest.mark.parametrize("changes,match", [
    (dict(q=lambda x: x["q"][0]), "q must be a 4-D"),
    (dict(k=lambda x: x["k"][:, :4]), "k must have shape"),
    (dict(v=lambda x: x["v"][:, :, :1]), "v must have shape"),
    (dict(alpha=lambda x: x["alpha"][..., 0]), "alpha must be a 4-D"),
    (dict(alpha=lambda x: x["alpha"][:1]), "alpha must have shape"),
    (dict(log_beta=lambda x: x["log_beta"][..., None]), "log_beta must have shape"),
    (dict(gamma=lambda x: x["gamma"][:, :2]), "gamma must have shape"),
    (dict(q=lambda x: x["q"].long(), k=lambda x: x["k"].long()), "q must be a floating-point"),
    (dict(q=lambda x: x["q"][:, :0], k=lambda x: x["k"][:, :0], v=lambda x: x["v"][:, :0],
          alpha=lambda x: x["alpha"][:, :0], log_beta=lambda x: x["log_beta"][:, :0],
          gamma=lambda x: x["gamma"][:, :0]), "at least one token"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
    (dict(chunk_size=2.0), "chunk_size must be an integer >= 1"),
    (dict(compress_fn="softplus"), "compress_fn must be one of"),
    (dict(mix_fn="relu"), "mix_fn must be one of"),
    (dict(backend="cuda"), "backend must be"),
    (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens needs a batch of 1"),
    (dict(initial_state=torch.zeros(2, 2, 6, 3)), "initial_state must be None, a pair"),
    (dict(initial_state=(torch.zeros(1, 2, 6, 3), torch.zeros(1, 2, 6, 4))), "initial_state.m_k must have shape"),
    (dict(initial_state=(torch.zeros(2, 2, 6, 3), torch.zeros(2, 2, 5, 4))), "initial_state.m_v must have shape"),
])
def test_bad_input_raises_a_clear_error(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


def test_bad_cu_seqlens_and_state_counts():
    x = make_inputs(1, 6, 2, 3, 3, 4, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 6"):
        trellis_attention(*x, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        trellis_attention(*x, cu_seqlens=torch.tensor([0, 4, 2, 6]))
    with pytest.raises(ValueError, match="cu_seqlens must hold integers"):
        trellis_attention(*x, cu_seqlens=torch.tensor([0.0, 6.0]))
    with pytest.raises(ValueError, match="N = 2 sequences"):
        trellis_attention(*x, cu_seqlens=torch.tensor([0, 2, 6]), initial_state=make_state(3, 2, 3, 3, 4, chunk_size=4, seed=1))
    state = make_state(1, 2, 3, 3, 4, chunk_size=4, seed=1)
    state.offset.fill_(4)
    with pytest.raises(ValueError, match=r"offset must lie in \[0, chunk_size = 4\)"):
        trellis_attention(*x, chunk_size=4, initial_state=state)


def test_bad_gates_raise_a_clear_error():
    """A gate out of its range (or NaN) makes the memory blow up: rejected by name."""
    for name, value, match in [
        ("gamma", -0.1, "gamma must be finite and >= 0"),
        ("gamma", float("inf"), "gamma must be finite and >= 0"),
        ("gamma", float("nan"), "gamma must be finite and >= 0"),
        ("log_beta", 0.1, "log_beta must be <= 0"),
        ("log_beta", float("nan"), "log_beta must be <= 0"),
    ]:
        def bad(x, name=name, value=value):
            t = x[name].clone()
            t[1, 3, 0] = value
            return t

        with pytest.raises(ValueError, match=match):
            _call(**{name: bad})
    # The ends of the ranges are allowed: a full forget everywhere, no learning.
    _call(log_beta=lambda x: torch.full_like(x["log_beta"], float("-inf")),
          gamma=lambda x: torch.zeros_like(x["gamma"]))


def test_zero_sized_dims_raise_a_clear_error():
    x = dict(zip(["q", "k", "v", "alpha", "log_beta", "gamma"], make_inputs(2, 5, 2, 3, 4, 6, seed=0)))
    for label, changed in [
        ("H", {key: t[:, :, :0] for key, t in x.items()}),
        ("Dk", {"q": x["q"][..., :0], "k": x["k"][..., :0]}),
        ("Dv", {"v": x["v"][..., :0]}),
        ("M", {"alpha": x["alpha"][..., :0]}),
    ]:
        with pytest.raises(ValueError, match=f"{label} must be at least 1"):
            trellis_attention(**{**x, **changed})


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
@pytest.mark.parametrize("T", [1, 5])
def test_empty_batch_gives_empty_outputs(backend, T):
    """B = 0 is an empty batch: o [0, T, H, Dv] and a state with no rows (documented)."""
    x = [t[:0] for t in make_inputs(2, T, 2, 3, 4, 6, seed=0)]
    o, s = run(backend, x, chunk_size=4)
    assert o.shape == (0, T, 2, 4) and o.dtype == torch.float64
    assert s.m_k.shape == (0, 2, 6, 3) and s.anchor_v.shape == (0, 2, 6, 4) and s.offset.shape == (0,)


# ---------------------------------------------------------------------------------------------
# identity: residuals at the current state (design page, section 1), so C only chooses how the
# one function, the gated delta rule, is computed.


def _decode(x, state, C, **kw):
    """Token by token through the single-token step (``torch`` with T == 1)."""
    outputs = []
    for p in range(x[0].shape[1]):
        o, state = run("torch", [t[:, p : p + 1] for t in x], initial_state=state, chunk_size=C, **kw)
        outputs.append(o)
    return torch.cat(outputs, dim=1), state


def _at_chunk_start(state: TrellisState) -> TrellisState:
    """The same memories at C = 1 (identity ignores anchors and offsets)."""
    return TrellisState(state.m_k, state.m_v, state.anchor_k, state.anchor_v, torch.zeros_like(state.offset))


def _each_backend_against_the_loop(x, state, C, o_1, s_1, **kw):
    """Every backend (and the decode step) at C: outputs and memories checked against the loop's
    ``o_1, s_1`` at C = 1; yields ``(backend, final state)`` for the caller's own checks."""
    for backend in ["reference"] + FAST_BACKENDS + ["decode"]:
        if backend == "decode":
            o, s = _decode(x, state, C, **kw)
        else:
            o, s = run(backend, x, initial_state=state, chunk_size=C, **kw)
        torch.testing.assert_close(o, o_1, **TOL, msg=lambda m: f"{backend}: {m}")
        torch.testing.assert_close(s.m_k, s_1.m_k, **TOL)
        torch.testing.assert_close(s.m_v, s_1.m_v, **TOL)
        yield backend, s


@pytest.mark.parametrize("C,mf", [(1, "ln_silu"), (3, "l2_silu"), (16, "softmax"), (64, "ln_silu")])
def test_identity_is_one_function_at_every_chunk_size(C, mf):
    """Every backend at C (rows resuming mid-chunk) equals the per-token loop at C = 1 and the
    independent statement above, in float64."""
    x = make_inputs(2, 70, 2, 5, 7, 6, seed=C)
    state = make_state(2, 2, 5, 7, 6, chunk_size=C, seed=C + 1)
    kw = dict(compress_fn="identity", mix_fn=mf)
    o_1, s_1 = run("reference", x, initial_state=_at_chunk_start(state), chunk_size=1, **kw)
    torch.testing.assert_close(o_1, naive(*x, state.m_k, state.m_v, 1, "identity", mf), **TOL)
    assert o_1.abs().max() > 0.1
    for backend, s in _each_backend_against_the_loop(x, state, C, o_1, s_1, **kw):
        if backend != "reference":
            assert_states_close(s, run("reference", x, initial_state=state, chunk_size=C, **kw)[1])


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("C", [4, 16])
def test_identity_gradients(backend, C):
    """Against autograd of the loop at the same C (anchors included), and the gradients of the
    outputs and memories against the loop at C = 1: the same function, the same gradients."""
    x = make_inputs(2, 23, 2, 3, 4, 5, requires_grad=True, seed=C)
    state = make_state(2, 2, 3, 4, 5, chunk_size=C, requires_grad=True, seed=C + 1)
    expected = _grads("reference", x, state, C, "identity", "ln_silu")
    for g, e in zip(_grads(backend, x, state, C, "identity", "ln_silu"), expected):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)

    def grads(backend, chunk_size, state):
        o, s = run(backend, x, initial_state=state, chunk_size=chunk_size, compress_fn="identity")
        gen = torch.Generator().manual_seed(1)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in (o, s.m_k, s.m_v))
        return torch.autograd.grad(loss, list(x) + [state.m_k, state.m_v])

    for g, e in zip(grads(backend, C, state), grads("reference", 1, _at_chunk_start(state))):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_identity_resume_at_every_split_and_varlen(backend):
    C, T = 5, 13
    x = make_inputs(2, T, 2, 3, 5, 4, seed=2)
    state = make_state(2, 2, 3, 5, 4, chunk_size=C, seed=3)
    kw = dict(compress_fn="identity", mix_fn="ln_silu")
    o_all, s_all = run("reference", x, initial_state=_at_chunk_start(state), chunk_size=1, **kw)
    for split in range(1, T):
        o1, s1 = run(backend, [t[:, :split] for t in x], initial_state=state, chunk_size=C, **kw)
        o2, s2 = run(backend, [t[:, split:] for t in x], initial_state=s1, chunk_size=C, **kw)
        torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, **TOL)
        torch.testing.assert_close(s2.m_k, s_all.m_k, **TOL)
        torch.testing.assert_close(s2.m_v, s_all.m_v, **TOL)
    lengths = [5, 0, 9, 1, 3]
    x = make_inputs(1, sum(lengths), 2, 4, 3, 5, seed=3)
    state = make_state(len(lengths), 2, 4, 3, 5, chunk_size=C, seed=4)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = run(backend, x, initial_state=state, chunk_size=C, cu_seqlens=cu, **kw)
    o_ref, s_ref = run("reference", x, initial_state=_at_chunk_start(state), chunk_size=1, cu_seqlens=cu, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(s.m_k, s_ref.m_k, **TOL)
    assert_states_close(s, run("reference", x, initial_state=state, chunk_size=C, cu_seqlens=cu, **kw)[1])


def _long_stream(T, repeated, C=64, H=2, D=8, M=8):
    """float32 op-level stream like a model's (unit-norm q, k, v; beta ~ 0.95, gamma ~ sigmoid):
    ``T`` random tokens, or one random token repeated ``T`` times."""
    x = make_inputs(1, 1 if repeated else T, H, D, D, M, dtype=torch.float32, seed=0)
    if repeated:
        x = [t.expand((1, T) + t.shape[2:]) for t in x]
    state = make_state(1, H, D, D, M, chunk_size=C, dtype=torch.float32, seed=1)
    return run("torch", x, initial_state=state, chunk_size=C, compress_fn="identity")


def _assert_bounded(o, s):
    # The gated delta rule with unit keys and gamma <= 1 contracts: the memory stays of the
    # order of the targets alpha (N(0, 1) entries) however long the stream.
    assert o.isfinite().all() and s.m_k.isfinite().all() and s.m_v.isfinite().all()
    assert s.m_k.abs().max() < 100 and s.m_v.abs().max() < 100 and o.abs().max() < 100


@pytest.mark.parametrize("repeated", [False, True])
def test_identity_long_streams_stay_bounded(repeated):
    """With anchors at chunk starts, C = 64 stale steps on aligned keys diverged (NaN within
    ~3k tokens of one repeated token); at the current state the memory stays bounded."""
    _assert_bounded(*_long_stream(20_000, repeated))


@pytest.mark.slow
@pytest.mark.parametrize("repeated", [False, True])
def test_identity_100k_token_streams_stay_bounded(repeated):
    _assert_bounded(*_long_stream(100_000, repeated))


# ---------------------------------------------------------------------------------------------
# A full forget, log_beta = -inf (documented as allowed): finite, and exact, everywhere.


@pytest.mark.parametrize("wg", WRITE_GRADIENTS)
@pytest.mark.parametrize("cf", COMPRESS_FNS)
@pytest.mark.parametrize("where", [5, 4, 0])  # inside a chunk, at a chunk start, the first token
def test_full_forget_is_finite_and_exact(cf, where, wg):
    C = 4
    x = list(make_inputs(2, 11, 2, 3, 4, 5, seed=where))
    lb = x[4].clone()
    lb[0, where, :] = float("-inf")  # both heads of row 0
    lb[1, where + 1, 1] = float("-inf")  # one head of row 1, one token later
    x[4] = lb
    x = [t.requires_grad_() for t in x]
    memories = (torch.randn(2, 2, 5, d, dtype=torch.float64, requires_grad=True) for d in (3, 4))
    state = TrellisState.at_chunk_start(*memories)
    kw = dict(compress_fn=cf, mix_fn="ln_silu", write_gradient=wg)
    o_ref, s_ref = run("reference", x, initial_state=state, chunk_size=C, **kw)
    g_ref = _grads("reference", x, state, C, cf, "ln_silu", wg=wg)
    assert o_ref.isfinite().all() and all(g.isfinite().all() for g in g_ref)
    for backend in FAST_BACKENDS + ["decode"]:
        if backend == "decode":
            o, s = _decode(x, state, C, **kw)
        else:
            o, s = run(backend, x, initial_state=state, chunk_size=C, **kw)
            for g, e in zip(_grads(backend, x, state, C, cf, "ln_silu", wg=wg), g_ref):
                assert g.isfinite().all()
                torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)
        torch.testing.assert_close(o, o_ref, **TOL, msg=lambda m: f"{backend}: {m}")
        assert_states_close(s, s_ref)


# ---------------------------------------------------------------------------------------------
# Cost: the work follows the tokens present, not the chunk size.


def _allocated_bytes(fn) -> int:
    """Bytes that the tensor operations of ``fn()`` allocate, summed (CPU profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(event.self_cpu_memory_usage, 0) for event in prof.events())


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("cf,wg", [("layernorm", "anchored"), ("identity", "anchored"), ("layernorm", "exact")])
def test_cost_follows_the_tokens_not_the_chunk_size(backend, cf, wg):
    """A 5-token call at C = 4096 allocated 4.4 GB (blocks of C x C); now it allocates what
    C = 8 does and gives the same numbers. C = 10**9 runs and equals the reference, rows
    resuming at the start and 3 tokens before the end of a chunk."""
    x = make_inputs(2, 5, 2, 3, 4, 6, seed=1)
    pair = (torch.randn(2, 2, 6, 3, dtype=torch.float64), torch.randn(2, 2, 6, 4, dtype=torch.float64))
    o_8, s_8 = run(backend, x, initial_state=pair, chunk_size=8, compress_fn=cf, write_gradient=wg)
    o_big, s_big = run(backend, x, initial_state=pair, chunk_size=4096, compress_fn=cf, write_gradient=wg)
    torch.testing.assert_close(o_big, o_8, **TOL)
    assert_states_close(s_big.map(lambda t: t % 8 if t.dtype == torch.long else t), s_8)
    small = _allocated_bytes(lambda: run(backend, x, initial_state=pair, chunk_size=8, compress_fn=cf, write_gradient=wg))
    big = _allocated_bytes(lambda: run(backend, x, initial_state=pair, chunk_size=4096, compress_fn=cf, write_gradient=wg))
    assert big < 2 * small + 100_000, (small, big)

    C = 10**9
    state = make_state(2, 2, 3, 4, 6, chunk_size=C, seed=2)
    state.offset.copy_(torch.tensor([0, C - 3]))
    o, s = run(backend, x, initial_state=state, chunk_size=C, compress_fn=cf, write_gradient=wg)
    o_ref, s_ref = run("reference", x, initial_state=state, chunk_size=C, compress_fn=cf, write_gradient=wg)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)
    assert s.offset.tolist() == [5, 2]


# ---------------------------------------------------------------------------------------------
# "exact" writes: every residual at the memory just before its write (design page, sections 1-2),
# so C only chooses how the one function, the per-token recurrence of C = 1, is computed.


@pytest.mark.parametrize("cf,mf", [("layernorm", "ln_silu"), ("l2norm", "softmax"), ("layernorm", "l2_silu")])
@pytest.mark.parametrize("C", [1, 3, 16, 64])
def test_exact_is_one_function_at_every_chunk_size(C, cf, mf):
    """Every backend at C (rows resuming mid-chunk, T not a multiple of C) equals the anchored
    loop at C = 1 and the independent statement above, in float64; the anchors it hands back
    are its memories."""
    x = make_inputs(2, 70, 2, 5, 7, 6, seed=C)
    state = make_state(2, 2, 5, 7, 6, chunk_size=C, seed=C + 1)
    o_1, s_1 = run("reference", x, initial_state=_at_chunk_start(state), chunk_size=1, compress_fn=cf, mix_fn=mf)
    torch.testing.assert_close(o_1, naive(*x, state.m_k, state.m_v, C, cf, mf, "exact"), **TOL)
    assert o_1.abs().max() > 0.1
    kw = dict(compress_fn=cf, mix_fn=mf, write_gradient="exact")
    for _, s in _each_backend_against_the_loop(x, state, C, o_1, s_1, **kw):
        assert torch.equal(s.anchor_k, s.m_k) and torch.equal(s.anchor_v, s.m_v)
        assert s.offset.tolist() == ((state.offset + 70) % C).tolist()


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("C,cf", [(4, "layernorm"), (16, "l2norm"), (64, "layernorm")])
def test_exact_gradients_equal_the_recurrence(backend, C, cf):
    """The gradients of the outputs and memories at C equal the loop's at C = 1 (anchors and
    offsets do not enter the function)."""
    x = make_inputs(2, 37, 2, 3, 4, 5, requires_grad=True, seed=C)
    state = make_state(2, 2, 3, 4, 5, chunk_size=C, requires_grad=True, seed=C + 1)

    def grads(backend, chunk_size, state, wg):
        o, s = run(backend, x, initial_state=state, chunk_size=chunk_size, compress_fn=cf, write_gradient=wg)
        gen = torch.Generator().manual_seed(1)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in (o, s.m_k, s.m_v))
        return torch.autograd.grad(loss, list(x) + [state.m_k, state.m_v])

    expected = grads("reference", 1, _at_chunk_start(state), "anchored")
    for g, e in zip(grads(backend, C, state, "exact"), expected):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("layout", [1, 5, 16, 64])
def test_exact_writes_in_any_torch_layout_are_the_recurrence(layout, monkeypatch):
    """The torch path lays exact writes out in chunks of EXACT_LAYOUT_CHUNK tokens whatever C;
    any such length computes the loop at C = 1: outputs, memories and every gradient in float64,
    packed sequences (an empty one) and a C whose offsets the state still counts."""
    from trellis_lm.ops.trellis import chunked

    monkeypatch.setattr(chunked, "EXACT_LAYOUT_CHUNK", layout)
    lengths = [21, 0, 3, 40]
    x = make_inputs(1, sum(lengths), 2, 4, 4, 5, requires_grad=True, seed=layout)
    state = make_state(len(lengths), 2, 4, 4, 5, chunk_size=7, requires_grad=True, seed=layout)
    cu = torch.tensor([0] + lengths).cumsum(0)

    def grads(backend, chunk_size, state, wg):
        o, s = run(backend, x, initial_state=state, chunk_size=chunk_size, cu_seqlens=cu, write_gradient=wg)
        gen = torch.Generator().manual_seed(1)
        loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in (o, s.m_k, s.m_v))
        return (o, s), torch.autograd.grad(loss, list(x) + [state.m_k, state.m_v])

    (o, s), got = grads("torch", 7, state, "exact")
    (o_1, s_1), expected = grads("reference", 1, _at_chunk_start(state), "anchored")
    torch.testing.assert_close(o, o_1, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(s.m_k, s_1.m_k, rtol=1e-9, atol=1e-10)
    assert s.offset.tolist() == ((state.offset + torch.tensor(lengths)) % 7).tolist()
    for g, e in zip(got, expected):
        assert e.abs().max() > 0
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-9)


def test_exact_and_anchored_differ_beyond_one_token_chunks():
    """Guards the comparisons above: a backend that ignored write_gradient would be caught."""
    x = make_inputs(1, 12, 1, 4, 4, 3, seed=0)
    state = (torch.randn(1, 1, 3, 4, dtype=torch.float64),) * 2
    for backend in ["reference"] + FAST_BACKENDS:
        o_exact, _ = run(backend, x, initial_state=state, chunk_size=4, write_gradient="exact")
        o_anchored, _ = run(backend, x, initial_state=state, chunk_size=4, write_gradient="anchored")
        assert (o_exact - o_anchored).abs().max() > 1e-3, backend


def test_bad_write_gradient_is_refused_by_name():
    x = make_inputs(1, 3, 1, 2, 2, 2, seed=0)
    with pytest.raises(ValueError, match="write_gradient must be one of"):
        trellis_attention(*x, write_gradient="stale")
