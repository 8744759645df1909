"""The ``trellis-lm`` command, run in-process through ``main([...])`` on tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import tiny_model
from trellis_lm import TrellisForCausalLM, train_tokenizer
from trellis_lm.cli import main
from trellis_lm.training import sample_chats

TINY_OVERRIDES = "hidden_size=32,num_hidden_layers=1,num_heads=2,head_dim=8,num_slots=4,chunk_size=4,intermediate_size=48"
QUIET_TRAINING = ["--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli-model")
    tiny_model(seed=4, vocab_size=300).save_pretrained(folder)
    train_tokenizer(["hello world", "hello there", "the memory is fixed"] * 10, vocab_size=300).save_pretrained(folder)
    return folder


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_console_script_help():
    script = Path(sys.executable).with_name("trellis-lm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trellis_lm"]
    run = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for name in ("generate", "train", "eval", "bench", "convert"):
        assert name in run.stdout


@pytest.mark.parametrize(
    "argv, expected",
    [(["generate"], "--max-new-tokens"), (["train"], "TrainingArguments"), (["train", "pretrain"], "--data_files"),
     (["train", "finetune"], "--lora_target_modules"), (["eval"], "trellis_demo"), (["bench"], "--quick"),
     (["convert"], "--distill")],
)
def test_every_command_explains_itself(capsys, argv, expected):
    assert expected in help_text(capsys, *argv)


def test_convert_says_when_conversion_is_unavailable(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "trellis_lm.conversion.cli", None)  # makes the import fail
    assert "conversion is unavailable" in help_text(capsys, "convert")
    assert main(["convert", "src", "dst"]) == 1
    assert "conversion is unavailable" in capsys.readouterr().err


def test_generate(capsys, checkpoint):
    assert main(["generate", str(checkpoint), "hello", "the memory", "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    batch = tokenizer(["hello", "the memory"], padding=True, return_tensors="pt")
    expected = model.generate(**batch, max_new_tokens=4, do_sample=False)
    new = tokenizer.batch_decode(expected[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert lines == ["hello" + new[0], "the memory" + new[1]]
    assert main(["generate", str(checkpoint), "hello", "--chat", "--do-sample", "--seed", "0", "--max-new-tokens", "3"]) == 0


def test_train_pretrain_and_finetune(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i} is about memory slot {i}." for i in range(30)))
    out = tmp_path / "pretrained"
    assert main(["train", "pretrain", "--data_files", str(corpus), "--output_dir", str(out), "--max_steps", "1",
                 "--per_device_train_batch_size", "4", "--max_length", "16", "--vocab_size", "300",
                 "--config_overrides", TINY_OVERRIDES, *QUIET_TRAINING]) == 0
    assert f"trained 1 steps; model saved to {out}" in capsys.readouterr().out
    assert type(AutoModelForCausalLM.from_pretrained(out)) is TrellisForCausalLM

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(chat) + "\n" for chat in sample_chats(8)))
    tuned = tmp_path / "tuned"
    assert main(["train", "finetune", "--model", str(out), "--data_files", str(chats), "--output_dir", str(tuned),
                 "--max_steps", "1", "--per_device_train_batch_size", "4", "--lora", "--lora_rank", "2",
                 *QUIET_TRAINING]) == 0
    assert (tuned / "adapter_model.safetensors").is_file()
    assert type(AutoModelForCausalLM.from_pretrained(tuned / "merged")) is TrellisForCausalLM


def test_eval(capsys, checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    output = tmp_path / "results.json"
    assert main(["eval", str(checkpoint), "--tasks", "trellis_demo_choice", "--limit", "2", "--batch-size", "2",
                 "--device", "cpu", "--output", str(output)]) == 0
    assert "trellis_demo_choice" in capsys.readouterr().out
    assert "acc,none" in json.loads(output.read_text())["results"]["trellis_demo_choice"]


def test_bench_quick(capsys, monkeypatch):
    import trellis_lm.benchmark as benchmark

    # The benchmark's own sizes take a while on two cores; the command's wiring is what is tested.
    quick_op, quick_decode = benchmark.bench_op, benchmark.bench_decode
    monkeypatch.setattr(benchmark, "bench_op", lambda *args, repeats: quick_op(1, 16, 1, 4, 4, 4, repeats=1))
    monkeypatch.setattr(
        benchmark, "bench_decode",
        lambda contexts, rounds, **size: quick_decode([4, 8], 1, hidden=16, layers=1, heads=1, head_dim=8, slots=4,
                                                     vocab=32),
    )
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "--quick", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "torch is" in out and "Llama/Trellis" in out
