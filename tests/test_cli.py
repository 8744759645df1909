"""The ``trellis-lm`` command, run in-process through ``main([...])`` on tiny models."""

from __future__ import annotations

import io
import json
from dataclasses import fields
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tiny_models import tiny_model
from trellis_lm import TrellisForCausalLM, train_tokenizer
from trellis_lm.arguments import Parser, config_fields
from trellis_lm.cli import SEPARATOR, main
from trellis_lm.training import SMALL_MODEL, PretrainArguments, new_model_config, sample_chats

TINY_OVERRIDES = "hidden_size=32,num_hidden_layers=1,num_heads=2,head_dim=8,num_slots=4,chunk_size=4,intermediate_size=48"
QUIET_TRAINING = ["--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "--logging_steps", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli-model")
    tiny_model(seed=4, vocab_size=300).save_pretrained(folder)
    train_tokenizer(["hello world", "hello there", "the memory is fixed"] * 10, vocab_size=300).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny Llama checkpoint to convert."""
    folder = tmp_path_factory.mktemp("cli-llama") / "llama"
    config = LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    train_tokenizer(["hello world"] * 10, vocab_size=300).save_pretrained(folder)
    return folder


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_console_script_help(checkpoint):
    script = Path(sys.executable).with_name("trellis-lm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trellis_lm"]
    run = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for name in ("generate", "train", "eval", "bench", "convert"):
        assert name in run.stdout
    # A command that runs has the model registered with transformers (the script defers it).
    run = subprocess.run([*command, "generate", str(checkpoint), "hello", "--max-new-tokens", "2"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("hello"), run.stderr[-2000:]


# What the command's script runs: its entry point, then which of the heavy packages it imported.
ENTRY_POINT = """import sys, trellis_lm_command
try:
    status = trellis_lm_command.main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
print(status, sorted({name.split(".")[0] for name in sys.modules} & {"torch", "transformers"}))"""


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0), (["--version"], 0), (["generate", "--help"], 0), (["eval", "--help"], 0), (["bogus"], 2), ([], 2),
    (["generate", "{tmp}/missing", "hi"], 2), (["generate", "{tmp}", "hi", "--max-new-tokens", "0"], 2),
    (["eval", "{tmp}", "--batch-size", "x"], 2), (["train"], 2), (["train", "distill"], 2),
])
def test_help_and_a_refused_command_line_answer_without_the_model_stack(tmp_path, argv, status):
    """Issue 72: ``trellis-lm --help`` and an argument error took as long as importing the whole
    model stack (``import trellis_lm``: over twice torch + transformers). From the command's entry
    point, neither imports torch or transformers (what it costs is not asserted: a timing)."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    run = subprocess.run([sys.executable, "-c", ENTRY_POINT, *argv], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines()[-1] == f"{status} []", run.stderr[-2000:]


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
    assert lines == ["hello" + new[0], SEPARATOR, "the memory" + new[1]]
    assert main(["generate", str(checkpoint), "hello", "--chat", "--do-sample", "--seed", "0", "--max-new-tokens", "3"]) == 0
    capsys.readouterr()
    # The same options spelled with underscores, as the train recipes spell theirs.
    assert main(["generate", str(checkpoint), "hello", "the memory", "--max_new_tokens", "4", "--num_beams=1"]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_a_prompt_of_no_tokens_is_one_line_naming_it(capsys, checkpoint, tmp_path):
    """Issue 72: ``generate MODEL ""`` with a tokenizer that adds no BOS token: exit 1 and the
    model's traceback. Refused before the model loads; a prompt that is not empty once templated
    (``--chat``) or tokenized (a BOS token) is generated from."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    backend = tokenizer.backend_tokenizer
    backend.post_processor = None  # no BOS token: "" holds no tokens
    folder = tmp_path / "no-bos"
    AutoModelForCausalLM.from_pretrained(checkpoint).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token,
                            pad_token=tokenizer.pad_token).save_pretrained(folder)
    for prompts, number in [([""], 1), (["hello", ""], 2)]:
        capsys.readouterr()
        assert main(["generate", str(folder), *prompts]) == 2
        assert capsys.readouterr().err == (f"trellis-lm generate: error: argument prompts: prompt {number} ('') holds "
                                           "no tokens: expected text to continue\n")
    assert main(["generate", str(folder), "", "--chat", "--max-new-tokens", "1"]) == 0
    assert main(["generate", str(checkpoint), "", "--max-new-tokens", "1"]) == 0


def test_options_take_hyphens_or_underscores():
    parser = Parser(prog="p")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--top_k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--num-beams", type=int)
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("words", nargs="*")
    args = parser.parse_args(["--max_new_tokens", "3", "--top-k=5", "--top_p", "0.5", "--", "--max_new_tokens"])
    assert (args.max_new_tokens, args.top_k, args.top_p, args.words) == (3, 5, 0.5, ["--max_new_tokens"])
    assert parser.parse_args(["--max_new", "4"]).max_new_tokens == 4  # abbreviated, as argparse allows
    with pytest.raises(SystemExit):
        parser.parse_args(["--num_", "1"])  # --num-beams or --num-fewshot: left to argparse, which refuses it


def test_recipe_help_lists_its_own_options_first(capsys):
    text = help_text(capsys, "train", "pretrain")
    usage, options = text.split("\noptions:\n")
    assert len(usage.splitlines()) < 15, usage  # not the usage of every TrainingArguments option
    first_trainer_option = options.index("--output_dir")
    for field in fields(PretrainArguments):
        assert options.index(f"--{field.name}") < first_trainer_option, field.name


def test_train_pretrain_and_finetune(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i} is about memory slot {i}." for i in range(30)))
    out = tmp_path / "pretrained"
    assert main(["train", "pretrain", "--data_files", str(corpus), "--output_dir", str(out), "--max_steps", "1",
                 "--per_device_train_batch_size", "4", "--max_length", "16", "--vocab_size", "300",
                 "--config_overrides", TINY_OVERRIDES, *QUIET_TRAINING]) == 0
    assert f"trained 1 steps; model saved to {out}" in capsys.readouterr().out
    assert type(AutoModelForCausalLM.from_pretrained(out)) is TrellisForCausalLM
    card = (out / "README.md").read_text()  # the card says what the run was
    assert "Local files: corpus.txt. Trained by `trellis_lm.training.pretrain`: 1 steps; batch 4 x 1" in card
    assert "the last logged training loss was" in card and "Not recorded" not in card

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(chat) + "\n" for chat in sample_chats(8)))
    tuned = tmp_path / "tuned"
    assert main(["train", "finetune", "--model", str(out), "--data_files", str(chats), "--output_dir", str(tuned),
                 "--max_steps", "1", "--per_device_train_batch_size", "4", "--lora", "--lora_rank", "2",
                 *QUIET_TRAINING]) == 0
    said = capsys.readouterr().out
    assert f"LoRA adapter saved to {tuned}" in said and f"which loads on its own, to {tuned / 'merged'}" in said
    assert (tuned / "adapter_model.safetensors").is_file()
    assert type(AutoModelForCausalLM.from_pretrained(tuned / "merged")) is TrellisForCausalLM
    card = (tuned / "merged" / "README.md").read_text()
    assert f"Local files: chats.jsonl; starting from the checkpoint {out}; loss on the assistant turns only" in card
    assert "Trained by `trellis_lm.training.finetune with LoRA`: 1 steps" in card


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
    # Its compiled model decodes eagerly here: compiling costs most of a minute on two cores, and
    # the compiled step is checked against the eager one in tests/test_generation.py.
    quick_op, quick_decode, models = benchmark.bench_op, benchmark.bench_decode, benchmark.same_size_models

    def eager_models(**size):
        trellis, compiled, llama = models(**size)
        compiled.config.compile_decode = False
        return trellis, compiled, llama

    monkeypatch.setattr(benchmark, "same_size_models", eager_models)
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


# ----------------------------------------------------------------------------- bad arguments


def exit_status(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns it or argparse raises it."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes), and every folder (-> b"")."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


def assert_one_line_naming(err: str, argument: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and argument in lines[-1] and "error:" in lines[-1], err


BAD_ARGUMENTS = [
    (["generate", "{tmp}/missing", "hi"], "argument model"),
    (["generate", "missing/folder/here", "hi"], "argument model"),
    (["generate", "{tmp}/empty", "hi"], "argument model"),
    (["generate", "{tmp}/notes.txt", "hi"], "argument model"),
    (["generate", "", "hi"], "argument model"),
    (["generate", "outputs/nope", "hi"], "argument model"),  # outputs/ is a folder: a typo, not a Hub id
    (["generate", "{ckpt}"], "argument prompts"),  # standard input is empty
    (["generate", "{ckpt}", "hi", "--max_new_tokens", "0"], "--max-new-tokens"),
    (["generate", "{ckpt}", "hi", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["generate", "{ckpt}", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "{ckpt}", "hi", "--num-beams", "0"], "--num-beams"),
    (["generate", "{ckpt}", "hi", "--top-k", "0"], "--top-k"),
    (["generate", "{ckpt}", "hi", "--top-p", "1.5"], "--top-p"),
    (["generate", "{ckpt}", "hi", "--temperature", "0"], "--temperature"),
    (["generate", "{ckpt}", "hi", "--seed", "-1"], "--seed"),
    (["generate", "{ckpt}", "hi", "--dtype", "float17"], "--dtype"),
    (["generate", "{ckpt}", "hi", "--device", "toaster"], "--device"),
    (["generate", "{ckpt}", "hi", "--bogus"], "--bogus"),
    (["train", "pretrain", "--bogus", "1"], "--bogus"),
    (["train", "pretrain", "--max_steps", "many"], "--max_steps"),
    (["train", "pretrain", "--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    (["train", "pretrain", "--data_files", "{tmp}/missing.txt"], "--data_files"),
    (["train", "finetune", "--model", "{tmp}/missing"], "--model"),
    (["train", "finetune", "--model", "{tmp}/empty"], "--model"),
    (["train", "finetune", "--lora", "--lora_rank", "0"], "--lora_rank"),
    (["train", "finetune", "--model", "outputs/nope"], "--model"),
    (["train", "pretrain", "--per-device-train-batch-size", "0"], "--per_device_train_batch_size"),
    (["train", "distill"], "argument recipe"),
    # Issue 50: checked before anything is built or written.
    (["train", "pretrain", "--max_steps", "-3"], "--max_steps"),
    (["train", "pretrain", "--max_steps", "0"], "--max_steps"),
    (["train", "finetune", "--max_steps", "-3"], "--max_steps"),
    (["train", "pretrain", "--state_passing", "2"], "--state_passing"),
    (["train", "finetune", "--state_passing", "-0.5"], "--state_passing"),
    (["train", "pretrain", "--state_passing_from", "1"], "--state_passing_from"),
    (["train", "pretrain", "--state_passing_from", "nan"], "--state_passing_from"),
    (["train", "pretrain", "--state_passing", "0", "--state_passing_from", "0.5"], "--state_passing_from"),
    (["train", "pretrain", "--output_dir", "{tmp}/notes.txt"], "--output_dir"),
    (["train", "finetune", "--output_dir", "{tmp}/notes.txt"], "--output_dir"),
    (["train", "pretrain", "--data_files", "{tmp}/empty"], "--data_files"),
    (["train", "pretrain", "--resume_from_checkpoint", "{tmp}/missing"], "--resume_from_checkpoint"),
    (["train", "finetune", "--resume_from_checkpoint", "{tmp}/notes.txt"], "--resume_from_checkpoint"),
    (["train", "finetune", "--data_files", "{tmp}/notes.txt"], "--data_files"),
    (["train", "finetune", "--data_files", "{tmp}/texts.jsonl"], "--data_files"),
    (["train", "finetune", "--data_files", "{tmp}/latin1.jsonl"], "--data_files"),  # issue 72: a decoder's traceback
    # Issue 72: a 31-line traceback once the tokenizer was trained, exit 1, an empty output folder left.
    (["train", "pretrain", "--config_overrides", "hidden_size=32,write_gradient=Exact"], "--config_overrides"),
    (["train", "pretrain", "--config_overrides", "write_gradient="], "--config_overrides"),
    (["train", "pretrain", "--config_overrides", "wrte_gradient=exact"], "--config_overrides"),
    (["train", "pretrain", "--config_overrides", "use_forget_gate=yes"], "--config_overrides"),
    (["train", "finetune", "--config_overrides", "chunk_size=4,num_slots"], "--config_overrides"),
    (["train", "finetune", "--config_overrides", "chunk_size=4,chunk_size=8"], "--config_overrides"),
    (["train", "finetune", "--config_overrides", ""], "--config_overrides"),
    (["train", "finetune", "--model", "{ckpt}", "--config_overrides", "chunk_size=4"], "--config_overrides"),
    (["eval", "{tmp}/missing"], "argument model"),
    (["eval", "{ckpt}", "--batch-size", "0"], "--batch-size"),
    (["eval", "{ckpt}", "--batch-size", "auto:x"], "--batch-size"),
    (["eval", "{ckpt}", "--batch_size", "0"], "--batch-size"),
    (["eval", "outputs/nope"], "argument model"),
    (["eval", "{ckpt}", "--limit", "0"], "--limit"),
    (["eval", "{ckpt}", "--num-fewshot", "-1"], "--num-fewshot"),
    (["eval", "{ckpt}", "--max-length", "0"], "--max-length"),
    (["eval", "{ckpt}", "--dtype", "float17"], "--dtype"),
    (["eval", "{ckpt}", "--include-path", "{tmp}/missing"], "--include-path"),
    (["eval", "{ckpt}", "--output", "{tmp}/missing/results.json"], "--output"),
    (["eval", "{ckpt}", "--tasks", "no_such_task"], "--tasks"),
    (["bench", "--threads", "0"], "--threads"),
    (["bench", "--threads", "two"], "--threads"),
    (["bench", "--bogus"], "--bogus"),
    (["bench", "--bogus_option"], "--bogus_option"),
    (["convert", "{tmp}/missing", "{tmp}/out"], "argument src"),
    (["convert", "{tmp}/empty", "{tmp}/out"], "argument src"),
    (["convert", "{llama}", "{tmp}/notes.txt"], "argument dst"),
    (["convert", "{llama}", "{tmp}/notes.txt", "--overwrite"], "argument dst"),
    (["convert", "{llama}", "{tmp}/notes.txt/out"], "argument dst"),
    (["convert", "{tmp}/model.gguf", "{tmp}", "--overwrite"], "argument dst"),  # would delete the GGUF file
    (["convert", "{llama}", "{tmp}/out", "--num-slots", "0"], "--num-slots"),
    (["convert", "{llama}", "{tmp}/out", "--num_slots", "0"], "--num-slots"),
    (["convert", "{llama}", "{tmp}/out", "--distill", "--data", "{tmp}/missing.txt"], "--data"),
    (["convert", "{llama}", "{tmp}/out", "--distill", "--lora-rank", "-1"], "--lora-rank"),
    (["convert", "{llama}", "{tmp}/out", "--set", "wrte_gradient=exact"], "argument --set"),
    (["convert", "{llama}", "{tmp}/out", "--set", "write_gradient=Exact"], "TrellisConfig.write_gradient"),
    (["convert", "{llama}", "{tmp}/out", "--set", "write_gradient"], "argument --set"),
]


@pytest.mark.parametrize("argv, argument", BAD_ARGUMENTS, ids=[" ".join(argv) for argv, _ in BAD_ARGUMENTS])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(capsys, monkeypatch, tmp_path, checkpoint, llama,
                                                              argv, argument):
    (tmp_path / "empty").mkdir()
    (tmp_path / "outputs").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "texts.jsonl").write_text('{"text": "JSON, but no chat"}\n')
    (tmp_path / "latin1.jsonl").write_bytes('{"messages": []}\n{"messages": ["caf\xe9"]}\n'.encode("latin-1"))
    monkeypatch.chdir(tmp_path)  # a command's default outputs (outputs/..., DST-distill) would land here
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    before = files_under(tmp_path)
    argv = [a.format(tmp=tmp_path, ckpt=checkpoint, llama=llama) for a in argv]
    assert exit_status(argv) == 2
    assert_one_line_naming(capsys.readouterr().err, argument)
    assert files_under(tmp_path) == before


def test_config_fields_are_json_values_and_a_value_may_hold_commas():
    """What ``--config_overrides`` and ``convert --set`` read (issue 72: ``--config_overrides``
    failed after the tokenizer was trained; ``--set`` checked its values)."""
    text = 'num_hidden_layers=2,mixer_types=["trellis", "attention"],compress_fn=l2norm,rms_norm_eps=1e-5,use_cache=false'
    assert config_fields([text, "kvm_rope_dims=null"], "--x") == {
        "num_hidden_layers": 2, "mixer_types": ["trellis", "attention"], "compress_fn": "l2norm", "rms_norm_eps": 1e-5,
        "use_cache": False, "kvm_rope_dims": None}
    config = new_model_config(PretrainArguments(config_overrides=text), vocab_size=300)
    assert (config.mixer_types, config.compress_fn, config.use_cache, config.hidden_size) == (
        ["trellis", "attention"], "l2norm", False, SMALL_MODEL["hidden_size"])
    for bad, match in [("=3", "'=3' is not FIELD=VALUE"), ("chunk_size=4,=3", "got '4,=3'"),
                       ("chunk_size=4,chunk_size=4", "chunk_size is given twice"),
                       ("chunk_size=4.0", "TrellisConfig.chunk_size must be"), ("num_slot=4", "did you mean 'num_slots'")]:
        with pytest.raises(ValueError, match=f"^--config_overrides: .*{re.escape(match)}"):
            new_model_config(PretrainArguments(config_overrides=bad), vocab_size=300)


@pytest.mark.parametrize(
    "argv, argument",
    [(["generate", "org/name", "hi"], "argument model"), (["eval", "org/name"], "argument model"),
     (["train", "finetune", "--model", "org/name"], "argument --model")],
)
def test_a_hub_id_that_does_not_load_exits_2_with_one_line(capsys, monkeypatch, tmp_path, argv, argument):
    def not_found(*args, **kwargs):
        raise OSError("org/name is not a local folder and is not a valid model identifier\n"
                      "If this is a private repository, make sure to pass a token")

    for auto_class in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto_class, "from_pretrained", not_found)
    monkeypatch.chdir(tmp_path)
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert_one_line_naming(err, argument)
    assert "not a valid model identifier" in err and "private repository" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["generate", "outputs/nope", "hi"], ["generate", "", "hi"], ["eval", "outputs/nope"],
                                  ["train", "finetune", "--model", "outputs/nope"]])
def test_a_missing_local_path_is_refused_without_asking_the_hub(capsys, monkeypatch, tmp_path, argv):
    """A typo in a local path (its first folder exists here) or an empty name: refused at once,
    not after transformers has retried the Hub for a minute."""

    def hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    for auto_class in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(auto_class, "from_pretrained", hub)
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert_one_line_naming(err, "model")
    assert "outputs/nope does not exist" in err or "an empty name" in err, err


# ----------------------------------------------------------------------------- convert: never into its source


def convert_argv(src: Path, dst: Path, *more: str) -> list[str]:
    return ["convert", str(src), str(dst), "--num-slots", "8", "--chunk-size", "8", *more]


@pytest.mark.parametrize("dst", ["same", "symlink", "inside", "holding", "holding-overwrite"])
def test_convert_never_writes_into_its_source(capsys, tmp_path, llama, dst):
    src = tmp_path / "L"
    src.mkdir()
    for file in llama.iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    (tmp_path / "link").symlink_to(src, target_is_directory=True)
    target, more = {
        "same": (src, []), "symlink": (tmp_path / "link", []), "inside": (src / "out", []),
        "holding": (tmp_path, []), "holding-overwrite": (tmp_path, ["--overwrite"]),
    }[dst]
    before = files_under(tmp_path)
    assert exit_status(convert_argv(src, target, *more)) == 2
    err = capsys.readouterr().err
    assert_one_line_naming(err, "argument dst")
    assert len(err.strip().splitlines()) == 1
    assert files_under(tmp_path) == before  # every file of L byte for byte, and nothing beside it


def test_convert_keeps_distillation_checkpoints_out_of_its_source(capsys, tmp_path, llama):
    texts = tmp_path / "texts.txt"
    texts.write_text("hello world")
    src = tmp_path / "m-distill"  # the default work dir of DST "m"
    src.mkdir()
    for file in llama.iterdir():
        (src / file.name).write_bytes(file.read_bytes())
    # Short stages, in case a run is let through.
    distill = ("--distill", "--data", str(texts), "--stage1-steps", "1", "--stage2-steps", "1", "--cpu")
    before = files_under(tmp_path)
    assert exit_status(convert_argv(src, tmp_path / "m", *distill)) == 2
    assert_one_line_naming(capsys.readouterr().err, "argument --work-dir")
    for work in (src / "work", tmp_path / "out" / "work"):
        assert exit_status(convert_argv(src, tmp_path / "out", *distill, "--work-dir", str(work))) == 2
        assert_one_line_naming(capsys.readouterr().err, "argument --work-dir")
    assert files_under(tmp_path) == before


def test_convert_replaces_a_non_empty_destination_only_with_overwrite(capsys, tmp_path, llama):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("keep me")
    assert exit_status(convert_argv(llama, dst)) == 2
    assert_one_line_naming(capsys.readouterr().err, "--overwrite")
    assert files_under(tmp_path) == {"out": b"", "out/old.txt": b"keep me"}

    assert exit_status(convert_argv(llama, dst, "--overwrite")) == 0
    assert not (dst / "old.txt").exists()
    assert json.loads((dst / "config.json").read_text())["model_type"] == "trellis"
    assert type(AutoModelForCausalLM.from_pretrained(dst)) is TrellisForCausalLM
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging folder left beside it

    empty = tmp_path / "empty"
    empty.mkdir()
    assert exit_status(convert_argv(llama, empty)) == 0  # an empty folder is no one's work
    assert (empty / "config.json").is_file()


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_a_conversion_that_stops_halfway_leaves_no_partial_model(monkeypatch, tmp_path, llama, interruption,
                                                                  existing):
    def stop(*args, **kwargs):  # after the weights are saved, before the tokenizer is copied
        raise interruption("stopped")

    monkeypatch.setattr("trellis_lm.conversion.llama.copy_tokenizer", stop)
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "old.txt").write_text("previous model")
    before = files_under(tmp_path)
    with pytest.raises(interruption):
        main(convert_argv(llama, dst, "--overwrite"))
    assert files_under(tmp_path) == before  # the old folder as it was (or none), no staging folder


def test_convert_to_the_source_in_a_real_process(tmp_path, llama):
    """The console script itself: status 2, one line, no traceback."""
    before = files_under(llama)
    run = subprocess.run([sys.executable, "-m", "trellis_lm", "convert", str(llama), str(llama)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "argument dst" in run.stderr
    assert files_under(llama) == before
