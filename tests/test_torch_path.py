"""The PyTorch path's fast paths compute the same function as the plain code they replace."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from op_inputs import make_inputs, make_state
from tiny_models import random_tokens, tiny_model
from transformers_names import cache_of
from trellis_lm.mixers.base import FUSE_MIN_TOKENS
from trellis_lm.ops import WRITE_GRADIENTS, trellis_attention
from trellis_lm.ops.trellis.compress_mix import COMPRESS_FNS, MIX_FNS


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_fused_projections_match_the_modules_and_follow_weight_changes(monkeypatch):
    model = tiny_model(dtype=torch.float64)
    ids = random_tokens(2, FUSE_MIN_TOKENS // 2 + 3)  # an odd length, enough tokens to fuse
    mixer = model.model.layers[0].self_attn
    ran = []
    fuse = type(mixer)._fused_projections
    monkeypatch.setattr(type(mixer), "_fused_projections", lambda self, x: ran.append(fuse(self, x)) or ran[-1])
    fused = _logits(model, ids)
    assert ran and all(r is not None for r in ran)  # eval + no_grad: the fused path ran
    with torch.enable_grad():
        plain = model(ids).logits.detach()  # autograd on: the modules themselves
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    # An in-place change of one weight (an optimizer step, load_state_dict) is seen at once.
    with torch.no_grad():
        mixer.g_proj.weight.mul_(1.5)  # (v is L2-normalised: scaling it would change nothing)
    changed = _logits(model, ids)
    with torch.enable_grad():
        plain = model(ids).logits.detach()
    assert not torch.allclose(changed, fused)
    torch.testing.assert_close(changed, plain, rtol=1e-12, atol=1e-12)


def test_wrapped_projection_is_not_fused():
    """An adapter replacing a projection (as PEFT does) must run: the fused path steps aside."""
    model = tiny_model(dtype=torch.float64)
    ids = random_tokens(1, FUSE_MIN_TOKENS + 1)
    mixer = model.model.layers[0].self_attn

    class Scaled(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.out_features = inner.out_features

        def forward(self, x):
            return 2 * self.inner(x)

    before = _logits(model, ids)
    mixer.g_proj = Scaled(mixer.g_proj)
    after = _logits(model, ids)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
def test_chunk_form_at_chunk_size_one_and_odd_group_sizes(monkeypatch, write_gradient):
    """Read-outs batched over groups of chunks: group boundaries anywhere give the same numbers."""
    import trellis_lm.ops.trellis.chunked as chunked

    x = make_inputs(2, 23, 2, 4, 4, 5, seed=1)
    state = make_state(2, 2, 4, 4, 5, chunk_size=3, seed=2)
    kw = dict(initial_state=state, chunk_size=3, write_gradient=write_gradient, output_final_state=True)
    ref, s_ref = trellis_attention(*x, backend="reference", **kw)
    monkeypatch.setattr(chunked, "GROUP_ELEMENTS", 1)  # one chunk per group
    o, s = trellis_attention(*x, backend="torch", **kw)
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-9)
    for name, t in s.tensors().items():
        torch.testing.assert_close(t, s_ref.tensors()[name], rtol=1e-9, atol=1e-9)


def test_short_inputs_run_the_projections_one_by_one(monkeypatch):
    """Below FUSE_MIN_TOKENS (decode steps) the modules run; the numbers are the same either way."""
    model = tiny_model(dtype=torch.float64)
    mixer = model.model.layers[0].self_attn
    ran = []
    fuse = type(mixer)._fused_projections
    monkeypatch.setattr(type(mixer), "_fused_projections", lambda self, x: ran.append(fuse(self, x)) or ran[-1])
    ids = random_tokens(1, FUSE_MIN_TOKENS + 1)
    with torch.no_grad():
        full = model(ids).logits
        ran.clear()
        out = model(ids[:, :FUSE_MIN_TOKENS], use_cache=True)  # fused: exactly FUSE_MIN_TOKENS
        assert all(r is not None for r in ran)
        ran.clear()
        last = model(ids[:, -1:], past_key_values=cache_of(out)).logits
    assert ran and all(r is None for r in ran)
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("write_gradient", WRITE_GRADIENTS)
@pytest.mark.parametrize("cf,mf", list(itertools.product(COMPRESS_FNS, MIX_FNS)))
def test_decode_step_without_autograd_matches_reference(cf, mf, write_gradient):
    """The step as decoding runs it (no autograd: the fused layer-norm VJP), odd sizes, rows at a
    chunk start (anchors replaced) and mid-chunk, without the value checks."""
    x = make_inputs(3, 1, 3, 5, 7, 9, seed=2)
    state = make_state(3, 3, 5, 7, 9, chunk_size=4, seed=3)
    state.offset.copy_(torch.tensor([0, 2, 3]))
    kw = dict(initial_state=state, chunk_size=4, compress_fn=cf, mix_fn=mf, write_gradient=write_gradient,
              output_final_state=True)
    with torch.no_grad():
        o, s = trellis_attention(*x, check_values=False, **kw)
        ref, s_ref = trellis_attention(*x, backend="reference", **kw)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12)
    for name, t in s.tensors().items():
        torch.testing.assert_close(t, s_ref.tensors()[name], rtol=1e-12, atol=1e-12)


def test_check_values_false_skips_only_the_range_checks():
    """``check_values=False`` reads no gate or offset back; shapes are still checked, and the
    default still rejects a bad gate on a single token."""
    q, k, v, alpha, log_beta, gamma = make_inputs(2, 1, 2, 4, 4, 5, seed=0)
    bad_gamma = gamma.clone()
    bad_gamma[1, 0, 0] = -1.0
    with pytest.raises(ValueError, match="gamma must be finite and >= 0"):
        trellis_attention(q, k, v, alpha, log_beta, bad_gamma)
    trellis_attention(q, k, v, alpha, log_beta, bad_gamma, check_values=False)
    with pytest.raises(ValueError, match="log_beta must have shape"):
        trellis_attention(q, k, v, alpha, log_beta[:, :, :1], gamma, check_values=False)


def test_mixer_never_runs_the_op_s_range_checks(monkeypatch):
    # One rule for non-finite values on every path (issue 34, item 13): inside a model NaN
    # propagates to the logits, at prefill, decode and padded steps alike, and generate() stops
    # on it; so no call pays the checks' host syncs (they only ever caught NaN activations).
    import trellis_lm.mixers.trellis as trellis_mixer

    seen = []
    op, step_op = trellis_mixer.TrellisMixer.op, trellis_mixer.TrellisMixer.step_op

    def recording(*args, **kwargs):
        seen.append((args[0].shape[1], kwargs["check_values"]))
        return op(*args, **kwargs)

    def recording_step(*args, **kwargs):  # the unchecked decode step: no checks at all
        seen.append((args[0].shape[1], "step"))
        return step_op(*args, **kwargs)

    monkeypatch.setattr(trellis_mixer.TrellisMixer, "op", staticmethod(recording))
    monkeypatch.setattr(trellis_mixer.TrellisMixer, "step_op", staticmethod(recording_step))
    model = tiny_model()
    ids = random_tokens(2, 6)
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        model(ids[:, 5:], past_key_values=cache_of(out))
        assert set(seen) == {(5, False), (1, "step")}
        seen.clear()
        mask = torch.tensor([[1] * 7, [1] * 6 + [0]])  # the cache has taken in 6 tokens
        model(ids[:, 5:], attention_mask=mask, past_key_values=cache_of(out))
    assert set(seen) == {(1, False)}


def test_cached_conv_tails_do_not_keep_the_prefill_alive():
    """After a prefill the cache holds the last conv inputs, not views of the whole sequence."""
    model = tiny_model()
    with torch.no_grad():
        cache = cache_of(model(random_tokens(1, 40), use_cache=True))
    for name in ("q_tail", "k_tail"):
        tail = getattr(cache.layers[0], name)
        assert tail.untyped_storage().nbytes() <= 2 * tail.numel() * tail.element_size(), name


def _op_calls():
    """One small call of each op on float32 inputs that require grad: ``{name: call}``, each call
    returning the output (T = 11, a chunk size that does not divide it); Trellis with both write
    gradients (exact: the models' default)."""
    from op_inputs import make_kvm_inputs
    from test_lattice_ops import make_inputs as lattice_inputs, mid_chunk_state
    from trellis_lm.ops import kvm_attention, lattice_attention

    f32 = dict(dtype=torch.float32)
    trellis_x = make_inputs(2, 11, 2, 6, 5, 7, requires_grad=True, seed=0, **f32)
    lattice_x = tuple(t.float().detach().requires_grad_() for t in lattice_inputs(2, 11, 2, 6, 5, seed=0))
    lattice_s = mid_chunk_state(2, 2, 6, 5, chunk_size=4, seed=1).map(lambda t: t.float() if t.is_floating_point() else t)
    kvm_x, kvm_p = make_kvm_inputs(1, 11, 2, 8, 8, requires_grad=True, **f32)
    return {
        **{name: (trellis_x, lambda wg=wg: trellis_attention(*trellis_x, chunk_size=4, write_gradient=wg,
                                                              backend="torch")[0])
           for name, wg in (("trellis", "exact"), ("trellis-anchored", "anchored"))},
        "lattice": (lattice_x, lambda: lattice_attention(*lattice_x, initial_state=lattice_s, chunk_size=4,
                                                         backend="torch")[0]),
        "kvm": (kvm_x, lambda: kvm_attention(*kvm_x, **kvm_p, chunk_size=4, window_chunks=1, rope_dims=4,
                                             state_size=4, backend="torch")[0]),
    }


@pytest.mark.parametrize("op", ["trellis", "trellis-anchored", "lattice", "kvm"])
def test_ops_compute_in_float32_inside_a_bf16_autocast_region(op):
    """A bf16 Trainer step runs the model in a CPU autocast region: the ops must still compute
    (and keep their states) in float32, forward and backward, as outside it."""
    inputs, call = _op_calls()[op]

    def run(autocast: bool):
        for t in inputs:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = call()
        out.square().sum().backward()  # outside the region, as torch's autocast recipe has it
        return out.detach(), [t.grad.clone() for t in inputs]

    plain, inside = run(False), run(True)
    assert inside[0].dtype == torch.float32
    torch.testing.assert_close(inside, plain, rtol=0, atol=0)
