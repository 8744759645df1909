"""The language-modelling study: its data split, its same-size models, and a smoke run of the
command (resumed, rendered)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trellis_lm.eval.synthetic import ModelSize
from trellis_lm.eval.lm_study import (
    build_study_model, num_parameters, position_buckets, stdlib_corpus, study_models,
)

ROOT = Path(__file__).resolve().parent.parent


def test_the_split_is_by_file_deterministic_and_disjoint():
    first, second = stdlib_corpus(), stdlib_corpus()
    assert first.files == second.files
    seen = [set(paths) for paths in first.files.values()]
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert all(len(paths) > 10 for paths in first.files.values())
    with pytest.raises(ValueError, match="held_out_percent"):
        stdlib_corpus(held_out_percent=50)


def test_every_study_model_has_the_llama_s_parameter_count_within_5_percent():
    size = ModelSize(hidden_size=48, num_hidden_layers=4, num_heads=2, head_dim=24, intermediate_size=128,
                     num_slots=12, chunk_size=8)
    counts = {spec.name: num_parameters(build_study_model(spec, size, 300, 512)) for spec in study_models(64)}
    assert set(counts) >= {"llama", "trellis", "delta-rule", "trellis-no-forget", "trellis-mix-softmax", "trellis-C1",
                           "lattice", "kvm", "hybrid"}
    for name, count in counts.items():
        assert abs(count / counts["llama"] - 1) <= 0.05, (name, count, counts["llama"])


def test_position_buckets_double_from_the_training_length():
    assert position_buckets(512, 64) == [(0, 64), (64, 128), (128, 256), (256, 512)]
    assert position_buckets(100, 64) == [(0, 64), (64, 100)]


def test_the_quick_preset_runs_resumes_and_renders(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "lm_study.py"), "--preset", "quick", "--out", str(tmp_path),
               "--page", str(tmp_path / "page.md"), "--models", "llama,trellis"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    records = json.loads((tmp_path / "lm_study.json").read_text())
    full = [r for r in records if r["phase"] == "full"]
    assert {r["model"] for r in full} == {"llama", "trellis"} and len(records) == 6  # 2 rates + 1 seed each
    for record in full:
        for key in ("model", "mixer_types", "seed", "learning_rate", "train_tokens", "train_length", "num_parameters",
                    "val_ppl", "test_ppl", "ppl_by_length", "passkey", "tokens_per_s"):
            assert record[key] is not None, key
        assert set(record["ppl_by_length"]) == set(record["passkey"]) == {"32", "128"}
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)  # resumed: nothing runs again
    assert len(json.loads((tmp_path / "lm_study.json").read_text())) == 6
    page = (tmp_path / "page.md").read_text()
    assert "| trellis |" in page and "## Findings over seeds" in page and (tmp_path / "figures" / "lm_passkey.png").is_file()
