"""The convert-and-distil run as a Python function (``conversion.pipeline``), and what the
command line gives it: the same run, the source located once, each overlap checked once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_conversion_hybrid import make_teacher, run_cli
from trellis_lm.conversion import ConversionOptions, DistillOptions, convert_and_distill
from trellis_lm.conversion.cli import add_convert_arguments

SMALL = ("--num-slots", 8, "--chunk-size", 8)
SHORT = ("--block-size", 16, "--batch-size", 4, "--stage1-steps", 2, "--stage2-steps", 2, "--cpu", "--choice-blocks", 3)


@pytest.fixture(scope="module")
def teacher_and_texts(tmp_path_factory):
    """(teacher folder, a .jsonl file of 20 texts of 40 words): 820 tokens, 52 blocks of 16."""
    root = tmp_path_factory.mktemp("pipeline")
    make_teacher("llama", root / "teacher", layers=3, seed=2, shared_direction=0.5)
    texts = root / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": " ".join(f"w{3 + (i * j) % 90}" for j in range(40))})
                               for i in range(20)))
    return root / "teacher", texts


def test_the_python_function_runs_what_the_command_runs(teacher_and_texts, tmp_path, capsys):
    folder, texts = teacher_and_texts
    options = DistillOptions(data=[texts], block_size=16, batch_size=4, stage1_steps=2, stage2_steps=2, cpu=True,
                             keep_dearest=1, choice_blocks=3)
    conversion = ConversionOptions(num_slots=8, chunk_size=8, overrides={"compress_fn": "l2norm"})
    model = convert_and_distill(folder, tmp_path / "py", conversion, options)
    assert "distilled model written to" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["py", "py-distill"]  # no staging folder left
    work = tmp_path / "py-distill"
    assert (work / "layerwise" / "final" / "config.json").is_file()
    assert [p.name for p in (work / "logits").glob("checkpoint-*")] == ["checkpoint-2"]
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "py")
    assert saved.config.compress_fn == "l2norm"
    kept = json.loads((work / "layer_choice.json").read_text())["kept"]
    assert [i for i, kind in enumerate(saved.config.mixer_types) if kind == "attention"] == kept
    for name, value in saved.state_dict().items():  # the model returned is the one written
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)

    assert run_cli(folder, tmp_path / "cli", *SMALL, "--set", "compress_fn=l2norm", "--distill", "--data", texts,
                   *SHORT, "--keep-attention", "auto:1") == 0
    assert json.loads((tmp_path / "cli-distill" / "layer_choice.json").read_text()) == json.loads(
        (work / "layer_choice.json").read_text())
    from_cli = AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(from_cli.state_dict()[name], value, rtol=0, atol=0)


def test_a_run_locates_its_source_once_and_checks_each_overlap_once(teacher_and_texts, tmp_path, monkeypatch):
    """The hybrid of --keep-attention auto:K converts twice and loads the teacher twice: from the
    one located source, and DST and the work folder checked against it (and each other) once."""
    folder, texts = teacher_and_texts
    located, checked = [], []
    for module in [m for name, m in sys.modules.items() if name.startswith("trellis_lm.conversion.")]:
        for name, calls in (("locate_source", located), ("path_overlap", checked)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _recording(getattr(module, name), calls))
    dst, work = tmp_path / "out", tmp_path / "out-distill"
    assert run_cli(folder, dst, *SMALL, "--distill", "--data", texts, *SHORT, "--keep-attention", "auto:1") == 0
    assert [Path(*call) for call in located] == [folder]
    assert [tuple(Path(p).resolve() for p in call) for call in checked] == [
        (dst.resolve(), folder.resolve()), (work.resolve(), folder.resolve()), (work.resolve(), dst.resolve())]


def _recording(function, calls: list):
    def recorded(*args):
        calls.append(args)
        return function(*args)
    return recorded


def test_the_command_s_defaults_are_the_function_s():
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    args = parser.parse_args(["src", "dst", "--distill", "--data", "texts.txt"])
    for field in dataclasses.fields(DistillOptions):
        if field.name not in ("data", "keep_dearest"):
            assert getattr(args, field.name) == field.default, field.name
    for field in dataclasses.fields(ConversionOptions):
        if field.name != "overrides":
            assert getattr(args, field.name) == field.default, field.name
    assert args.set == [] and ConversionOptions().overrides == {}
    assert args.overwrite is inspect.signature(convert_and_distill).parameters["overwrite"].default


@pytest.mark.parametrize("fields, match", [
    (dict(block_size=0), r"argument --block-size: expected an integer >= 1, got '0'"),
    (dict(stage1_lr=-1.0), r"argument --stage1-lr: expected a number > 0, got '-1.0'"),
    (dict(state_passing=1.5), r"argument --state-passing: expected a number in \[0, 1\], got '1.5'"),
    (dict(stage1_patience=2.5), r"argument --stage1-patience: expected an integer >= 1, got '2.5'"),
    (dict(keep_dearest=-1), r"argument --keep-attention: expected an integer >= 0, got '-1'"),
])
def test_distill_options_refuse_what_the_command_s_argument_types_refuse(fields, match):
    with pytest.raises(ValueError, match=match):
        DistillOptions(data=["texts.txt"], **fields)


def test_the_function_refuses_before_writing(teacher_and_texts, tmp_path):
    folder, texts = teacher_and_texts
    for kwargs, match in [
        (dict(conversion=ConversionOptions(keep_attention=[0]), distill=DistillOptions(data=[texts], keep_dearest=1)),
         "keep_dearest chooses the kept layers itself"),
        (dict(distill=DistillOptions(data=[texts], stage1_patience=2)), "argument --stage1-patience"),
        (dict(distill=DistillOptions(data=[])), "--distill needs training texts"),
        (dict(conversion=ConversionOptions(num_slots=8, chunk_size=8, overrides={"head_dim": 4})),
         "mismatched head dims"),
    ]:
        with pytest.raises(ValueError, match=match):
            convert_and_distill(folder, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="argument dst: .* the source .*: a conversion never writes into its source"):
        convert_and_distill(folder, folder / "out")


def test_a_config_field_with_its_own_option_is_refused_in_overrides():
    """``--set num_slots=4`` once raised a bare TypeError deep in the conversion ("got multiple
    values"); it names the option to use instead."""
    for name, option in [("num_slots", "--num-slots"), ("chunk_size", "--chunk-size"), ("seed", "--seed")]:
        with pytest.raises(ValueError, match=rf"--set {name}=\.\.\.: {name} has its own option, {option}"):
            ConversionOptions(overrides={name: 4})
    assert ConversionOptions(overrides={"conv_size": 2}).options()["conv_size"] == 2
