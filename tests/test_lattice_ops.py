"""The Lattice op: the torch backend and the decode step against the per-token reference of the
design page ``lattice.md`` (float64, fresh random inputs)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from trellis_lm.ops.lattice import BACKENDS, LATTICE_VARIANTS, LatticeState, lattice_attention

TOL = dict(rtol=1e-10, atol=1e-10)
GRAD_TOL = dict(rtol=1e-9, atol=1e-10)


def make_inputs(B, T, H, M, D, *, dtype=torch.float64, seed, requires_grad=False, gamma_scale=1.0):
    """``(q, k, v, gamma)`` shaped like the layer's: unit q, k (over M) and v (over D), gamma in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    tensors = (
        F.normalize(rand(B, T, H, M), dim=-1),
        F.normalize(rand(B, T, H, M), dim=-1),
        F.normalize(rand(B, T, H, D), dim=-1),
        gamma_scale * torch.sigmoid(rand(B, T, H)),
    )
    return tuple(t.detach().requires_grad_(requires_grad) for t in tensors)


def mid_chunk_state(N, H, M, D, *, chunk_size, seed, requires_grad=False) -> LatticeState:
    """A state as an earlier call leaves it: unit anchor rows, an accumulation that differs from
    them, random offsets in [0, C)."""
    gen = torch.Generator().manual_seed(seed)
    anchor = F.normalize(torch.randn(N, H, M, D, generator=gen, dtype=torch.float64), dim=-1)
    memory = anchor + 0.3 * torch.randn(N, H, M, D, generator=gen, dtype=torch.float64)
    return LatticeState(
        memory.requires_grad_(requires_grad), anchor.requires_grad_(requires_grad),
        torch.randint(0, chunk_size, (N,), generator=gen),
    )


def run(backend, x, **kw):
    return lattice_attention(*x, backend=backend, output_final_state=True, **kw)


def assert_states_close(a: LatticeState, b: LatticeState, **tol) -> None:
    for name, t in a.tensors().items():
        torch.testing.assert_close(t, b.tensors()[name], **(tol or TOL), msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# An independent statement of the design page, section 1: one (row, head) at a time, as written.


def naive(q, k, v, gamma, s0, C, variant):
    B, T, H, _ = q.shape
    out = torch.zeros(v.shape, dtype=v.dtype)
    for b, h in itertools.product(range(B), range(H)):
        S = s0[b, h] / s0[b, h].norm(dim=-1, keepdim=True)
        U = S
        for p in range(T):
            if p % C == 0:
                A = U = S
            kk, vv, g = k[b, p, h], v[b, p, h], gamma[b, p, h]
            if variant == "dec":
                w, bb = A.T @ kk - vv, g * kk
            elif variant == "enc":
                w, bb = vv, g * (A @ vv - kk)
            else:
                w, bb = vv, -g * kk
            U = torch.stack([U[i] - bb[i] * (w - (A[i] @ w) * A[i]) for i in range(U.shape[0])])
            S = U / U.norm(dim=-1, keepdim=True)
            out[b, p, h] = S.T @ q[b, p, h]
    return out


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C", [1, 3])
def test_reference_matches_the_design_page_statement(variant, C):
    x = make_inputs(2, 7, 2, 4, 3, seed=0)
    s0 = torch.randn(2, 2, 4, 3, dtype=torch.float64)
    o, _ = lattice_attention(*x, initial_state=s0, chunk_size=C, variant=variant, backend="reference")
    torch.testing.assert_close(o, naive(*x, s0, C, variant), **TOL)


# ---------------------------------------------------------------------------------------------
# The torch backend == the reference.


@pytest.mark.parametrize("M,D", [(7, 5), (3, 10)])  # M > D and M < D, none a power of two
@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C", [1, 3, 16, 64])
def test_torch_matches_reference(C, variant, M, D):
    x = make_inputs(2, 37, 2, M, D, seed=0)  # 37 is not a multiple of any C > 1
    s0 = torch.randn(2, 2, M, D, dtype=torch.float64)
    kw = dict(initial_state=s0, chunk_size=C, variant=variant)
    o_ref, s_ref = run("reference", x, **kw)
    o, s = run("torch", x, **kw)
    assert o_ref.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("B,T,H,M,D,C", [
    (1, 1, 1, 1, 1, 1),      # everything of size one
    (2, 1, 3, 5, 4, 64),     # one token, a chunk much longer than the input
    (3, 65, 1, 7, 2, 64),    # one token past a chunk
    (2, 10, 2, 2, 9, 10),    # T equal to the chunk
    (1, 33, 2, 6, 6, 32),
])
def test_odd_sizes_from_a_mid_chunk_state(variant, B, T, H, M, D, C):
    x = make_inputs(B, T, H, M, D, seed=0)
    state = mid_chunk_state(B, H, M, D, chunk_size=C, seed=1)
    kw = dict(initial_state=state, chunk_size=C, variant=variant)
    o_ref, s_ref = run("reference", x, **kw)
    o, s = run("torch", x, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)
    if T > 1:  # T == 1 runs the step with either name; the chunk form must be what ran here
        o_step = torch.cat([run("torch", [t[:, :1] for t in x], **kw)[0], o[:, 1:]], dim=1)
        torch.testing.assert_close(o_step, o_ref, **TOL)


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C", [1, 64])
def test_chunk_form_with_a_single_token(C, variant):
    """T == 1 without cu_seqlens runs the step; packed, it runs the chunk form (one real cell)."""
    x = make_inputs(1, 1, 3, 6, 5, seed=0)
    state = mid_chunk_state(2, 3, 6, 5, chunk_size=C, seed=1)
    kw = dict(initial_state=state, chunk_size=C, variant=variant, cu_seqlens=torch.tensor([0, 0, 1]))
    o_ref, s_ref = run("reference", x, **kw)
    o, s = run("torch", x, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)


def test_chunk_size_and_variant_change_the_function():
    """Guards the comparisons above: a backend that ignored chunk_size or variant would be caught."""
    x = make_inputs(1, 12, 1, 4, 4, seed=0)
    s0 = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    o1, _ = run("reference", x, initial_state=s0, chunk_size=1)
    o4, _ = run("reference", x, initial_state=s0, chunk_size=4)
    assert (o1 - o4).abs().max() > 1e-3
    outs = [run("reference", x, initial_state=s0, chunk_size=4, variant=name)[0] for name in LATTICE_VARIANTS]
    for a, b in itertools.combinations(outs, 2):
        assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
def test_cost_follows_the_tokens_not_the_chunk_size(variant):
    # 5 tokens in a chunk of 10**9: the blocks are 5 wide (a C-wide grid would ask for terabytes).
    x = make_inputs(2, 5, 2, 6, 4, seed=0)
    state = mid_chunk_state(2, 2, 6, 4, chunk_size=3, seed=1)
    state.offset = torch.tensor([3, 10**9 - 2])  # the second row crosses a chunk boundary
    o, final = run("torch", x, initial_state=state, chunk_size=10**9, variant=variant)
    o_ref, final_ref = run("reference", x, initial_state=state, chunk_size=10**9, variant=variant)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(final, final_ref)


def test_initial_memory_rows_are_normalised_by_the_op():
    x = make_inputs(2, 9, 2, 5, 3, seed=0)
    s0 = torch.randn(2, 2, 5, 3, dtype=torch.float64)
    scale = torch.rand(2, 2, 5, 1, dtype=torch.float64) * 10 + 0.1
    for backend in BACKENDS:
        o, _ = run(backend, x, initial_state=s0, chunk_size=4)
        o_scaled, _ = run(backend, x, initial_state=s0 * scale, chunk_size=4)
        torch.testing.assert_close(o_scaled, o, **TOL)
    state = LatticeState.at_chunk_start(s0 * scale)
    assert state.offset.tolist() == [0, 0] and state.rows == 2
    assert list(state.tensors()) == LatticeState.field_names() == ["memory", "anchor", "offset"]
    torch.testing.assert_close(state.memory.norm(dim=-1), torch.ones(2, 2, 5, dtype=torch.float64), **TOL)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_read_slots_stay_on_the_sphere(backend):
    """q = e_i reads slot i of S: a unit vector after every token, even with large steps."""
    M, D, T = 5, 4, 40
    q, k, v, gamma = make_inputs(2, T, 2, M, D, gamma_scale=5.0, seed=0)
    q = F.one_hot(torch.arange(T) % M, M).to(torch.float64)[None, :, None, :].expand(2, T, 2, M)
    o, s = run(backend, (q, k, v, gamma), initial_state=torch.randn(2, 2, M, D, dtype=torch.float64), chunk_size=8)
    torch.testing.assert_close(o.norm(dim=-1), torch.ones(2, T, 2, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(s.anchor.norm(dim=-1), torch.ones(2, 2, M, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (s.memory.norm(dim=-1) > 1 + 1e-6).all()  # U itself is not normalised: steps add to it


# ---------------------------------------------------------------------------------------------
# State: resume and packed sequences.


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("C", [1, 4, 5])
def test_resume_at_every_split(backend, C):
    T = 13
    x = make_inputs(2, T, 2, 4, 3, seed=0)
    state = mid_chunk_state(2, 2, 4, 3, chunk_size=C, seed=1)
    o_all, s_all = run("reference", x, initial_state=state, chunk_size=C)
    for split in range(1, T):
        o1, s1 = run(backend, [t[:, :split] for t in x], initial_state=state, chunk_size=C)
        o2, s2 = run(backend, [t[:, split:] for t in x], initial_state=s1, chunk_size=C)
        torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_all, **TOL)
        assert_states_close(s2, s_all)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("C", [1, 3, 8])
def test_varlen_equals_each_sequence_alone(backend, C):
    lengths = [5, 0, 9, 1, 3]
    x = make_inputs(1, sum(lengths), 2, 4, 3, seed=0)
    state = mid_chunk_state(len(lengths), 2, 4, 3, chunk_size=C, seed=1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, s = run(backend, x, initial_state=state, chunk_size=C, cu_seqlens=cu)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        row_state = state.map(lambda t: t[n : n + 1])
        if end == start:  # an empty sequence hands its state back untouched
            for name, t in s.map(lambda t: t[n : n + 1]).tensors().items():
                assert torch.equal(t, row_state.tensors()[name]), name
            continue
        o_n, s_n = run("reference", [t[:, start:end] for t in x], initial_state=row_state, chunk_size=C)
        torch.testing.assert_close(o[:, start:end], o_n, **TOL)
        assert_states_close(s.map(lambda t: t[n : n + 1]), s_n)


# ---------------------------------------------------------------------------------------------
# Gradients: autograd of the reference (float64) is the ground truth.


def _grads(backend, x, initial_state, C, variant, cu_seqlens=None):
    o, s = run(backend, x, initial_state=initial_state, chunk_size=C, variant=variant, cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(0)
    # A random projection of every output and of the final state, anchor included.
    outs = [o, s.memory, s.anchor]
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outs)
    if isinstance(initial_state, LatticeState):
        leaves = list(x) + [initial_state.memory, initial_state.anchor]
    else:
        leaves = list(x) + [initial_state]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C", [1, 4, 16])
def test_gradients_match_reference_from_a_memory_tensor(C, variant):
    x = make_inputs(2, 11, 2, 5, 3, requires_grad=True, seed=0)
    s0 = torch.randn(2, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    expected = _grads("reference", x, s0, C, variant)
    got = _grads("torch", x, s0, C, variant)
    for name, g, e in zip(["q", "k", "v", "gamma", "initial_state"], got, expected):
        assert e.abs().max() > 1e-3, name
        torch.testing.assert_close(g, e, **GRAD_TOL, msg=lambda m: f"d/d{name}: {m}")


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C", [1, 5])
def test_gradients_match_reference_from_a_mid_chunk_state(C, variant):
    """Through the carried anchor: the first chunk's writes are taken there."""
    x = make_inputs(2, 9, 2, 3, 4, requires_grad=True, seed=0)
    state = mid_chunk_state(2, 2, 3, 4, chunk_size=C, requires_grad=True, seed=1)
    if C > 1:
        state.offset.copy_(torch.tensor([2, 0]))  # one row mid-chunk, one at a chunk start
    expected = _grads("reference", x, state, C, variant)
    got = _grads("torch", x, state, C, variant)
    for name, g, e in zip(["q", "k", "v", "gamma", "memory", "anchor"], got, expected):
        torch.testing.assert_close(g, e, **GRAD_TOL, msg=lambda m: f"d/d{name}: {m}")
    if C > 1:
        assert expected[-1][0].abs().max() > 1e-3  # the mid-chunk row's anchor matters
        assert expected[-1][1].abs().max() == 0  # at a chunk start the anchor is replaced


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
@pytest.mark.parametrize("C,mid_chunk", [(1, False), (3, True), (4, False)])
def test_reads_in_many_blocks_match_reference(monkeypatch, C, mid_chunk, variant):
    """The reads run in blocks of chunks after the chain; a tiny block budget makes every block
    one chunk, and an odd chunk count leaves a last block of another size. Outputs, final state
    and gradients (inputs and the carried state) must not depend on the blocks."""
    from trellis_lm.ops.lattice import chunked

    x = make_inputs(2, 11, 3, 5, 3, requires_grad=True, seed=0)
    state = mid_chunk_state(2, 3, 5, 3, chunk_size=C, requires_grad=True, seed=1)
    if not mid_chunk:
        state.offset.zero_()
    expected = _grads("reference", x, state, C, variant)
    o_ref, s_ref = run("reference", x, initial_state=state, chunk_size=C, variant=variant)
    for budget in (1, 2 * 3 * (C * (5 + 3 + C) + 5 * 3) * 3):  # one chunk per block; three
        monkeypatch.setattr(chunked, "READ_ELEMENTS", budget)
        o, s = run("torch", x, initial_state=state, chunk_size=C, variant=variant)
        torch.testing.assert_close(o, o_ref, **TOL)
        assert_states_close(s, s_ref)
        got = _grads("torch", x, state, C, variant)
        for name, g, e in zip(["q", "k", "v", "gamma", "memory", "anchor"], got, expected):
            torch.testing.assert_close(g, e, **GRAD_TOL, msg=lambda m: f"d/d{name}: {m}")


def test_varlen_gradients_match_reference():
    lengths = [4, 0, 7]
    x = make_inputs(1, sum(lengths), 2, 3, 3, requires_grad=True, seed=0)
    state = mid_chunk_state(3, 2, 3, 3, chunk_size=3, requires_grad=True, seed=1)
    cu = torch.tensor([0] + lengths).cumsum(0)
    got = _grads("torch", x, state, 3, "dec", cu)
    expected = _grads("reference", x, state, 3, "dec", cu)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **GRAD_TOL)


# ---------------------------------------------------------------------------------------------
# The decode step.


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
def test_single_token_step_matches_reference(variant):
    """The decode step (``torch``/``auto`` with T == 1) against the loop, values and gradients;
    rows at a chunk start (offset 0: U and the anchor renormalised) and mid-chunk."""
    from trellis_lm.ops.lattice.step import step_forward
    from trellis_lm.ops.registry import OpCall

    def picked(backend: str, length: int, packed: bool):
        return BACKENDS.function(backend, OpCall(torch.device("cpu"), torch.float64, length, packed))

    assert picked("auto", 1, False) is step_forward
    assert picked("torch", 1, False) is step_forward
    assert picked("auto", 2, False) is BACKENDS["torch"].forward
    assert picked("auto", 1, True) is BACKENDS["torch"].forward
    x = make_inputs(3, 1, 2, 5, 3, requires_grad=True, seed=0)
    state = mid_chunk_state(3, 2, 5, 3, chunk_size=4, requires_grad=True, seed=1)
    state.offset.copy_(torch.tensor([0, 2, 3]))
    for backend in ("auto", "torch"):
        o, final = run(backend, x, initial_state=state, chunk_size=4, variant=variant)
        o_ref, final_ref = run("reference", x, initial_state=state, chunk_size=4, variant=variant)
        torch.testing.assert_close(o, o_ref, **TOL)
        assert_states_close(final, final_ref)
        assert final.offset.tolist() == [1, 3, 0]
    expected = _grads("reference", x, state, 4, variant)
    for g, e in zip(_grads("auto", x, state, 4, variant), expected):
        torch.testing.assert_close(g, e, **GRAD_TOL)
    assert expected[-1].abs().max() > 0  # the mid-chunk rows' anchors get gradients


def test_decoding_token_by_token_equals_one_call():
    x = make_inputs(2, 11, 2, 4, 6, seed=0)
    s0 = torch.randn(2, 2, 4, 6, dtype=torch.float64)
    o_all, s_all = run("torch", x, initial_state=s0, chunk_size=4)
    state, outs = s0, []
    for t in range(11):
        o, state = run("auto", [y[:, t : t + 1] for y in x], initial_state=state, chunk_size=4)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_all, **TOL)
    assert_states_close(state, s_all)


# ---------------------------------------------------------------------------------------------
# Dtypes.


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_low_precision_inputs_keep_float32_state(backend, dtype):
    x = [t.to(dtype) for t in make_inputs(2, 20, 2, 8, 8, seed=0)]
    s0 = torch.randn(2, 2, 8, 8)
    o, s = run(backend, x, initial_state=s0.to(dtype), chunk_size=8)
    assert o.dtype == dtype and s.memory.dtype == torch.float32 and s.anchor.dtype == torch.float32
    # Against float64 on the same (rounded) inputs: only the op's own arithmetic differs.
    o_ref, _ = run("reference", [t.double() for t in x], initial_state=s0.to(dtype).double(), chunk_size=8)
    err = (o.double() - o_ref).norm() / o_ref.norm()
    assert err < {torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.


def _call(**changes):
    x = dict(zip(["q", "k", "v", "gamma"], make_inputs(2, 5, 2, 6, 4, seed=0)))
    kw = dict(chunk_size=4, initial_state=torch.randn(2, 2, 6, 4, dtype=torch.float64))
    for key, value in changes.items():
        (x if key in x else kw)[key] = value(x) if callable(value) and key in x else value
    return lattice_attention(**x, **kw)


def _bad_offset():
    state = LatticeState.at_chunk_start(torch.randn(2, 2, 6, 4, dtype=torch.float64))
    state.offset.fill_(4)
    return state


@pytest.mark.parametrize("changes,match", [
    (dict(initial_state=None), "initial_state is required.*zero memory has no direction"),
    (dict(initial_state=(torch.zeros(2, 2, 6, 4),)), "initial_state must be a memory tensor"),
    (dict(initial_state=torch.randn(1, 2, 6, 4)), "initial_state must have shape"),
    (dict(initial_state=torch.randn(2, 2, 4, 6)), "initial_state must have shape"),
    (dict(initial_state=LatticeState(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 3), torch.zeros(2).long())),
     "initial_state.anchor must have shape"),
    (dict(initial_state=LatticeState(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 6, 4), torch.zeros(2).long())),
     "initial_state.memory must have shape"),
    (dict(initial_state=_bad_offset()), r"initial_state.offset must lie in \[0, chunk_size = 4\)"),
    (dict(q=lambda x: x["q"][0]), "q must be a 4-D"),
    (dict(k=lambda x: x["k"][:, :4]), "k must have shape"),
    (dict(k=lambda x: x["k"][..., :3]), "k must have shape"),
    (dict(v=lambda x: x["v"][:, :, :1]), "v must have shape"),
    (dict(v=lambda x: x["v"][0]), "v must be a 4-D"),
    (dict(gamma=lambda x: x["gamma"][..., None]), "gamma must have shape"),
    (dict(gamma=lambda x: x["gamma"][:, :2]), "gamma must have shape"),
    (dict(q=lambda x: x["q"].long(), k=lambda x: x["k"].long()), "q must be a floating-point"),
    (dict(q=lambda x: x["q"][:, :0], k=lambda x: x["k"][:, :0], v=lambda x: x["v"][:, :0],
          gamma=lambda x: x["gamma"][:, :0]), "at least one token"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
    (dict(chunk_size=2.0), "chunk_size must be an integer >= 1"),
    (dict(variant="DEC"), "variant must be one of"),
    (dict(variant=None), "variant must be one of"),
    (dict(backend="triton"), "backend must be"),
    (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens needs a batch of 1"),
])
def test_bad_input_raises_a_clear_error(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


@pytest.fixture
def seeded():
    """A seeded, forked RNG: the test is deterministic, and tests after it that draw unseeded
    numbers get the stream they would get without it."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        yield


def _one(t, value):
    """``t`` with one element set to ``value``."""
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_gamma_out_of_range_raises(value, seeded):
    """As the Trellis op's gamma: finite and >= 0 (a negative step climbs the loss)."""
    with pytest.raises(ValueError, match=r"gamma must be finite and >= 0, got values in"):
        _call(gamma=lambda x: _one(x["gamma"], value))
    _call(gamma=lambda x: torch.zeros_like(x["gamma"]))  # 0 writes nothing


def test_initial_memory_with_a_zero_row_raises(seeded):
    """A slot without a direction normalises to NaN, and every output with it."""
    s0 = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    s0[1, 0, 3] = 0.0
    with pytest.raises(ValueError, match=r"initial_state must be a memory of rows with finite, nonzero norms .*"
                                         r"got values in \[0.0, "):
        _call(initial_state=s0)
    state = LatticeState(s0, F.normalize(torch.randn(2, 2, 6, 4, dtype=torch.float64), dim=-1), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"initial_state.memory must be a memory of rows with finite, nonzero norms"):
        _call(initial_state=state)


def test_check_values_false_skips_only_the_value_checks(monkeypatch, seeded):
    """``check_values=False`` (decode steps) reads nothing back: no gamma, memory norm or offset
    check; shapes are still checked, and the default checks a single token too."""
    from trellis_lm.ops import checks
    from trellis_lm.ops.lattice import dispatch

    x = make_inputs(2, 1, 2, 6, 4, seed=0)
    bad_gamma = _one(x[3], -1.0)
    state = mid_chunk_state(2, 2, 6, 4, chunk_size=4, seed=1)
    with pytest.raises(ValueError, match="gamma must be finite and >= 0"):
        lattice_attention(*x[:3], bad_gamma, initial_state=state, chunk_size=4)
    with pytest.raises(ValueError, match="gamma must have shape"):
        lattice_attention(*x[:3], x[3][..., :1], initial_state=state, chunk_size=4, check_values=False)

    def no_read(*args, **kwargs):
        raise AssertionError("values read back")

    monkeypatch.setattr(dispatch, "expect_in_range", no_read)
    monkeypatch.setattr(checks, "check_offsets", no_read)  # through checks.checked_offsets_state
    o, _ = lattice_attention(*x[:3], bad_gamma, initial_state=state, chunk_size=4, check_values=False)
    assert o.shape == (2, 1, 2, 4)


def test_bad_cu_seqlens_and_state_counts():
    x = make_inputs(1, 6, 2, 3, 3, seed=0)
    s0 = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 6"):
        lattice_attention(*x, initial_state=s0, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must hold integers"):
        lattice_attention(*x, initial_state=s0, cu_seqlens=torch.tensor([0.0, 6.0]))
    with pytest.raises(ValueError, match="N = 3 sequences"):
        lattice_attention(*x, initial_state=s0, cu_seqlens=torch.tensor([0, 2, 4, 6]))
