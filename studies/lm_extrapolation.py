"""Why do the language-modelling study's memory models degrade far past their training length, and
why does passkey retrieval fail? Controlled runs, one factor changed at a time from the study's
Trellis (``studies/lm_study.py``, ``docs/results_lm.md``), each with the study's data, size,
recipe and tokens at Trellis's best rate there, over seeds:

    .venv/bin/python -m studies.lm_extrapolation                        # ~3.5 h on 2 cores (24 variants, 2 seeds), resumable
    .venv/bin/python -m studies.lm_extrapolation --preset quick --out /tmp/x --page /tmp/x/page.md
    .venv/bin/python -m studies.lm_extrapolation --render-only

The variants:

* ``llama`` and ``trellis``: the study's models again (same seeds, so the same weights), the
  controls, now with the measures below;
* ``trellis-fast-gate``: the forget gate initialised so that every head forgets within the
  training length (``1 - beta`` over [1e-2, 1e-1] instead of [1e-3, 1e-1]: horizons of 10-100
  tokens instead of 10-1000);
* ``trellis-T512``: trained on windows of 4x the training length, 512 tokens instead of 128
  (batch 4 instead of 16: the same tokens per step and in all); ``trellis-T512-lr1e-3`` the same
  at 1e-3, because the study's rate did not train it in every seed.

* ``trellis-C8``: chunks of 8 tokens instead of 32 (the study's ``trellis-C1`` row is the exact
  recurrence, C = 1; it trains at a quarter of C = 32's speed on a CPU, so C = 8 asks how much of
  C = 1's gain a cheaper chunk keeps).

No forget gate at all is the study's ``trellis-no-forget`` row; it is not trained again here.

* state passing (issue 35, :mod:`trellis_lm.state_passing`: a training row starts from a row of the
  previous batch's final memory states with probability p), with the same seeds, windows and initial
  weights as the runs without: ``trellis-sp`` (p = 0.9 from the first step), ``trellis-sp50``
  (p = 0.5), ``trellis-sp-late``, ``trellis-sp-from70`` and ``trellis-sp-half`` (p = 0.9 over the
  last fifth / 30% / half of the steps only, the paper's post-training); ``<model>-sp-late`` and
  ``<model>-sp-from70`` (the last fifth / 30%) for ``lattice`` (at its study rate, 1.2e-2),
  ``hybrid``, ``delta-rule`` and ``trellis-C8``, and ``trellis-C16-sp-from70`` and
  ``trellis-C64-sp-from70`` for the chunk-size table; and ``lattice``, ``hybrid``, ``delta-rule``
  without it (the study's own runs: where this command has not run them, the page takes them from
  ``docs/results_data/lm_study.json``, the same seeds and recipe, hence the same weights). These runs
  skip the memory profile and the capped readings. About 3.5 min each on 2 idle cores.

Measures (every run): validation perplexity at 128 tokens; perplexity by position (the study's
buckets, on its long held-out files, read in one pass); passkey *preference* (does the model
give the key it was shown a higher probability than a fresh one: it moves before exact-match
retrieval can, see :func:`~trellis_lm.eval.passkey.passkey_preference`); and for the memory
models the RMS of each layer's memories after 128 ... 8192 tokens, each head's forget horizon, and
perplexity by position again with every horizon capped at the training length at inference
(:func:`~studies.lm.capped_horizons`: a causal test of the slow heads).
Every run is appended to ``<out>/lm_extrapolation.json`` as it finishes; the page is
``docs/results_lm_extrapolation.md``.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from studies.lm import (
    STUDY_SIZE, Recipe, StudyModel, build_study_model, capped_horizons, encode_corpus, forget_gates, memory_profile,
    num_parameters, stdlib_corpus, study_models, train_lm,
)
from studies.records import append_record, load_records, save_records, spread, study_arguments
from trellis_lm.eval.passkey import passkey_preference
from trellis_lm.eval.perplexity import perplexity, perplexity_by_position
from trellis_lm.mixers import forget_gate_bias

ROOT = Path(__file__).resolve().parent.parent
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
# Interventions at inference, in multiples of the training length: every forget horizon capped
# (at the training length itself, and at 8x it), and the text read in segments of 8x it, each
# from a fresh state.
CAPS = (1, 8)
RESET = 8


STUDY_MODELS = {spec.name: spec for spec in study_models(128)}
# The models the state-passing runs compare, with their study learning rates.
STATE_PASSING_MODELS = (
    ("trellis", STUDY_MODELS["trellis"], None), ("lattice", STUDY_MODELS["lattice"], 1.2e-2),
    ("hybrid", STUDY_MODELS["hybrid"], None), ("delta-rule", STUDY_MODELS["delta-rule"], None),
    ("trellis-C8", StudyModel("trellis-C8", overrides={"chunk_size": 8}), None),
)
# The chunk sizes of the table the default is chosen from, beside the study's 32 and C8 above.
CHUNK_MODELS = tuple((f"trellis-C{c}", StudyModel(f"trellis-C{c}", overrides={"chunk_size": c}), None) for c in (16, 64))


@dataclass(frozen=True)
class Variant:
    """One controlled run's model and recipe: the study's ``spec``, trained on windows of
    ``length_factor`` times the preset's training length (the batch divided by it, to keep the
    tokens per step), at ``learning_rate`` (the preset's when ``None``), with the forget gate's
    bias spread over ``gate_span`` (values of ``1 - beta``, see :func:`forget_gate_bias`) when given."""

    name: str
    spec: StudyModel
    length_factor: int = 1
    gate_span: Optional[tuple[float, float]] = None
    learning_rate: Optional[float] = None
    state_passing: float = 0.0
    state_passing_from: float = 0.0
    state_decay: Optional[float] = None  # (StatePassing's decay)
    # The memory profile and the capped-horizon readings (the first study's diagnostics).
    diagnostics: bool = True


VARIANTS = (
    Variant("llama", StudyModel("llama", kind="llama")),
    Variant("trellis", StudyModel("trellis")),
    Variant("trellis-fast-gate", StudyModel("trellis"), gate_span=(1e-2, 1e-1)),
    Variant("trellis-T512", StudyModel("trellis"), length_factor=4),
    # At 512 tokens the study's rate left seed 0 on a plateau (loss 6.2 for most of the run).
    Variant("trellis-T512-lr1e-3", StudyModel("trellis"), length_factor=4, learning_rate=1e-3),
    Variant("trellis-C8", StudyModel("trellis-C8", overrides={"chunk_size": 8})),
    # State passing (issue 35): a training row starts from a row of the previous batch's final
    # states with probability p. The same seeds, windows and initial weights as the runs without.
    # For Trellis: p = 0.9 from the first step, p = 0.5, and p = 0.9 over the last fifth or half of
    # the steps only (post-training, as the paper applies it); for the other models the late recipe.
    Variant("trellis-sp", StudyModel("trellis"), state_passing=0.9, diagnostics=False),
    Variant("trellis-sp50", StudyModel("trellis"), state_passing=0.5, diagnostics=False),
    Variant("trellis-sp-late", StudyModel("trellis"), state_passing=0.9, state_passing_from=0.8, diagnostics=False),
    Variant("trellis-sp-half", StudyModel("trellis"), state_passing=0.9, state_passing_from=0.5, diagnostics=False),
    Variant("trellis-sp-from70", StudyModel("trellis"), state_passing=0.9, state_passing_from=0.7, diagnostics=False),
    *(Variant(f"{name}-sp-late", spec, learning_rate=rate, state_passing=0.9, state_passing_from=0.8,
              diagnostics=False)
      for name, spec, rate in STATE_PASSING_MODELS[1:]),
    # The recipe chosen from Trellis's runs (p = 0.9 over the last 30% of the steps) for every model,
    # and for the chunk-size table (C = 32 is trellis-sp-from70).
    *(Variant(f"{name}-sp-from70", spec, learning_rate=rate, state_passing=0.9, state_passing_from=0.7,
              diagnostics=False)
      for name, spec, rate in STATE_PASSING_MODELS[1:] + CHUNK_MODELS),
    # The runs without for delta rule, Lattice and the hybrid (the study's own runs again).
    *(Variant(name, spec, learning_rate=rate, diagnostics=False)
      for name, spec, rate in STATE_PASSING_MODELS[1:] if name != "trellis-C8"),
)

PRESETS: dict[str, dict[str, Any]] = {
    # The study's cpu preset (its size, data, recipe) at Trellis's and Llama's best rate there, 3e-3.
    "cpu": dict(size=STUDY_SIZE, vocab=4096, recipe=Recipe(train_length=128, batch_size=16, tokens=1_500_000),
                learning_rate=3e-3, seeds=(0, 1), lengths=(128, 512, 1024, 2048, 8192), eval_windows=256, long_files=8,
                passkey_trials=4, threads=2),
    "quick": dict(size=dataclasses.replace(STUDY_SIZE, hidden_size=32, num_heads=2, head_dim=16, intermediate_size=64,
                                           num_slots=8, chunk_size=8),
                  vocab=512, recipe=Recipe(train_length=32, batch_size=4, tokens=4 * 32 * 8), learning_rate=3e-3,
                  seeds=(0,), lengths=(32, 128), eval_windows=8, long_files=2, passkey_trials=1, threads=None,
                  max_train_files=40),
}


def build(variant: Variant, preset: dict[str, Any], vocab_size: int, target: int) -> torch.nn.Module:
    model = build_study_model(variant.spec, preset["size"], vocab_size, max(preset["lengths"]) + 64, target)
    if variant.gate_span is not None:
        with torch.no_grad():
            for _, mixer in forget_gates(model):
                gate = mixer.beta_proj
                bias = forget_gate_bias(gate.out_features, mixer.config.gate_logit_normalizer, variant.gate_span)
                gate.bias.copy_(bias.to(gate.bias))
    return model


def measures(variant: Variant, preset: dict[str, Any], encoded: Any, seed: int) -> dict[str, Callable[[Any], Any]]:
    """Each measure of a trained model, by its record field (see the module doc)."""
    train_length, lengths, test = preset["recipe"].train_length, preset["lengths"], encoded.files["test"]
    longest, files = max(lengths), preset["long_files"]

    def by_position(**kwargs: Any) -> Callable[[Any], dict[str, float]]:
        return lambda model: perplexity_by_position(model, test, longest, train_length, files, **kwargs)

    def capped(multiple: int) -> Callable[[Any], dict[str, float]]:
        def measure(model: Any) -> dict[str, float]:
            with capped_horizons(model, multiple * train_length):
                return by_position()(model)
        return measure

    found = {
        "val_ppl": lambda model: perplexity(model, encoded.files["validation"], train_length, preset["eval_windows"]),
        "ppl_by_position": by_position(),
        f"ppl_by_position_reset_{RESET}x": by_position(reset_every=RESET * train_length),
        "passkey_preference": lambda model: {
            str(n): passkey_preference(model, encoded.tokenizer, test, n, DEPTHS, preset["passkey_trials"], seed)
            for n in lengths},
    }
    if variant.spec.kind != "llama" and variant.diagnostics:
        text = next(f for f in test if f.numel() >= longest)[:longest]
        found["memory"] = lambda model: memory_profile(model, text, lengths)
        found.update({f"ppl_by_position_capped_{m}x": capped(m) for m in CAPS})
    return found


def run_all(preset: dict[str, Any], out: Path, names: Optional[list[str]], keep: Optional[str]) -> None:
    """Train and measure every variant and seed not yet in ``<out>/lm_extrapolation.json``; a run
    already there whose model was kept in ``keep`` gets the measures its record lacks (a measure
    added to the study after it ran)."""
    if preset.get("threads"):
        torch.set_num_threads(preset["threads"])
    path = out / "lm_extrapolation.json"
    encoded = encode_corpus(stdlib_corpus(), preset["vocab"], preset.get("max_train_files"))
    vocab, base = len(encoded.tokenizer), preset["recipe"]
    # The Llama's parameter count, computed before any seeding (as the study does: building it
    # draws random numbers, which would change the seeded models' weights).
    target = num_parameters(build_study_model(VARIANTS[0].spec, preset["size"], vocab, max(preset["lengths"]) + 64))
    for variant in VARIANTS:
        if names is not None and variant.name not in names:
            continue
        length = variant.length_factor * base.train_length
        if base.batch_size % variant.length_factor:
            raise ValueError(f"{variant.name} needs a batch size divisible by {variant.length_factor}, got {base.batch_size}")
        recipe = dataclasses.replace(base, train_length=length, batch_size=base.batch_size // variant.length_factor)
        for seed in preset["seeds"]:
            todo = measures(variant, preset, encoded, seed)
            kept = Path(keep) / f"{variant.name}-seed{seed}" if keep else None
            records = load_records(path)
            record = next((r for r in records if (r["model"], r["seed"]) == (variant.name, seed)), None)
            if record is not None:
                missing = [name for name in todo if name not in record]
                if missing and kept is not None and kept.is_dir():
                    model = AutoModelForCausalLM.from_pretrained(kept).eval()
                    record.update({name: todo[name](model) for name in missing})
                    save_records(path, records)
                    print(f"{variant.name} seed={seed}: measured {missing} on the kept model")
                continue
            torch.manual_seed(seed)  # as the study does, so its models come back identical
            model = build(variant, preset, vocab, target)
            bar = tqdm(total=recipe.steps, desc=f"{variant.name} seed={seed}", leave=False)
            rate = variant.learning_rate or preset["learning_rate"]
            trained = train_lm(model, encoded.tokens["train"], recipe, rate, seed,
                               lambda step, loss: bar.update(1), state_passing=variant.state_passing,
                               state_passing_from=variant.state_passing_from)
            bar.close()
            record = {
                "model": variant.name, "seed": seed, "learning_rate": rate, "train_length": length,
                "batch_size": recipe.batch_size, "train_tokens": recipe.tokens, "gate_span": variant.gate_span,
                "state_passing": variant.state_passing, "state_passing_from": variant.state_passing_from,
                **trained, **{name: measure(model) for name, measure in todo.items()},
            }
            append_record(path, record)
            if kept is not None:
                model.save_pretrained(kept)
            print(f"{variant.name} seed={seed}: val ppl {record['val_ppl']:.2f}, ppl by position "
                  f"{ {k: round(v, 1) for k, v in record['ppl_by_position'].items()} }")


def passing(record: dict[str, Any]) -> str:
    """A run's state passing in words: its probability, and from which step on."""
    probability, start = record.get("state_passing") or 0, record.get("state_passing_from") or 0
    if not probability:
        return "no"
    return f"p = {probability:g}" + (f", from {start:.0%} of the steps" if start else "")


def with_study_baselines(records: list[dict[str, Any]], learning_rate: float) -> list[dict[str, Any]]:
    """``records`` plus, for each model of ``STATE_PASSING_MODELS`` whose run without state
    passing this command has not made, the language-modelling study's own runs of it
    (``docs/results_data/lm_study.json``, marked ``"from_study"``): the same seeds, data, recipe
    and rate, so the same weights (the ``trellis`` and ``llama`` rows, rerun here, reproduce the
    study's validation perplexities to the last digit)."""
    study = ROOT / "docs" / "results_data" / "lm_study.json"
    if not study.exists() or not records:
        return records
    have = {(r["model"], r["seed"]) for r in records}
    # Only runs measured as these were: the same training length and position buckets (a
    # quick preset's runs are not the study's).
    like = (records[0]["train_length"], list(records[0]["ppl_by_position"]))
    added = []
    for name, _, rate in STATE_PASSING_MODELS:
        for run in load_records(study):
            if (run["model"] == name and run.get("phase") == "full" and "ppl_by_position" in run
                    and (run["train_length"], list(run["ppl_by_position"])) == like
                    and run["learning_rate"] == (rate or learning_rate) and (name, run["seed"]) not in have):
                added.append({**run, "from_study": True})
    return records + added


# The chunk-size table (issue 35): Trellis at each C with the recipes' state passing.
CHUNK_ROWS = ((8, "trellis-C8-sp-from70"), (16, "trellis-C16-sp-from70"), (32, "trellis-sp-from70"),
              (64, "trellis-C64-sp-from70"))


def chunk_table(by_model: dict[str, list[dict[str, Any]]], buckets: list[str]) -> list[str]:
    """Validation perplexity, the first and last position buckets and their ratio for each chunk
    size of ``CHUNK_ROWS`` that ran (training speed: ``benchmarks/bench_chunk_training.py``)."""
    rows = [(c, by_model[m]) for c, m in CHUNK_ROWS if m in by_model]
    if not rows:
        return []
    first, last = buckets[0], buckets[-1]
    lines = ["", "## Chunk size, with state passing (p = 0.9 over the last 30% of the steps)", "",
             f"| C | seeds | validation ppl | ppl [{first}) | ppl [{last}) | [{last}) / [{first}) |", "|---|---|---|---|---|---|"]
    for c, runs in rows:
        ratios = [r["ppl_by_position"][last] / r["ppl_by_position"][first] for r in runs]
        lines.append(f"| {c} | {len(runs)} | {spread([r['val_ppl'] for r in runs])} | "
                     f"{spread([r['ppl_by_position'][first] for r in runs], 1)} | "
                     f"{spread([r['ppl_by_position'][last] for r in runs], 1)} | {spread(ratios)} |")
    return lines


def render(out: Path, page: Path) -> None:
    records = with_study_baselines(load_records(out / "lm_extrapolation.json"), PRESETS["cpu"]["learning_rate"])
    models = [v.name for v in VARIANTS if any(r["model"] == v.name for r in records)]
    by_model = {m: [r for r in records if r["model"] == m] for m in models}
    lines = ["# Why memory models degrade past their training length: controlled runs", "",
             "Command: `python -m studies.lm_extrapolation` (the module doc says what each variant changes). "
             "Each cell: mean over seeds [min, max]. What the runs show is read in `docs/results_lm.md` "
             "(section \"Past the training length\").", ""]
    if not records:
        page.write_text("\n".join(lines + ["No run has finished yet."]) + "\n")
        return
    lines += ["| variant | train length | batch | lr | state passing | seeds | validation ppl (128 tokens) | "
              "final training loss (its own windows) |", "|---|---|---|---|---|---|---|---|"]
    for m in models:
        runs = by_model[m]
        lines.append(f"| {m}{' (study run)' if runs[0].get('from_study') else ''} | {runs[0]['train_length']} | {runs[0]['batch_size']} | {runs[0]['learning_rate']:g} | "
                     f"{passing(runs[0])} | {len(runs)} | {spread([r['val_ppl'] for r in runs])} | "
                     f"{spread([r['curve'][-1][1] for r in runs])} |")
    buckets = list(records[0]["ppl_by_position"])
    lines += chunk_table(by_model, buckets)
    length = records[0]["train_length"] // next(v.length_factor for v in VARIANTS if v.name == records[0]["model"])
    readings = [("ppl_by_position", "one pass"), (f"ppl_by_position_reset_{RESET}x", f"reset every {RESET * length}"),
                *[(f"ppl_by_position_capped_{m}x", f"horizons capped at {m * length}") for m in CAPS]]
    lines += ["", "## Perplexity by position on long held-out files", "",
              f"The same tokens read four ways: in one pass; in segments of {RESET * length} tokens, each from a fresh "
              "state (no token sees further back); in one pass with every forget horizon capped at inference "
              "(`capped_horizons`: each forget gate's logit clamped so no head remembers longer than the cap).", "",
              "| variant | reading | " + " | ".join(buckets) + " |", "|---|---|" + "---|" * len(buckets)]
    for m in models:
        for field, reading in readings:
            runs = [r for r in by_model[m] if field in r]
            if runs:
                lines.append(f"| {m} | {reading} | " + " | ".join(spread([r[field][b] for r in runs], 1) for b in buckets)
                             + " |")
    lengths = list(records[0]["passkey_preference"])
    lines += ["", "## Passkey preference (shown key likelier than a fresh one; chance 0.50)", "",
              "Fraction of prompts / mean margin in nats, by context length.", "",
              "| variant | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for m in (m for m in models if "passkey_preference" in by_model[m][0]):  # not measured by the study
        cells = [f"{spread([r['passkey_preference'][n]['preferred'] for r in by_model[m]])} / "
                 f"{statistics.fmean(r['passkey_preference'][n]['margin_nats'] for r in by_model[m]):+.2f}"
                 for n in lengths]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    memory = [m for m in models if "memory" in by_model[m][0]]
    if memory:
        lines += ["", "## What the memories hold (seed 0, one long held-out file)", "",
                  "RMS of each layer's `m_k` after n tokens (layers 0..L-1), and each layer's forget horizons "
                  "(tokens over which a write decays by e, per head, over the whole read).", "",
                  "| variant | " + " | ".join(f"m_k RMS at {n}" for n in lengths) + " | horizons (tokens) |",
                  "|---|" + "---|" * (len(lengths) + 1)]
        for m in memory:
            profile = next(r for r in by_model[m] if r["seed"] == min(x["seed"] for x in by_model[m]))["memory"]
            rms = [" / ".join(f"{layer['m_k']:.2f}" for layer in profile["rms"][n]) for n in lengths]
            horizons = "; ".join(", ".join(f"{h:.0f}" for h in layer) for layer in profile["horizon"]) or "no forget gate"
            lines.append(f"| {m} | " + " | ".join(rms) + f" | {horizons} |")
    lines += figures(by_model, buckets, lengths, page)
    page.write_text("\n".join(lines) + "\n")
    print(f"wrote {page}")


def figures(by_model: dict[str, list[dict[str, Any]]], buckets: list[str], lengths: list[str], page: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = page.parent / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m, runs in by_model.items():
        axes[0].plot([int(b.split("-")[1]) for b in buckets],
                     [statistics.fmean(r["ppl_by_position"][b] for r in runs) for b in buckets], marker="o", label=m)
        if "passkey_preference" in runs[0]:
            axes[1].plot([int(n) for n in lengths],
                         [statistics.fmean(r["passkey_preference"][n]["preferred"] for r in runs) for n in lengths],
                         marker="o", label=m)
    axes[0].set(xscale="log", yscale="log", xlabel="tokens (end of each position bucket)", ylabel="perplexity",
                title="Perplexity by position")
    axes[1].axhline(0.5, color="gray", lw=0.8)
    axes[1].set(xscale="log", xlabel="context tokens", ylabel="shown key preferred", title="Passkey preference",
                ylim=(0, 1.05))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "lm_extrapolation.png", dpi=110)
    plt.close(fig)
    lines = ["", "## Figures", "", "![perplexity by position and passkey preference](figures/lm_extrapolation.png)"]
    # State passing: each run beside the run without it (same seeds), one panel per model.
    passed = {m: runs for m, runs in by_model.items() if runs[0].get("state_passing")}
    bases = sorted({m.split("-sp")[0] for m in passed} & set(by_model))
    if bases:
        fig, axes = plt.subplots(1, len(bases), figsize=(5 * len(bases), 4), squeeze=False)
        ends = [int(b.split("-")[1]) for b in buckets]
        for ax, base in zip(axes[0], bases):
            for m in [base] + [m for m in passed if m.split("-sp")[0] == base]:
                ax.plot(ends, [statistics.fmean(r["ppl_by_position"][b] for r in by_model[m]) for b in buckets],
                        marker="o", label=f"{m} ({passing(by_model[m][0])})")
            ax.set(xscale="log", yscale="log", xlabel="tokens (end of each position bucket)", ylabel="perplexity",
                   title=f"{base}: state passing")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(folder / "lm_state_passing.png", dpi=110)
        plt.close(fig)
        lines += ["", "![perplexity by position with and without state passing](figures/lm_state_passing.png)"]
    return lines


def main() -> None:
    args = study_arguments(__doc__, PRESETS, "lm_extrapolation.json", ROOT / "docs" / "results_lm_extrapolation.md",
                           "variants")
    if not args.render_only:
        run_all(PRESETS[args.preset], args.out, args.models, args.keep_models)
    render(args.out, args.page)


if __name__ == "__main__":
    main()
