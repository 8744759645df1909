"""The stock Trainer on tiny models: loss normalisation, checkpointing, bf16, and the recipes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments
from transformers.utils import is_torch_bf16_available_on_device

from tiny_models import SCHEDULES
from trainer_helpers import ROWS, sgd_trainer, trained_parameters
from transformers_names import CHECKPOINTING_ARG
from trellis_lm import TrellisForCausalLM, train_tokenizer
from trellis_lm.training import (
    FinetuneArguments,
    PretrainArguments,
    document_pieces,
    ensure_chat_template,
    finetune,
    pretrain,
    sample_chats,
    tokenize_chat,
)

def one_sgd_step(tmp_path, **training_kwargs) -> dict[str, torch.Tensor]:
    """Minus the gradient the Trainer applies in one step over the first four rows."""
    trainer = sgd_trainer(str(tmp_path), rows=ROWS[:4], max_steps=1, **training_kwargs)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return {name: p - before[name] for name, p in trained_parameters(trainer).items()}


def assert_same_updates(actual: dict, expected: dict, **tolerance) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=name, **tolerance)
    assert any(bool(update.abs().max() > 0) for update in expected.values())


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gradient_accumulation_equals_one_big_batch(tmp_path, schedule):
    whole = one_sgd_step(tmp_path, per_device_train_batch_size=4, schedule=schedule)
    for batch, steps in ((2, 2), (1, 4)):
        accumulated = one_sgd_step(
            tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=steps, schedule=schedule)
        assert_same_updates(accumulated, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_trainer_activation_checkpointing_gives_the_same_update(tmp_path, schedule):
    plain = one_sgd_step(tmp_path, per_device_train_batch_size=4, schedule=schedule)
    checkpointed = one_sgd_step(tmp_path, per_device_train_batch_size=4, schedule=schedule, **{CHECKPOINTING_ARG: True})
    assert_same_updates(checkpointed, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not is_torch_bf16_available_on_device("cpu"), reason="no bfloat16 on this CPU")
def test_trainer_bf16_step_on_cpu(tmp_path):
    plain = one_sgd_step(tmp_path, per_device_train_batch_size=4)
    bf16 = one_sgd_step(tmp_path, per_device_train_batch_size=4, bf16=True)
    for name, update in bf16.items():  # autocast: bfloat16 matmuls, float32 weights and memories
        assert torch.isfinite(update).all(), name
    cosine = torch.nn.functional.cosine_similarity(
        torch.cat([u.flatten() for u in bf16.values()]), torch.cat([u.flatten() for u in plain.values()]), dim=0
    )
    assert cosine > 0.95


# ----------------------------------------------------------------------------- recipes


def test_document_pieces():
    assert document_pieces(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert document_pieces([1, 2], 5) == [[1, 2]]


TINY_OVERRIDES = "hidden_size=32,num_hidden_layers=1,num_heads=2,head_dim=8,num_slots=4,chunk_size=4,intermediate_size=48"


def tiny_training_args(output_dir, **overrides) -> TrainingArguments:
    fields = dict(
        output_dir=str(output_dir), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
        save_steps=1, logging_steps=1, report_to="none", disable_tqdm=True, use_cpu=True,
    )
    fields.update(overrides)
    return TrainingArguments(**fields)


def test_pretrain_recipe_streams_packs_checkpoints_and_resumes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    paragraphs = [f"Paragraph {i} says that memory number {i} is fixed.\nIt has two lines." for i in range(40)]
    corpus.write_text("\n\n".join(paragraphs))
    args = PretrainArguments(data_files=[str(corpus)], vocab_size=300, max_length=12, config_overrides=TINY_OVERRIDES)
    out = tmp_path / "run"
    trainer = pretrain(args, tiny_training_args(out))
    assert trainer.state.global_step == 2
    assert {"checkpoint-1", "checkpoint-2", "model.safetensors", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is TrellisForCausalLM and model.config.hidden_size == 32

    # State passing is on by default (over the last 30% of the steps: here the second): one
    # document piece per padded row, since a state is carried per row; checkpoints hold the states.
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 4
    assert (out / "checkpoint-2" / "state_passing-rank0.safetensors").exists()
    assert not (out / "checkpoint-1" / "state_passing-rank0.safetensors").exists()

    resumed = pretrain(args, tiny_training_args(out, max_steps=3, resume_from_checkpoint="last"))
    assert resumed.state.global_step == 3

    # Without it, a collated batch is one row of packed pieces, position ids restarting at each.
    packed = pretrain(dataclasses.replace(args, state_passing=0.0), tiny_training_args(tmp_path / "packed", max_steps=1))
    batch = next(iter(packed.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1
    assert int((batch["position_ids"] == 0).sum()) == 4
    assert int((batch["labels"] == -100).sum()) == 4


def test_chat_labels_cover_the_assistant_turns_only():
    tokenizer = train_tokenizer(["What is 1 + 2?", "1 + 2 = 3."] * 10, vocab_size=300)
    ensure_chat_template(tokenizer)
    messages = sample_chats(1, seed=3)[0]["messages"] + [
        {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."},
    ]
    example = tokenize_chat(messages, tokenizer)
    ids, labels = example["input_ids"], example["labels"]
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(ids) == whole
    trained = [token for token, label in zip(ids, labels) if label != -100]
    assert all(label in (-100, token) for token, label in zip(ids, labels))
    answers = [m["content"] + tokenizer.eos_token + "\n" for m in messages if m["role"] == "assistant"]
    assert tokenizer.decode(trained) == "".join(answers)
    # The prompt of the first answer is tokenized as at inference.
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and set(labels[: len(prompt_ids)]) == {-100}
    assert len(tokenize_chat(messages, tokenizer, max_length=5)["labels"]) == 5


def test_finetune_recipe_with_lora(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(chat) + "\n" for chat in sample_chats(16)))
    args = FinetuneArguments(
        data_files=[str(chats)], vocab_size=300, config_overrides=TINY_OVERRIDES, lora=True, lora_rank=2
    )
    out = tmp_path / "run"
    trainer = finetune(args, tiny_training_args(out, max_steps=1, save_steps=10))
    assert trainer.state.global_step == 1
    assert {"adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert type(merged) is TrellisForCausalLM
