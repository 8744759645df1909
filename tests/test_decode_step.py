"""The lean decode path (issues 40 and 73) computes what the checked path computes.

* Each op's unchecked single-token step (``trellis_step``, ``lattice_step``, ``kvm_step``)
  against the op's per-token reference, in float64, from states mid-chunk and at chunk starts,
  rows at mixed phases, odd sizes, over KVM's folds.
* Projections stacked once per ``generate`` call (``projection_stacks``) against the modules
  called one by one: the same logits and tokens for every schedule, stacks made only inside the
  call and rebuilt by the next (a weight changed in between is seen), refused for modules an
  adapter wraps.
* A span's decode plan (``decode_step``: memory blocks by ``run_segment``, the others through
  their modules) against the general forward: the same logits in float64 for every schedule
  and setting, in bfloat16, with a cache that records its calls for rollback (a crop after plan
  steps), hooked blocks and hooked outer modules, and bad inputs left to the general checks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from op_inputs import make_inputs, make_kvm_inputs, make_state
from tiny_models import SCHEDULES, random_tokens, tiny_model

import trellis_lm.compiled_decode as compiled_decode
from trellis_lm import TrellisCache
from trellis_lm.cache_trellis import CACHE_ARG
from trellis_lm.compiled_decode import inference_span
from trellis_lm.decode_step import TokenStep
from trellis_lm.mixers import MemoryMixer
from trellis_lm.mixers.base import ERFC_GELU_MAX, gelu
from trellis_lm.mixers.norms_convs import ScaledRMSNorm, rms_norm
from trellis_lm.projection_stacks import LinearStack, stacked_projections
from trellis_lm.ops import (
    COMPRESS_FNS, LATTICE_VARIANTS, MIX_FNS, WRITE_GRADIENTS, kvm_attention, kvm_step, lattice_attention,
    lattice_step, trellis_attention, trellis_step,
)
from trellis_lm.ops.registry import Backend, BackendRegistry
from trellis_lm.ops.trellis import step as trellis_step_module


def assert_states_equal(got, want):
    for name, tensor in want.tensors().items():
        torch.testing.assert_close(got.tensors()[name], tensor, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("widths", [(5, 7), (6, 6)])
@pytest.mark.parametrize("products", ["broadcast", "matmul"])
@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
@pytest.mark.parametrize("compress_fn", COMPRESS_FNS)
@pytest.mark.parametrize("mix_fn", MIX_FNS)
def test_trellis_step_is_the_op_s_next_token(compress_fn, mix_fn, write_gradient, products, widths, monkeypatch):
    # 4 rows at offsets 0 (a chunk start: the anchors move), 1, C - 1 and 2; H, D, M not powers of
    # two; anchors that differ from the memories (which exact writes do not read). Both forms of
    # the memory products: these small memories take the broadcast one unless it is set to none;
    # with keys and values of one width, broadcast runs both passes as one, and a second step
    # continues the first's memories (halves of one tensor) from k and v that are parts of one.
    if products == "matmul":
        monkeypatch.setattr(trellis_step_module, "BROADCAST_PRODUCTS_MAX", 0)
    (rows, heads, slots, chunk), (dk, dv) = (4, 3, 6, 4), widths
    state = make_state(rows, heads, dk, dv, slots, chunk_size=chunk, seed=2)
    state.offset = torch.tensor([0, 1, chunk - 1, 2])
    settings = dict(chunk_size=chunk, compress_fn=compress_fn, mix_fn=mix_fn, write_gradient=write_gradient)
    for seed in (1, 3):
        inputs = make_inputs(rows, 1, heads, dk, dv, slots, seed=seed)
        if dk == dv and seed == 3:
            q, k, v, *gates = inputs
            inputs = (q, *torch.cat([k, v], dim=2).split(heads, dim=2), *gates)
        want_o, want_state = trellis_attention(*inputs, initial_state=state, output_final_state=True,
                                               backend="reference", **settings)
        o, state = trellis_step(*inputs, state=state, backend="torch", **settings)  # the torch step's forms
        torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
        assert_states_equal(state, want_state)
        halves = state.m_k._base is not None and state.m_k._base is state.m_v._base
        assert halves == (products == "broadcast" and dk == dv)


@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
def test_steps_in_a_row_give_the_reference_s_gradients(write_gradient):
    # Three single-token calls, each continuing the last one's state (after the first, memories that
    # are halves of one tensor), k and v normalised together as a layer does: gradients of every
    # input and of the first state, float64, against the per-token reference's.
    rows, heads, dim, slots, chunk = 2, 3, 6, 5, 4
    state = make_state(rows, heads, dim, dim, slots, chunk_size=chunk, seed=4, requires_grad=True)
    tokens = [make_inputs(rows, 1, heads, dim, dim, slots, seed=seed, requires_grad=True) for seed in (5, 6, 7)]
    leaves = [*state.tensors().values(), *(t for token in tokens for t in token)]
    leaves = [t for t in leaves if t.requires_grad]

    def gradients(backend):
        carried, loss = state, 0.0
        for q, k, v, *gates in tokens:
            k, v = torch.cat([k, v], dim=2).split(heads, dim=2)
            o, carried = trellis_attention(q, k, v, *gates, initial_state=carried, output_final_state=True,
                                           backend=backend, chunk_size=chunk, write_gradient=write_gradient)
            loss = loss + (o * o).sum()
        loss = loss + (carried.m_k ** 3).sum() + carried.m_v.sum()
        # Exact writes read no anchor: theirs have no gradient on either path.
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    for got, want in zip(gradients("torch"), gradients("reference")):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", LATTICE_VARIANTS)
def test_lattice_step_is_the_op_s_next_token(variant):
    rows, heads, slots, dim, chunk = 3, 3, 5, 7, 4
    gen = torch.Generator().manual_seed(0)

    def inputs(length):
        q, k = (F.normalize(torch.randn(rows, length, heads, slots, generator=gen, dtype=torch.float64), dim=-1)
                for _ in range(2))
        v = F.normalize(torch.randn(rows, length, heads, dim, generator=gen, dtype=torch.float64), dim=-1)
        return q, k, v, torch.sigmoid(torch.randn(rows, length, heads, generator=gen, dtype=torch.float64))

    memory = torch.randn(rows, heads, slots, dim, generator=gen, dtype=torch.float64)
    _, state = lattice_attention(*inputs(5), initial_state=memory, chunk_size=chunk, variant=variant,
                                 output_final_state=True)
    for _ in range(chunk + 1):  # every offset, a chunk start among them
        x = inputs(1)
        want_o, want_state = lattice_attention(*x, initial_state=state, chunk_size=chunk, variant=variant,
                                               output_final_state=True, backend="reference")
        o, state = lattice_step(*x, state=state, chunk_size=chunk, variant=variant)
        torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
        assert_states_equal(state, want_state)


@pytest.mark.parametrize("budget", ["fixed", "power_law"])
def test_kvm_step_is_the_op_s_next_token_across_folds(budget):
    heads, dk, dv = 3, 6, 5
    settings = dict(chunk_size=3, window_chunks=2, rope_dims=2, sinks=1, state_size=5, budget=budget)
    (q, k, v, gate), params = make_kvm_inputs(2, 4, heads, dk, dv)
    _, state = kvm_attention(q, k, v, gate, **params, **settings, output_final_state=True)
    for t in range(14):  # several folds, with buffers still growing and then full
        (q, k, v, gate), _ = make_kvm_inputs(2, 1, heads, dk, dv, seed=10 + t)
        want_o, want_state = kvm_attention(q, k, v, gate, **params, **settings, initial_state=state,
                                           output_final_state=True, backend="reference")
        o, state = kvm_step(q, k, v, gate, **params, **settings, state=state)
        torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
        assert_states_equal(state, want_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_rms_norm_is_torch_s_in_at_least_float32(dtype):
    # Every path (decode steps, the general forward, training) computes one RMSNorm: torch's, over
    # float32 for half-precision inputs, to the bit.
    generator = torch.Generator().manual_seed(11)
    for shape in [(1, 193), (3, 1, 5, 7), (2, 64)]:
        x = (torch.randn(shape, generator=generator) * 3).to(dtype)
        weight = torch.randn(shape[-1], generator=generator).to(dtype)
        if dtype == torch.bfloat16:
            want = weight * F.rms_norm(x.float(), shape[-1:], eps=1e-5).to(dtype)
        else:
            want = F.rms_norm(x, shape[-1:], weight, eps=1e-5)
        with torch.no_grad():
            assert torch.equal(rms_norm(x, weight, 1e-5), want)
        assert torch.equal(rms_norm(x.requires_grad_(), weight, 1e-5), want)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-15), (torch.float32, 1e-6)])
def test_a_decode_step_s_norm_and_gelu_are_torch_s_up_to_rounding(dtype, tolerance):
    # The scaled RMSNorm (eagerly; compiled, torch's own) and GELU by erfc (a few elements, no
    # graph; torch's kernel above ERFC_GELU_MAX) against torch's functions, a zero row included.
    generator = torch.Generator().manual_seed(13)
    x = (torch.randn(4, 1, 3, 37, generator=generator) * 3).to(dtype)
    x[2, 0, 1] = 0.0
    weight = torch.randn(37, generator=generator).to(dtype)
    norm = ScaledRMSNorm.of(weight, 1e-5)
    want = F.rms_norm(x, (37,), weight, eps=1e-5)
    torch.testing.assert_close(norm(x), want, rtol=tolerance, atol=tolerance)
    assert torch.equal(torch.compile(norm, backend="aot_eager", fullgraph=True)(x), want)
    g = (torch.randn(1, 192, generator=generator) * 4).to(dtype)
    big = (torch.randn(1, ERFC_GELU_MAX + 1, generator=generator) * 4).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(gelu(g), F.gelu(g), rtol=tolerance, atol=tolerance)
        assert torch.equal(gelu(big), F.gelu(big))  # above the limit: torch's kernel itself


def test_the_single_token_choice_follows_the_registry():
    calls = []
    registry = BackendRegistry("op", Backend("slow", lambda *a: calls.append("slow"), priority=0))
    registry.single_token("auto", torch.device("cpu"), torch.float32)(None)
    registry.register(Backend("fast", lambda *a: calls.append("fast"), priority=1))
    registry.single_token("auto", torch.device("cpu"), torch.float32)(None)
    assert calls == ["slow", "fast"]


def decode_by_hand(model, ids, steps):
    """Greedy tokens and each step's logits by plain forwards (every projection module called),
    never choosing EOS (as generate with ``min_new_tokens=steps``)."""
    scores = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(steps):
            scores.append(out.logits[:, -1])
            token = out.logits[:, -1:].index_fill(-1, torch.tensor([model.config.eos_token_id]), -torch.inf).argmax(-1)
            ids = torch.cat([ids, token], dim=1)
            out = model(token, use_cache=True, **{CACHE_ARG: getattr(out, CACHE_ARG)})
    return ids, scores


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_generate_with_stacked_projections_gives_the_modules_numbers(schedule, monkeypatch):
    model = tiny_model(schedule=schedule, dtype=torch.float64, attention_bias=True)
    ids = random_tokens(2, 7)
    stacked_calls = []
    call = LinearStack.__call__
    monkeypatch.setattr(LinearStack, "__call__", lambda self, x, **kwargs: stacked_calls.append(x.shape) or call(self, x, **kwargs))
    want_ids, want_scores = decode_by_hand(model, ids, 6)
    assert not stacked_calls  # outside a stacking span: the modules, one by one
    with stacked_projections(model):  # generate's span: the same steps through the stacks
        got_ids, got_scores = decode_by_hand(model, ids, 6)
    assert stacked_calls
    assert torch.equal(got_ids, want_ids)
    for got, want in zip(got_scores, want_scores):  # float64 logits
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    stacked_calls.clear()
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert stacked_calls and torch.equal(out, want_ids)
    assert all(m.projection_stack is None for m in model.modules() if hasattr(m, "projection_stack"))


def test_a_weight_changed_between_generate_calls_is_seen():
    model = tiny_model(schedule="hybrid", dtype=torch.float64)
    ids = random_tokens(1, 5)
    model.generate(ids, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(3.0)
            layer.mlp.up_proj.weight.add_(0.5)
    want_ids, _ = decode_by_hand(model, ids, 3)
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert torch.equal(out, want_ids)
    with stacked_projections(model):  # made now, from the changed weights
        assert torch.equal(model.model.layers[0].mlp.projection_stack.weight[48:], model.model.layers[0].mlp.up_proj.weight)


def test_stacks_refuse_modules_an_adapter_wraps_and_nest():
    from peft import LoraConfig, get_peft_model

    model = tiny_model(schedule="hybrid")
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM")).eval()
    with stacked_projections(peft_model):
        layers = model.model.layers
        assert all(layer.self_attn.projection_stack is None for layer in layers)  # q_proj is LoRA's
        assert all(layer.mlp.projection_stack is not None for layer in layers)
        outer = layers[0].mlp.projection_stack
        with stacked_projections(peft_model):
            assert layers[0].mlp.projection_stack is outer
        assert layers[0].mlp.projection_stack is outer
    assert layers[0].mlp.projection_stack is None


def test_the_unchecked_step_runs_only_where_its_contract_holds():
    model = tiny_model()
    mixer = model.model.layers[0].self_attn
    state = mixer.fresh_state(2).map(torch.clone)
    inputs = make_inputs(2, 1, 2, 8, 8, 6, dtype=torch.float32, seed=0)
    assert mixer._decode_step(inputs, state)
    assert not mixer._decode_step(make_inputs(2, 2, 2, 8, 8, 6, dtype=torch.float32, seed=0), state)  # two tokens
    assert not mixer._decode_step(inputs, None)  # no carried state: the op starts one
    assert not mixer._decode_step((inputs[0].bfloat16(), *inputs[1:]), state)  # not in the state's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not mixer._decode_step(inputs, state)


@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
def test_a_models_decode_steps_give_the_checked_ops_logits(write_gradient, monkeypatch):
    """A Trellis model's decode steps through the unchecked step (``step_op``, with the model's
    settings: exact writes by default) against the same steps through the checked op: the same
    logits over more than a chunk of steps (chunks of 4), so a setting the step dropped would show."""
    model = tiny_model(dtype=torch.float64, write_gradient=write_gradient)
    ids = random_tokens(2, 5)
    steps = []
    step_op = type(model.model.layers[0].self_attn).step_op
    monkeypatch.setattr(type(model.model.layers[0].self_attn), "step_op",
                        staticmethod(lambda *args, **kwargs: steps.append(kwargs) or step_op(*args, **kwargs)))
    _, lean = decode_by_hand(model, ids, 9)
    assert len(steps) == 9 * len(model.model.layers)  # every step after the prompt's
    monkeypatch.setattr(MemoryMixer, "_decode_step", lambda self, inputs, state: False)
    steps.clear()
    _, checked = decode_by_hand(model, ids, 9)
    assert not steps
    for got, want in zip(lean, checked):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- the decode plan (issue 73)

# (schedule, settings, the runs of memory blocks, by length, each step takes through run_segment)
PLAN_RUNS = [
    ("trellis", {}, [2]),
    ("trellis", {"write_gradient": "anchored"}, [2]),
    ("trellis", {"compress_fn": "l2norm", "mix_fn": "softmax", "use_forget_gate": False, "conv_size": 0}, [2]),
    ("trellis", {"compress_fn": "identity", "mix_fn": "l2_silu", "conv_size": 2}, [2]),
    ("lattice", {"lattice_variant": "enc"}, [2]),
    # As many slots as head dims: q, k (per head, over the slots) and v share one L2 norm.
    ("lattice", {"head_dim": 7}, [2]),
    # trellis, trellis | attention | lattice; kvm | lattice | attention | trellis (attention, KVM: modules)
    ("hybrid", {"head_dim": 6}, [2, 1]),
    ("kvm-hybrid", {"head_dim": 6}, [1, 1]),
]


@pytest.fixture
def plan_runs(monkeypatch):
    """The length of each run of blocks a decode plan ran by ``run_segment`` (eagerly), in order."""
    runs = []
    real = compiled_decode.run_eagerly
    monkeypatch.setattr(compiled_decode, "run_eagerly",
                        lambda segment, *args: runs.append(len(segment.blocks)) or real(segment, *args))
    return runs


@pytest.mark.parametrize(("schedule", "settings", "runs"), PLAN_RUNS)
def test_plan_steps_give_the_general_paths_logits(schedule, settings, runs, plan_runs):
    # Odd sizes; chunks of 4 and 7 steps after a 5-token prompt, so anchors move mid-decode.
    model = tiny_model(seed=5, dtype=torch.float64, schedule=schedule, num_heads=3, num_slots=7, **settings)
    ids = random_tokens(3, 5, seed=2)
    want_ids, want = decode_by_hand(model, ids, 7)
    assert plan_runs == []  # outside a span: the general forward
    with inference_span(model):
        got_ids, got = decode_by_hand(model, ids, 7)
    assert plan_runs == runs * 7
    assert torch.equal(got_ids, want_ids)
    for step, (mine, theirs) in enumerate(zip(got, want)):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12, msg=f"step {step}")


def test_plan_steps_in_bfloat16_give_the_general_paths_logits(plan_runs):
    # bfloat16 activations, float32 states and op: the casts the general path makes, made alike.
    model = tiny_model(seed=6, dtype=torch.bfloat16, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 6, seed=3)
    want_ids, want = decode_by_hand(model, ids, 5)
    with inference_span(model):
        got_ids, got = decode_by_hand(model, ids, 5)
    assert plan_runs == [2, 1] * 5 and torch.equal(got_ids, want_ids)
    for mine, theirs in zip(got, want):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs)


def steps_then_crop(model, ids, span):
    """Logits of a prompt, three single-token steps, a crop of two tokens and the two again, with
    a cache that records its calls for rollback; and the cache's tensors after."""
    cache, logits = TrellisCache(model.config, rollback_window=4), []
    with torch.no_grad(), span:
        logits.append(model(ids[:, :5], past_key_values=cache).logits)
        for t in (5, 6, 7, 6, 7):
            if t == 6 and cache.get_seq_length() == 8:
                cache.crop(-2)
            logits.append(model(ids[:, t: t + 1], past_key_values=cache).logits)
    return torch.cat(logits, dim=1), [t for layer in cache.layers for t in layer.tensors().values()]


def test_plan_steps_record_for_rollback(plan_runs):
    # A recording cache's plan steps keep each memory mixer's input; a crop replays them by the
    # general path, and the steps after it continue as a straight run would.
    model = tiny_model(seed=2, dtype=torch.float64, schedule="hybrid", head_dim=6)
    ids = random_tokens(1, 8, seed=4)
    want, want_tensors = steps_then_crop(model, ids, contextlib.nullcontext())
    got, got_tensors = steps_then_crop(model, ids, inference_span(model))
    assert plan_runs == [2, 1] * 5
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(got_tensors, want_tensors):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the steps before the crop, and the two after it, as one forward gives them
        straight = model(ids).logits
    torch.testing.assert_close(got[:, :8], straight, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got[:, 8:], straight[:, 6:], rtol=1e-9, atol=1e-9)


def test_hooked_blocks_and_outer_modules_run_through_their_modules(plan_runs):
    model = tiny_model(seed=7, dtype=torch.float64, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 5, seed=5)
    want_ids, want = decode_by_hand(model, ids, 3)
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    with inference_span(model):  # layer 1 (a Trellis block) through its modules, layer 0 and 3 by the plan
        got_ids, _ = decode_by_hand(model, ids, 3)
    handle.remove()
    assert seen == [5, 1, 1, 1] and plan_runs == [1, 1] * 3 and torch.equal(got_ids, want_ids)
    plan_runs.clear()
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: seen.append("head"))
    with inference_span(model):  # a hook outside the blocks: no step is the plan's
        got_ids, got = decode_by_hand(model, ids, 3)
    handle.remove()
    assert seen[4:] == ["head"] * 4 and plan_runs == [] and torch.equal(got_ids, want_ids)
    assert TokenStep.of(model.model.layers[0]) is None  # outside a span: no stacks, no plan steps


def test_the_plan_leaves_bad_inputs_to_the_general_checks():
    model = tiny_model(seed=1, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 5, seed=6)
    cache = TrellisCache(model.config)
    with torch.no_grad(), inference_span(model):
        model(ids, past_key_values=cache)
        with pytest.raises(ValueError, match="attention_mask must be a 2-D padding mask"):
            model(ids[:, :1], attention_mask=torch.ones(2, 5, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match="position_ids must be 2-D"):
            model(ids[:, :1], position_ids=torch.zeros(2, 1, 1, dtype=torch.long), past_key_values=cache)
        with pytest.raises(ValueError, match="the cache holds 2 rows, the input 1"):
            model(ids[:1, :1], past_key_values=cache)
        other = tiny_model(seed=1, schedule="trellis")
        with pytest.raises(ValueError, match="the cache was made for layers"):
            other(ids[:, :1], past_key_values=cache)
        assert cache.get_seq_length() == 5  # nothing taken in
