"""State passing (issue 35): training rows start from the previous batch's final states."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tiny_models import SCHEDULES, random_tokens, tiny_model
from trainer_helpers import ROWS, sgd_trainer, trained_parameters
from transformers_names import CHECKPOINTING_ARG, cache_of, enable_checkpointing
from trellis_lm import TrellisCache
from trellis_lm.cache_entries import AttentionLayerCache
from trellis_lm.cache_trellis import CACHE_ARG
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


def test_a_decayed_state_starts_between_the_carried_memories_and_the_learned_ones():
    model = tiny_model(dtype=torch.float64).train()
    first, second = random_tokens(2, 7, seed=1), random_tokens(2, 5, seed=2)
    with StatePassing(probability=1.0, decay=0.3).attached(model):
        model(first)
        passed = model(second, labels=second)
    passed.loss.backward()
    model.eval()
    expected = carried_cache(model, first)
    for layer, block in zip(expected.layers, model.model.layers):
        mk0, mv0 = block.self_attn.mk0, block.self_attn.mv0
        state = layer.state
        # The memories and anchors moved 70% of the way back to the learned ones; the tails kept.
        blended = {name: (start + 0.3 * (getattr(state, name) - start)).detach()
                   for name, start in (("m_k", mk0), ("anchor_k", mk0), ("m_v", mv0), ("anchor_v", mv0))}
        layer.hold(layer.entry._replace(state=type(state)(**blended, offset=state.offset)))
    torch.testing.assert_close(passed.logits, model(second, cache=expected).logits, **EXACT)
    assert not torch.allclose(passed.logits, model(second, cache=carried_cache(model, first)).logits)
    # The blend keeps a graph to the learned memories (a carried state as it is has none).
    assert all(block.self_attn.mk0.grad.abs().sum() > 0 for block in model.model.layers)


def test_a_decay_is_refused_where_it_has_no_meaning():
    for bad in (1.0, -0.1, True, "0.5"):
        with pytest.raises(ValueError, match=r"decay must be None or a number in \[0, 1\)"):
            StatePassing(decay=bad)
    model = tiny_model(schedule="hybrid").train()
    ids = random_tokens(2, 6)
    with StatePassing(probability=1.0, decay=0.5).attached(model):
        model(ids)
        with pytest.raises(ValueError, match="decay blends Trellis memories only; layer 3 is a lattice layer"):
            model(ids)


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


# ----------------------------------------------------------------------------- issue 50


def test_a_run_resumed_from_a_moved_or_renamed_checkpoint_continues_its_states(tmp_path):
    # The states are read from the checkpoint actually resumed, wherever it is and whatever its
    # name; one without them resumes with a warning naming it.
    def trainer(output_dir, max_steps: int = 4):
        run = sgd_trainer(str(output_dir), rows=ROWS * 2, dtype=torch.float64, schedule="kvm-hybrid",
                          max_steps=max_steps, per_device_train_batch_size=2, save_strategy="steps", save_steps=2)
        run.add_callback(StatePassingCallback(probability=1.0, seed=0))
        return run

    expected = trained_parameters(trainer(tmp_path / "straight"))
    moved = tmp_path / "elsewhere" / "my-step-2"
    moved.parent.mkdir()
    (tmp_path / "straight" / "checkpoint-2").rename(moved)
    resumed = trainer(tmp_path / "resumed")  # its own output folder holds no checkpoint-2
    resumed.train(resume_from_checkpoint=str(moved))
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter.detach(), expected[name], msg=name, rtol=1e-10, atol=1e-12)
    # The resumed run does not read the output folder's own checkpoint-2 (of another run) either.
    (moved / CHECKPOINT_NAME.format(rank=0)).unlink()
    with pytest.warns(RuntimeWarning, match=rf"resuming from {moved}, which holds no state_passing-rank0.safetensors"):
        trainer(tmp_path / "resumed").train(resume_from_checkpoint=str(moved))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_training_call_that_raises_leaves_the_carried_states_as_they_were(schedule):
    model = tiny_model(schedule=schedule, dtype=torch.float64).train()
    first, second, third = random_tokens(2, 7, seed=1), random_tokens(2, 5, seed=2), random_tokens(2, 6, seed=3)
    with StatePassing(probability=1.0).attached(model) as passing:
        model(first, labels=first)
        held = copy.deepcopy(passing.carried)
        with pytest.raises(Exception):  # the loss fails after the model body kept the batch's final states
            model(second, labels=second[:, :3])
        assert passing.carried.keys() == held.keys()
        for index, (q_tail, k_tail, state) in held.items():
            for name, tensor in state.tensors().items():
                torch.testing.assert_close(passing.carried[index][2].tensors()[name], tensor, rtol=0, atol=0)
        passed = model(third).logits
    model.eval()
    torch.testing.assert_close(passed, model(third, cache=carried_cache(model, first)).logits, **EXACT)


def saved_states(tmp_path, schedule: str = "trellis", **overrides):
    model = tiny_model(schedule=schedule, **overrides).train()
    passing = StatePassing(probability=1.0)
    with passing.attached(model):
        model(random_tokens(2, 6))
    path = tmp_path / "states.safetensors"
    passing.save(path)
    return model, path


@pytest.mark.parametrize(
    "other, match",
    [(dict(chunk_size=3), r"carried by a model with chunk_size=4, this model has chunk_size=3"),
     (dict(schedule="lattice"), r"carried by a model with mixer_types=\['trellis', 'trellis'\]"),
     (dict(num_slots=5), r"num_slots=6, this model has num_slots=5")],
)
def test_a_state_file_loads_only_into_a_model_with_the_same_layers(tmp_path, other, match):
    _, path = saved_states(tmp_path)
    passing = StatePassing()
    with pytest.raises(ValueError, match=match):
        passing.load(path, tiny_model(**other))
    assert passing.carried == {}


def test_a_state_file_that_is_not_what_save_wrote_is_refused_by_name(tmp_path):
    model, path = saved_states(tmp_path)
    passing = StatePassing()
    passing.load(path, model)  # the good file
    assert sorted(passing.carried) == [0, 1]

    def rewritten(change_tensors=None, change_metadata=None):
        with safe_open(str(path), framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        change_tensors and change_tensors(tensors)
        change_metadata and change_metadata(metadata)
        bad = tmp_path / "bad.safetensors"
        save_file(tensors, str(bad), metadata=metadata)
        return bad

    unsigned = dict(change_metadata=lambda m: m.pop("signature"))  # as files written before issue 50
    cases = [
        (dict(change_tensors=lambda t: t.pop("generator")), model, r"holds no 'generator'"),
        (dict(change_tensors=lambda t: t.update({"layers.5.m_k": t["layers.0.m_k"].clone()})), model,
         r"state for layer 5, which is not in the model"),
        (dict(change_tensors=lambda t: t.update({"layers.0.offset": t["layers.0.offset"] + 4})), model,
         r"layer 0 \(trellis\) tensor 'offset' holds values in \[\d, \d\], allowed: \[0, 3\]"),
        (dict(change_tensors=lambda t: t.update({"layers.1.m_v": t["layers.1.m_v"].half()})), model,
         r"layer 1 \(trellis\) tensor 'm_v' has dtype F16"),
        (unsigned, tiny_model(num_slots=5), r"layer 0 \(trellis\) tensor '\w+' has shape \[2, 2, 6, 8\], the model needs \[rows, 2, 5, 8\] \(rows = as"),
        (unsigned, tiny_model(schedule="lattice"), r"unknown tensor"),
    ]
    for change, into, match in cases:
        with pytest.raises(ValueError, match=match):
            StatePassing().load(rewritten(**change), into)
    with pytest.raises(ValueError, match="is a folder: expected a state file"):
        StatePassing().load(tmp_path, model)
    hybrid = tiny_model(schedule="hybrid")
    _, path = saved_states(tmp_path, schedule="kvm-hybrid")
    with pytest.raises(ValueError, match=r"mixer_types"):
        StatePassing().load(path, hybrid)


def test_state_and_cache_files_are_refused_on_their_headers_before_a_tensor_is_read(tmp_path, monkeypatch):
    """One loader order (issue 76): a tensor of the wrong shape or dtype is refused from the file's
    header, in a state file as in a cache file, before any tensor is read."""
    import trellis_lm.cache_trellis
    import trellis_lm.state_passing

    model, path = saved_states(tmp_path)
    cache = getattr(model.eval()(random_tokens(2, 5), use_cache=True), CACHE_ARG)
    cache.save(tmp_path / "cache.safetensors")
    for name, keep in (("states", path), ("cache", tmp_path / "cache.safetensors")):
        with safe_open(str(keep), framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors["layers.1.m_v"] = tensors["layers.1.m_v"].half()
        save_file(tensors, str(tmp_path / f"bad_{name}.safetensors"), metadata=metadata)

    class Unread:
        """safe_open whose tensors cannot be read (headers can)."""

        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            handle = self.file.__enter__()
            outer = self

            class Handle:
                def __getattr__(self, attr):
                    return getattr(handle, attr)

                def get_tensor(self, key):
                    raise AssertionError(f"tensor {key!r} read before the headers were checked")

            outer.handle = Handle()
            return outer.handle

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

    monkeypatch.setattr(trellis_lm.state_passing, "safe_open", Unread)
    monkeypatch.setattr(trellis_lm.cache_trellis, "safe_open", Unread)
    with pytest.raises(ValueError, match=r"layer 1 \(trellis\) tensor 'm_v' has dtype F16"):
        StatePassing().load(tmp_path / "bad_states.safetensors", model)
    with pytest.raises(ValueError, match=r"layer 1 \(trellis\) tensor 'm_v' has dtype F16"):
        TrellisCache.load(tmp_path / "bad_cache.safetensors")


def test_a_state_file_has_the_cache_file_s_header_and_checks(tmp_path):
    """One file format (issue 54): the states' file records its format, version and layer kinds as
    a cache file does; a cache file, or a file that records other kinds, is refused by name, and a
    states file by ``TrellisCache.load``; a file written before the header existed (no format) is
    still read, checked by its tensors."""
    model, path = saved_states(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert metadata["format"] == "trellis-carried-states" and metadata["layer_kinds"] == '["trellis", "trellis"]'
    assert "seen_tokens" not in metadata

    cache = TrellisCache(model.config)
    with torch.no_grad():
        model.eval()(random_tokens(2, 3), past_key_values=cache)
    cache.save(tmp_path / "cache.safetensors")
    with pytest.raises(ValueError, match=r"is not a file of carried training states \(metadata format: 'trellis-cache'\)"):
        StatePassing().load(tmp_path / "cache.safetensors", model)
    for config in (None, model.config):
        with pytest.raises(ValueError, match=r"is not a Trellis cache file \(metadata format: 'trellis-carried-states'\)"):
            TrellisCache.load(path, config=config)

    def written(name, **changes):
        save_file(tensors, str(tmp_path / name), metadata={**metadata, **changes})
        return tmp_path / name

    unsigned = {k: v for k, v in metadata.items() if k != "signature"}
    save_file(tensors, str(tmp_path / "other_kinds.safetensors"), metadata={**unsigned, "layer_kinds": '["trellis", "lattice"]'})
    with pytest.raises(ValueError, match=r"carried by a model with the layers \['trellis', 'lattice'\]"):
        StatePassing().load(tmp_path / "other_kinds.safetensors", model)
    with pytest.raises(ValueError, match=r"carried-states format version '9'"):
        StatePassing().load(written("future.safetensors", format_version="9"), model)

    legacy = {"probability": metadata["probability"], "signature": metadata["signature"]}
    save_file(tensors, str(tmp_path / "legacy.safetensors"), metadata=legacy)
    with pytest.raises(ValueError, match=r"is not a Trellis cache file \(metadata format: None\)"):
        TrellisCache.load(tmp_path / "legacy.safetensors")
    passing = StatePassing()
    passing.load(tmp_path / "legacy.safetensors", model)
    assert sorted(passing.carried) == [0, 1]
    for index, entry in passing.carried.items():
        torch.testing.assert_close(entry.state.m_k, tensors[f"layers.{index}.m_k"], rtol=0, atol=0)
