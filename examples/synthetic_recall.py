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

import torch

from trellis_lm.eval.synthetic import MQARTask, ModelSize, ModelSpec, TrainSettings, default_variants, run_mqar

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


PRESETS = {
    # About 30 min on 2 CPU cores with --jobs 2: 17 runs, the chunk-size-1 run the longest.
    # lr 1e-2: at 3e-3 neither Trellis nor Llama gets past recalling "some value of the
    # context" in this budget.
    "cpu": Preset(
        size=ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                       num_slots=32, chunk_size=16),
        train=TrainSettings(max_steps=800, batch_size=64, learning_rate=1e-2),
        vocab_size=64, num_train=20_000, num_test=512,
        base_seq_len=64, base_pairs=4, pairs=(2, 4, 8), seq_lens=(64, 128),
        sweep_variants=("llama", "trellis"),
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
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("mqar", "niah"), default="mqar")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--variants", help="comma-separated subset of: " + ",".join(s.name for s in default_variants()))
    parser.add_argument("--pairs", help="comma-separated key-value pair counts (replaces the preset's)")
    parser.add_argument("--seq-lens", help="comma-separated context lengths (replaces the preset's)")
    parser.add_argument("--max-steps", type=int, help="training steps per run (replaces the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="mqar: runs trained at once, in separate processes")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "synthetic-recall")
    parser.add_argument("--results-md", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--model", help="niah: a trained checkpoint folder (with its tokenizer)")
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
    return f"{device}, {torch.get_num_threads()} torch thread(s), {platform.platform()}, torch {torch.__version__}"


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


def plot_accuracy(results: list[dict], column: str, fixed: str, fixed_value: int, path: Path) -> bool:
    """Accuracy against ``column`` (one line per model); False when there is nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r["task"][fixed] == fixed_value]
    if len({r["task"][column] for r in rows}) < 2:
        return False
    figure, axes = plt.subplots(figsize=(6, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        points = sorted((r["task"][column], r["accuracy"]) for r in rows if r["model"] == model)
        if len(points) > 1:  # the ablations sit at one point: they have their own table
            axes.plot(*zip(*points), marker="o", label=model)
    axes.set_xscale("log", base=2)
    axes.set_xlabel(column)
    axes.set_ylabel("MQAR accuracy")
    axes.set_ylim(0, 1.02)
    axes.set_title(f"{fixed} = {fixed_value}")
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
    lines = [f"## Ablations (seq_len = {preset.base_seq_len}, {preset.base_pairs} pairs)", "",
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


def write_mqar_markdown(results: list[dict], preset: Preset, args: argparse.Namespace, command: str) -> None:
    md_path = args.results_md
    figures = md_path.parent / "figures"
    size, train = results[0]["size"], results[0]["train"]
    lines = [
        "# Synthetic recall results",
        "",
        "Produced by running, from the repository root:",
        "",
        f"    {command}",
        "",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        f"- machine: {machine_description()}",
        f"- model size: {size}",
        f"- training: {train} (transformers.Trainer, AdamW, cosine schedule)",
        f"- data: MQAR, vocab {preset.vocab_size}, {preset.num_train} train / {preset.num_test} test examples "
        "per setting, power_a 0.01; accuracy = fraction of answer positions whose argmax equals the value "
        f"(chance: 1/{preset.vocab_size - preset.vocab_size // 2})",
        "",
    ]
    for column, fixed, value, title in (
        ("num_kv_pairs", "seq_len", preset.base_seq_len, "Accuracy vs number of key-value pairs"),
        ("seq_len", "num_kv_pairs", preset.base_pairs, "Accuracy vs context length"),
    ):
        # A sweep with a single point adds nothing to the table of all runs below.
        if len({r["task"][column] for r in results if r["task"][fixed] == value}) < 2:
            continue
        lines += [f"## {title} ({fixed} = {value})", "", accuracy_table(results, column, fixed, value), ""]
        figure = figures / f"mqar_accuracy_vs_{column}.png"
        if plot_accuracy(results, column, fixed, value, figure):
            lines += [f"![{title}]({figure.relative_to(md_path.parent).as_posix()})", ""]
    lines += ablation_section(results, preset)
    lines += ["## All runs", "", "| model | seq_len | pairs | accuracy | mean train loss | params | train s |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['task']['seq_len']} | {r['task']['num_kv_pairs']} | {r['accuracy']:.3f} "
                     f"| {r['mean_train_loss']:.3f} | {r['num_parameters']} | {r['train_seconds']:.0f} |")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def run_mqar_study(args: argparse.Namespace, command: str) -> list[dict]:
    preset = PRESETS[args.preset]
    train = preset.train if args.max_steps is None else dataclasses.replace(preset.train, max_steps=args.max_steps)
    grid = mqar_grid(preset, args)
    args.out.mkdir(parents=True, exist_ok=True)
    done: dict[int, dict] = {}
    started = time.perf_counter()

    def record(index: int, result: dict) -> None:
        done[index] = result
        spec, task = grid[index]
        print(f"[{len(done)}/{len(grid)}] {spec.name:20s} seq_len={task.seq_len:4d} pairs={task.num_kv_pairs:3d} "
              f"acc={result['accuracy']:.3f} mean loss={result['mean_train_loss']:.3f} "
              f"({result['train_seconds']:.0f}s train, {time.perf_counter() - started:.0f}s total)", flush=True)
        # Written after every run, so an interrupted sweep keeps what it finished.
        finished = [done[i] for i in sorted(done)]
        (args.out / "mqar_results.json").write_text(json.dumps({"command": command, "results": finished}, indent=1))

    if args.jobs == 1:
        for index, (spec, task) in enumerate(grid):
            record(index, run_mqar(spec, task, preset.size, train))
    else:
        # Small models use one core badly: separate processes, one torch thread pool each.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=torch.set_num_threads,
                                 initargs=(args.threads,)) as pool:
            futures = {pool.submit(run_mqar, spec, task, preset.size, train): i for i, (spec, task) in enumerate(grid)}
            for future in as_completed(futures):
                record(futures[future], future.result())
    results = [done[i] for i in range(len(grid))]
    write_mqar_markdown(results, preset, args, command)
    print(f"wrote {args.out / 'mqar_results.json'} and {args.results_md}")
    return results


def run_niah_study(args: argparse.Namespace, command: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import trellis_lm  # noqa: F401  (registers the auto classes)
    from trellis_lm.eval.niah import make_niah_example, score_niah

    if not args.model:
        raise SystemExit("--task niah needs --model (a trained checkpoint folder with its tokenizer)")
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
    (args.out / "niah_results.json").write_text(json.dumps({"command": command, "scores": scores}, indent=1))
    print(f"wrote {args.out / 'niah_results.json'}")
    return scores


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "examples/synthetic_recall.py", *(sys.argv[1:] if argv is None else argv)])
    if args.task == "mqar":
        run_mqar_study(args, command)
    else:
        run_niah_study(args, command)


if __name__ == "__main__":
    main()
