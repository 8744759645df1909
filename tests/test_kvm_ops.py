"""The KVM op: the chunked backend against the per-token reference of ``kvm.md`` (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from op_inputs import make_kvm_inputs
from trellis_lm.ops import KVMState, kvm_attention

TOL = dict(rtol=1e-9, atol=1e-9)


def run(backend, x, params, **kw):
    return kvm_attention(*x, **params, backend=backend, output_final_state=True, **kw)


def assert_states_close(a: KVMState, b: KVMState, **tol) -> None:
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        assert x.dtype == y.dtype, name
        torch.testing.assert_close(x, y, **(tol or TOL), msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# The reference against the page, on cases small enough to state by hand.


def test_before_the_first_fold_it_is_causal_attention_over_the_window():
    (q, k, v, g), p = make_kvm_inputs(2, 6, 2, 8, 5)
    t_w = p["temperature"][:, 1]
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), (t_w[:, None, None] * k.transpose(1, 2)), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    for backend in ("reference", "torch"):  # W = 6 tokens: nothing leaves the window
        o, state = run(backend, (q, k, v, g), p, chunk_size=3, window_chunks=2, rope_dims=4, state_size=3)
        torch.testing.assert_close(o, expected, **TOL)
        assert state.used.tolist() == [0, 0] and state.covered.tolist() == [0, 0]


def _ln_s(x, p, h):
    return F.layer_norm(x, x.shape[-1:], p["norm_weight"][h], p["norm_bias"][h], eps=1e-5)


def test_two_folds_by_hand():
    """C = 2, one-chunk window, 3 rows, 1 sink: chunk 0 seeds the state ungated; chunk 1
    appends its less familiar token and merges the other into its best non-sink row."""
    C, R = 2, 2
    (q, k, v, g), p = make_kvm_inputs(1, 5, 1, 6, 4, seed=3)
    _, state = run("reference", (q, k, v, g), p, chunk_size=C, window_chunks=1, rope_dims=R, state_size=3, sinks=1)
    kp = _ln_s(torch.cat([torch.zeros(5, R, dtype=k.dtype), k[0, :, 0, R:]], -1), p, 0)  # [T, Dk]
    vv, gg = v[0, :, 0], g[0, :, 0]
    sk, sv, radii = kp[:2].clone(), vv[:2].clone(), vv[:2].norm(dim=-1)
    score = (kp[2:4] @ _ln_s(sk, p, 0).T).amax(-1)
    new, old = (2, 3) if score[0] <= score[1] else (3, 2)
    sk, sv = torch.cat([sk, gg[new] * kp[new][None]]), torch.cat([sv, gg[new] * vv[new][None]])
    radii = torch.cat([radii, (gg[new] * vv[new]).norm()[None]])
    winner = 1 + int((kp[old] @ _ln_s(sk, p, 0)[1:].T).argmax())
    sk[winner] += gg[old] * kp[old]
    sv[winner] += gg[old] * vv[old]
    torch.testing.assert_close(state.keys[0, 0], sk, **TOL)
    torch.testing.assert_close(state.values[0, 0], sv, **TOL)
    torch.testing.assert_close(state.radii[0, 0], radii, **TOL)
    assert state.used.tolist() == [3] and state.covered.tolist() == [4] and state.seen.tolist() == [5]
    torch.testing.assert_close(state.window_k[0, :, 0], k[0, 4], **TOL)


def test_the_last_token_reads_the_state_as_the_page_says():
    (q, k, v, g), p = make_kvm_inputs(1, 11, 2, 6, 4, seed=5)
    o, state = run("reference", (q, k, v, g), p, chunk_size=3, window_chunks=2, rope_dims=2, state_size=4)
    used, n_win = int(state.used), int(state.seen - state.covered)
    t_s, t_w = p["temperature"][:, 0], p["temperature"][:, 1]
    for h in range(2):
        sk, sv, r = state.keys[0, h, :used], state.values[0, h, :used], state.radii[0, h, :used]
        keys = torch.cat([t_s[h] * _ln_s(sk, p, h), t_w[h] * state.window_k[0, h, :n_win]])
        values = torch.cat([r[:, None] * sv / sv.norm(dim=-1, keepdim=True), state.window_v[0, h, :n_win]])
        y = torch.softmax(keys @ q[0, -1, h] / math.sqrt(6), -1) @ values
        torch.testing.assert_close(o[0, -1, h], y, **TOL)


# ---------------------------------------------------------------------------------------------
# The chunked backend == the reference.

CONFIGS = [  # B, T, H, Dk, Dv, C, window_chunks, state_size, sinks, rope_dims
    (2, 29, 2, 8, 5, 3, 2, 3, 1, 4),  # state at the chunk size, many folds
    (2, 31, 2, 6, 4, 4, 1, 9, 0, 2),  # state grows by short appends
    (1, 40, 1, 8, 6, 5, 3, 12, 1, 6),  # state of more than two chunks
    (1, 45, 2, 4, 3, 8, 1, 8, 1, 0),  # no RoPE channels
    (3, 1, 2, 6, 4, 3, 2, 3, 1, 4),  # a single token
    (2, 7, 2, 6, 4, 3, 2, 5, 2, 2),  # T not a multiple of C, one fold
]


@pytest.mark.parametrize("B,T,H,Dk,Dv,C,blocks,S,sinks,R", CONFIGS)
def test_torch_matches_reference(B, T, H, Dk, Dv, C, blocks, S, sinks, R):
    x, p = make_kvm_inputs(B, T, H, Dk, Dv, seed=T)
    kw = dict(chunk_size=C, window_chunks=blocks, state_size=S, sinks=sinks, rope_dims=R)
    o_ref, s_ref = run("reference", x, p, **kw)
    o, s = run("torch", x, p, **kw)
    assert o_ref.abs().max() > 0.1
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)
    if T > blocks * C:  # the state is in use
        assert int(s_ref.used.min()) >= C


@pytest.mark.parametrize("budget,extra", [
    ("power_law", dict(budget_scale=1.5, budget_exponent=0.5, budget_min=3, budget_round=2)),
    ("saturation", dict(budget_saturation=12.0, budget_min=2)),
])
def test_growable_budgets_match_reference(budget, extra):
    x, p = make_kvm_inputs(2, 60, 2, 6, 4, seed=1)
    kw = dict(chunk_size=3, window_chunks=2, state_size=14, sinks=1, rope_dims=2, budget=budget, **extra)
    o_ref, s_ref = run("reference", x, p, **kw)
    o, s = run("torch", x, p, **kw)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)
    _, s_fixed = run("reference", x, p, **{**kw, "budget": "fixed", "state_size": 3})
    assert 3 < int(s_ref.used[0]) < 14 and int(s_fixed.used[0]) == 3
    o_pieces, s_pieces = _run_pieces("torch", x, p, [0, 1, 8, 19, 20, 31, 47, 60], **kw)
    torch.testing.assert_close(o_pieces, o_ref, **TOL)
    assert_states_close(s_pieces, s_ref)


# ---------------------------------------------------------------------------------------------
# Resume, varlen.

RESUME_KW = dict(chunk_size=3, window_chunks=2, state_size=4, sinks=1, rope_dims=2)


def _pieces(x, bounds):
    return [tuple(t[:, a:b] for t in x) for a, b in zip(bounds[:-1], bounds[1:])]


def _run_pieces(backend, x, p, bounds, **kw):
    state, outs = None, []
    for piece in _pieces(x, bounds):
        o, state = run(backend, piece, p, initial_state=state, **kw)
        outs.append(o)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_resume_at_every_split(backend):
    T = 20 if backend == "torch" else 14
    x, p = make_kvm_inputs(2, T, 2, 6, 4, seed=7)
    o_full, s_full = run(backend, x, p, **RESUME_KW)
    for a in range(1, T):
        o, s = _run_pieces(backend, x, p, [0, a, T], **RESUME_KW)
        torch.testing.assert_close(o, o_full, **TOL)
        assert_states_close(s, s_full)
    # The carried state matters: the second piece alone gives other outputs.
    o_alone, _ = run(backend, tuple(t[:, 9:] for t in x), p, **RESUME_KW)
    assert (o_alone - o_full[:, 9:]).abs().max() > 1e-2


@pytest.mark.parametrize("bounds", [
    list(range(0, 24)),  # one token at a time
    [0, 2, 4, 5, 9, 10, 17, 23],  # mid-chunk continuations of several tokens
])
def test_resume_in_pieces(bounds):
    x, p = make_kvm_inputs(2, 23, 2, 6, 4, seed=8)
    o_ref, s_ref = run("reference", x, p, **RESUME_KW)
    o, s = _run_pieces("torch", x, p, bounds, **RESUME_KW)
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(s, s_ref)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_varlen_equals_each_sequence_alone(backend):
    lengths, prefix = [5, 0, 13, 1, 9], [2, 7, 0, 10, 4]  # each resumes from its own prefix
    x, p = make_kvm_inputs(1, sum(lengths) + sum(prefix), 2, 6, 4, seed=9)
    starts, expected, states, packed = 0, [], [], []
    for n, (L, P) in enumerate(zip(lengths, prefix)):
        seq = tuple(t[:, starts : starts + P + L] for t in x)
        starts += P + L
        state = run("torch", tuple(t[:, :P] for t in seq), p, **RESUME_KW)[1] if P else None
        state = state or KVMState.empty(1, 2, 4, 6, 6, 4, dtype=torch.float64)
        states.append(state)
        tail = tuple(t[:, P:] for t in seq)
        packed.append(tail)
        expected.append(run(backend, tail, p, initial_state=state, **RESUME_KW) if L else (tail[2], state))
    x_packed = tuple(torch.cat([piece[i] for piece in packed], dim=1) for i in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    o, s = run(backend, x_packed, p, initial_state=KVMState.cat(states), cu_seqlens=cu, **RESUME_KW)
    torch.testing.assert_close(o, torch.cat([e[0] for e in expected], dim=1), **TOL)
    assert_states_close(s, KVMState.cat([e[1] for e in expected]))


# ---------------------------------------------------------------------------------------------
# Gradients, state size, dtypes.


@pytest.mark.parametrize("sinks,S", [(1, 3), (0, 5)])
def test_gradients_match_reference(sinks, S):
    x, p = make_kvm_inputs(2, 17, 2, 6, 4, seed=11, requires_grad=True)
    kw = dict(chunk_size=3, window_chunks=1, state_size=S, sinks=sinks, rope_dims=2)
    leaves = list(x) + list(p.values())
    grads = {}
    for backend in ("reference", "torch"):
        o, s = run(backend, x, p, **kw)
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        loss = (o * w).sum() + s.keys.pow(2).sum() * 0.1 + (s.values * s.radii[..., None]).sum() * 0.1
        grads[backend] = torch.autograd.grad(loss, leaves)
    names = ["q", "k", "v", "gate", *p]
    for name, a, b in zip(names, grads["torch"], grads["reference"]):
        assert b.abs().max() > 1e-3, name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def test_gradients_match_reference_with_rows_at_mixed_phases():
    """Rows resume at different points, so they fold at different chunks of one call: the
    chunk form then updates only the folding rows (the path a batch at one phase skips)."""
    x, p = make_kvm_inputs(3, 11, 2, 6, 4, seed=12, requires_grad=True)
    prefixes = make_kvm_inputs(1, 9, 2, 6, 4, seed=13)[0]
    states = [run("torch", tuple(t[:, :n] for t in prefixes), p, **RESUME_KW)[1] for n in (1, 5, 8)]
    state = KVMState.cat([s.map(lambda t: t.detach()) for s in states])
    leaves = list(x) + list(p.values())
    grads, outs = {}, {}
    for backend in ("reference", "torch"):
        o, s = run(backend, x, p, initial_state=state, **RESUME_KW)
        outs[backend] = (o, s)
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        loss = (o * w).sum() + s.keys.pow(2).sum() * 0.1 + (s.values * s.radii[..., None]).sum() * 0.1
        grads[backend] = torch.autograd.grad(loss, leaves)
    torch.testing.assert_close(outs["torch"][0], outs["reference"][0], **TOL)
    assert_states_close(outs["torch"][1], outs["reference"][1])
    for name, a, b in zip(["q", "k", "v", "gate", *p], grads["torch"], grads["reference"]):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")


def _numel(state: KVMState) -> int:
    return sum(t.numel() for t in state.tensors().values())


def test_fixed_state_is_bounded():
    kw = dict(chunk_size=128, window_chunks=2, state_size=128, sinks=1, rope_dims=2)
    x, p = make_kvm_inputs(1, 100_000, 1, 4, 4, dtype=torch.float32, seed=0)
    _, small = run("torch", tuple(t[:, : 2 * 128 + 1] for t in x), p, **kw)
    _, large = run("torch", x, p, **kw)
    assert _numel(small) == _numel(large)
    assert [t.shape for t in small.tensors().values()] == [t.shape for t in large.tensors().values()]
    assert int(large.seen) == 100_000 and int(large.used) == 128 and int(large.covered) == 100_000 // 128 * 128 - 128
    assert large.keys.dtype == torch.float32 and bool(torch.isfinite(large.keys).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_keep_float32_state(dtype):
    x, p = make_kvm_inputs(1, 20, 2, 6, 4, seed=2)
    o64, s64 = run("torch", x, p, **RESUME_KW)
    o, s = run("torch", tuple(t.to(dtype) for t in x), p, **RESUME_KW)
    assert o.dtype == dtype and s.keys.dtype == torch.float32 and s.used.dtype == torch.long
    assert (o.double() - o64).abs().max() < {torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.


def _call(**changes):
    (q, k, v, g), p = make_kvm_inputs(2, 5, 2, 6, 4)
    args = dict(q=q, k=k, v=v, gate=g, **p)
    kw = dict(chunk_size=2, window_chunks=1, rope_dims=2, sinks=1, state_size=2)
    for key, value in changes.items():
        if key == "initial_state" and callable(value):
            value = value()  # built when the test runs, not when pytest collects it
        (args if key in args else kw)[key] = value(args) if callable(value) and key in args else value
    return kvm_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("gate"), **args, **kw)


WINDOW = ("window_k", "window_v", "window_g")


def _state(**changes):
    return lambda: _made_state(**changes)


def _made_state(**changes):
    _, state = run("torch", *make_kvm_inputs(2, 3, 2, 6, 4), chunk_size=2, window_chunks=1, rope_dims=2, state_size=2)
    return KVMState(**{**state.tensors(), **{k: v(state) for k, v in changes.items()}})


@pytest.mark.parametrize("changes,match", [
    (dict(q=lambda a: a["q"][0]), "q must be a 4-D"),
    (dict(k=lambda a: a["k"][:, :4]), "k must have shape"),
    (dict(v=lambda a: a["v"][:, :, :1]), "v must have shape"),
    (dict(gate=lambda a: a["gate"][..., None]), "gate must have shape"),
    (dict(norm_weight=lambda a: a["norm_weight"][:1]), "norm_weight must have shape"),
    (dict(norm_bias=lambda a: a["norm_bias"][:, :3]), "norm_bias must have shape"),
    (dict(temperature=lambda a: a["temperature"][:, :1]), "temperature must have shape"),
    (dict(gate=lambda a: a["gate"].long()), "gate must be a floating-point"),
    (dict(chunk_size=0), "chunk_size must be an integer >= 1"),
    (dict(window_chunks=0), "window_chunks must be an integer >= 1"),
    (dict(rope_dims=7), "rope_dims must be an integer in"),
    (dict(sinks=2), "sinks must be an integer in"),
    (dict(sinks=-1), "sinks must be an integer in"),
    (dict(state_size=1), "state_size must be an integer >= 2"),
    (dict(budget="sqrt"), "budget must be one of"),
    (dict(budget_exponent=0.0), "budget_exponent must be"),
    (dict(budget_round=0), "budget_round must be"),
    (dict(backend="triton"), "backend must be"),
    (dict(cu_seqlens=torch.tensor([0, 5])), "cu_seqlens needs a batch of 1"),
    (dict(initial_state=(torch.zeros(2, 2, 2, 6),)), "initial_state must be None or a KVMState"),
    (dict(initial_state=_state(keys=lambda s: s.keys[..., :5])), "initial_state.keys must have shape"),
    (dict(initial_state=_state(radii=lambda s: s.radii[:, :, :1])), "initial_state.radii must have shape"),
    (dict(initial_state=_state(keys=lambda s: s.keys[:, :, :1], values=lambda s: s.values[:, :, :1],
                               radii=lambda s: s.radii[:, :, :1])), r"initial_state.used must .* \(R = 1"),
    (dict(initial_state=_state(**{name: (lambda s, n=name: getattr(s, n)[:, :, :0]) for name in WINDOW})),
     "initial_state.window_k must hold the window's seen - covered tokens"),
    (dict(chunk_size=1, sinks=0, initial_state=_state()), r"initial_state.window_k must have shape .* W' <= "),
    (dict(initial_state=_state(window_g=lambda s: s.window_g[:1])), "initial_state.window_g must have shape"),
    (dict(initial_state=_state(seen=lambda s: s.seen.double())), "initial_state.seen must hold integers"),
    (dict(initial_state=_state(covered=lambda s: s.covered + 2)), "initial_state.seen and initial_state.covered"),
    (dict(initial_state=_state(used=lambda s: s.used + 1)), "initial_state.used must"),
    (dict(window_chunks=2, initial_state=_state()), "initial_state.seen and initial_state.covered disagree"),
])
def test_bad_input_raises_a_clear_error(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(**changes)


def _one(t, value):
    """``t`` with one element set to ``value``."""
    t = t.clone()
    t.view(-1)[t.numel() // 2] = value
    return t


@pytest.mark.parametrize("value", [-1e-30, -0.5, float("nan"), float("inf")])
def test_gate_out_of_range_raises(value):
    """The page's merge gate is > 0; NaN or inf would spread through the state. 0, the underflow
    of a very negative logit, is allowed: it only leaves a row empty."""
    with pytest.raises(ValueError, match=r"gate must be finite and >= 0, got values in"):
        _call(gate=lambda a: _one(a["gate"], value))
    _call(gate=lambda a: _one(a["gate"], 0.0))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_temperature_raises(value):
    with pytest.raises(ValueError, match=r"temperature must be finite, got values in"):
        _call(temperature=lambda a: _one(a["temperature"], value))
    _call(temperature=lambda a: -a["temperature"])  # the page sets no sign: learned from 1


def test_odd_rope_dims_raises():
    with pytest.raises(ValueError, match=r"rope_dims must be even \(RoPE turns channel pairs"):
        _call(rope_dims=3)


def test_rope_dims_equal_to_dk_raises_and_says_why():
    with pytest.raises(ValueError, match=r"rope_dims must be less than Dk = 6: .*every state key is the same vector "
                                         r"and nothing can be found by content; got 6"):
        _call(rope_dims=6)


@pytest.mark.parametrize("budget", ["power_law", "saturation"])
def test_budget_min_above_state_size_raises_for_growable_budgets(budget):
    with pytest.raises(ValueError, match=r"budget_min must be an integer in \[0, 2\] \(at most state_size"):
        _call(budget=budget, budget_min=3)
    _call(budget=budget, budget_min=2)
    _call(budget="fixed", budget_min=3)  # the fixed budget has no floor: any budget_min goes with it
    _call(budget=budget)  # the default floor is one chunk, never above state_size (>= chunk_size)


def test_check_values_false_skips_only_the_value_checks(monkeypatch):
    """``check_values=False`` (decode steps) reads no gate, temperature or counter back; shapes
    are still checked, and the default rejects a bad gate on a single token too."""
    from trellis_lm.ops.kvm import dispatch

    one_token = dict(q=lambda a: a["q"][:, :1], k=lambda a: a["k"][:, :1], v=lambda a: a["v"][:, :1],
                     gate=lambda a: _one(a["gate"][:, :1], float("nan")))
    with pytest.raises(ValueError, match="gate must be finite and >= 0"):
        _call(**one_token, initial_state=_state())
    with pytest.raises(ValueError, match="gate must have shape"):
        _call(gate=lambda a: a["gate"][..., :1], check_values=False)

    def no_read(*args):
        raise AssertionError("values read back")

    state = _made_state()
    monkeypatch.setattr(dispatch, "expect_in_range_and_read", no_read)
    o, _ = _call(**one_token, initial_state=state, temperature=lambda a: _one(a["temperature"], float("inf")),
                 check_values=False)
    assert o.shape == (2, 1, 2, 4)


# ---------------------------------------------------------------------------------------------
# Work and memory follow the tokens present, not the sizes asked for.

HUGE = 10**9


def _rooms(state: KVMState) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state.tensors().items()}


@pytest.mark.parametrize("huge,small", [
    # Nothing folds: one chunk as wide as the tokens, no state rows.
    (dict(chunk_size=HUGE, state_size=HUGE), dict(chunk_size=40, state_size=40)),
    (dict(chunk_size=3, window_chunks=HUGE), dict(chunk_size=3, window_chunks=14)),
    # Folds from the 7th token on, every chunk appended: rows only for the tokens folded.
    (dict(chunk_size=3, window_chunks=2, state_size=HUGE), dict(chunk_size=3, window_chunks=2, state_size=40)),
])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_memory_follows_the_tokens_not_the_sizes_asked_for(huge, small, backend):
    """A 40-token call at C, B or S = 10**9 is the call at sizes that just hold it (the
    preallocated state would need hundreds of GB), in one piece, resumed, and decoded."""
    x, p = make_kvm_inputs(2, 40, 2, 6, 4, seed=4)
    kw = dict(sinks=1, rope_dims=2)
    o, s = run(backend, x, p, **huge, **kw)
    o_small, s_small = run(backend, x, p, **small, **kw)
    torch.testing.assert_close(o, o_small, **TOL)
    assert_states_close(s, s_small)
    assert s.keys.shape[2] <= int(s.covered.max()) and s.window_k.shape[2] <= 40
    o_resumed, s_resumed = _run_pieces(backend, x, p, [0, 17, 38, 39, 40], **huge, **kw)
    torch.testing.assert_close(o_resumed, o_small, **TOL)
    assert_states_close(s_resumed, s_small)
    assert _rooms(s_resumed) == _rooms(s)


# ---------------------------------------------------------------------------------------------
# Decoding: the single-token step (step.py) == the reference, token by token.

DECODE_CONFIGS = [  # Dk, C, window_chunks, state_size, sinks, rope_dims, budget options
    (8, 3, 2, 3, 1, 4, {}),  # state at the chunk size
    (6, 4, 1, 9, 0, 2, {}),  # state above it, grown by short appends; no sinks
    (8, 5, 3, 12, 1, 6, {}),  # a three-chunk window
    (4, 8, 1, 8, 1, 0, {}),  # no RoPE channels, the largest chunk
    (6, 3, 1, 5, 0, 2, {}),
    (6, 3, 2, 14, 1, 2, dict(budget="power_law", budget_scale=1.5, budget_exponent=0.5, budget_min=3, budget_round=2)),
    (6, 4, 1, 16, 0, 4, dict(budget="saturation", budget_saturation=12.0, budget_min=2)),
]


def _prefill_rows(x, p, prefixes, **kw):
    """Each row's first ``prefixes[n]`` tokens run alone (chunked), states joined by ``cat``."""
    heads, dk, dv = x[0].shape[2], x[0].shape[3], x[2].shape[3]
    states = []
    for n, P in enumerate(prefixes):
        if P:
            states.append(run("torch", tuple(t[n : n + 1, :P] for t in x), p, **kw)[1])
        else:
            states.append(KVMState.empty(
                1, heads, kw["state_size"], kw["chunk_size"] * kw["window_chunks"], dk, dv, dtype=x[0].dtype,
            ))
    return KVMState.cat(states)


def _decode(x, p, prefixes, steps, state, **kw):
    """``steps`` one-token calls; row n's i-th token is ``x[n, prefixes[n] + i]``."""
    outs = []
    for i in range(steps):
        token = tuple(torch.stack([t[n, P + i] for n, P in enumerate(prefixes)])[:, None] for t in x)
        o, state = run("auto", token, p, initial_state=state, **kw)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def _reference_rows(x, p, prefixes, steps, **kw):
    """The reference on each row's whole prefix + decoded tokens: the decoded outputs, the state."""
    outs, states = [], []
    for n, P in enumerate(prefixes):
        o, s = run("reference", tuple(t[n : n + 1, : P + steps] for t in x), p, **kw)
        outs.append(o[:, P:])
        states.append(s)
    return torch.cat(outs), KVMState.cat(states)


@pytest.mark.parametrize("Dk,C,blocks,S,sinks,R,extra", DECODE_CONFIGS)
def test_decode_steps_match_reference_at_mixed_phases(Dk, C, blocks, S, sinks, R, extra):
    W = blocks * C
    # Fresh; mid first chunk; a full window (the first step folds); mid-chunk after folds;
    # later, at another phase: every row folds on its own steps.
    prefixes = [0, C // 2 + 1, W, W + 2 * C + 1, 2 * W + 3 * C + 2]
    steps = W + 2 * C + 1  # at least three folds in every row
    x, p = make_kvm_inputs(len(prefixes), max(prefixes) + steps, 2, Dk, 4, seed=C * 10 + S)
    kw = dict(chunk_size=C, window_chunks=blocks, state_size=S, sinks=sinks, rope_dims=R, **extra)
    state = _prefill_rows(x, p, prefixes, **kw)
    assert len(set(zip(state.seen.tolist(), state.covered.tolist(), state.used.tolist()))) == len(prefixes)
    o, final = _decode(x, p, prefixes, steps, state, **kw)
    o_ref, s_ref = _reference_rows(x, p, prefixes, steps, **kw)
    assert o_ref.abs().max() > 0.1
    torch.testing.assert_close(o, o_ref, **TOL)
    assert_states_close(final, s_ref)
    assert (final.covered - state.covered).min() >= 3 * C  # the steps folded
    if extra:  # the growable budget grew during decoding
        assert bool((final.used > state.used).any()) and int(final.used.max()) < S


def test_decode_step_is_one_row_of_a_batch():
    """A row's steps do not depend on the other rows of the batch (folding or not)."""
    kw = dict(chunk_size=3, window_chunks=2, state_size=4, sinks=1, rope_dims=2)
    prefixes, steps = [6, 7, 0], 8
    x, p = make_kvm_inputs(3, 20, 2, 6, 4, seed=21)
    state = _prefill_rows(x, p, prefixes, **kw)
    o, final = _decode(x, p, prefixes, steps, state, **kw)
    for n in range(3):
        o_n, final_n = _decode(
            tuple(t[n : n + 1] for t in x), p, prefixes[n : n + 1], steps, state.map(lambda t: t[n : n + 1]), **kw
        )
        torch.testing.assert_close(o[n : n + 1], o_n, **TOL)
        assert_states_close(final.map(lambda t: t[n : n + 1]), final_n)


def test_decode_in_float32_keeps_float32_state():
    """The step's rearranged LN_s (centred keys, affine on the query) stays accurate in float32."""
    kw = dict(chunk_size=3, window_chunks=2, state_size=5, sinks=1, rope_dims=2)
    prefixes, steps = [4, 9], 10
    x, p = make_kvm_inputs(2, 20, 2, 6, 4, seed=17)
    o64, _ = _decode(x, p, prefixes, steps, _prefill_rows(x, p, prefixes, **kw), **kw)
    x32, p32 = tuple(t.float() for t in x), {name: t.float() for name, t in p.items()}
    o32, s32 = _decode(x32, p32, prefixes, steps, _prefill_rows(x32, p32, prefixes, **kw), **kw)
    assert o32.dtype == torch.float32 and s32.keys.dtype == torch.float32 and s32.used.dtype == torch.long
    assert (o32.double() - o64).abs().max() < 1e-5


def test_auto_and_torch_pick_the_step_for_one_token():
    import dataclasses

    from trellis_lm.ops.kvm import dispatch, step

    calls = []
    original = dispatch.BACKENDS.unregister("torch")
    dispatch.BACKENDS.register(dataclasses.replace(original, step=lambda *a: calls.append(1) or step.step_forward(*a)))
    try:
        kw = dict(chunk_size=3, window_chunks=2, state_size=4, sinks=1, rope_dims=2)
        x, p = make_kvm_inputs(2, 2, 2, 6, 4)
        for backend in ("auto", "torch"):
            run(backend, tuple(t[:, :1] for t in x), p, **kw)
        assert len(calls) == 2
        run("auto", x, p, **kw)  # two tokens: chunked
        run("reference", tuple(t[:, :1] for t in x), p, **kw)  # asked for by name
        x1, p1 = make_kvm_inputs(1, 2, 2, 6, 4)
        run("auto", x1, p1, cu_seqlens=torch.tensor([0, 1, 2]), **kw)  # packed: chunked
        assert len(calls) == 2
    finally:
        dispatch.BACKENDS.unregister("torch")
        dispatch.BACKENDS.register(original)


def test_decode_gradients_match_reference():
    """The step is differentiable like the reference: gradients of outputs and final state
    through decoded tokens, folds included, and through the prefilled state."""
    kw = dict(chunk_size=3, window_chunks=1, state_size=5, sinks=1, rope_dims=2)
    prefix, steps = 4, 8  # folds at positions 6, 9, 12 during decoding
    x, p = make_kvm_inputs(2, prefix + steps, 2, 6, 4, seed=13, requires_grad=True)
    leaves = list(x) + list(p.values())

    def loss(o, s):
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)
        return (o * w).sum() + s.keys.pow(2).sum() * 0.1 + (s.values * s.radii[..., None]).sum() * 0.1

    _, state = run("torch", tuple(t[:, :prefix] for t in x), p, **kw)
    o, final = _decode(x, p, [prefix, prefix], steps, state, **kw)
    grads = torch.autograd.grad(loss(o, final), leaves)
    o_ref, s_ref = run("reference", x, p, **kw)
    grads_ref = torch.autograd.grad(loss(o_ref[:, prefix:], s_ref), leaves)
    for name, a, b in zip(["q", "k", "v", "gate", *p], grads, grads_ref):
        assert b.abs().max() > 1e-3, name
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")
