"""The studies' bookkeeping: the shared command line, runs saved as they finish (a stopped study
resumes), the learning-rate sweep's choices, and how the pages show a spread over seeds."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence


def study_arguments(doc: str, presets: Sequence[str], records: str, page: Path, what: str) -> argparse.Namespace:
    """The command line both study scripts share: ``--preset`` (of ``presets``), ``--out`` (the
    folder of the ``records`` JSON, created), ``--page``, ``--models`` (a comma-separated subset of
    ``what``, parsed to a list or ``None``), ``--render-only`` and ``--keep-models``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(presets), default="cpu")
    parser.add_argument("--out", default=str(page.parent / "results_data"), help=f"folder of {records}")
    parser.add_argument("--page", default=str(page), help="the page to write")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of the {what}")
    parser.add_argument("--render-only", action="store_true", help="write the page from the saved runs")
    parser.add_argument("--keep-models", default=None, help="a folder to save each trained model in "
                        "(save_pretrained, one sub-folder per run), for analysis after the study")
    args = parser.parse_args()
    args.out, args.page = Path(args.out), Path(args.page)
    args.out.mkdir(parents=True, exist_ok=True)
    args.models = args.models.split(",") if args.models else None
    return args


def load_records(path: Path) -> list[dict[str, Any]]:
    """The runs saved in a study's JSON file (a list of records; empty when there is no file)."""
    return json.loads(path.read_text()) if path.exists() else []


def save_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Write the runs to the JSON file through a new file renamed over the old one, so a study
    stopped mid-write keeps its earlier runs."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, path)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Add one finished run to the JSON file (:func:`save_records`)."""
    save_records(path, load_records(path) + [record])


def widened_rate(rates: list[float], best: Optional[float]) -> Optional[float]:
    """The rate to try next when ``best`` lies at an edge of the ``rates`` tried (the sweep has not
    bracketed the model's optimum, so the model could be held at a rate too low or too high for
    it): 2x beyond that edge; ``None`` when ``best`` is inside (or every rate diverged)."""
    if best is None or len(rates) < 2 or min(rates) < best < max(rates):
        return None
    return best * 2 if best == max(rates) else best / 2


def sweep_runs(records: list[dict[str, Any]], model: str, tokens: int | None = None) -> list[dict[str, Any]]:
    """The model's finished sweep runs (diverged rates excluded), of ``tokens`` tokens when given."""
    return [r for r in records if r["model"] == model and r["phase"] == "sweep" and r.get("val_ppl") is not None
            and (tokens is None or r["train_tokens"] == tokens)]


def best_rate(records: list[dict[str, Any]], model: str, tokens: int | None = None) -> Optional[float]:
    """The sweep's learning rate with the lowest validation perplexity (diverged rates excluded)."""
    sweep = sweep_runs(records, model, tokens)
    return min(sweep, key=lambda r: r["val_ppl"])["learning_rate"] if sweep else None


def chosen_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluated full runs at each model's best rate (full runs at a rate a widened sweep
    superseded stay in the JSON and in the page's list of every run, not in its tables)."""
    best = {model: best_rate(records, model) for model in {r["model"] for r in records}}
    return [r for r in records if r["phase"] == "full" and r.get("test_ppl") is not None
            and r["learning_rate"] == best[r["model"]]]


def mean_and_spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(mean, min, max)."""
    values = list(values)
    return statistics.fmean(values), min(values), max(values)


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``mean [min, max]`` of ``values`` (the mean alone for one value), ``digits`` decimals."""
    mean, low, high = mean_and_spread(values)
    return f"{mean:.{digits}f}" + (f" [{low:.{digits}f}, {high:.{digits}f}]" if len(values) > 1 else "")


def median_range(values: Sequence[Optional[float]], digits: int, missing: str = "never") -> str:
    """``median [min, max]`` of ``values``, ``None`` (an event that never came) counting as the
    largest and shown as ``missing``."""
    ordered = sorted(values, key=lambda v: (v is None, v or 0))

    def show(v: Optional[float]) -> str:
        return missing if v is None else f"{v:.{digits}f}"

    # The lower median, so that "never" is the median only when most runs never got there.
    median = ordered[(len(ordered) - 1) // 2]
    return show(median) + (f" [{show(ordered[0])}, {show(ordered[-1])}]" if len(ordered) > 1 else "")


def sweep(run_rate: Callable[[float], Any], path: Path, model: str, rates: Sequence[float], widen: int,
          tokens: int) -> Optional[float]:
    """Run a model's learning-rate sweep: ``run_rate(rate)`` at each of ``rates`` (a run already
    in the records is skipped by the caller's ``run_rate``), then up to ``widen`` more rates past
    an edge where the best one sits there. The best rate of the model's sweep runs of ``tokens``
    in the records at ``path`` (``None``: every rate diverged)."""
    rates = list(rates)
    for rate in rates:
        run_rate(rate)
    best = best_rate(load_records(path), model, tokens)
    for _ in range(widen):
        rate = widened_rate(rates, best)
        if rate is None:
            break
        rates.append(rate)
        run_rate(rate)
        best = best_rate(load_records(path), model, tokens)
    return best
