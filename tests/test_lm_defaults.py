"""The defaults study (issue 74): a CI-sized run of its command (resumed, rendered), how it
compares a candidate with the Llama, and the other domain's text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from studies.lm import GENERATED, torch_headers
from studies.lm_defaults import (CANDIDATES, DEFAULT_MODEL, PACKAGE_DEFAULT, PRESETS, against, far_near, other_ratios,
                                 seed_by_seed)
from studies.lm_extrapolation import build
from trellis_lm import TrellisConfig
from trellis_lm.state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION

ROOT = Path(__file__).resolve().parent.parent


def test_the_quick_preset_runs_resumes_and_renders(tmp_path):
    command = [sys.executable, "-m", "studies.lm_defaults", "--preset", "quick", "--out", str(tmp_path),
               "--page", str(tmp_path / "page.md"), "--models", "llama,default,no-state-passing,no-conv"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    records = json.loads((tmp_path / "lm_defaults.json").read_text())
    assert len(records) == 13  # 2 rates + 1 seed each, and the close call's second seed of the Llama
    assert sorted(r["seed"] for r in records if r["model"] == "llama" and r["phase"] == "full") == [0, 1]
    full = {r["model"]: r for r in records if r["phase"] == "full"}
    assert set(full) == {"llama", "default", "no-state-passing", "no-conv"}
    for record in full.values():
        assert list(record["ppl_by_position"]) == list(record["other_ppl_by_position"]) == ["0-32", "32-64", "64-128"]
        assert record["test_ppl"] > 1 and len(record["other_source"]["files"]) == 2
    assert (full["default"]["state_passing"], full["default"]["state_passing_from"]) == (0.9, 0.7)
    assert full["default"]["overrides"] == {"write_gradient": "exact", "chunk_size": 16}
    assert full["no-conv"]["overrides"]["conv_size"] == 0 and full["no-state-passing"]["state_passing"] == 0
    # The same seed, windows and weights until state passing starts: the runs differ only by it.
    assert full["default"]["curve"][0] == full["no-state-passing"]["curve"][0]
    assert full["default"]["val_ppl"] != full["no-state-passing"]["val_ppl"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)  # resumed: nothing runs again
    assert len(json.loads((tmp_path / "lm_defaults.json").read_text())) == 13
    page = (tmp_path / "page.md").read_text()
    assert "## The issue's goals, for the default when the study began" in page and "| no-conv | no short convolution" in page
    assert "Not run yet (or not every seed finished): state-passing-last-10" in page
    assert (tmp_path / "figures" / "lm_defaults.png").is_file()
    refused = subprocess.run(command[:-1] + ["llama,defualt"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and "--models: no candidate named defualt; the candidates: llama, default," in refused.stderr


def test_every_candidate_changes_one_thing_from_its_base():
    def settings(variant):
        overrides = {f"config {k}": v for k, v in variant.spec.overrides.items()}
        return {**overrides, "state passing": (variant.state_passing, variant.state_passing_from, variant.state_decay),
                "gate span": variant.gate_span, "length": variant.length_factor, "rate": variant.learning_rate}

    by_name = {c.name: c for c in CANDIDATES}
    order = list(by_name)
    for candidate in CANDIDATES:
        if candidate.name not in ("llama", "default"):
            base = by_name[candidate.base]
            assert order.index(base.name) < order.index(candidate.name)  # a stopped study has the base first
            mine, theirs = settings(candidate.variant), settings(base.variant)
            changed = [k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k)]
            assert len(changed) == 1, (candidate.name, changed)
    assert len(by_name) == len(CANDIDATES)


def test_the_package_default_candidate_has_the_package_defaults():
    """The row the page reads the goals for as the package's default is built with the package's
    defaults for every model field the study's size leaves to them (the slot count among them), and
    state passing as the recipes' default; "default", where the study began, is not."""
    def config(name):
        variant = next(c.variant for c in CANDIDATES if c.name == name)
        return variant, build(variant, PRESETS["cpu"], 64, 2_000_000).config

    package = TrellisConfig()
    fields = ("num_slots", "compress_fn", "mix_fn", "write_gradient", "chunk_size", "conv_size", "use_forget_gate",
              "gate_logit_normalizer")
    variant, built = config(PACKAGE_DEFAULT)
    assert {f: getattr(built, f) for f in fields} == {f: getattr(package, f) for f in fields}
    assert (variant.state_passing, variant.state_passing_from, variant.state_decay, variant.gate_span) == (
        DEFAULT_PROBABILITY, DEFAULT_START_FRACTION, None, None)
    _, began = config("default")
    assert (began.mix_fn, began.num_slots) == ("ln_silu", 32)
    assert set(DEFAULT_MODEL) <= set(fields)


def test_a_candidate_is_compared_seed_by_seed_and_far_with_near():
    llama = [{"seed": 0, "val_ppl": 50.0}, {"seed": 1, "val_ppl": 60.0}]
    runs = [{"seed": 0, "val_ppl": 51.0}, {"seed": 1, "val_ppl": 60.0}, {"seed": 2, "val_ppl": 55.0 * 1.05}]
    mean, worst = against(runs, llama)
    assert mean == pytest.approx((51 + 60 + 57.75) / 3 / 55 - 1)
    assert worst == pytest.approx(0.05)  # seed 2 against the Llama's mean (no seed 2 there); seed 0 is +2%
    assert seed_by_seed(runs, llama) == "+2.0% / +0.0%" and seed_by_seed(runs, None) == "-"
    run = {"ppl_by_position": {"0-128": 10.0, "128-256": 13.0, "256-512": 11.0}}
    assert far_near(run) == pytest.approx((1.1, 1.3))
    other = [{"seed": 0, "other_ppl_by_position": {"0-128": 20.0, "128-256": 1.0, "256-512": 30.0}}]
    base = [{"seed": 0, "other_ppl_by_position": {"0-128": 10.0, "128-256": 1.0, "256-512": 20.0}}]
    assert other_ratios(other, base) == pytest.approx((2.0, 1.5))
    # Read against the Llama's runs of the candidate's own seeds: a seed it lacks does not count.
    more = base + [{"seed": 3, "other_ppl_by_position": {"0-128": 30.0, "128-256": 1.0, "256-512": 60.0}}]
    assert other_ratios(other, more) == pytest.approx((2.0, 1.5))
    assert against(runs[:2], llama + [{"seed": 3, "val_ppl": 99.0}])[0] == pytest.approx(55.5 / 55 - 1)


def test_the_other_domain_is_hand_written_headers_picked_by_path_alone(tmp_path):
    def tokenizer(text, add_special_tokens):
        return {"input_ids": list(text.encode())}

    files, source = torch_headers(tokenizer, 20_000, 3)
    again, same = torch_headers(tokenizer, 20_000, 3)
    assert source == same and [f.tolist() for f in files] == [f.tolist() for f in again]
    assert len(files) == 3 and all(f.numel() >= 20_000 for f in files) and len(set(source["files"])) == 3
    for ids in files:
        assert not any(mark in bytes(ids[:2000].tolist()).decode(errors="replace") for mark in GENERATED)
    with pytest.raises(ValueError, match="headers of 20000 tokens or more; 1000000 were asked for"):
        torch_headers(tokenizer, 20_000, 1_000_000)
    # Generated files are passed over wherever their paths sort, and files of too few tokens (by
    # the tokenizer, not bytes) are not taken.
    def words(text, add_special_tokens):
        return {"input_ids": [len(word) for word in text.split()]}

    for index, mark in enumerate(GENERATED * 3):
        (tmp_path / f"generated{index}.h").write_text(f"// {mark}\n" + "int x;\n" * 100)
    (tmp_path / "one_word.h").write_text("y" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "written.h").write_text("// by hand\n" + "int z;\n" * 100)
    files, source = torch_headers(words, 150, 1, root=tmp_path)
    assert source["files"] == ["sub/written.h"] and files[0][:3].tolist() == [2, 2, 4]
    with pytest.raises(ValueError, match="holds 1 headers of 150 tokens or more; 2 were asked for"):
        torch_headers(words, 150, 2, root=tmp_path)
