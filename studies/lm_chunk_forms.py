"""Does chunked Trellis train as well as its exact recurrence? The language-modelling study's
models (``studies/lm_study.py``: data, size, recipe, windows, seeds), each with the recipes' state
passing (p = 0.9 over the last 30% of the steps), compared at the training length and far past it:

    .venv/bin/python -m studies.lm_chunk_forms                  # ~3 h on 2 idle cores, resumable
    .venv/bin/python -m studies.lm_chunk_forms --preset quick --out /tmp/x --page /tmp/x/page.md
    .venv/bin/python -m studies.lm_chunk_forms --render-only    # the section of docs/results_lm.md

The models: Trellis with ``write_gradient="exact"`` (every write's gradient at the memory just
before it) at C = 16, 32, 64, which all compute the per-token recurrence (C only chooses how);
Trellis ``"anchored"`` (the gradient at the chunk's start, every checkpoint before the field) at
C = 16, 32, 64; Trellis at C = 1 (the recurrence itself, through the anchored form's per-token
chunk loop: an independent code path); the gated delta rule and Lattice (their study rates); and
the same-size Llama (no state to pass).

Learning rates: the study's sweeps chose 3e-3 for every Trellis variant, the delta rule and Llama,
and 1.2e-2 for Lattice. The exact form is a new model, so it gets its own sweep (the study's: the
preset's rates on a quarter of the tokens, seed 0, widened at an edge); since it is one function at
every C, the sweep runs at C = 64 and its best rate serves C = 16 and 32 too.

Measures: validation and test perplexity at the training length (the study's windows), perplexity
by position on long held-out files read in one pass up to 64x the training length, training
tokens/s (on a shared machine: compare speeds with ``benchmarks/bench_chunk_training.py``), and for
the Trellis runs the largest difference between the model's chunk form and the per-token loop
(backend ``"reference"``) on the trained weights: logits on held-out windows, float32 and float64.
Every run is appended to ``<out>/lm_chunk_forms.json`` as it finishes; ``--render-only`` writes
the section into ``docs/results_lm.md`` (between its markers) and the figure.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from studies.lm import (
    STUDY_SIZE, Recipe, StudyModel, build_study_model, encode_corpus, num_parameters, random_windows, stdlib_corpus,
    train_lm,
)
from studies.records import append_record, best_rate, load_records, spread, study_arguments, sweep
from trellis_lm.eval.perplexity import perplexity, perplexity_by_position

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results_lm.md"
BEGIN, END = "<!-- lm_chunk_forms: begin -->", "<!-- lm_chunk_forms: end -->"


@dataclass(frozen=True)
class Model:
    """A compared model: its study spec, its learning rate (``None``: swept, see the module doc;
    ``sweep_as``: take the rate the named model's sweep chose), and whether its rows pass states."""

    spec: StudyModel
    learning_rate: Optional[float] = None
    sweep_as: Optional[str] = None
    state_passing: bool = True

    @property
    def name(self) -> str:
        return self.spec.name


def _trellis(name: str, chunk: int, form: str, **kwargs: Any) -> Model:
    return Model(StudyModel(name, overrides={"chunk_size": chunk, "write_gradient": form}), **kwargs)


# In the order they run: the comparison the defaults are chosen from first.
MODELS = (
    _trellis("exact-C64", 64, "exact"),
    _trellis("anchored-C64", 64, "anchored", learning_rate=3e-3),
    Model(StudyModel("llama", kind="llama"), 3e-3, state_passing=False),
    _trellis("exact-C16", 16, "exact", sweep_as="exact-C64"),
    _trellis("exact-C32", 32, "exact", sweep_as="exact-C64"),
    _trellis("C1", 1, "anchored", learning_rate=3e-3),
    _trellis("anchored-C16", 16, "anchored", learning_rate=3e-3),
    _trellis("anchored-C32", 32, "anchored", learning_rate=3e-3),
    Model(StudyModel("delta-rule", overrides={"compress_fn": "identity", "chunk_size": 32}), 3e-3),
    Model(StudyModel("lattice", overrides={"mixer_types": ("lattice",), "lattice_variant": "dec", "chunk_size": 32}),
          1.2e-2),
)
# The page's row order.
ROWS = ("llama", "exact-C16", "exact-C32", "exact-C64", "anchored-C16", "anchored-C32", "anchored-C64", "C1",
        "delta-rule", "lattice")
# Where a model has not run here, the page shows the earlier studies' runs of the same model, recipe,
# seeds and rate (hence the same initial weights and windows), marked: lm_extrapolation's state-passing
# runs (no test perplexity recorded) and lm_study's (test perplexity; C = 1 there without state passing).
EARLIER = {
    "anchored-C16": ("lm_extrapolation.json", "trellis-C16-sp-from70"),
    "anchored-C32": ("lm_extrapolation.json", "trellis-sp-from70"),
    "anchored-C64": ("lm_extrapolation.json", "trellis-C64-sp-from70"),
    "delta-rule": ("lm_extrapolation.json", "delta-rule-sp-from70"),
    "lattice": ("lm_extrapolation.json", "lattice-sp-from70"),
    "llama": ("lm_study.json", "llama"),
    "C1": ("lm_study.json", "trellis-C1"),
}

PRESETS: dict[str, dict[str, Any]] = {
    # The study's cpu preset (lm_study.py), with its rates for the sweep.
    "cpu": dict(size=STUDY_SIZE, vocab=4096, recipe=Recipe(train_length=128, batch_size=16, tokens=1_500_000),
                lrs=(1e-3, 3e-3, 6e-3), widen=2, seeds=(0, 1), multiples=(1, 4, 8, 16, 64), eval_windows=256,
                # One thread: the study shared its machine with other work, where two threads
                # per process oversubscribed the cores (speed: bench_chunk_training.py).
                long_files=8, check_windows=4, threads=1),
    "quick": dict(size=dataclasses.replace(STUDY_SIZE, hidden_size=32, num_heads=2, head_dim=16, intermediate_size=64,
                                           num_slots=8, chunk_size=8),
                  vocab=512, recipe=Recipe(train_length=32, batch_size=4, tokens=4 * 32 * 8), lrs=(1e-3, 3e-3),
                  widen=0, seeds=(0,), multiples=(1, 4), eval_windows=8, long_files=2, check_windows=2, threads=None,
                  max_train_files=40),
}


@torch.no_grad()
def loop_difference(model: Any, windows: torch.Tensor) -> dict[str, float]:
    """The largest absolute difference between the logits of the model's chunk form (its
    ``op_backend``, ``"auto"``) and of the per-token loop (``"reference"``) on ``windows``
    ``[N, T]``, in float32 and in float64 (a copy of the model), with the largest logit beside
    them for scale."""
    result = {}
    for dtype in (torch.float32, torch.float64):
        copy = model.to(dtype)
        logits = {}
        for backend in ("auto", "reference"):
            copy.config.op_backend = backend
            logits[backend] = copy(input_ids=windows).logits
        copy.config.op_backend = "auto"
        name = str(dtype).removeprefix("torch.")
        result[f"max_abs_{name}"] = float((logits["auto"] - logits["reference"]).abs().max())
        result["max_logit"] = float(logits["reference"].abs().max())
    model.to(torch.float32)
    return result


def run_all(preset: dict[str, Any], out: Path, names: Optional[list[str]]) -> None:
    """Train and measure every model and seed not yet in ``<out>/lm_chunk_forms.json``."""
    if preset.get("threads"):
        torch.set_num_threads(preset["threads"])
    path = out / "lm_chunk_forms.json"
    encoded = encode_corpus(stdlib_corpus(), preset["vocab"], preset.get("max_train_files"))
    vocab, recipe, size = len(encoded.tokenizer), preset["recipe"], preset["size"]
    short = dataclasses.replace(recipe, tokens=recipe.tokens // 4)
    longest = recipe.train_length * max(preset["multiples"])
    # The Llama's parameter count, before any seeding (building it draws random numbers).
    llama = next(m for m in MODELS if m.spec.kind == "llama")
    target = num_parameters(build_study_model(llama.spec, size, vocab, longest + 64))
    check = random_windows(encoded.tokens["test"], preset["check_windows"], recipe.train_length,
                           torch.Generator().manual_seed(0))[:, :-1].long()

    def run(model_spec: Model, phase: str, rate: float, seed: int, budget: Recipe) -> None:
        done = {(r["model"], r["phase"], r["learning_rate"], r["seed"]) for r in load_records(path)}
        if (model_spec.name, phase, rate, seed) in done:
            return
        torch.manual_seed(seed)
        model = build_study_model(model_spec.spec, size, vocab, longest + 64, target)
        bar = tqdm(total=budget.steps, desc=f"{model_spec.name} {phase} lr={rate:g} seed={seed}", leave=False)
        trained = train_lm(model, encoded.tokens["train"], budget, rate, seed, lambda step, loss: bar.update(1),
                           state_passing=0.9 if model_spec.state_passing else 0.0, state_passing_from=0.7)
        bar.close()
        record = {"model": model_spec.name, "phase": phase, "seed": seed, "learning_rate": rate,
                  "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in model_spec.spec.overrides.items()},
                  "state_passing": model_spec.state_passing, "train_tokens": budget.tokens,
                  "train_length": budget.train_length, "num_parameters": num_parameters(model), **trained}
        model.eval()
        record["val_ppl"] = perplexity(model, encoded.files["validation"], budget.train_length, preset["eval_windows"])
        if phase == "full":
            record["test_ppl"] = perplexity(model, encoded.files["test"], budget.train_length, preset["eval_windows"])
            record["ppl_by_position"] = perplexity_by_position(model, encoded.files["test"], longest,
                                                               budget.train_length, preset["long_files"])
            if model_spec.spec.kind == "trellis":
                record["loop_difference"] = loop_difference(model, check)
        append_record(path, record)
        print(f"{model_spec.name} {phase} lr={rate:g} seed={seed}: "
              f"{ {k: record.get(k) for k in ('val_ppl', 'test_ppl', 'tokens_per_s', 'loop_difference')} }")

    def swept_rate(model_spec: Model) -> Optional[float]:
        return sweep(lambda rate: run(model_spec, "sweep", rate, preset["seeds"][0], short), path, model_spec.name,
                     preset["lrs"], preset["widen"], short.tokens)

    rates: dict[str, Optional[float]] = {}
    for model_spec in MODELS:
        if names is not None and model_spec.name not in names:
            continue
        if model_spec.sweep_as:
            rate = rates.get(model_spec.sweep_as) or best_rate(load_records(path), model_spec.sweep_as, short.tokens)
        else:
            rate = model_spec.learning_rate or swept_rate(model_spec)
        rates[model_spec.name] = rate
        if rate is None:
            print(f"{model_spec.name}: no learning rate yet (its sweep, or {model_spec.sweep_as}'s, has not run)")
            continue
        for seed in preset["seeds"]:
            run(model_spec, "full", rate, seed, recipe)


def with_earlier_runs(records: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """``records`` plus, for each model of :data:`EARLIER` without a full run here, the earlier
    study's full runs of it, renamed and marked ``"earlier"`` (the source file)."""
    have = {r["model"] for r in records if r["phase"] == "full"}
    added = []
    for name, (file, earlier) in EARLIER.items():
        if name in have or not (folder / file).exists():
            continue
        for run in load_records(folder / file):
            if run["model"] == earlier and run.get("phase", "full") == "full" and "ppl_by_position" in run:
                added.append({**run, "model": name, "phase": "full", "earlier": file})
    return records + added


def section(records: list[dict[str, Any]], figure: Path, figure_link: str) -> list[str]:
    """The page's section: the comparison table, the far/near table, the loop check, and the figure."""
    full = [r for r in records if r["phase"] == "full"]
    models = [m for m in ROWS if any(r["model"] == m for r in full)]
    if not models:
        return ["## Chunked Trellis against its exact recurrence", "", "No run has finished yet."]
    by_model = {m: [r for r in full if r["model"] == m] for m in models}
    buckets = list(full[0]["ppl_by_position"])
    first, last = buckets[0], buckets[-1]
    llama = by_model.get("llama")
    lines = ["## Chunked Trellis against its exact recurrence", "",
             "Command: `python -m studies.lm_chunk_forms` (the module doc says what each row is). Every Trellis row, "
             "the delta rule and Lattice pass states over the last 30% of the steps (p = 0.9, the recipes' default). "
             "`exact-C*` compute Trellis's per-token recurrence (`write_gradient=\"exact\"`) at each chunk size; "
             "`anchored-C*` take every write's gradient at its chunk's start (every checkpoint saved before the "
             "field); `C1` is the recurrence through the anchored form's per-token chunk loop. "
             "Each cell: mean over seeds [min, max]. Rows marked * are the earlier studies' runs of the same "
             "model, recipe, seeds and rate (`lm_extrapolation.json`: no test perplexity recorded; "
             "`lm_study.json`: C = 1 there passed no states).", "",
             "| model | lr | seeds | validation ppl | test ppl | val / Llama's | "
             f"ppl [{first}) | ppl [{last}) | [{last}) / [{first}) | "
             "training tokens/s as run (shared machine: not comparable across rows; BENCHMARKS.md times them in turns) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        runs = by_model[m]
        ratio = (spread([statistics.fmean(r["val_ppl"] for r in runs) / statistics.fmean(r["val_ppl"] for r in llama)])
                 if llama else "")
        far = [r["ppl_by_position"][last] / r["ppl_by_position"][first] for r in runs]
        tests = [r["test_ppl"] for r in runs if r.get("test_ppl")]
        lines.append(f"| {m}{' *' if runs[0].get('earlier') else ''} | {runs[0]['learning_rate']:g} | {len(runs)} | "
                     f"{spread([r['val_ppl'] for r in runs])} | {spread(tests) if tests else '-'} | {ratio} | "
                     f"{spread([r['ppl_by_position'][first] for r in runs], 1)} | "
                     f"{spread([r['ppl_by_position'][last] for r in runs], 1)} | {spread(far)} | "
                     f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f} |")
    sweeps = [r for r in records if r["phase"] == "sweep"]
    if sweeps:
        lines += ["", "Learning-rate sweep of the exact form (a quarter of the tokens, seed 0): " + ", ".join(
            f"{r['learning_rate']:g} -> {r['val_ppl']:.2f}" for r in sorted(sweeps, key=lambda r: r["learning_rate"]))
            + " (validation perplexity)."]
    checked = [r for r in full if "loop_difference" in r]
    if checked:
        lines += ["", "Chunk form against the per-token loop on the trained weights (largest |logit difference| on "
                  "held-out windows at the training length; the largest |logit| for scale):", "",
                  "| model | seed | float32 | float64 | largest logit |", "|---|---|---|---|---|"]
        for r in checked:
            d = r["loop_difference"]
            lines.append(f"| {r['model']} | {r['seed']} | {d['max_abs_float32']:.1e} | {d['max_abs_float64']:.1e} | "
                         f"{d['max_logit']:.1f} |")
    _figure(by_model, buckets, figure)
    return lines + ["", f"![perplexity by position, exact and anchored chunk forms]({figure_link})"]


def _figure(by_model: dict[str, list[dict[str, Any]]], buckets: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    ends = [int(b.split("-")[1]) for b in buckets]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for m, runs in by_model.items():
        style = "-" if m.startswith("exact") else "--" if m.startswith("anchored") else ":"
        axes[0].plot(ends, [statistics.fmean(r["ppl_by_position"][b] for r in runs) for b in buckets], style,
                     marker="o", markersize=3, label=m)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens (end of each position bucket)", ylabel="perplexity",
                title="Perplexity by position (held-out files, one pass)")
    axes[0].legend(fontsize=7, ncol=2)
    names = list(by_model)
    means = [statistics.fmean(r["val_ppl"] for r in by_model[m]) for m in names]
    axes[1].barh(range(len(names)), means, color=["C0" if m.startswith("exact") else "C1" if m.startswith("anchored")
                                                  else "C2" for m in names])
    axes[1].set_yticks(range(len(names)), names, fontsize=8)
    axes[1].invert_yaxis()
    axes[1].set(xlabel="validation perplexity at the training length", title="At the training length",
                xlim=(min(means) * 0.9, max(means) * 1.03))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(out: Path, page: Path) -> None:
    """Write the section between the page's markers (appended when the page has none)."""
    figure = page.parent / "figures" / "lm_chunk_forms.png"
    lines = section(with_earlier_runs(load_records(out / "lm_chunk_forms.json"), out), figure,
                    "figures/lm_chunk_forms.png")
    block = "\n".join([BEGIN, *lines, END])
    text = page.read_text() if page.exists() else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    page.write_text(text)
    print(f"wrote {page}")


def main() -> None:
    args = study_arguments(__doc__, PRESETS, "lm_chunk_forms.json", PAGE, "models")
    if not args.render_only:
        run_all(PRESETS[args.preset], args.out, args.models)
    render(args.out, args.page)


if __name__ == "__main__":
    main()
