"""Synthetic recall study: train tiny Trellis variants and a same-size Llama on MQAR, or score
a trained checkpoint on single-needle retrieval (S-NIAH).

    .venv/bin/python -m studies.synthetic_recall --preset cpu --jobs 2        # MQAR, see PRESETS for its time
    .venv/bin/python -m studies.synthetic_recall --task niah --preset cpu --jobs 2
    .venv/bin/python -m studies.synthetic_recall --preset goal --jobs 2       # the issue's goal setting (hours)
    .venv/bin/python -m studies.synthetic_recall --preset cpu-ablation --jobs 2   # the ablations at 24 pairs (~1.5 h)
    .venv/bin/python -m studies.synthetic_recall --preset gpu                 # the larger study, one GPU
    .venv/bin/python -m studies.synthetic_recall --variants llama,trellis --pairs 4 --seq-lens 64 --lrs 3e-3
    .venv/bin/python -m studies.synthetic_recall --render-only              # the page from the saved runs
    .venv/bin/python -m studies.synthetic_recall --task niah --model outputs/demo-model

Every (model, setting) is trained at each of the preset's learning rates with the first seed,
then with the other seeds at the rate that scored best on a validation set (apart from the
test set); tables show that rate's median test accuracy and its range over seeds. Every run
(settings, scores, learning curve) is saved to ``<out>/synthetic_results.json`` as it
finishes, so a stopped study keeps what it ran; ``--render-only`` writes the page from it.
The page (``--results-md``, default ``docs/results.md``) gets PNG plots next to it. Nothing
is downloaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from studies.records import median_range
from studies.synthetic import (
    INIT_VARIANTS, InlineExecutor, MQARTask, ModelSize, ModelSpec, NIAHTask, Sweep, TrainSettings, default_variants,
    escape_step, run_mqar, run_niah, setting_key, summarize, sweep_runs,
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
    sweep: Sweep = Sweep()
    # The models trained at the base setting (None: every variant).
    base_variants: Optional[tuple[str, ...]] = None
    niah: Optional[NIAHTask] = None
    niah_train: Optional[TrainSettings] = None
    niah_variants: tuple[str, ...] = ("llama", "trellis")
    niah_sweep: Sweep = Sweep()
    # (seq_len, num_kv_pairs) settings mixed into every unit's training data (MQARTask.train_mix).
    train_mix: tuple[tuple[int, int], ...] = ()
    # S-NIAH: each variant again with state passing, per (probability, from fraction of the steps).
    niah_state_passing: tuple[tuple[float, float], ...] = ()


# Models trained at the base setting of the cpu preset, in the order they run: every row of the
# issue (l2_silu mixing, not one of the paper's directions, only in the larger presets). The exact
# recurrence (C = 1) is last: it costs as much as five other rows.
CPU_ROWS = ("llama", "trellis", "trellis-delta", "trellis-no-forget", "lattice-dec", "kvm", "kvm-merge", "hybrid",
            "trellis-M16", "trellis-M64", "trellis-C64", "trellis-mix-softmax", "lattice-enc", "lattice-sim", "trellis-C1")

# Every model of PAPER_DIRECTIONS and LATTICE_PAIRS, after the Llama reference; C = 1 last (cost).
ABLATION_ROWS = ("llama", "trellis", "trellis-no-forget", "trellis-mix-softmax", "trellis-delta", "trellis-M16",
                 "trellis-M64", "trellis-C64", "lattice-dec", "lattice-enc", "lattice-sim", "trellis-C1")

PRESETS = {
    # Sized for about 45 minutes on 2 idle CPU cores with --jobs 2: 15 models x 5 runs at one short
    # setting (32 tokens, 4 pairs; at 64 tokens Trellis was still at chance after 600 steps at lr 3e-3).
    # trellis-C1, the exact recurrence, costs ~7x a chunked run per step: a third of the total.
    # C = 64 is then one chunk of the whole sequence. The time measured is in docs/results.md.
    "cpu": Preset(
        size=ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                       num_slots=32, chunk_size=16),
        train=TrainSettings(max_steps=600, batch_size=32, eval_every=50, num_val=256),
        vocab_size=64, num_train=20_000, num_test=512,
        base_seq_len=32, base_pairs=4, pairs=(), seq_lens=(),
        sweep_variants=("llama", "trellis"), base_variants=CPU_ROWS,
        sweep=Sweep(learning_rates=(1e-3, 3e-3, 1e-2), seeds=(0, 1, 2)),
        # S-NIAH (--task niah): trained at 128 tokens, scored up to 16k; 3 models x 5 runs (the
        # default sweep: 1e-3, 3e-3 and 1e-2 with seed 0, seeds 1 and 2 at the best).
        niah=NIAHTask(train_context=128, eval_contexts=(128, 1024, 4096, 16384), samples=4, num_train=20_000),
        niah_train=TrainSettings(max_steps=1500, batch_size=32, eval_every=250),
        # Without the forget gate nothing written decays: does retrieval then reach past 128 tokens?
        niah_variants=("llama", "trellis", "trellis-no-forget"),
    ),
    # The paper's ablation directions and Lattice's write rules at a setting hard enough to order
    # them: at the cpu preset's 32 tokens / 4 pairs (and in probes at 64 / 16) every row is at the
    # ceiling. 24 pairs in 96 tokens, vocab 128: single-seed probes of Trellis reached 0.44-0.56 in
    # 1200 steps (1e-3, 3e-3); 32 pairs in 128 tokens 0.18 at 3e-3 (M = 16: 0.72), with each step a
    # third dearer. Same model as cpu; Llama as the attention reference. Its 60 runs took 92 min
    # on 2 cores with --jobs 2, the last 40 min beside other runs; C = 1, the last row, trains 12-18 min
    # a run (the others 1-3). Results: docs/results_ablation.md.
    "cpu-ablation": Preset(
        size=ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                       num_slots=32, chunk_size=16),
        train=TrainSettings(max_steps=1200, batch_size=32, eval_every=100, num_val=256),
        vocab_size=128, num_train=20_000, num_test=512,
        base_seq_len=96, base_pairs=24, pairs=(), seq_lens=(), sweep_variants=(), base_variants=ABLATION_ROWS,
    ),
    # The user setting (128 tokens, 8 pairs, vocab 128, batch 64, 1200 steps) for Llama,
    # Trellis and the hybrid: about 1 h 30 on 2 CPU cores with --jobs 2 (estimated, not run).
    "cpu-user": Preset(
        size=ModelSize(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, intermediate_size=128,
                       num_slots=32, chunk_size=16),
        train=TrainSettings(max_steps=1200, batch_size=64, eval_every=100, num_val=256),
        vocab_size=128, num_train=50_000, num_test=512,
        base_seq_len=128, base_pairs=8, pairs=(), seq_lens=(),
        sweep_variants=("llama", "trellis"), base_variants=("llama", "trellis", "hybrid"),
    ),
    # The earlier single-run attempt at the goal setting sized for a CPU (docs/results_data/cpu-goal.json):
    # one learning rate, one seed, 1500 steps of 32, no mixture; it stayed at chance.
    "cpu-goal": Preset(
        size=ModelSize(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, intermediate_size=256,
                       num_slots=64, chunk_size=64),
        train=TrainSettings(max_steps=1500, batch_size=32),
        vocab_size=256, num_train=50_000, num_test=512,
        base_seq_len=256, base_pairs=16, pairs=(16,), seq_lens=(256,), sweep_variants=("llama", "trellis"),
        sweep=Sweep(learning_rates=(5e-3,), seeds=(0,)),
    ),
    # The goal: Trellis >= 99% MQAR at seq_len 256, 16 pairs, hidden 128, 2 layers, in at
    # least 2 of 3 seeds: met at 1e-3 in 3 of 3, each run stopping at 99.5% validation after 1400-2700
    # steps, 21-38 min on one CPU core (docs/results_notes.md); the whole 3-rate sweep is a few hours
    # of CPU (a run that never reaches the target trains all 4000 steps, ~80 min), minutes on a GPU.
    # Trained on Zoology's kind of mixture: trained on 256 / 16 alone, Trellis (with the old convs)
    # stayed at chance for 2500 steps.
    "goal": Preset(
        size=ModelSize(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, intermediate_size=256,
                       num_slots=64, chunk_size=64),
        train=TrainSettings(max_steps=4000, batch_size=64, eval_every=100, num_val=512, stop_accuracy=0.995),
        vocab_size=256, num_train=100_000, num_test=1000,
        base_seq_len=256, base_pairs=16, pairs=(), seq_lens=(), sweep_variants=("trellis",),
        base_variants=("trellis",), train_mix=((64, 4), (128, 8)),
    ),
    # Zoology-sized: the goal setting (seq_len 256, 16 pairs, hidden 128, 2 layers), a large
    # vocabulary, up to 64 pairs and 512 tokens, every variant in every sweep.
    "gpu": Preset(
        size=ModelSize(hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, intermediate_size=256,
                       num_slots=64, chunk_size=64),
        train=TrainSettings(max_steps=4000, batch_size=64, eval_batch_size=256, eval_every=200, num_val=512),
        vocab_size=8192, num_train=100_000, num_test=3000,
        base_seq_len=256, base_pairs=16, pairs=(4, 8, 16, 32, 64), seq_lens=(64, 128, 256, 512),
        sweep_variants=tuple(spec.name for spec in default_variants()),
        niah=NIAHTask(train_context=1024, eval_contexts=(1024, 4096, 16384, 65536), samples=16, num_train=50_000),
        niah_train=TrainSettings(max_steps=3000, batch_size=32, eval_every=250),
        niah_variants=tuple(spec.name for spec in default_variants()),
    ),
}
# Issue 35: does state passing (p = 0.9 over the last 30% of the steps, the LM study's recipe) keep
# retrieval at 4x-64x the training length? Trellis with and without it, the cpu preset's S-NIAH
# training at its best rate there (1e-3), seeds 0 and 1; 4 runs, about 25 min on 2 idle cores.
PRESETS["cpu-state-passing"] = dataclasses.replace(
    PRESETS["cpu"], niah=NIAHTask(train_context=128, eval_contexts=(128, 512, 1024, 2048, 8192), samples=4,
                                  num_train=20_000),
    niah_variants=("trellis",), niah_sweep=Sweep(learning_rates=(1e-3,), seeds=(0, 1)),
    niah_state_passing=((0.9, 0.7),))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("all", "mqar", "niah"), default="mqar",
                        help="mqar (default): the MQAR study; niah: S-NIAH training and scoring; all: both. The page "
                        "shows the latest results of both")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--variants", help="comma-separated subset of: " + ",".join(s.name for s in default_variants()))
    parser.add_argument("--pairs", help="comma-separated key-value pair counts (replaces the preset's)")
    parser.add_argument("--seq-lens", help="comma-separated context lengths (replaces the preset's)")
    parser.add_argument("--train-mix", metavar="TxP,...",
                        help="MQAR settings mixed into the training data, e.g. 64x4,128x8 (tokens x pairs; replaces "
                        "the preset's; an empty string: none)")
    parser.add_argument("--max-steps", type=int, help="training steps per run (replaces the preset's)")
    parser.add_argument("--lrs", help="comma-separated learning rates to sweep (replaces the preset's)")
    parser.add_argument("--seeds", help="comma-separated seeds; the first sweeps the learning rates (replaces the "
                        "preset's)")
    parser.add_argument("--init", default="default",
                        help="comma-separated initialisations of the Trellis models, each trained as its own row "
                        "named <model>@<init> (Llama keeps its own): " + ",".join(INIT_VARIANTS))
    parser.add_argument("--init-report", type=Path, metavar="JSON",
                        help="print the initialisation table of the MQAR runs in JSON (a synthetic_results.json or "
                        "{'runs': [...]}) and draw their learning curves into docs/figures, without training")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, in separate processes")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "synthetic-recall")
    parser.add_argument("--results-md", type=Path, default=REPO / "docs" / "results.md")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the runs of <out>/synthetic_results.json with the same model, task and training "
                        "settings instead of training them again (to continue a stopped study)")
    parser.add_argument("--render-only", action="store_true",
                        help="write the page from <out>/synthetic_results.json without training")
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


def chosen_sweep(sweep: Sweep, args: argparse.Namespace) -> Sweep:
    """``sweep`` with ``--lrs`` and ``--seeds`` applied."""
    lrs = sweep.learning_rates if args.lrs is None else tuple(float(x) for x in args.lrs.split(","))
    return Sweep(learning_rates=lrs, seeds=int_list(args.seeds, sweep.seeds))


def chosen_variants(args: argparse.Namespace) -> list[ModelSpec]:
    """``--variants`` (all by default), each Trellis one once per ``--init`` (a row named
    ``<model>@<init>`` unless the init is the default)."""
    variants = default_variants()
    if args.variants:
        wanted = args.variants.split(",")
        unknown = sorted(set(wanted) - {spec.name for spec in variants})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}; choose from {[spec.name for spec in variants]}")
        variants = [spec for spec in variants if spec.name in wanted]
    inits = args.init.split(",")
    unknown = sorted(set(inits) - set(INIT_VARIANTS))
    if unknown:
        raise SystemExit(f"unknown inits {unknown}; choose from {list(INIT_VARIANTS)}")
    return [dataclasses.replace(spec, init=init, name=spec.name if init == "default" else f"{spec.name}@{init}")
            for spec in variants for init in inits if spec.kind != "llama" or init == "default"]


def parse_train_mix(text: str) -> tuple[tuple[int, int], ...]:
    """``--train-mix``: ``"64x4,128x8"`` -> ``((64, 4), (128, 8))``; an empty string: no mixture."""
    settings = []
    for item in filter(None, text.split(",")):
        parts = item.split("x")
        if len(parts) != 2 or not all(part.isdigit() for part in parts):
            raise SystemExit(f"--train-mix: {item!r} is not <tokens>x<pairs> with two positive integers, e.g. 64x4")
        settings.append((int(parts[0]), int(parts[1])))
    return tuple(settings)


def mqar_grid(preset: Preset, args: argparse.Namespace) -> list[tuple[ModelSpec, MQARTask]]:
    """The (model, task) units of the study, in the order they run: the preset's base models at the
    base setting, and its swept models at each of ``pairs`` and ``seq_lens``."""
    variants = chosen_variants(args)
    pairs = int_list(args.pairs, preset.pairs)
    seq_lens = int_list(args.seq_lens, preset.seq_lens)

    def task(seq_len: int, num_kv_pairs: int) -> MQARTask:
        return MQARTask(seq_len=seq_len, num_kv_pairs=num_kv_pairs, vocab_size=preset.vocab_size,
                        num_train=preset.num_train, num_test=preset.num_test, train_mix=train_mix)

    train_mix = preset.train_mix if args.train_mix is None else parse_train_mix(args.train_mix)

    settings = [(preset.base_seq_len, preset.base_pairs)]
    settings += [(preset.base_seq_len, p) for p in pairs]
    settings += [(s, preset.base_pairs) for s in seq_lens]
    grid = []
    for seq_len, num_pairs in dict.fromkeys(settings):  # in order, without repeats
        is_base = (seq_len, num_pairs) == (preset.base_seq_len, preset.base_pairs)
        # With --variants the choice is the user's; otherwise the preset's base rows, in its order.
        if is_base and not args.variants and preset.base_variants is not None:
            grid += [(spec, task(seq_len, num_pairs)) for name in preset.base_variants
                     for spec in variants if spec.name.split("@")[0] == name]
            continue
        grid += [(spec, task(seq_len, num_pairs)) for spec in variants
                 if is_base or spec.name.split("@")[0] in preset.sweep_variants]
    return grid


def machine_description() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    # Torch threads per run are the command's --threads (default 1), shown with each command.
    return f"{device}, {platform.platform()}, torch {torch.__version__}"


def fmt_lr(lr: float) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def command_line(data: dict) -> str:
    """The page's line for a study's command: its wall clock, and the runs it took from the
    saved file (``--resume``) rather than trained."""
    ran = f"{data['wall_minutes']:.0f} min wall clock" if data.get("wall_minutes") else "did not finish"
    reused = data.get("resumed_runs")
    return f"Command: `{data['command']}` ({ran}" + (f"; {reused} runs reused from the saved file)" if reused else ")")


def cell(summary: dict) -> str:
    """``median [min, max]`` of a summary's seeds, with the seed count when it is not 3."""
    n = len(summary["accuracies"])
    spread = f" [{summary['min']:.2f}, {summary['max']:.2f}]" if n > 1 else ""
    return f"{summary['median']:.3f}{spread}" + ("" if n == 3 else f" (n={n})")


def accuracy_table(summaries: list[dict], column: str, fixed: str, fixed_value: int) -> str:
    """Markdown: one row per model swept along ``column``, cells ``median [min, max]``."""
    rows = [s for s in summaries if s["task"][fixed] == fixed_value]
    columns = sorted({s["task"][column] for s in rows})
    models = [m for m in dict.fromkeys(s["model"] for s in rows) if sum(s["model"] == m for s in rows) > 1]
    cells = {(s["model"], s["task"][column]): s for s in rows}
    lines = ["| model | " + " | ".join(f"{column}={c}" for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    for model in models:
        values = [cell(cells[model, c]) if (model, c) in cells else "-" for c in columns]
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


def plot_curves(records: list[dict], summaries: list[dict], title: str, path: Path) -> bool:
    """Learning curves of one setting: a panel per model, a solid line per seed at the best
    learning rate and a dotted line for each other rate (first seed). False without curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [s for s in summaries if any(r["curve"] for r in records if r["model"] == s["model"])]
    if not models:
        return False
    cols = min(4, len(models))
    rows = -(-len(models) // cols)
    figure, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False, sharey=True)
    for ax, summary in zip(axes.flat, models):
        for r in records:
            if r["model"] != summary["model"] or not r["curve"]:
                continue
            steps, scores = zip(*r["curve"])
            lr, seed = r["train"]["learning_rate"], r["train"]["seed"]
            if lr == summary["best_lr"]:
                ax.plot(steps, scores, label=f"seed {seed}", linewidth=1.5, color=f"C{seed % 10}")
            else:
                ax.plot(steps, scores, linestyle=":", color="grey", linewidth=1, label=f"lr {fmt_lr(lr)}")
        ax.set_title(f"{summary['model']} (lr {fmt_lr(summary['best_lr'])})", fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=5, loc="upper left")
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    figure.suptitle(title, fontsize=9)
    figure.supxlabel("training step", fontsize=8)
    figure.supylabel("validation accuracy", fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# The paper's ablation directions (its Table 3): (claim, the variant that should win, the one it beats).
PAPER_DIRECTIONS = (
    ("the forget gate helps", "trellis", "trellis-no-forget"),
    ("ln_silu beats softmax as the mixing function", "trellis", "trellis-mix-softmax"),
    ("chunk size 1 beats chunk size 64", "trellis-C1", "trellis-C64"),
    ("more memory slots beat fewer (M = 64 vs 16)", "trellis-M64", "trellis-M16"),
    ("a non-linear phi (LayerNorm) beats the delta rule (identity)", "trellis", "trellis-delta"),
)
LATTICE_PAIRS = (
    ("dec vs enc", "lattice-dec", "lattice-enc"),
    ("dec vs sim", "lattice-dec", "lattice-sim"),
    ("enc vs sim", "lattice-enc", "lattice-sim"),
)


# Below this gap between medians an order holding over every seed is not read as a difference: with
# 3 seeds a side, two equal models put every seed of one above the other 1 time in 20 (10 in each
# order), and on a shared plateau a few points are the plateau's level, not recall.
MIN_GAP = 0.05
# Two models whose every seed scores at least this cannot be ordered at that setting: it is too easy.
CEILING = 0.95


# A seed "learned" the task when it scores at least this: on a plateau that runs to a seed-dependent
# step, each seed either escapes within the budget or not, so counts of escapes say more than ranges.
LEARNED = 0.9


def fisher_one_sided(hits_a: int, n_a: int, hits_b: int, n_b: int) -> float:
    """One-sided Fisher exact test: the probability, with the margins fixed and no difference
    between the two models, that ``a`` gets ``hits_a`` or more of all the hits."""
    hits, total = hits_a + hits_b, n_a + n_b
    tail = range(hits_a, min(hits, n_a) + 1)
    return sum(math.comb(n_a, x) * math.comb(n_b, hits - x) for x in tail) / math.comb(total, hits)


def learned_counts(a: dict, b: dict) -> str:
    """``k/n vs k/n`` seeds at ``LEARNED`` or more, with the one-sided Fisher p that ``a``
    learns more often than ``b``, and the other way's p when ``b`` learned more often."""
    hits_a, hits_b = (sum(x >= LEARNED for x in s["accuracies"]) for s in (a, b))
    n_a, n_b = len(a["accuracies"]), len(b["accuracies"])
    text = f"{hits_a}/{n_a} vs {hits_b}/{n_b} (p = {fisher_one_sided(hits_a, n_a, hits_b, n_b):.2f}"
    if hits_b * n_a > hits_a * n_b:
        text += f"; the other way: {fisher_one_sided(hits_b, n_b, hits_a, n_a):.2f}"
    return text + ")"


def verdict(a: dict, b: dict) -> str:
    """Whether ``a`` beats ``b`` over seeds: separated when every seed of one is above every seed
    of the other and the medians are ``MIN_GAP`` apart, otherwise why not."""
    if len(a["accuracies"]) < 2 or len(b["accuracies"]) < 2:
        return "too few seeds"
    gap = a["median"] - b["median"]
    if max(a["max"], b["max"]) < 0.05:
        return "undecided: both at chance"
    if min(a["min"], b["min"]) >= CEILING:
        return f"undecided: both at the ceiling (every seed >= {CEILING})"
    if a["min"] > b["max"] or b["min"] > a["max"]:
        above = a["min"] > b["max"]
        if abs(gap) < MIN_GAP:
            return f"no clear difference: every seed {'above' if above else 'below'}, by < {MIN_GAP} (the same level)"
        return "**yes** (every seed above)" if above else "**no, the opposite** (every seed below)"
    order = "higher" if gap > 0 else "lower" if gap < 0 else "equal"
    return f"not separated: median {order}, ranges overlap"


def ablation_section(summaries: list[dict], preset: Preset) -> list[str]:
    """Markdown: every model at the base setting, and whether each paper direction holds."""
    base = {s["model"]: s for s in summaries
            if (s["task"]["seq_len"], s["task"]["num_kv_pairs"]) == (preset.base_seq_len, preset.base_pairs)}
    if not base:
        return []
    lrs = sorted({lr for s in base.values() for lr in s["lr_scores"]})
    lines = [f"### All models (seq_len = {preset.base_seq_len}, {preset.base_pairs} pairs)", "",
             "Test accuracy at the best learning rate: median [min, max] over seeds; then the first seed's "
             "test accuracy at each learning rate of the sweep; \"near -> far\": the best rate's median accuracy "
             "over seeds in each quarter of the query region, the queries nearest the context first; \"1st query\": "
             "the best rate's median accuracy on each example's first query, where a model that binds no key to "
             f"its value scores 1/{preset.base_pairs} (later queries it can answer by elimination among the values "
             "not yet answered).", "",
             "| model | layers | changed | best lr | accuracy | near -> far | 1st query | "
             + " | ".join(f"lr {fmt_lr(lr)}" for lr in lrs) + " | s / run |",
             "|---|---|---|---:|---:|---|---:|" + "---:|" * len(lrs) + "---:|"]
    for name, s in base.items():
        changed = ", ".join(f"{k}={v}" for k, v in s["overrides"].items() if k != "mixer_types") or "-"
        layers = "+".join(s["mixer_types"]) if s.get("mixer_types") else "-"
        scores = " | ".join(f"{s['lr_scores'][lr]:.3f}" if lr in s["lr_scores"] else "-" for lr in lrs)
        quarters = " ".join("-" if x is None else f"{x:.2f}" for x in s.get("by_query_position") or ()) or "-"
        first = "-" if s.get("first_query") is None else f"{s['first_query']:.2f}"
        lines.append(f"| {name} | {layers} | {changed} | {fmt_lr(s['best_lr'])} | {cell(s)} | {quarters} | {first} | {scores} "
                     f"| {s['mean_seconds']:.0f} |")

    def compare(title: str, pairs: tuple) -> list[str]:
        rows = [f"| {claim} | {w} {cell(base[w])} vs {l} {cell(base[l])} | {verdict(base[w], base[l])} "
                f"| {learned_counts(base[w], base[l])} |" for claim, w, l in pairs if w in base and l in base]
        return ["", f"| {title} | runs (median [min, max]) | holds over seeds? | seeds >= {LEARNED} (p) |",
                "|---|---|---|---|", *rows] if rows else []

    lines += compare("paper's claim", PAPER_DIRECTIONS)
    lines += compare("Lattice write rule", LATTICE_PAIRS)
    return lines + ["", "A claim holds over seeds when every seed of one model scores above every seed of the "
                    f"other (at each model's own best learning rate) and the medians differ by at least {MIN_GAP}; "
                    f"two models with every seed at {CEILING} or more are not ordered (the setting is too easy for them). "
                    f"\"seeds >= {LEARNED}\": how many seeds of each model reached {LEARNED} (learned the task within "
                    "the budget), and p, the one-sided Fisher exact probability of the first model's count or more "
                    "if both learned equally often (small p: the first learns more often; \"the other way\": the same for the "
                    "second, when it learned more often).", ""]


def mqar_lines(data: dict, preset: Preset, figures: Path, md_dir: Path) -> list[str]:
    records, sweep = data["results"], Sweep(**{k: tuple(v) for k, v in data["sweep"].items()})
    summaries = summarize(records, sweep)
    size, train = records[0]["size"], records[0]["train"]
    shown = {k: v for k, v in train.items() if k not in ("learning_rate", "seed")}
    lines = [
        "## MQAR", "", command_line(data), "",
        f"- model size: {size}",
        f"- training: {shown} (transformers.Trainer, AdamW, warm-up then cosine)",
        f"- sweep: learning rates {[fmt_lr(x) for x in sweep.learning_rates]} with seed {sweep.seeds[0]}, then seeds "
        f"{list(sweep.seeds[1:])} at the rate with the best validation accuracy ({train['num_val']} held-out "
        "examples, apart from the test set); every run is in the raw JSON",
        f"- data: MQAR, vocab {preset.vocab_size}, {preset.num_train} train / {preset.num_test} test examples "
        "per setting and seed, power_a 0.01; accuracy = fraction of answer positions whose argmax equals the value "
        f"(chance: 1/{preset.vocab_size - preset.vocab_size // 2})",
    ]
    mix = records[0]["task"].get("train_mix")
    if mix:
        others = ", ".join(f"{seq_len} tokens / {pairs} pairs" for seq_len, pairs in mix)
        lines.append(f"- training data: a mixture of each row's own setting and {others} (Zoology's recipe; the "
                     "train examples split evenly, one setting per batch); validation and test at the row's own "
                     "setting")
    lines += [
        f"- runs recorded: {len(records)}",
        "",
    ]
    lines += ablation_section(summaries, preset)
    for column, fixed, value, title in (
        ("num_kv_pairs", "seq_len", preset.base_seq_len, "Accuracy vs number of key-value pairs"),
        ("seq_len", "num_kv_pairs", preset.base_pairs, "Accuracy vs context length"),
    ):
        rows = [s for s in summaries if s["task"][fixed] == value]
        if len({s["task"][column] for s in rows}) < 2:
            continue
        lines += [f"### {title} ({fixed} = {value})", "", accuracy_table(summaries, column, fixed, value), ""]
        series: dict[str, list] = {}
        for s in rows:
            series.setdefault(s["model"], []).append((s["task"][column], s["median"]))
        figure = figures / f"mqar_accuracy_vs_{column}.png"
        if plot_lines(series, column, "MQAR accuracy (median over seeds)", f"{fixed} = {value}", figure):
            lines += [f"![{title}]({figure.relative_to(md_dir).as_posix()})", ""]
    settings = dict.fromkeys((s["task"]["seq_len"], s["task"]["num_kv_pairs"]) for s in summaries)
    for seq_len, pairs in settings:
        at = [s for s in summaries if (s["task"]["seq_len"], s["task"]["num_kv_pairs"]) == (seq_len, pairs)]
        runs = [r for r in records if (r["task"]["seq_len"], r["task"]["num_kv_pairs"]) == (seq_len, pairs)]
        figure = figures / f"mqar_curves_T{seq_len}_P{pairs}.png"
        if plot_curves(runs, at, f"MQAR, seq_len {seq_len}, {pairs} pairs", figure):
            lines += [f"### Learning curves (seq_len = {seq_len}, {pairs} pairs)", "",
                      "Validation accuracy every few steps; solid: each seed at the best learning rate, dotted: "
                      "the other rates (first seed).", "",
                      f"![Learning curves, seq_len {seq_len}, {pairs} pairs]({figure.relative_to(md_dir).as_posix()})",
                      ""]
    lines += ["### All runs", "",
              "| model | seq_len | pairs | lr | seed | role | test acc | val acc | mean train loss | steps | train s |",
              "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['model']} | {r['task']['seq_len']} | {r['task']['num_kv_pairs']} "
                     f"| {fmt_lr(r['train']['learning_rate'])} | {r['train']['seed']} | {r.get('sweep_role', '-')} "
                     f"| {r['accuracy']:.3f} | {r['val_accuracy']:.3f} | {r['mean_train_loss']:.3f} "
                     f"| {r.get('steps_run', r['train']['max_steps'])} | {r['train_seconds']:.0f} |")
    return lines + [""]


def niah_lines(data: dict, figures: Path, md_dir: Path) -> list[str]:
    records, sweep = data["results"], Sweep(**{k: tuple(v) for k, v in data["sweep"].items()})
    summaries = summarize(records, sweep)
    task, train = records[0]["task"], records[0]["train"]
    shown = {k: v for k, v in train.items() if k not in ("learning_rate", "seed")}
    contexts = task["eval_contexts"]

    def mean(r: dict, length: int) -> float:
        scores = r["scores"][str(length)]
        return sum(scores.values()) / len(scores)

    lines = [
        "## Single-needle retrieval (S-NIAH)", "", command_line(data), "",
        f"- trained from scratch on {task['num_train']} prompts of {task['train_context']} tokens (noise haystack, a "
        "7-digit number needle at a uniform depth; loss on the answer only), then scored with greedy `generate()` on "
        f"unseen needles: {task['samples']} prompts per (context, depth), depths {task['depths']}",
        f"- training: {shown}; tokenizer: byte-level BPE, {task['tokenizer_vocab']} tokens, trained on the task's text",
        f"- sweep: learning rates {[fmt_lr(x) for x in sweep.learning_rates]} with seed {sweep.seeds[0]}, then seeds "
        f"{list(sweep.seeds[1:])} at the rate that retrieved most validation needles at {task['train_context']} tokens",
        "",
        "Fraction of needles retrieved (mean over depths) at the best learning rate: median [min, max] over seeds.", "",
        "| model | best lr | seeds | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
        "|---|---:|---:|" + "---:|" * len(contexts),
    ]
    series = {}
    for s in summaries:
        at_best = [r for r in records if r["model"] == s["model"] and r["train"]["learning_rate"] == s["best_lr"]]
        cells, medians = [], []
        for c in contexts:
            values = sorted(mean(r, c) for r in at_best)
            median = statistics.median(values)
            medians.append((c, median))
            cells.append(f"{median:.2f}" + (f" [{values[0]:.2f}, {values[-1]:.2f}]" if len(values) > 1 else ""))
        series[s["model"]] = medians
        lines.append(f"| {s['model']} | {fmt_lr(s['best_lr'])} | {len(at_best)} | " + " | ".join(cells) + " |")
    lines += ["", "Every run (mean over depths per context):", "",
              "| model | lr | seed | " + " | ".join(f"{c}" for c in contexts) + " | train s |",
              "|---|---:|---:|" + "---:|" * len(contexts) + "---:|"]
    for r in records:
        lines.append(f"| {r['model']} | {fmt_lr(r['train']['learning_rate'])} | {r['train']['seed']} | "
                     + " | ".join(f"{mean(r, c):.2f}" for c in contexts) + f" | {r['train_seconds']:.0f} |")
    figure = figures / "niah_accuracy_vs_context.png"
    if plot_lines(series, "context tokens", "needles retrieved (median over seeds)",
                  f"S-NIAH, trained at {task['train_context']} tokens", figure):
        lines += ["", f"![S-NIAH accuracy vs context]({figure.relative_to(md_dir).as_posix()})"]
    return lines + [""]


def init_report(runs: list[dict], figures: Path, md_dir: Path, name: str) -> list[str]:
    """Markdown: per setting, learning rate, model and init, the step each seed left chance and its
    final test accuracy, median [min, max] over seeds, and a figure of learning curves per setting and
    rate, ``<figures>/<name>_T<seq_len>_P<pairs>_lr<lr>.png`` (``name``: the study's, so that two
    studies' figures do not overwrite each other)."""
    def setting(r: dict) -> tuple[int, int, float]:
        return r["task"]["seq_len"], r["task"]["num_kv_pairs"], r["train"]["learning_rate"]

    groups: dict[tuple, list[dict]] = {}
    for r in sorted(runs, key=lambda r: (setting(r)[:2], -setting(r)[2])):
        groups.setdefault((setting(r), r["model"]), []).append(r)
    lines = ["| seq_len, pairs | model | init | lr | seeds | step leaving chance (val > 0.1) | final test accuracy "
             "| per seed (step: accuracy) |", "|---|---|---|---:|---:|---|---|---|"]
    for ((seq_len, pairs, lr), _), group in groups.items():
        group.sort(key=lambda r: r["train"]["seed"])
        steps = [escape_step(r["curve"]) for r in group]
        per_seed = ", ".join(f"{'never' if s is None else s}: {r['accuracy']:.2f}" for s, r in zip(steps, group))
        model = group[0]["model"].split("@")[0]  # an init's row is named <model>@<init>
        lines.append(f"| {seq_len}, {pairs} | {model} | {group[0].get('init', 'default')} | {fmt_lr(lr)} | {len(group)} "
                     f"| {median_range(steps, 0)} | {median_range([r['accuracy'] for r in group], 3)} | {per_seed} |")
    for seq_len, pairs, lr in dict.fromkeys(key for key, _ in groups):
        at = [r for r in runs if setting(r) == (seq_len, pairs, lr)]
        summaries = summarize(at, Sweep(learning_rates=(lr,), seeds=tuple(sorted({r["train"]["seed"] for r in at}))))
        figure = figures / f"{name}_T{seq_len}_P{pairs}_lr{fmt_lr(lr)}.png"
        title = f"MQAR, seq_len {seq_len}, {pairs} pairs, lr {fmt_lr(lr)}: initialisations"
        if plot_curves(at, summaries, title, figure):
            lines += ["", f"![{title}]({figure.relative_to(md_dir).as_posix()})"]
    return lines


def write_markdown(results: dict, preset: Preset, args: argparse.Namespace) -> None:
    """``args.results_md`` from the saved results of both tasks, plus the hand-written reading
    (``<name>_notes.md`` beside it, e.g. ``results_notes.md``) when there is one."""
    md_path = args.results_md
    figures = md_path.parent / "figures"
    lines = [
        "# Synthetic recall results", "",
        "Written by `studies/synthetic_recall.py` (commands below, run from the repository root).", "",
        f"- date (UTC): {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}",
        f"- machine: {machine_description()}",
        "",
    ]
    if results.get("mqar", {}).get("results"):
        lines += mqar_lines(results["mqar"], preset, figures, md_path.parent)
    if results.get("niah", {}).get("results"):
        lines += niah_lines(results["niah"], figures, md_path.parent)
    notes = md_path.with_name(f"{md_path.stem}_notes.md")
    if notes.exists():
        lines += [notes.read_text(encoding="utf-8")]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")


def run_study(args: argparse.Namespace, units: list, sweep: Sweep, describe, results: dict, key: str,
              command: str, saved: Path) -> None:
    """Train ``units`` over ``sweep`` (``args.jobs`` at a time), saving ``results[key]`` to
    ``saved`` after every run."""
    started = time.perf_counter()
    previous = results.get(key, {}).get("results", []) if args.resume else []
    entry = results[key] = {"command": command, "sweep": dataclasses.asdict(sweep), "results": [],
                            "wall_minutes": None}
    if previous:
        entry["resumed_runs"] = len(previous)

    def reuse(submit):
        """``submit`` that answers from ``previous`` when a run with the same settings is there."""
        def submit_or_reuse(fn, *fn_args):
            spec, task, *_, train = fn_args
            want = (spec.name, json.dumps(dataclasses.asdict(task), sort_keys=True),
                    json.dumps(dataclasses.asdict(train), sort_keys=True))
            for record in previous:
                if (record["model"], json.dumps(record["task"], sort_keys=True),
                        json.dumps(record["train"], sort_keys=True)) == want:
                    return InlineExecutor().submit(lambda: record)
            return submit(fn, *fn_args)
        return submit_or_reuse
    total = len(units) * (len(sweep.learning_rates) + len(sweep.seeds) - 1)

    def on_result(record: dict) -> None:
        entry["results"].append(record)
        saved.write_text(json.dumps(results, indent=1))
        print(f"[{len(entry['results'])}/{total}] {describe(record)} lr={fmt_lr(record['train']['learning_rate'])} "
              f"seed={record['train']['seed']} ({record['train_seconds']:.0f}s train, "
              f"{time.perf_counter() - started:.0f}s total)", flush=True)

    if args.jobs == 1:
        sweep_runs(units, sweep, reuse(InlineExecutor().submit), on_result)
    else:
        # Small models use one core badly: separate processes, one torch thread pool each.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=torch.set_num_threads,
                                 initargs=(args.threads,)) as pool:
            sweep_runs(units, sweep, reuse(pool.submit), on_result, max_in_flight=args.jobs)
    # Grouped by unit, as summarize and the tables expect.
    order = {setting_key({"model": spec.name, "task": dataclasses.asdict(task)}): i
             for i, (_, (spec, task, *_)) in enumerate(units)}
    entry["results"].sort(key=lambda r: order.get(setting_key(r), len(order)))
    entry["wall_minutes"] = (time.perf_counter() - started) / 60
    saved.write_text(json.dumps(results, indent=1))


def with_steps(train: TrainSettings, args: argparse.Namespace) -> TrainSettings:
    """``train`` with ``--max-steps`` applied when given."""
    return train if args.max_steps is None else dataclasses.replace(train, max_steps=args.max_steps)


def mqar_units(args: argparse.Namespace, preset: Preset) -> list:
    train = with_steps(preset.train, args)
    return [(run_mqar, (spec, task, preset.size, train)) for spec, task in mqar_grid(preset, args)]


def niah_units(args: argparse.Namespace, preset: Preset) -> list:
    """The preset's NIAH variants (among ``--variants`` when given), trained at its short context."""
    if preset.niah is None:
        return []
    train = with_steps(preset.niah_train, args)
    wanted = set(args.variants.split(",")) if args.variants else set(preset.niah_variants)
    specs = [spec for spec in default_variants() if spec.name in preset.niah_variants and spec.name in wanted]
    units = [(run_niah, (spec, preset.niah, preset.size, train)) for spec in specs]
    for probability, start in preset.niah_state_passing:
        passed = dataclasses.replace(train, state_passing=probability, state_passing_from=start)
        units += [(run_niah, (dataclasses.replace(spec, name=state_passing_name(spec.name, probability, start)),
                              preset.niah, preset.size, passed)) for spec in specs]
    return units


def state_passing_name(model: str, probability: float, start: float) -> str:
    """The row of ``model`` trained with state passing, named as the LM study names its runs:
    ``trellis-sp`` (p = 0.9 from the first step), ``trellis-sp50-from70`` (p = 0.5 from 70%)."""
    return (f"{model}-sp" + ("" if probability == 0.9 else f"{round(probability * 100)}")
            + (f"-from{round(start * 100)}" if start else ""))


def describe_mqar(r: dict) -> str:
    return (f"mqar {r['model']:20s} seq_len={r['task']['seq_len']:4d} pairs={r['task']['num_kv_pairs']:3d} "
            f"acc={r['accuracy']:.3f} val={r['val_accuracy']:.3f} mean loss={r['mean_train_loss']:.3f}")


def describe_niah(r: dict) -> str:
    means = {length: sum(s.values()) / len(s) for length, s in r["scores"].items()}
    return f"niah {r['model']:20s} " + " ".join(f"{k}:{v:.2f}" for k, v in means.items())


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
    command = shlex.join(["python", "-m", "studies.synthetic_recall", *(sys.argv[1:] if argv is None else argv)])
    if args.task == "niah" and args.model:
        score_checkpoint_niah(args, command)
        return
    if args.init_report:
        data = json.loads(args.init_report.read_text())
        runs = data["runs"] if "runs" in data else data["mqar"]["results"]
        print("\n".join(init_report(runs, args.results_md.parent / "figures", args.results_md.parent,
                                     args.init_report.stem)))
        return
    preset = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "synthetic_results.json"
    # A run of one task keeps the other task's latest results in the page.
    results = json.loads(saved.read_text()) if saved.exists() else {}
    if not args.render_only:
        if args.task in ("all", "mqar"):
            run_study(args, mqar_units(args, preset), chosen_sweep(preset.sweep, args), describe_mqar, results,
                      "mqar", command, saved)
        units = niah_units(args, preset) if args.task in ("all", "niah") else []
        if units:
            run_study(args, units, chosen_sweep(preset.niah_sweep, args), describe_niah, results, "niah", command,
                      saved)
    write_markdown(results, preset, args)
    print(f"wrote {saved} and {args.results_md}")


if __name__ == "__main__":
    main()
