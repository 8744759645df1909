"""Synthetic recall: MQAR data, S-NIAH prompts and scoring, and the MQAR training harness."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tiny_models import tiny_model
from trellis_lm import train_tokenizer
from trellis_lm.eval.mqar import FILLER_TOKEN, IGNORE_INDEX, answer_accuracy, make_mqar
from trellis_lm.eval.niah import (
    NOISE_SENTENCES, NIAHExample, make_niah_example, make_niah_training_data, niah_match, niah_tokenizer, score_niah,
)
from trellis_lm.eval.synthetic import (
    MQARTask, ModelSize, NIAHTask, TrainSettings, build_model, default_variants, mqar_accuracy, run_mqar,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "synthetic_recall.py"


# ---------------------------------------------------------------- MQAR data


def test_mqar_shapes_and_determinism():
    ids, labels = make_mqar(5, 40, 4, 30, seed=3)
    assert ids.shape == labels.shape == (5, 40) and ids.dtype == labels.dtype == torch.long
    again_ids, again_labels = make_mqar(5, 40, 4, 30, seed=3)
    assert torch.equal(ids, again_ids) and torch.equal(labels, again_labels)
    assert not torch.equal(ids, make_mqar(5, 40, 4, 30, seed=4)[0])


@pytest.mark.parametrize("num_queries", [None, 2])
def test_mqar_labels_are_the_values_of_queried_keys(num_queries):
    pairs, vocab = 6, 40
    ids, labels = make_mqar(50, 64, pairs, vocab, seed=0, num_queries=num_queries)
    for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
        keys, values = row_ids[0 : 2 * pairs : 2], row_ids[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)
        assert all(vocab // 2 <= v < vocab for v in values)
        value_of = dict(zip(keys, values))
        answers = [t for t, label in enumerate(row_labels) if label != IGNORE_INDEX]
        assert len(answers) == (num_queries or pairs)
        assert all(t >= 2 * pairs + 1 for t in answers)  # no label inside the context
        asked = [row_ids[t - 1] for t in answers]
        assert len(set(asked)) == len(asked) and all(k in value_of for k in asked)
        assert all(row_labels[t] == row_ids[t] == value_of[row_ids[t - 1]] for t in answers)
        # Everything after the context that is neither a query key nor its answer is filler.
        query_tokens = {t for a in answers for t in (a - 1, a)}
        assert all(row_ids[t] == FILLER_TOKEN for t in range(2 * pairs, 64) if t not in query_tokens)


def test_mqar_query_gaps_follow_the_power_law():
    def mean_offset(power_a: float) -> float:
        ids, labels = make_mqar(400, 200, 4, 64, seed=1, power_a=power_a)
        rows, cols = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        return (cols - 1 - 8).float().mean().item()  # key position relative to the context end

    uniform, heavy = mean_offset(1.0), mean_offset(0.01)
    # a = 1 is uniform over the 96 two-token slots (offset 0 .. 190), mean ~ 95.
    assert 80 < uniform < 110
    # Small a concentrates queries near the context but keeps a long tail.
    assert heavy < 0.75 * uniform
    ids, labels = make_mqar(400, 200, 4, 64, seed=1, power_a=0.01)
    offsets = (labels != IGNORE_INDEX).nonzero(as_tuple=True)[1] - 9
    assert (offsets < 20).float().mean() > 0.3 and offsets.max() > 150


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(seq_len=15), "seq_len 15 is too short"),
        (dict(vocab_size=9), "fewer than num_kv_pairs"),
        (dict(num_examples=0), "num_examples"),
        (dict(num_kv_pairs=0), "num_kv_pairs"),
        (dict(power_a=0.0), "power_a"),
        (dict(num_queries=5), "num_queries"),
    ],
)
def test_mqar_rejects_bad_arguments(kwargs, message):
    args = dict(num_examples=2, seq_len=16, num_kv_pairs=4, vocab_size=32, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        make_mqar(**args)


def test_model_loss_sees_only_the_answers():
    model = tiny_model()
    ids, labels = make_mqar(3, 24, 3, 97, seed=0)
    logits = model(input_ids=ids).logits
    loss = model(input_ids=ids, labels=labels).loss
    answer = labels[:, 1:] != IGNORE_INDEX
    expected = F.cross_entropy(logits[:, :-1][answer], labels[:, 1:][answer])
    torch.testing.assert_close(loss, expected)
    # Logits that put all mass on the labels score 1; on the filler token, 0.
    perfect = F.one_hot(labels.roll(-1, dims=1).clamp(min=0), 97).float()  # logits at t predict t + 1
    assert answer_accuracy(perfect, labels) == (9, 9)
    assert answer_accuracy(torch.zeros(3, 24, 97).index_fill_(2, torch.tensor([0]), 1.0), labels) == (0, 9)


# ---------------------------------------------------------------- NIAH


@pytest.fixture(scope="module")
def tokenizer():
    texts = list(NOISE_SENTENCES) * 20 + ["The special magic number for amber is 1234567.", "Question: what is"] * 20
    return train_tokenizer(texts, vocab_size=320)


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_niah_needle_sits_at_the_requested_depth(tokenizer, depth):
    example = make_niah_example(tokenizer, 300, depth, "number", seed=7)
    needle = f"is {example.answer}."
    assert example.prompt.index(needle) > example.needle_char_start
    assert abs(example.needle_char_start / example.haystack_chars - depth) < 0.15
    assert example.prompt.rstrip().endswith("is") and "Question:" in example.prompt[example.haystack_chars :]
    assert example.answer.isdigit() and len(example.answer) == 7
    length = len(tokenizer(example.prompt, add_special_tokens=False)["input_ids"])
    assert 250 <= length <= 302


def test_niah_uuid_needles_and_prose_haystack_are_seeded(tokenizer):
    first = make_niah_example(tokenizer, 400, 0.5, "uuid", seed=1, haystack="prose")
    assert first == make_niah_example(tokenizer, 400, 0.5, "uuid", seed=1, haystack="prose")
    assert str(uuid.UUID(first.answer)) == first.answer and first.answer in first.prompt
    assert make_niah_example(tokenizer, 400, 0.5, "uuid", seed=2).answer != first.answer
    assert not any(s in first.prompt for s in NOISE_SENTENCES)
    with pytest.raises(ValueError, match="needle_kind"):
        make_niah_example(tokenizer, 400, 0.5, "word", seed=1)
    with pytest.raises(ValueError, match="depth"):
        make_niah_example(tokenizer, 400, 1.5, "number", seed=1)
    with pytest.raises(ValueError, match="cannot hold"):
        make_niah_example(tokenizer, 10, 0.5, "number", seed=1)


class AnswersEveryOther:
    """A stand-in for a model: generates the right answer for even rows, a wrong one otherwise."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, examples: list[NIAHExample]) -> None:
        self.tokenizer, self.examples, self.rows = tokenizer, examples, 0

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        assert kwargs["do_sample"] is False
        assert attention_mask[:, -1].all()  # left padded: every prompt ends at the last column
        texts = [" " + (e.answer if (self.rows + i) % 2 == 0 else "0000000")
                 for i, e in enumerate(self.examples[self.rows : self.rows + len(input_ids)])]
        self.rows += len(input_ids)
        new = self.tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")["input_ids"]
        return torch.cat([input_ids, new[:, :max_new_tokens]], 1)


def test_score_niah_matches_strings_in_the_new_tokens(tokenizer):
    examples = [make_niah_example(tokenizer, 100 + 20 * i, 0.5, "number", seed=i) for i in range(6)]
    tokenizer.padding_side = "right"
    assert score_niah(AnswersEveryOther(tokenizer, examples), tokenizer, examples, 20, batch_size=4) == 0.5
    assert tokenizer.padding_side == "right"  # restored
    assert niah_match(" 1234567.", "1234567") and not niah_match("123456", "1234567")


def test_score_niah_runs_a_tiny_model(tokenizer):
    model = tiny_model(vocab_size=len(tokenizer))
    examples = [make_niah_example(tokenizer, 100, d, "number", seed=0) for d in (0.0, 1.0)]
    assert 0.0 <= score_niah(model, tokenizer, examples, max_new_tokens=4) <= 1.0


# ---------------------------------------------------------------- training harness

TINY = ModelSize(hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8, intermediate_size=32, num_slots=8,
                 chunk_size=4)


def test_every_variant_builds_and_scores():
    ids, labels = make_mqar(4, 16, 2, 16, seed=0)
    names = [spec.name for spec in default_variants()]
    assert len(set(names)) == len(names) and "llama" in names and "trellis" in names
    for spec in default_variants():
        model = build_model(spec, TINY, vocab_size=16, max_len=16)
        assert 0.0 <= mqar_accuracy(model, ids, labels, batch_size=3) <= 1.0
        for field, value in spec.overrides.items():
            assert getattr(model.config, field) == value


@pytest.mark.parametrize("name", ["trellis", "llama"])
def test_run_mqar_end_to_end(name):
    spec = next(s for s in default_variants() if s.name == name)
    task = MQARTask(seq_len=16, num_kv_pairs=2, vocab_size=16, num_train=32, num_test=8)
    result = run_mqar(spec, task, TINY, TrainSettings(max_steps=3, batch_size=8))
    assert result["model"] == name and 0.0 <= result["accuracy"] <= 1.0
    assert result["task"]["seq_len"] == 16 and result["num_parameters"] > 0
    json.dumps(result)


def test_niah_training_data_trains_on_the_answer_only():
    tokenizer = niah_tokenizer(300)
    ids, labels, mask = make_niah_training_data(tokenizer, 6, 128, seed=1)
    again = make_niah_training_data(tokenizer, 6, 128, seed=1)
    assert all(torch.equal(a, b) for a, b in zip((ids, labels, mask), again))
    assert ids.shape == labels.shape == mask.shape and ids.shape[0] == 6
    for row_ids, row_labels, row_mask in zip(ids, labels, mask):
        real = int(row_mask.sum())
        assert bool(row_mask[:real].all()) and not bool(row_mask[real:].any())  # right padding
        answer = row_labels != IGNORE_INDEX
        # The labelled tokens are the row's last real ones: the answer, then EOS.
        assert torch.equal(answer.nonzero()[:, 0], torch.arange(real - int(answer.sum()), real))
        assert row_labels[real - 1] == tokenizer.eos_token_id
        assert torch.equal(row_labels[answer], row_ids[answer])
        text = tokenizer.decode(row_ids[:real], skip_special_tokens=True)
        value = tokenizer.decode(row_labels[answer][:-1]).strip()
        # The answer is the needle's value, stated in the needle earlier in the prompt.
        assert len(value) == 7 and value.isdigit() and f"is {value}." in text and text.endswith(f" is {value}")


def load_example():
    module_spec = importlib.util.spec_from_file_location("synthetic_recall", EXAMPLE)
    module = importlib.util.module_from_spec(module_spec)
    # dataclasses resolve the module's annotations through sys.modules.
    sys.modules[module_spec.name] = module
    module_spec.loader.exec_module(module)
    return module


def test_example_command_writes_json_tables_and_plots(tmp_path, monkeypatch):
    example = load_example()
    # The cpu preset's sweep shape with tiny models and data, to stay fast.
    tiny_niah = NIAHTask(train_context=128, eval_contexts=(128, 160), depths=(0.0, 1.0), samples=1, num_train=8,
                         tokenizer_vocab=300)
    small = dataclasses.replace(example.PRESETS["cpu"], size=TINY, num_train=64, num_test=16, niah=tiny_niah)
    monkeypatch.setitem(example.PRESETS, "cpu", small)
    md = tmp_path / "docs" / "results.md"
    (md.parent).mkdir()
    (md.parent / "results_notes.md").write_text("## Reading\n\nhand-written\n")
    example.main(["--preset", "cpu", "--variants", "llama,trellis,trellis-no-forget,trellis-M16", "--pairs", "2,4",
                  "--seq-lens", "64,128", "--max-steps", "2", "--out", str(tmp_path / "out"), "--results-md", str(md)])
    saved = json.loads((tmp_path / "out" / "synthetic_results.json").read_text())
    runs = {(r["model"], r["task"]["seq_len"], r["task"]["num_kv_pairs"]) for r in saved["mqar"]["results"]}
    # Every variant at the base setting; only the swept models elsewhere.
    assert runs == {(m, s, p) for m in ("llama", "trellis") for s, p in ((64, 2), (64, 4), (128, 4))} | {
        ("trellis-no-forget", 64, 4), ("trellis-M16", 64, 4)}
    # S-NIAH trains the preset's S-NIAH models among those asked for (not trellis-M16).
    assert {r["model"] for r in saved["niah"]["results"]} == {"llama", "trellis", "trellis-no-forget"}
    assert set(saved["niah"]["results"][0]["scores"]) == {"128", "160"}
    text = md.read_text()
    assert "| llama |" in text and "num_kv_pairs=2" in text and "seq_len=128" in text
    assert "| the forget gate helps | trellis " in text and "S-NIAH" in text and "hand-written" in text
    for name in ("mqar_accuracy_vs_num_kv_pairs", "mqar_accuracy_vs_seq_len", "niah_accuracy_vs_context"):
        assert (md.parent / "figures" / f"{name}.png").stat().st_size > 0
    # A later run of one task keeps the other's results on the page.
    example.main(["--task", "mqar", "--preset", "cpu", "--variants", "llama", "--pairs", "4", "--seq-lens", "64",
                  "--max-steps", "1", "--out", str(tmp_path / "out"), "--results-md", str(md)])
    assert "S-NIAH" in md.read_text()


def test_example_command_scores_niah_on_a_checkpoint(tmp_path, tokenizer):
    tiny_model(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    load_example().main(["--task", "niah", "--model", str(tmp_path / "model"), "--context-lengths", "128",
                         "--depths", "0,1", "--niah-samples", "2", "--out", str(tmp_path / "out")])
    scores = json.loads((tmp_path / "out" / "niah_checkpoint_results.json").read_text())["scores"]
    assert set(scores["128"]) == {"0.0", "1.0"} and all(0 <= v <= 1 for v in scores["128"].values())


def test_presets_cover_the_requested_ablations():
    example = load_example()
    args = example.parse_args(["--preset", "cpu"])
    grid = example.mqar_grid(example.PRESETS["cpu"], args)
    names = {spec.name for spec, _ in grid}
    assert names == {spec.name for spec in default_variants()}
    assert {task.seq_len for _, task in grid} == {64, 128}
    # The ablations run once, at the base setting; the pair and length sweeps only for the swept models.
    assert len(grid) == len(default_variants()) + 2 * (len(example.PRESETS["cpu"].pairs) - 1) + 2
    assert len(example.mqar_grid(example.PRESETS["gpu"], example.parse_args(["--preset", "gpu"]))) > len(grid)


def test_trellis_learns_tiny_mqar():
    """CI-sized variant of the slow test below (~12 s): beyond "some value of the context"."""
    task = MQARTask(seq_len=16, num_kv_pairs=2, vocab_size=16, num_train=3200, num_test=200)
    size = ModelSize(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, intermediate_size=64,
                     num_slots=16, chunk_size=8)
    result = run_mqar(default_variants()[1], task, size, TrainSettings(max_steps=300, batch_size=32,
                                                                       learning_rate=1e-2))
    # Chance is 1/8; naming one of the two values of the context at random scores 1/2.
    assert result["accuracy"] > 0.6


@pytest.mark.slow
def test_trellis_learns_easy_mqar():
    task = MQARTask(seq_len=32, num_kv_pairs=2, vocab_size=32, num_train=4800, num_test=200)
    size = ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                     num_slots=32, chunk_size=16)
    result = run_mqar(default_variants()[1], task, size, TrainSettings(max_steps=150, batch_size=32))
    # Chance is 1/16 (values are the upper half of the vocabulary).
    assert result["accuracy"] > 0.25
