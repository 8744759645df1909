"""Synthetic recall study: train tiny Trellis variants and a same-size Llama on MQAR, or score
a trained checkpoint on single-needle retrieval (S-NIAH).

    .venv/bin/python examples/synthetic_recall.py --task mqar --preset cpu    # ~15-30 min on 2 CPU cores (estimated)
    .venv/bin/python examples/synthetic_recall.py --task mqar --preset gpu    # the larger study, one GPU
    .venv/bin/python examples/synthetic_recall.py --task mqar --variants llama,trellis --pairs 4 --seq-lens 64
    .venv/bin/python examples/synthetic_recall.py --task niah --model outputs/demo-model

NIAH writes ``<out>/niah_results.json`` (accuracy per context length and depth). MQAR writes
``<out>/mqar_results.json``, the markdown tables (``--results-md``, default
``docs/results.md``) and PNG plots of accuracy against the number of key-value pairs and
against the context length next to the markdown file. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from trellis_lm.eval.synthetic import (
    MQARTask, ModelSize, ModelSpec, NIAHTask, TrainSettings, default_variants, run_mqar, run_niah,
)

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Preset:
    """A sweep: every variant at ``base_seq_len`` with ``base_pairs`` (the ablations), and the
    ``sweep_variants`` also at each of ``pairs`` and each of ``seq_lens``."""

    size: ModelSize
    train: TrainSettings
    vocab_size: int
    num_train: int
    num_test: int
    base_seq_len: int
    base_pairs: int
    pairs: tuple[int, ...]
    seq_lens: tuple[int, ...]
    sweep_variants: tuple[str, ...]
    niah: Optional[NIAHTask] = None
    niah_train: Optional[TrainSettings] = None
    niah_variants: tuple[str, ...] = ("llama", "trellis")


PRESETS = {
    # On 2 CPU cores with --jobs 2: the MQAR sweep (17 runs, the chunk-size-1 run the longest) took
    # 35 min, S-NIAH (3 runs, scored up to 16k tokens) about 11 min more.
    # lr 1e-2: at 3e-3 neither Trellis nor Llama gets past recalling "some value of the
    # context" in this budget.
    "cpu": Preset(
        size=ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                       num_slots=32, chunk_size=16),
        train=TrainSettings(max_steps=800, batch_size=64, learning_rate=1e-2),
        vocab_size=64, num_train=20_000, num_test=512,
        base_seq_len=64, base_pairs=4, pairs=(2, 4, 8), seq_lens=(64, 128),
        sweep_variants=("llama", "trellis"),
        # Trained at 128 tokens: at 256, 1500 steps left both models unable to retrieve at all.
        niah=NIAHTask(train_context=128, eval_contexts=(128, 1024, 4096, 16384), samples=4, num_train=20_000),
        niah_train=TrainSettings(max_steps=1500, batch_size=32, learning_rate=1e-2),
        # Without the forget gate nothing written decays: does retrieval then reach past 128 tokens?
        niah_variants=("llama", "trellis", "trellis-no-forget"),
    ),
    # The goal setting only (seq_len 256, 16 pairs, hidden 128, 2 layers), sized for a CPU:
    # a 256-token vocabulary and 1500 steps of 32 sequences (~1.5 s a step for Trellis on 2 cores).
    "cpu-goal": Preset(
        size=ModelSize(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, intermediate_size=256,
                       num_slots=64, chunk_size=64),
        train=TrainSettings(max_steps=1500, batch_size=32, learning_rate=5e-3),
        vocab_size=256, num_train=50_000, num_test=512,
        base_seq_len=256, base_pairs=16, pairs=(16,), seq_lens=(256,), sweep_variants=("llama", "trellis"),
    ),
    # Zoology-sized: the goal setting (seq_len 256, 16 pairs, hidden 128, 2 layers), a large
    # vocabulary, up to 64 pairs and 512 tokens, every variant in every sweep.
    "gpu": Preset(
        size=ModelSize(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, intermediate_size=256,
                       num_slots=64, chunk_size=64),
        train=TrainSettings(max_steps=4000, batch_size=64, learning_rate=3e-3, eval_batch_size=256),
        vocab_size=8192, num_train=100_000, num_test=3000,
        base_seq_len=256, base_pairs=16, pairs=(4, 8, 16, 32, 64), seq_lens=(64, 128, 256, 512),
        sweep_variants=tuple(spec.name for spec in default_variants()),
        niah=NIAHTask(train_context=1024, eval_contexts=(1024, 4096, 16384, 65536), samples=16, num_train=50_000),
        niah_train=TrainSettings(max_steps=3000, batch_size=32, learning_rate=3e-3),
        niah_variants=tuple(spec.name for spec in default_variants()),
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("all", "mqar", "niah"), default="all",
                        help="all: the MQAR sweep, then S-NIAH training and scoring; results.md shows both")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--variants", help="comma-separated subset of: " + ",".join(s.name for s in default_variants()))
    parser.add_argument("--pairs", help="comma-separated key-value pair counts (replaces the preset's)")
    parser.add_argument("--seq-lens", help="comma-separated context lengths (replaces the preset's)")
    parser.add_argument("--max-steps", type=int, help="training steps per run (replaces the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="mqar: runs trained at once, in separate processes")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "synthetic-recall")
    parser.add_argument("--results-md", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--model", help="niah: score this trained checkpoint folder (with its tokenizer) instead of "
                        "training the preset's models on the task")
    parser.add_argument("--context-lengths", default="256,512,1024", help="niah: context sizes in tokens")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="niah: needle depths in [0, 1]")
    parser.add_argument("--niah-samples", type=int, default=8, help="niah: examples per (length, depth)")
    parser.add_argument("--needle-kind", choices=("number", "uuid"), default="number", help="niah: the needle's value")
    parser.add_argument("--haystack", choices=("noise", "prose"), default="noise", help="niah: the filler text")
    return parser.parse_args(argv)


def int_list(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if text is None else tuple(int(x) for x in text.split(","))


def mqar_grid(preset: Preset, args: argparse.Namespace) -> list[tuple[ModelSpec, MQARTask]]:
    """The (model, task) runs of the sweep, in the order they run."""
    variants = default_variants()
    if args.variants:
        wanted = args.variants.split(",")
        unknown = sorted(set(wanted) - {spec.name for spec in variants})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {[spec.name for spec in variants]}")
        variants = [spec for spec in variants if spec.name in wanted]
    pairs = int_list(args.pairs, preset.pairs)
    seq_lens = int_list(args.seq_lens, preset.seq_lens)

    def task(seq_len: int, num_kv_pairs: int) -> MQARTask:
        return MQARTask(seq_len=seq_len, num_kv_pairs=num_kv_pairs, vocab_size=preset.vocab_size,
                        num_train=preset.num_train, num_test=preset.num_test)

    settings = [(preset.base_seq_len, preset.base_pairs)]
    settings += [(preset.base_seq_len, p) for p in pairs]
    settings += [(s, preset.base_pairs) for s in seq_lens]
    grid = []
    for seq_len, num_pairs in dict.fromkeys(settings):  # in order, without repeats
        is_base = (seq_len, num_pairs) == (preset.base_seq_len, preset.base_pairs)
        grid += [(spec, task(seq_len, num_pairs)) for spec in variants
                 if is_base or spec.name in preset.sweep_variants]
    return grid


def machine_description() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    # Torch threads per run are the command's --threads (default 1), shown with each command.
    return f"{device}, {platform.platform()}, torch {torch.__version__}"


def accuracy_table(results: list[dict], column: str, fixed: str, fixed_value: int) -> str:
    """Markdown table of accuracy, one row per model, one column per value of ``column``."""
    rows = [r for r in results if r["task"][fixed] == fixed_value]
    columns = sorted({r["task"][column] for r in rows})
    # Only the models swept along `column`; the ablations at one point have their own table.
    models = [m for m in dict.fromkeys(r["model"] for r in rows) if sum(r["model"] == m for r in rows) > 1]
    cell = {(r["model"], r["task"][column]): r["accuracy"] for r in rows}
    lines = [f"| model | " + " | ".join(f"{column}={c}" for c in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for model in models:
        values = [f"{cell[model, c]:.3f}" if (model, c) in cell else "-" for c in columns]
        lines.append(f"| {model} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def plot_lines(series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str, title: str, path: Path) -> bool:
    """One line per name of ``series`` (``(x, y)`` points, x on a log2 axis); False when no
    series has two points, so there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {name: sorted(points) for name, points in series.items() if len(points) > 1}
    if not series:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        axes.plot(*zip(*points), marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_ylim(0, 1.02)
    axes.set_title(title)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# The paper's ablation directions (its Table 3): (claim, the variant that should win, the one it beats).
PAPER_DIRECTIONS = (
    ("the forget gate helps", "trellis", "trellis-no-forget"),
    ("ln_silu beats softmax as the mixing function", "trellis", "trellis-mix-softmax"),
    ("chunk size 1 beats chunk size 64", "trellis-C1", "trellis-C64"),
    ("more memory slots beat fewer (M = 64 vs 16)", "trellis-M64", "trellis-M16"),
)


def ablation_section(results: list[dict], preset: Preset) -> list[str]:
    """Markdown: every variant at the base setting, and whether each paper direction holds."""
    base = {r["model"]: r for r in results
            if (r["task"]["seq_len"], r["task"]["num_kv_pairs"]) == (preset.base_seq_len, preset.base_pairs)}
    if len(base) < 2:
        return []
    lines = [f"### Ablations (seq_len = {preset.base_seq_len}, {preset.base_pairs} pairs)", "",
             "| model | changed | accuracy |", "|---|---|---:|"]
    for name, r in base.items():
        changed = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "-"
        lines.append(f"| {name} | {changed} | {r['accuracy']:.3f} |")
    lines += ["", "| paper's claim | runs | reproduced here? |", "|---|---|---|"]
    for claim, winner, loser in PAPER_DIRECTIONS:
        if winner in base and loser in base:
            a, b = base[winner]["accuracy"], base[loser]["accuracy"]
            verdict = "yes" if a > b else "no" if a < b else "tie"
            lines.append(f"| {claim} | {winner} {a:.3f} vs {loser} {b:.3f} | {verdict} |")
    return lines + ["", "One seed per run: differences of a few points are within run-to-run noise.", ""]


def mqar_lines(results: list[dict], preset: Preset, command: str, figures: Path, md_dir: Path) -> list[str]:
    size, train = results[0]["size"], results[0]["train"]
    lines = [
        "## MQAR", "", f"Command: `{command}`", "",
        f"- model size: {size}",
        f"- training: {train} (transformers.Trainer, AdamW, warm-up then cosine)",
        f"- data: MQAR, vocab {preset.vocab_size}, {preset.num_train} train / {preset.num_test} test examples "
        "per setting, power_a 0.01; accuracy = fraction of answer positions whose argmax equals the value "
        f"(chance: 1/{preset.vocab_size - preset.vocab_size // 2})",
        "",
    ]
    for column, fixed, value, title in (
        ("num_kv_pairs", "seq_len", preset.base_seq_len, "Accuracy vs number of key-value pairs"),
        ("seq_len", "num_kv_pairs", preset.base_pairs, "Accuracy vs context length"),
    ):
        rows = [r for r in results if r["task"][fixed] == value]
        # A sweep with a single point adds nothing to the table of all runs below.
        if len({r["task"][column] for r in rows}) < 2:
            continue
        lines += [f"### {title} ({fixed} = {value})", "", accuracy_table(results, column, fixed, value), ""]
        series: dict[str, list] = {}
        for r in rows:
            series.setdefault(r["model"], []).append((r["task"][column], r["accuracy"]))
        figure = figures / f"mqar_accuracy_vs_{column}.png"
        if plot_lines(series, column, "MQAR accuracy", f"{fixed} = {value}", figure):
            lines += [f"![{title}]({figure.relative_to(md_dir).as_posix()})", ""]
    lines += ablation_section(results, preset)
    lines += ["### All runs", "", "| model | seq_len | pairs | accuracy | mean train loss | params | train s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['task']['seq_len']} | {r['task']['num_kv_pairs']} | {r['accuracy']:.3f} "
                     f"| {r['mean_train_loss']:.3f} | {r['num_parameters']} | {r['train_seconds']:.0f} |")
    return lines + [""]


def niah_lines(results: list[dict], command: str, figures: Path, md_dir: Path) -> list[str]:
    task, train = results[0]["task"], results[0]["train"]
    lines = [
        "## Single-needle retrieval (S-NIAH)", "", f"Command: `{command}`", "",
        f"- trained from scratch on {task['num_train']} prompts of {task['train_context']} tokens (noise haystack, a "
        "7-digit number needle at a uniform depth; loss on the answer only), then scored with greedy `generate()` on "
        f"unseen needles: {task['samples']} prompts per (context, depth), depths {task['depths']}",
        f"- training: {train}; tokenizer: byte-level BPE, {task['tokenizer_vocab']} tokens, trained on the task's text",
        "",
        "| model | " + " | ".join(f"{c} tokens" for c in task["eval_contexts"]) + " |",
        "|---|" + "---:|" * len(task["eval_contexts"]),
    ]
    series = {}
    for r in results:
        means = {int(length): sum(s.values()) / len(s) for length, s in r["scores"].items()}
        series[r["model"]] = sorted(means.items())
        lines.append(f"| {r['model']} | " + " | ".join(f"{means[c]:.2f}" for c in task["eval_contexts"]) + " |")
    lines += ["", "Mean over depths of the fraction of needles retrieved. By depth:", ""]
    for r in results:
        by_length = (f"{length}: " + ", ".join(f"{float(d):g}->{v:.2f}" for d, v in scores.items())
                     for length, scores in r["scores"].items())
        lines.append(f"- {r['model']}: " + "; ".join(by_length))
    figure = figures / "niah_accuracy_vs_context.png"
    if plot_lines(series, "context tokens", "needles retrieved",
                  f"S-NIAH, trained at {task['train_context']} tokens", figure):
        lines += ["", f"![S-NIAH accuracy vs context]({figure.relative_to(md_dir).as_posix()})"]
    return lines + [""]


def write_markdown(results: dict, preset: Preset, args: argparse.Namespace) -> None:
    """``args.results_md`` from the saved results of both tasks, plus the hand-written reading
    (``<name>_notes.md`` beside it, e.g. ``results_notes.md``) when there is one."""
    md_path = args.results_md
    figures = md_path.parent / "figures"
    lines = [
        "# Synthetic recall results", "",
        "Written by `examples/synthetic_recall.py` (commands below, run from the repository root).", "",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        f"- machine: {machine_description()}",
        "",
    ]
    if "mqar" in results:
        lines += mqar_lines(results["mqar"]["results"], preset, results["mqar"]["command"], figures, md_path.parent)
    if "niah" in results:
        lines += niah_lines(results["niah"]["results"], results["niah"]["command"], figures, md_path.parent)
    notes = md_path.with_name(f"{md_path.stem}_notes.md")
    if notes.exists():
        lines += [notes.read_text(encoding="utf-8")]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def run_in_turn(args: argparse.Namespace, jobs: list, describe) -> list[dict]:
    """Run ``fn(*fn_args)`` for each ``(fn, fn_args)`` of ``jobs``, ``args.jobs`` at a time; print
    ``describe(index, result)`` as each finishes. Returns the results in the order of ``jobs``."""
    done: dict[int, dict] = {}
    started = time.perf_counter()

    def record(index: int, result: dict) -> None:
        done[index] = result
        print(f"[{len(done)}/{len(jobs)}] {describe(index, result)} ({time.perf_counter() - started:.0f}s total)",
              flush=True)

    if args.jobs == 1:
        for index, (fn, fn_args) in enumerate(jobs):
            record(index, fn(*fn_args))
    else:
        # Small models use one core badly: separate processes, one torch thread pool each.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=torch.set_num_threads,
                                 initargs=(args.threads,)) as pool:
            futures = {pool.submit(fn, *fn_args): i for i, (fn, fn_args) in enumerate(jobs)}
            for future in as_completed(futures):
                record(futures[future], future.result())
    return [done[i] for i in range(len(jobs))]


def with_steps(train: TrainSettings, args: argparse.Namespace) -> TrainSettings:
    """``train`` with ``--max-steps`` applied when given."""
    return train if args.max_steps is None else dataclasses.replace(train, max_steps=args.max_steps)


def run_mqar_study(args: argparse.Namespace, preset: Preset) -> list[dict]:
    train = with_steps(preset.train, args)
    grid = mqar_grid(preset, args)

    def describe(index: int, r: dict) -> str:
        return (f"mqar {r['model']:20s} seq_len={r['task']['seq_len']:4d} pairs={r['task']['num_kv_pairs']:3d} "
                f"acc={r['accuracy']:.3f} mean loss={r['mean_train_loss']:.3f} ({r['train_seconds']:.0f}s train)")

    return run_in_turn(args, [(run_mqar, (spec, task, preset.size, train)) for spec, task in grid], describe)


def run_niah_training(args: argparse.Namespace, preset: Preset) -> list[dict]:
    """Train the preset's NIAH variants at its short context and score them at every length."""
    train = with_steps(preset.niah_train, args)
    wanted = set(args.variants.split(",")) if args.variants else set(preset.niah_variants)
    specs = [spec for spec in default_variants() if spec.name in preset.niah_variants and spec.name in wanted]
    if not specs:
        return []

    def describe(index: int, r: dict) -> str:
        means = {length: sum(s.values()) / len(s) for length, s in r["scores"].items()}
        return f"niah {r['model']:20s} " + " ".join(f"{k}:{v:.2f}" for k, v in means.items())

    return run_in_turn(args, [(run_niah, (spec, preset.niah, preset.size, train)) for spec in specs], describe)


def score_checkpoint_niah(args: argparse.Namespace, command: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trellis_lm  # noqa: F401  (registers the auto classes)
    from trellis_lm.eval.niah import make_niah_example, score_niah

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    scores: dict[str, dict[str, float]] = {}
    for length in int_list(args.context_lengths, ()):
        for depth in (float(d) for d in args.depths.split(",")):
            examples = [make_niah_example(tokenizer, length, depth, args.needle_kind, seed, haystack=args.haystack)
                        for seed in range(args.niah_samples)]
            # Enough new tokens for a UUID even with a byte-level vocabulary.
            max_new_tokens = 12 if args.needle_kind == "number" else 48
            scores.setdefault(str(length), {})[str(depth)] = score_niah(model, tokenizer, examples, max_new_tokens)
            print(f"context={length} depth={depth}: {scores[str(length)][str(depth)]:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "niah_checkpoint_results.json").write_text(json.dumps({"command": command, "scores": scores}, indent=1))
    print(f"wrote {args.out / 'niah_checkpoint_results.json'}")
    return scores


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "examples/synthetic_recall.py", *(sys.argv[1:] if argv is None else argv)])
    if args.task == "niah" and args.model:
        score_checkpoint_niah(args, command)
        return
    preset = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "synthetic_results.json"
    # A run of one task keeps the other task's latest results in the page.
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if args.task in ("all", "mqar"):
        results["mqar"] = {"command": command, "results": run_mqar_study(args, preset)}
        saved.write_text(json.dumps(results, indent=1))
    if args.task in ("all", "niah") and preset.niah is not None:
        niah = run_niah_training(args, preset)
        if niah:
            results["niah"] = {"command": command, "results": niah}
            saved.write_text(json.dumps(results, indent=1))
    write_markdown(results, preset, args)
    print(f"wrote {saved} and {args.results_md}")


if __name__ == "__main__":
    main()
