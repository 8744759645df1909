"""State passing (issue 35): training rows start from the previous batch's final states."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_models import SCHEDULES, random_tokens, tiny_model
from trainer_helpers import ROWS, sgd_trainer, trained_parameters
from transformers_names import CHECKPOINTING_ARG, cache_of, enable_checkpointing
from trellis_lm import TrellisCache
from trellis_lm.cache_trellis import AttentionLayerCache
from trellis_lm.state_passing import CHECKPOINT_NAME, StatePassing, StatePassingCallback

EXACT = dict(rtol=1e-12, atol=1e-12)


def carried_cache(model, ids: torch.Tensor) -> TrellisCache:
    """What state passing gives the batch after ``ids``: the final states, attention layers
    emptied (they keep their window), no tokens counted."""
    cache = cache_of(model(ids, use_cache=True))
    for layer in cache.layers:
        if isinstance(layer, AttentionLayerCache):
            layer.reset()
    cache.seen_tokens = 0
    return cache


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_row_starts_from_the_previous_batch_s_final_state(schedule):
    model = tiny_model(schedule=schedule, dtype=torch.float64).train()
    first, second, third = random_tokens(3, 7, seed=1), random_tokens(3, 5, seed=2), random_tokens(3, 6, seed=3)
    with StatePassing(probability=1.0).attached(model):
        model(first, labels=first)  # from the learned memories
        passed = model(second, labels=second)
        then = model(third, labels=third)
    model.eval()  # the same function, no hooks: the reference runs explicitly
    after_first = carried_cache(model, first)
    expected = model(second, labels=second, cache=after_first)
    torch.testing.assert_close(passed.logits, expected.logits, **EXACT)
    torch.testing.assert_close(passed.loss, expected.loss, **EXACT)
    after_second = cache_of(expected)
    for layer in after_second.layers:
        if isinstance(layer, AttentionLayerCache):
            layer.reset()
    after_second.seen_tokens = 0
    torch.testing.assert_close(then.logits, model(third, cache=after_second).logits, **EXACT)
    # Without state passing the same batch reads differently: the test can fail.
    assert not torch.allclose(passed.logits, model(second).logits)


def test_fresh_rows_start_from_the_learned_memories_and_extra_rows_too():
    model = tiny_model(schedule="kvm-hybrid", dtype=torch.float64).train()
    first, second = random_tokens(2, 6, seed=1), random_tokens(4, 5, seed=2)
    passing = StatePassing(probability=0.5, seed=0)
    draws = torch.rand(4, generator=torch.Generator().manual_seed(0)) < 0.5
    with passing.attached(model):
        model(first)
        out = model(second).logits
    model.eval()
    carried = model(second[:2], cache=carried_cache(model, first)).logits
    fresh = model(second).logits
    for row in range(4):
        expected = carried[row] if row < 2 and draws[row] else fresh[row]
        torch.testing.assert_close(out[row], expected, **EXACT)
    assert draws[:2].any() and not draws[:2].all()  # (seed chosen so both kinds of row occur)


def test_evaluation_and_an_explicit_cache_are_left_alone():
    model = tiny_model().train()
    ids = random_tokens(2, 6)
    with StatePassing(probability=1.0).attached(model) as passing:
        model(ids)
        held = copy.deepcopy(passing.carried)
        model.eval()
        torch.testing.assert_close(model(ids).logits, tiny_model().eval()(ids).logits)
        model.train()
        cache = TrellisCache(model.config)
        model(ids, cache=cache)  # the caller's cache: neither replaced nor kept
        assert cache.get_seq_length() == 6
        for index, (_, _, state) in held.items():
            torch.testing.assert_close(passing.carried[index][2].m_k, state.m_k, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"probability must be a number in \(0, 1\]"):
        StatePassing(probability=0)


@pytest.mark.parametrize("schedule", ["hybrid", "kvm"])
def test_activation_checkpointing_gives_the_same_gradients(schedule):
    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = tiny_model(schedule=schedule, dtype=torch.float64).train()
        if checkpointing:
            enable_checkpointing(model)
        with StatePassing(probability=1.0).attached(model):
            for seed in (1, 2):
                ids = random_tokens(2, 7, seed=seed)
                model.zero_grad()
                model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=name, **EXACT)


def test_trainer_callback_with_gradient_accumulation_saves_and_resumes(tmp_path):
    def trainer(max_steps: int):
        run = sgd_trainer(str(tmp_path), rows=ROWS * 2, dtype=torch.float64, schedule="kvm-hybrid", max_steps=max_steps,
                          per_device_train_batch_size=2, gradient_accumulation_steps=2, save_strategy="steps",
                          save_steps=2)
        callback = StatePassingCallback(probability=1.0, seed=0)
        run.add_callback(callback)
        return run, callback

    straight, straight_callback = trainer(4)
    expected = trained_parameters(straight)
    saved = tmp_path / "checkpoint-2" / CHECKPOINT_NAME.format(rank=0)
    assert saved.exists()
    # Resumed from step 2: the carried states come back, and the run ends where the straight one did.
    resumed, resumed_callback = trainer(4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), expected[name], msg=name, rtol=1e-10, atol=1e-12)
    # Hooks are gone after training: the model is an ordinary model.
    assert not resumed.model.model._forward_pre_hooks and not resumed.model.model._forward_hooks


def test_a_model_trained_with_state_passing_saves_loads_and_generates(tmp_path):
    run = sgd_trainer(str(tmp_path / "run"), schedule="hybrid", max_steps=2, per_device_train_batch_size=2,
                      **{CHECKPOINTING_ARG: True})
    run.add_callback(StatePassingCallback(probability=0.9))
    run.train()
    run.model.save_pretrained(tmp_path / "saved")
    from trellis_lm import TrellisForCausalLM

    loaded = TrellisForCausalLM.from_pretrained(tmp_path / "saved").eval()
    ids = random_tokens(1, 4)
    assert torch.equal(loaded.generate(ids, max_new_tokens=3, do_sample=False),
                       run.model.eval().generate(ids, max_new_tokens=3, do_sample=False))


def test_the_pretraining_recipe_passes_states_between_padded_rows(tmp_path):
    from trellis_lm.training import PretrainArguments, pretrain
    from test_training import TINY_OVERRIDES, tiny_training_args

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Paragraph {i} says that memory number {i} is fixed." for i in range(40)))
    args = PretrainArguments(data_files=[str(corpus)], vocab_size=300, max_length=12, config_overrides=TINY_OVERRIDES,
                             state_passing=0.9)
    out = tmp_path / "run"
    trainer = pretrain(args, tiny_training_args(out))
    assert trainer.state.global_step == 2
    assert (out / "checkpoint-2" / CHECKPOINT_NAME.format(rank=0)).exists()
    batch = next(iter(trainer.get_train_dataloader()))  # one piece per row, padding labelled -100
    assert batch["input_ids"].shape[0] > 1 and "position_ids" not in batch
    assert bool((batch["labels"][batch["attention_mask"] == 0] == -100).all())
    with pytest.raises(ValueError, match="--state_passing must be a probability"):
        pretrain(PretrainArguments(data_files=[str(corpus)], vocab_size=300, max_length=12,
                                   config_overrides=TINY_OVERRIDES, state_passing=2.0), tiny_training_args(out))


def test_the_callback_can_begin_late_and_refuses_bad_settings(tmp_path):
    seen = []
    run = sgd_trainer(str(tmp_path), schedule="trellis", max_steps=4, per_device_train_batch_size=2)
    callback = StatePassingCallback(probability=1.0, start_fraction=0.5)
    run.add_callback(callback)
    # Steps 0 and 1 start fresh (no hook yet), steps 2 and 3 are passed states.
    run.model.model.register_forward_hook(
        lambda module, args, kwargs, output: seen.append(kwargs.get("cache") is not None), with_kwargs=True)
    run.train()
    assert seen == [False, False, True, True]
    for bad in (dict(probability=0.0), dict(probability=1.5), dict(start_fraction=1.0), dict(start_fraction=-0.1)):
        with pytest.raises(ValueError, match="probability|start_fraction"):
            StatePassingCallback(**bad)
