"""The language-modelling study: its data split, its same-size models, and a smoke run of the
command (resumed, rendered)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trellis_lm import TrellisConfig, TrellisForCausalLM
from studies.lm import build_study_model, capped_horizons, memory_profile, num_parameters, stdlib_corpus, study_models
from studies.records import chosen_runs, median_range, spread, widened_rate
from studies.synthetic import ModelSize
from trellis_lm.eval.passkey import PASSKEY_LINE, PASSKEY_QUESTION, passkey_preference
from trellis_lm.eval.perplexity import perplexity_by_position, position_buckets
from trellis_lm.mixers import forget_gate_bias
from trellis_lm.tokenization_trellis import train_tokenizer

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
    command = [sys.executable, "-m", "studies.lm_study", "--preset", "quick", "--out", str(tmp_path),
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


def test_a_sweep_widens_only_when_its_best_rate_is_at_an_edge():
    assert widened_rate([1e-3, 3e-3, 6e-3], 3e-3) is None
    assert widened_rate([1e-3, 3e-3, 6e-3], 6e-3) == pytest.approx(1.2e-2)
    assert widened_rate([1e-3, 3e-3, 6e-3, 1.2e-2], 1e-3) == pytest.approx(5e-4)
    assert widened_rate([1e-3, 3e-3], None) is None and widened_rate([3e-3], 3e-3) is None


def test_the_tables_take_the_full_runs_at_the_best_rate_of_a_widened_sweep():
    def run(phase, lr, val, seed=0):
        return {"model": "m", "phase": phase, "learning_rate": lr, "val_ppl": val, "seed": seed, "train_tokens": 1,
                "test_ppl": val if phase == "full" else None}

    records = [run("sweep", 3e-3, 9.0), run("sweep", 6e-3, 8.0), run("full", 6e-3, 5.0), run("full", 6e-3, 5.1, 1),
               run("sweep", 1.2e-2, 7.0), run("full", 1.2e-2, 4.0)]
    assert [r["test_ppl"] for r in chosen_runs(records)] == [4.0]


def test_the_forget_gate_bias_spreads_one_minus_beta_over_its_span():
    for span in ((1e-3, 1e-1), (1e-2, 1e-1)):
        beta = torch.exp(F.logsigmoid(forget_gate_bias(3, 16.0, span)) / 16.0)
        torch.testing.assert_close(1 - beta, torch.tensor([span[1], math.sqrt(span[0] * span[1]), span[0]],
                                                          dtype=torch.float64))
    with pytest.raises(ValueError, match="span"):
        forget_gate_bias(2, 16.0, (0.1, 0.01))


class Copier(torch.nn.Module):
    """An induction head and nothing else: after a pair of tokens it predicts (with a large logit)
    the token that followed that pair's previous occurrence, so it copies a key it was shown."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, use_cache=False):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), self.vocab_size)
        after = {}
        for t in range(1, len(ids)):
            pair = (ids[t - 1], ids[t])
            if pair in after:
                logits[0, t, after[pair]] = 30.0
            if t + 1 < len(ids):
                after[pair] = ids[t + 1]
        return SimpleNamespace(logits=logits)


def test_passkey_preference_scores_the_shown_key_against_a_fresh_one():
    text = [PASSKEY_LINE.format(key=n) + PASSKEY_QUESTION + " @@@@ 0123456789" for n in range(10_000, 10_400, 7)]
    tokenizer = train_tokenizer(text, 300)
    filler = tokenizer("@", add_special_tokens=False)["input_ids"]
    files = [torch.tensor(filler * 300)]
    copier = passkey_preference(Copier(len(tokenizer)), tokenizer, files, 120, (0.0, 0.5, 1.0), 3, seed=0)
    assert copier["preferred"] == 1.0 and copier["margin_nats"] > 10


def test_memory_profile_reads_the_states_and_the_forget_horizons():
    config = TrellisConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=8,
                           intermediate_size=48, num_slots=4, chunk_size=4, mixer_types=["trellis", "attention"])
    torch.manual_seed(0)
    model = TrellisForCausalLM(config).eval()
    tokens = torch.randint(0, 64, (30,))
    profile = memory_profile(model, tokens, (7, 30))
    assert list(profile["rms"]) == ["7", "30"] and [list(layer) for layer in profile["rms"]["30"]] == [["m_k", "m_v"]]
    # One pass with a cache: the state after 30 tokens is the one a single call over them gives.
    out = model(input_ids=tokens[None], use_cache=True)
    state = out.past_key_values.layers[0].state
    assert profile["rms"]["30"][0]["m_k"] == pytest.approx(state.m_k.pow(2).mean().sqrt().item(), rel=1e-5)
    # At initialisation the horizons are the bias's: 1 / (1 - beta) for 1 - beta from 0.1 to 0.001.
    horizons = profile["horizon"]
    assert len(horizons) == 1
    for got, want in zip(horizons[0], [10.0, 10 ** (5 / 3), 10 ** (7 / 3), 1000.0]):
        assert got == pytest.approx(want, rel=0.25)
    with capped_horizons(model, 20.0) as capped:
        assert capped == 1 and max(memory_profile(model, tokens, (30,))["horizon"][0]) <= 20.0 + 1e-3
    assert memory_profile(model, tokens, (30,))["horizon"][0][-1] == pytest.approx(1000.0, rel=0.25)  # hooks gone
    no_forget = TrellisForCausalLM(TrellisConfig(**{**config.to_dict(), "use_forget_gate": False})).eval()
    assert memory_profile(no_forget, tokens, (30,))["horizon"] == []


def test_the_trellis_mixer_states_its_forget_gate():
    # The studies read horizons through the mixer: its log beta is the op's input, and the cap is
    # the largest logit whose horizon is at most the one asked for.
    model = TrellisForCausalLM(TrellisConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=3,
                                             head_dim=8, intermediate_size=48, num_slots=4,
                                             gate_logit_normalizer=7.0)).eval()
    mixer = model.model.layers[0].self_attn
    logits = torch.randn(2, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mixer.log_forget(logits), F.logsigmoid(logits) / 7.0)
    # Far out on both sides too (the gate's form switches to x itself below -20), with its gradient.
    for dtype in (torch.float64, torch.float32):
        wide = torch.linspace(-60.0, 60.0, 1201, dtype=dtype, requires_grad=True)
        got, = torch.autograd.grad(mixer.log_forget(wide).sum(), wide)
        want, = torch.autograd.grad((F.logsigmoid(wide) / 7.0).sum(), wide)
        torch.testing.assert_close(mixer.log_forget(wide), F.logsigmoid(wide) / 7.0)
        torch.testing.assert_close(got, want)
    for horizon in (1.5, 20.0, 4096.0):
        cap = torch.tensor([mixer.forget_logit_cap(horizon)], dtype=torch.float64)
        assert -1.0 / mixer.log_forget(cap).item() == pytest.approx(horizon, rel=1e-9)
        assert -1.0 / mixer.log_forget(cap + 1e-3).item() > horizon
    with pytest.raises(ValueError, match="horizon"):
        mixer.forget_logit_cap(0.0)


def test_the_studies_show_spreads_alike():
    assert spread([1.0, 2.0, 4.5]) == "2.50 [1.00, 4.50]" and spread([3.14159], digits=3) == "3.142"
    # The lower median; a run that never got there counts as the largest.
    assert median_range([30.0, None, 10.0, None], 0) == "30 [10, never]"
    assert median_range([None, None, 5.0], 1, missing="-") == "- [5.0, -]"


def test_perplexity_by_position_can_read_each_segment_from_a_fresh_state():
    config = TrellisConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=8,
                           intermediate_size=48, num_slots=4, chunk_size=4)
    torch.manual_seed(0)
    model = TrellisForCausalLM(config).eval()
    files = [torch.randint(0, 64, (40,))]
    one_pass = perplexity_by_position(model, files, 32, 8, 1)
    assert perplexity_by_position(model, files, 32, 8, 1, reset_every=32) == one_pass
    reset = perplexity_by_position(model, files, 32, 8, 1, reset_every=8)
    with torch.no_grad():  # by hand: each 8-token segment scored on its own
        losses = torch.cat([F.cross_entropy(model(input_ids=files[0][None, s : s + 8]).logits[0], files[0][s + 1 : s + 9],
                                            reduction="none") for s in range(0, 32, 8)])
    assert reset["0-8"] == pytest.approx(one_pass["0-8"])  # the first segment is the same read
    assert [reset[k] for k in ("8-16", "16-32")] == pytest.approx(
        [math.exp(losses[8:16].mean().item()), math.exp(losses[16:32].mean().item())], rel=1e-5)
    assert reset["16-32"] != pytest.approx(one_pass["16-32"])
    with pytest.raises(ValueError, match="reset_every"):
        perplexity_by_position(model, files, 32, 8, 1, reset_every=0)


def test_the_extrapolation_study_runs_renders_and_measures_kept_models(tmp_path):
    command = [sys.executable, "-m", "studies.lm_extrapolation", "--preset", "quick", "--out", str(tmp_path),
               "--page", str(tmp_path / "page.md"), "--models", "trellis,trellis-T512", "--keep-models", str(tmp_path / "m")]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    records = json.loads((tmp_path / "lm_extrapolation.json").read_text())
    assert [(r["model"], r["train_length"], r["batch_size"]) for r in records] == [("trellis", 32, 4), ("trellis-T512", 128, 1)]
    for record in records:
        assert set(record["passkey_preference"]) == {"32", "128"} and len(record["memory"]["horizon"]) == 4
        assert set(record["ppl_by_position_capped_8x"]) == set(record["ppl_by_position_reset_8x"]) == set(record["ppl_by_position"])
    page = (tmp_path / "page.md").read_text()
    assert "| trellis-T512 | 128 | 1 | 0.003 | no | 1 |" in page and (tmp_path / "figures" / "lm_extrapolation.png").is_file()
    # A measure missing from a record (added to the study after the run) is taken on the kept model.
    first = records[0].pop("ppl_by_position_reset_8x")
    (tmp_path / "lm_extrapolation.json").write_text(json.dumps(records))
    subprocess.run(command[:-4] + ["--models", "trellis", "--keep-models", str(tmp_path / "m")], check=True,
                   capture_output=True, cwd=ROOT)
    again = json.loads((tmp_path / "lm_extrapolation.json").read_text())
    assert again[0]["ppl_by_position_reset_8x"] == pytest.approx(first) and len(again) == 2


def test_the_extrapolation_study_trains_with_state_passing(tmp_path):
    command = [sys.executable, "-m", "studies.lm_extrapolation", "--preset", "quick", "--out", str(tmp_path),
               "--page", str(tmp_path / "page.md"), "--models", "trellis-sp-late"]
    subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
    [record] = json.loads((tmp_path / "lm_extrapolation.json").read_text())
    assert (record["state_passing"], record["state_passing_from"]) == (0.9, 0.8) and "memory" not in record
    assert "| trellis-sp-late | 32 | 4 | 0.003 | p = 0.9, from 80% of the steps | 1 |" in (tmp_path / "page.md").read_text()
