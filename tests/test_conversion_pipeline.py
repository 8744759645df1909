"""The convert-and-distil run as a Python function (``conversion.pipeline``), and what the
command line gives it: the same run, the source located once, each overlap checked once."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_conversion_hybrid import make_teacher, run_cli
from trellis_lm.conversion import ConversionOptions, DistillOptions, convert_and_distill
from trellis_lm.conversion.cli import add_convert_arguments
from trellis_lm.conversion.data import read_texts
from trellis_lm.conversion.resume import begin_run, check_resumable, run_record

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
    record = json.loads((work / "run.json").read_text())  # what a resume is checked against
    assert record == run_record(Path(record["src"]), conversion, options)
    assert record["ConversionOptions.num_slots"] == 8 and record["TrellisConfig.compress_fn"] == "l2norm"
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
    assert parser.parse_args(["s", "d", "--data", "a", "b", "--data", "c"]).data == ["a", "b", "c"]  # none dropped
    assert args.overwrite is inspect.signature(convert_and_distill).parameters["overwrite"].default


@pytest.mark.parametrize("fields, match", [
    (dict(block_size=0), r"DistillOptions.block_size: expected an integer >= 1, got 0$"),
    (dict(stage1_lr=-1.0), r"DistillOptions.stage1_lr: expected a number > 0, got -1.0$"),
    (dict(state_passing=1.5), r"DistillOptions.state_passing: expected a number in \[0, 1\], got 1.5$"),
    (dict(stage1_patience=2.5), r"DistillOptions.stage1_patience: expected an integer >= 1, got 2.5$"),
    (dict(keep_dearest=-1), r"DistillOptions.keep_dearest: expected an integer >= 0, got -1$"),
    # Issue 72: a string passed the check (its text parsed) and failed in the optimiser after the
    # run had converted and written; a bool is no number; nan no learning rate.
    (dict(stage1_lr="0.01"), r"DistillOptions.stage1_lr: expected a number > 0, got '0.01'$"),
    (dict(block_size="16"), r"DistillOptions.block_size: expected an integer >= 1, got '16'$"),
    (dict(lora_rank=True), r"DistillOptions.lora_rank: expected an integer >= 0, got True$"),
    (dict(temperature=float("nan")), r"DistillOptions.temperature: expected a number > 0, got nan$"),
    # Issue 72: "no" is truthy: the teacher loaded in bfloat16. Flags take booleans.
    (dict(bf16="no"), r"DistillOptions.bf16: expected True or False, got 'no'$"),
    (dict(resume="no"), r"DistillOptions.resume: expected True or False, got 'no'$"),
    (dict(cpu=1), r"DistillOptions.cpu: expected True or False, got 1$"),
    (dict(stage1_train_carried=None), r"DistillOptions.stage1_train_carried: expected True or False, got None$"),
    (dict(data=[Path("a.txt"), 3]), r"DistillOptions.data: expected a path or a sequence of paths"),
    (dict(data=b"texts.txt"), r"DistillOptions.data: expected a path or a sequence of paths"),
    (dict(work_dir=5), r"DistillOptions.work_dir: expected a folder path or None, got 5$"),
])
def test_distill_options_refuse_what_the_command_s_parser_refuses(fields, match):
    with pytest.raises(ValueError, match=match):
        DistillOptions(**{"data": ["texts.txt"], **fields})


@pytest.mark.parametrize("fields, match", [
    (dict(num_slots="4"), r"ConversionOptions.num_slots: expected an integer >= 1, got '4'$"),
    (dict(chunk_size=8.0), r"ConversionOptions.chunk_size: expected an integer >= 1, got 8.0$"),
    (dict(seed="0"), r"ConversionOptions.seed: expected an integer, got '0'$"),
    (dict(attention_every=0), r"ConversionOptions.attention_every: expected an integer >= 1, got 0$"),
    (dict(overrides=[("conv_size", 2)]), r"ConversionOptions.overrides: expected a mapping of TrellisConfig fields"),
])
def test_conversion_options_refuse_what_the_command_s_parser_refuses(fields, match):
    with pytest.raises(ValueError, match=match):
        ConversionOptions(**fields)


def test_a_single_data_path_is_one_path(teacher_and_texts, tmp_path):
    """Issue 72: ``data="folder"`` was read as the paths "f", "o", ... ("no such file")."""
    _, texts = teacher_and_texts
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_text(texts.read_text())
    for data in (str(folder), folder, str(texts), texts):
        options = DistillOptions(data=data)
        assert options.data == (data,)
        assert read_texts(options.data) == read_texts(texts) == read_texts(texts, "DistillOptions.data")
    assert DistillOptions(data=[texts, str(folder)]).data == (texts, str(folder))


@pytest.mark.parametrize("suffix, content, where, what", [
    (".jsonl", b'{"text": "a"}\n{"txt": "b"}\n', "line 2", 'has no "text" string'),
    (".jsonl", b'{"text": "a"}\n\n{"text": 5}\n', "line 3", 'has no "text" string'),
    (".jsonl", b'["text", "a"]\n', "line 1", 'has no "text" string'),
    (".jsonl", b'{"text": "a"}\n{"text": "b"\n', "line 2", r"is not JSON \(Expecting ',' delimiter\)"),
    (".jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', "line 2", r"is not UTF-8 text \(byte 0xff\)"),
    (".txt", b"one\ntwo \xe9\nthree", "line 2", r"is not UTF-8 text \(byte 0xe9\)"),
])
def test_a_data_file_that_cannot_be_read_is_named_with_its_line(teacher_and_texts, tmp_path, capsys, suffix, content,
                                                              where, what):
    """Issue 72: a bare ``KeyError: 'text'``, or a decoder's message naming no file (a traceback on
    the command line). The command reports it as one line, writing nothing."""
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^DistillOptions.data: {bad} {where} {what}"):
        read_texts([bad], "DistillOptions.data")
    with pytest.raises(ValueError, match=rf"^argument paths: {bad} {where} {what}"):
        read_texts(tmp_path)  # found in a folder, named alike
    assert run_cli(teacher_and_texts[0], tmp_path / "out", "--distill", "--data", bad) == 2
    assert re.fullmatch(rf"trellis-lm convert: error: argument --data: {bad} {where} {what}.*\n", capsys.readouterr().err)
    assert [p.name for p in tmp_path.iterdir()] == [bad.name]


def test_the_function_refuses_before_writing(teacher_and_texts, tmp_path):
    folder, texts = teacher_and_texts
    for kwargs, match in [
        (dict(conversion=ConversionOptions(keep_attention=[0]), distill=DistillOptions(data=[texts], keep_dearest=1)),
         "DistillOptions.keep_dearest: it chooses the kept layers itself"),
        (dict(distill=DistillOptions(data=[texts], stage1_patience=2)), "DistillOptions.stage1_patience"),
        (dict(distill=DistillOptions(data=[])), "DistillOptions.data: no training texts given"),
        (dict(conversion=ConversionOptions(num_slots=8, chunk_size=8, overrides={"head_dim": 4})),
         "mismatched head dims"),
        (dict(overwrite="no"), "argument overwrite: expected True or False, got 'no'"),
        (dict(distill={"data": [texts]}), "argument distill: expected DistillOptions or None"),
    ]:
        with pytest.raises(ValueError, match=match):
            convert_and_distill(folder, tmp_path / "out", **kwargs)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="argument dst: .* the source .*: a conversion never writes into its source"):
        convert_and_distill(folder, folder / "out")


def test_python_callers_read_python_names_and_the_command_its_options(teacher_and_texts, tmp_path, capsys):
    """Issue 72: the function answered a Python caller in the command's words ("pass --overwrite",
    "argument --stage1-patience"); each names an argument as its caller sets it."""
    folder, texts = teacher_and_texts
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    (tmp_path / "a-file").write_text("")
    cases = [  # (Python arguments, the same from the command line, the message in each)
        (dict(dst=tmp_path / "full"), ("--num-slots", 8), "argument dst: .* not empty: pass overwrite=True to replace it",
         "argument dst: .* not empty: pass --overwrite to replace it"),
        (dict(distill=DistillOptions(data=texts, stage1_patience=2)), ("--distill", "--data", texts, "--stage1-patience", 2),
         r"DistillOptions.stage1_patience: stopping needs held-out blocks to measure \(heldout_blocks=N\)",
         r"argument --stage1-patience: stopping needs held-out blocks to measure \(--heldout-blocks N\)"),
        (dict(distill=DistillOptions(data=texts, state_passing=0, state_passing_from=0.5)),
         ("--distill", "--data", texts, "--state-passing", 0, "--state-passing-from", 0.5),
         r"DistillOptions.state_passing_from: state passing is off \(state_passing=0\)",
         r"argument --state-passing-from: state passing is off \(--state-passing 0\)"),
        (dict(distill=DistillOptions(data=texts, work_dir=tmp_path / "a-file")),
         ("--distill", "--data", texts, "--work-dir", tmp_path / "a-file"),
         "DistillOptions.work_dir: .* is a file", "argument --work-dir: .* is a file"),
        (dict(distill=DistillOptions(data=tmp_path / "none.txt")), ("--distill", "--data", tmp_path / "none.txt"),
         "DistillOptions.data: .*none.txt: no such file or folder", "argument --data: .*none.txt: no such file or folder"),
    ]
    for kwargs, argv, python, command in cases:
        dst = kwargs.pop("dst", tmp_path / "out")
        with pytest.raises(ValueError, match=f"^{python}") as error:
            convert_and_distill(folder, dst, **kwargs)
        assert " --" not in str(error.value)
        assert run_cli(folder, dst, *argv) == 2
        assert re.fullmatch(f"trellis-lm convert: error: {command}.*\n", capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "full"]
    assert run_cli(folder, tmp_path / "out", "--set", "seed=1") == 2
    assert capsys.readouterr().err == ("trellis-lm convert: error: argument --set: seed has its own argument, --seed, "
                                       "not a further config field\n")


def test_a_resume_continues_only_the_run_its_work_folder_holds(teacher_and_texts, tmp_path, capsys):
    """Issue 72: a resume took the work folder's earlier run (num_slots 8, C 16, anchored) whatever
    the options asked (4, 8, exact) and printed success. The work folder records its run; a resume
    with other options is refused naming each, before anything is written; a run may be resumed
    for more steps; a fresh start (no resume) replaces the earlier run's checkpoints."""
    folder, texts = teacher_and_texts
    work = tmp_path / "work"
    earlier = (ConversionOptions(num_slots=8, chunk_size=16, overrides={"write_gradient": "anchored"}),
               DistillOptions(data=texts, work_dir=work, stage1_steps=2))
    begin_run(work, run_record(folder, *earlier), resume=False)
    (work / "layerwise" / "checkpoint-2").mkdir(parents=True)
    recorded = (work / "run.json").read_text()
    asked = ConversionOptions(num_slots=4, chunk_size=8, overrides={"write_gradient": "exact"})
    resumed = DistillOptions(data=texts, work_dir=work, stage1_steps=2, resume=True)
    with pytest.raises(ValueError, match=(
            r"^DistillOptions.resume: .*work holds a run made with other options: ConversionOptions.num_slots 4 "
            r"\(the run's: 8\), ConversionOptions.chunk_size 8 \(the run's: 16\), TrellisConfig.write_gradient "
            r"'exact' \(the run's: 'anchored'\); resume it with its own, or start afresh without resuming")):
        convert_and_distill(folder, tmp_path / "out", asked, resumed)
    assert run_cli(folder, tmp_path / "out", "--num-slots", 4, "--chunk-size", 8, "--set", "write_gradient=exact",
                   "--distill", "--data", texts, "--work-dir", work, "--stage1-steps", 2, "--resume") == 2
    assert re.fullmatch(r"trellis-lm convert: error: argument --resume: .* --num-slots 4 \(the run's: 8\), "
                        r"--chunk-size 8 \(the run's: 16\), TrellisConfig.write_gradient 'exact' .*\n",
                        capsys.readouterr().err)
    for other, field in [(dict(lora_rank=4), "DistillOptions.lora_rank 4"), (dict(bf16=True), "DistillOptions.bf16 True"),
                         (dict(keep_dearest=1), "DistillOptions.keep_dearest 1")]:
        with pytest.raises(ValueError, match=f"other options: {field} "):
            convert_and_distill(folder, tmp_path / "out", earlier[0], dataclasses.replace(resumed, **other))
    other_teacher = tmp_path / "teacher2"
    make_teacher("llama", other_teacher, layers=3, seed=3)
    with pytest.raises(ValueError, match=f"other options: src '{other_teacher.resolve()}'"):
        convert_and_distill(other_teacher, tmp_path / "out", earlier[0], resumed)
    assert (work / "run.json").read_text() == recorded and not (tmp_path / "out").exists()

    # More steps, another step count between checkpoints, another machine: the same run.
    check_resumable(work, run_record(folder, earlier[0], dataclasses.replace(
        resumed, stage1_steps=9, stage2_steps=7, save_steps=3, cpu=True, data=[texts, texts])))
    # Checkpoints of a run that recorded nothing cannot be told to be this run's.
    (work / "run.json").unlink()
    with pytest.raises(ValueError, match="holds checkpoints but no record of the options that made them"):
        check_resumable(work, run_record(folder, *earlier))
    # A fresh start replaces what an earlier run left (teacher activations, found by fingerprint, stay).
    (work / "teacher_activations").mkdir()
    begin_run(work, run_record(folder, asked, resumed), resume=False)
    assert sorted(p.name for p in work.iterdir()) == ["run.json", "teacher_activations"]
    check_resumable(work, run_record(folder, asked, resumed))
def test_a_config_field_with_its_own_option_is_refused_in_overrides():
    """``--set num_slots=4`` once raised a bare TypeError deep in the conversion ("got multiple
    values"); it names the argument to use instead."""
    for name in ("num_slots", "chunk_size", "seed"):
        with pytest.raises(ValueError, match=rf"ConversionOptions.overrides: {name} has its own argument, "
                                             rf"ConversionOptions.{name}"):
            ConversionOptions(overrides={name: 4})
    assert ConversionOptions(overrides={"conv_size": 2}).options()["conv_size"] == 2
