"""The lean decode path (issue 40) computes what the checked path computes.

* Each op's unchecked single-token step (``trellis_step``, ``lattice_step``, ``kvm_step``)
  against the op's per-token reference, in float64, from states mid-chunk and at chunk starts,
  rows at mixed phases, odd sizes, over KVM's folds.
* Projections stacked once per ``generate`` call (``projection_stacks``) against the modules
  called one by one: the same logits and tokens for every schedule, stacks made only inside the
  call and rebuilt by the next (a weight changed in between is seen), refused for modules an
  adapter wraps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from op_inputs import make_inputs, make_kvm_inputs, make_state
from tiny_models import SCHEDULES, random_tokens, tiny_model

from trellis_lm.cache_trellis import CACHE_ARG
from trellis_lm.mixers import MemoryMixer
from trellis_lm.projection_stacks import LinearStack, stacked_projections
from trellis_lm.ops import (
    COMPRESS_FNS, LATTICE_VARIANTS, MIX_FNS, WRITE_GRADIENTS, kvm_attention, kvm_step, lattice_attention,
    lattice_step, trellis_attention, trellis_step,
)
from trellis_lm.ops.registry import Backend, BackendRegistry


def assert_states_equal(got, want):
    for name, tensor in want.tensors().items():
        torch.testing.assert_close(got.tensors()[name], tensor, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
@pytest.mark.parametrize("compress_fn", COMPRESS_FNS)
@pytest.mark.parametrize("mix_fn", MIX_FNS)
def test_trellis_step_is_the_op_s_next_token(compress_fn, mix_fn, write_gradient):
    # 4 rows at offsets 0 (a chunk start: the anchors move), 1, C - 1 and 2; H, D, M not powers of
    # two; anchors that differ from the memories (which exact writes do not read).
    rows, heads, dk, dv, slots, chunk = 4, 3, 5, 7, 6, 4
    state = make_state(rows, heads, dk, dv, slots, chunk_size=chunk, seed=2)
    state.offset = torch.tensor([0, 1, chunk - 1, 2])
    inputs = make_inputs(rows, 1, heads, dk, dv, slots, seed=1)
    settings = dict(chunk_size=chunk, compress_fn=compress_fn, mix_fn=mix_fn, write_gradient=write_gradient)
    want_o, want_state = trellis_attention(*inputs, initial_state=state, output_final_state=True, backend="reference",
                                           **settings)
    o, final = trellis_step(*inputs, state=state, **settings)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    assert_states_equal(final, want_state)


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
    monkeypatch.setattr(LinearStack, "__call__", lambda self, x: stacked_calls.append(x.shape) or call(self, x))
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
