"""lm-evaluation-harness on a tiny saved model: the bundled offline tasks, through "hf" and "trellis"."""

from __future__ import annotations

import pytest

from tiny_models import schedules_ci_sized, tiny_model
from trellis_lm import train_tokenizer
from trellis_lm.eval import TASKS_DIR

pytest.importorskip("lm_eval")

LIMIT = 4  # documents per task; the generation prompts have 1- and 2-digit numbers, so batches are padded


@pytest.fixture(scope="module", params=schedules_ci_sized())  # ~30 s each on 2 cores
def checkpoint(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("eval-model")
    tiny_model(seed=2, vocab_size=300, schedule=request.param).save_pretrained(folder)
    train_tokenizer(["Question: What is 12 + 3?\nAnswer: 15"] * 10, vocab_size=300).save_pretrained(folder)
    return folder


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def responses(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_bundled_tasks_are_package_data():
    assert {"trellis_demo.yaml", "trellis_demo_choice.yaml", "trellis_demo_gen.yaml", "data.py",
            "trellis_demo_choice.jsonl", "trellis_demo_gen.jsonl"} <= {p.name for p in TASKS_DIR.iterdir()}


def test_hf_and_trellis_models_give_the_same_results_batched_or_not(checkpoint, offline):
    from lm_eval.api.registry import get_model

    from trellis_lm.eval.harness import TrellisLM, evaluate

    assert get_model("trellis") is TrellisLM and get_model("hf") is not None  # registering kept lm-eval's models
    # "hf" through remote code, in left-/right-padded batches; "trellis" one request at a time.
    batched = evaluate(checkpoint, ["trellis_demo"], model="hf", batch_size=LIMIT, limit=LIMIT, log_samples=True)
    single = evaluate(checkpoint, ["trellis_demo"], model="trellis", batch_size=1, limit=LIMIT, log_samples=True)
    assert batched["config"]["model_args"]["trust_remote_code"] is True
    for results in (batched, single):
        assert 0 <= results["results"]["trellis_demo_choice"]["acc,none"] <= 1
        assert 0 <= results["results"]["trellis_demo_gen"]["exact_match,first_number"] <= 1
        assert len(results["samples"]["trellis_demo_gen"]) == LIMIT

    # Loglikelihoods of every choice (right-padded batches vs one by one).
    for batched_doc, single_doc in zip(responses(batched, "trellis_demo_choice"), responses(single, "trellis_demo_choice")):
        for (batched_ll, _), (single_ll, _) in zip((r[0] for r in batched_doc), (r[0] for r in single_doc)):
            assert batched_ll == pytest.approx(single_ll, abs=1e-4)
    # Greedy generations (left-padded batches vs one by one).
    assert responses(batched, "trellis_demo_gen") == responses(single, "trellis_demo_gen")
    assert all(r[0][0] for r in responses(single, "trellis_demo_gen"))  # something was generated


def test_the_task_index_is_built_once_per_folders_and_again_when_their_yamls_change(tmp_path, monkeypatch):
    """Building lm-eval's index reads every task YAML it ships (20 s of a core): evaluate and the
    CLI share one per process, and a YAML added or changed in an included folder is indexed."""
    import os

    import lm_eval.tasks

    from trellis_lm.eval.harness import _task_manager, task_manager

    built = []

    class Recorder:
        def __init__(self, include_path=None):
            built.append(include_path)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Recorder)
    _task_manager.cache_clear()
    try:
        (tmp_path / "mine.yaml").write_text("task: mine\n")
        first = task_manager(tmp_path)
        assert task_manager(str(tmp_path)) is first and built == [[str(tmp_path)]]
        assert task_manager([TASKS_DIR, tmp_path]) is not first and len(built) == 2
        assert task_manager(None) is not first and built[-1] is None
        (tmp_path / "more" / "deeper").mkdir(parents=True)
        (tmp_path / "more" / "deeper" / "theirs.yml").write_text("task: theirs\n")
        added = task_manager(tmp_path)
        assert added is not first and task_manager(tmp_path) is added
        stat = (tmp_path / "mine.yaml").stat()
        os.utime(tmp_path / "mine.yaml", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
        assert task_manager(tmp_path) is not added
        assert len(built) == 5
    finally:
        _task_manager.cache_clear()
