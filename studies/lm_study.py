"""Is Trellis a good language model? Same-size models on real local text (the Python standard
library's source), perplexity at and beyond the training length, passkey retrieval, decode cost.

    .venv/bin/python -m studies.lm_study --preset cpu           # about 2.5 hours on 2 cores, resumable
    .venv/bin/python -m studies.lm_study --preset gpu           # the ~125M-parameter version (one GPU)
    .venv/bin/python -m studies.lm_study --preset quick --out /tmp/lm   # a smoke run (a minute)
    .venv/bin/python -m studies.lm_study --render-only          # the page from the saved runs

The recipe is the same for every model (AdamW, warm-up then cosine, the same batches of random
training windows, the same tokens): each model is first trained at every learning rate of the
preset on a short budget (a quarter of the tokens, seed 0), then with every seed at the rate with
the lowest validation perplexity on the full budget. Every finished run is appended to
``<out>/lm_study.json`` at once, so a stopped study resumes where it stopped (runs already in the
file are not run again); ``--render-only`` writes ``docs/results_lm.md`` and its figures from it.

Data: the ``.py`` files of this interpreter's standard library, split by file (a hash of the path)
into train / validation / test; the tokenizer (byte-level BPE) is trained on the train split only.
It is code with its comments and docstrings, one project's style, and English only where the
comments are: not a general text corpus, and its held-out files share authors and idioms with the
train split (what the page says too).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from studies.lm import STUDY_SIZE, Recipe, build_study_model, encode_corpus, num_parameters, stdlib_corpus, study_models, train_lm
from studies.records import (
    append_record, chosen_runs, load_records, spread, study_arguments, sweep, sweep_runs,
)
from trellis_lm.eval.decode_cost import decode_cost
from trellis_lm.eval.passkey import passkey_accuracy
from trellis_lm.eval.perplexity import perplexity, perplexity_by_position, position_buckets

ROOT = Path(__file__).resolve().parent.parent
PRESETS: dict[str, dict[str, Any]] = {
    # ~1.85M parameters (embeddings 1.05M of them), 1.5M training tokens a run, training length 128,
    # lengths up to 64x = 8192 tokens. Sized for ~2.5 h on 2 cores: 9 models x (3 short + 2 full).
    "cpu": dict(size=STUDY_SIZE, vocab=4096, recipe=Recipe(train_length=128, batch_size=16, tokens=1_500_000),
                lrs=(1e-3, 3e-3, 6e-3), widen=2, seeds=(0, 1), multiples=(1, 4, 8, 16, 64), eval_windows=256, long_files=8,
                passkey_trials=2, threads=2),
    # ~125M parameters at width 768 x 12 layers, 1024-token windows, 2.5B tokens would be the
    # paper's scale; this preset is the same study at 300M tokens a run: hours of one GPU (not run yet;
    # far beyond the 30 device-minutes a session here is lent).
    "gpu": dict(size=dataclasses.replace(STUDY_SIZE, hidden_size=768, num_hidden_layers=12, num_heads=12, head_dim=64,
                                         intermediate_size=2048, num_slots=64, chunk_size=64),
                vocab=16384, recipe=Recipe(train_length=1024, batch_size=32, tokens=300_000_000),
                lrs=(6e-4, 1.2e-3, 2.4e-3), widen=2, seeds=(0, 1), multiples=(1, 4, 8, 16, 64), eval_windows=1024, long_files=8,
                passkey_trials=4, threads=None),
    "quick": dict(size=dataclasses.replace(STUDY_SIZE, hidden_size=32, num_hidden_layers=4, num_heads=2, head_dim=16,
                                           intermediate_size=64, num_slots=8, chunk_size=8),
                  vocab=512, recipe=Recipe(train_length=32, batch_size=4, tokens=4 * 32 * 8),
                  lrs=(1e-3, 3e-3), widen=0, seeds=(0,), multiples=(1, 4), eval_windows=8, long_files=2, passkey_trials=1,
                  threads=None, max_train_files=40, models=("llama", "trellis", "kvm")),
}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def run_key(record: dict[str, Any]) -> tuple:
    return record["model"], record["phase"], record["learning_rate"], record["seed"], record["train_tokens"]


def evaluate_full(model, encoded, preset: dict[str, Any], seed: int) -> dict[str, Any]:
    """The measures of a full-budget run (see the module doc)."""
    length = preset["recipe"].train_length
    longest = length * max(preset["multiples"])
    by_position = perplexity_by_position(model, encoded.files["test"], longest, length, preset["long_files"])
    buckets = dict(zip([f"{a}-{b}" for a, b in position_buckets(longest, length)], by_position.values()))
    ppl_by_length = {}
    for multiple in preset["multiples"]:
        n = multiple * length
        a = 0 if multiple == 1 else n // 2
        ppl_by_length[str(n)] = buckets[f"{a}-{n}"]
    passkey = {str(m * length): passkey_accuracy(model, encoded.tokenizer, encoded.files["test"], m * length, DEPTHS,
                                                 preset["passkey_trials"], seed)
               for m in preset["multiples"]}
    context = next(f for f in encoded.files["test"] if f.numel() >= longest)[:longest]
    return {
        "test_ppl": perplexity(model, encoded.files["test"], length, preset["eval_windows"]),
        "ppl_by_position": buckets, "ppl_by_length": ppl_by_length, "passkey": passkey,
        "decode": {"context": longest, **decode_cost(model, context)},
    }


def run_study(args: argparse.Namespace, preset: dict[str, Any], out: Path) -> None:
    if preset.get("threads"):
        torch.set_num_threads(preset["threads"])
    records_path = out / "lm_study.json"
    done = {run_key(r) for r in load_records(records_path)}
    corpus = stdlib_corpus()
    print(f"corpus: Python {corpus.python} standard library, files {corpus.describe()['files']}")
    started = time.perf_counter()
    encoded = encode_corpus(corpus, preset["vocab"], preset.get("max_train_files"))
    data_info = {**corpus.describe(), "tokens": {s: int(t.numel()) for s, t in encoded.tokens.items()},
                 "vocab_size": len(encoded.tokenizer), "encode_seconds": time.perf_counter() - started}
    print(f"tokens: {data_info['tokens']} (vocabulary {data_info['vocab_size']})")
    size, recipe = preset["size"], preset["recipe"]
    short = dataclasses.replace(recipe, tokens=recipe.tokens // 4)
    names = args.models or preset.get("models")
    specs = [s for s in study_models(recipe.train_length) if names is None or s.name in names]
    max_len = recipe.train_length * max(preset["multiples"]) + 64
    target = num_parameters(build_study_model(specs[0], size, data_info["vocab_size"], max_len)) if specs[0].kind == "llama" else None

    def run(spec, phase: str, lr: float, seed: int, budget: Recipe) -> dict[str, Any] | None:
        key = (spec.name, phase, lr, seed, budget.tokens)
        if key in done:
            return None
        torch.manual_seed(seed)
        model = build_study_model(spec, size, data_info["vocab_size"], max_len, target)
        bar = tqdm(total=budget.steps, desc=f"{spec.name} {phase} lr={lr:g} seed={seed}", leave=False)

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

        try:
            trained = train_lm(model, encoded.tokens["train"], budget, lr, seed, progress)
            failed = None
        except FloatingPointError as error:  # a diverged rate is a result of the sweep, not a crash
            trained, failed = {"curve": [], "train_seconds": None, "tokens_per_s": None}, str(error)
        bar.close()
        record = {
            "model": spec.name, "kind": spec.kind, "overrides": {k: list(v) if isinstance(v, tuple) else v
                                                                 for k, v in spec.overrides.items()},
            "mixer_types": list(getattr(model.config, "layer_kinds", ["attention"] * size.num_hidden_layers)),
            "phase": phase, "seed": seed, "learning_rate": lr, "train_tokens": budget.tokens,
            "train_length": budget.train_length, "batch_size": budget.batch_size,
            "num_parameters": num_parameters(model), "intermediate_size": model.config.intermediate_size,
            **trained, "failed": failed,
        }
        if failed is None:
            record["val_ppl"] = perplexity(model, encoded.files["validation"], budget.train_length, preset["eval_windows"])
            if phase == "full":
                record.update(evaluate_full(model, encoded, preset, seed))
        append_record(records_path, record)
        if args.keep_models and phase == "full":
            model.save_pretrained(Path(args.keep_models) / f"{spec.name}-lr{lr:g}-seed{seed}")
        done.add(key)
        shown = {k: record.get(k) for k in ("val_ppl", "test_ppl", "tokens_per_s")}
        print(f"{spec.name} {phase} lr={lr:g} seed={seed}: {shown}" + (f" FAILED: {failed}" if failed else ""))
        return record

    for spec in specs:
        best = sweep(lambda lr, spec=spec: run(spec, "sweep", lr, preset["seeds"][0], short), records_path, spec.name,
                     preset["lrs"], preset["widen"], short.tokens)
        if best is None:
            print(f"{spec.name}: every rate of the sweep diverged; no full runs")
            continue
        for seed in preset["seeds"]:
            run(spec, "full", best, seed, recipe)
    # The command that reproduces the runs (where models were kept, or the page went, is no part of it).
    command = f"python -m studies.lm_study --preset {args.preset}" + (f" --models {','.join(names)}" if args.models else "")
    meta = {"command": command,
            "preset": args.preset, "data": data_info, "size": dataclasses.asdict(size), "recipe": dataclasses.asdict(recipe),
            "lrs": list(preset["lrs"]), "widen": preset["widen"], "seeds": list(preset["seeds"]), "multiples": list(preset["multiples"]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")}
    (out / "lm_study_meta.json").write_text(json.dumps(meta, indent=1))


# ----------------------------------------------------------------------------- the page


def render(out: Path, page: Path) -> None:
    records = load_records(out / "lm_study.json")
    meta_path = out / "lm_study_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    full = chosen_runs(records)
    models = list(dict.fromkeys(r["model"] for r in records))
    lines = ["# Language modelling on the Python standard library", ""]
    if meta:
        data = meta["data"]
        lines += [
            f"Command: `{meta['command']}` (finished {meta['finished']}; {meta['machine']}).", "",
            f"Data: Python {data['python']} standard library, files train / validation / test = "
            f"{data['files']['train']} / {data['files']['validation']} / {data['files']['test']} "
            f"({data['tokens']['train']:,} / {data['tokens']['validation']:,} / {data['tokens']['test']:,} tokens, "
            f"byte-level BPE of {data['vocab_size']} trained on the train split). Code with its comments and "
            "docstrings: one project's idioms, not general text.", "",
            f"Recipe (every model): {meta['recipe']}; learning rates {meta['lrs']} on a quarter of the tokens "
            f"(seed 0; a best rate at an edge widens the sweep by 2x that way, at most {meta.get('widen', 0)} times), then seeds "
            f"{meta['seeds']} at the best rate (lowest validation perplexity).", "",
        ]
    else:
        lines += ["The study has not finished: the tables below hold the runs saved so far.", ""]
    lines += ["## Perplexity at the training length", "",
              "| model | parameters | best lr | seeds | validation ppl | test ppl | training tokens/s |", "|---|---|---|---|---|---|---|"]
    for model in models:
        runs = [r for r in full if r["model"] == model]
        if not runs:
            sweep = [r for r in records if r["model"] == model]
            lines.append(f"| {model} | {sweep[0]['num_parameters']:,} | (sweep only) | 0 | | | |")
            continue
        rate, tried = runs[0]["learning_rate"], [r["learning_rate"] for r in sweep_runs(records, model)]
        edge = " (sweep edge)" if rate in (min(tried), max(tried)) else ""
        lines.append(f"| {model} | {runs[0]['num_parameters']:,} | {rate:g}{edge} | {len(runs)} | "
                     f"{spread([r['val_ppl'] for r in runs])} | {spread([r['test_ppl'] for r in runs])} | "
                     f"{statistics.fmean(r['tokens_per_s'] for r in runs):,.0f} |")
    if meta:
        missing = [spec.name for spec in study_models(meta["recipe"]["train_length"]) if spec.name not in models]
        if missing:
            lines += ["", f"Not run yet: {', '.join(missing)}."]
    widened = sorted({r["model"] for r in records if r["phase"] == "sweep" and meta
                      and r["learning_rate"] not in meta["lrs"]})
    if widened:
        lines += ["", f"Sweeps widened because the best rate was at an edge: {', '.join(widened)} (see every run)."]
    if any("(sweep edge)" in line for line in lines):
        lines += ["", "A best rate still at the edge of its sweep (marked) means the sweep did not bracket that "
                  "model's optimum: its row may improve with a wider sweep."]
    if full:
        lengths = list(full[0]["ppl_by_length"])
        lines += ["", "## Perplexity by position (long held-out files read in one pass)", "",
                  "Each cell: the perplexity of the tokens at positions [n/2, n) (n = the training length: [0, n)) of the "
                  "same held-out files. Buckets hold different text (later parts of the files), so compare models within "
                  "a column; along a row, position and content mix (the Llama's row shows how much the content alone "
                  "moves). Every bucket, [2048, 4096) included, is in the JSON (`ppl_by_position`) and the figure.", "",
                  "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
        for model in models:
            runs = [r for r in full if r["model"] == model]
            if runs:
                lines.append(f"| {model} | " + " | ".join(spread([r["ppl_by_length"][n] for r in runs]) for n in lengths) + " |")
        lines += ["", "## Passkey retrieval", "", "| model | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for model in models:
            runs = [r for r in full if r["model"] == model]
            if runs:
                lines.append(f"| {model} | " + " | ".join(spread([r["passkey"][n] for r in runs]) for n in lengths) + " |")
        lines += ["", "## Decoding after the longest context", "", "| model | context | ms/token | cache bytes |", "|---|---|---|---|"]
        for model in models:
            runs = [r for r in full if r["model"] == model]
            if runs:
                d = runs[0]["decode"]
                lines.append(f"| {model} | {d['context']} | {statistics.fmean(r['decode']['ms_per_token'] for r in runs):.2f} | "
                             f"{d['cache_bytes']:,} |")
    lines += findings(full)
    # The hand-written reading of these numbers lives beside the page (`<page>_notes.md`), so a
    # rerun that rewrites the tables keeps it.
    notes = page.with_name(page.stem + "_notes.md")
    if notes.exists():
        lines += ["", notes.read_text().strip()]
    lines += plots(records, full, page)
    lines += ["", "## Every run", "", "| model | phase | lr | seed | tokens | validation ppl | failed |", "|---|---|---|---|---|---|---|"]
    for r in records:
        val = f"{r['val_ppl']:.2f}" if r.get("val_ppl") is not None else ""
        lines.append(f"| {r['model']} | {r['phase']} | {r['learning_rate']:g} | {r['seed']} | {r['train_tokens']:,} | {val} | "
                     f"{r.get('failed') or ''} |")
    page.write_text("\n".join(lines) + "\n")
    print(f"wrote {page}")


# The paper's directions: (name, the model, the model it is compared with, what the paper finds).
DIRECTIONS = (
    ("Trellis against a Transformer (Llama)", "trellis", "llama", "lower or equal perplexity"),
    ("Trellis against the gated delta rule", "trellis", "delta-rule", "lower perplexity"),
    ("the forget gate", "trellis", "trellis-no-forget", "lower perplexity with it"),
    ("ln_silu mixing against softmax", "trellis", "trellis-mix-softmax", "lower perplexity with ln_silu"),
    ("chunked (C = 32) against the exact recurrence (C = 1)", "trellis", "trellis-C1", "about equal"),
    ("Trellis against Lattice", "trellis", "lattice", "lower perplexity"),
    ("Trellis against KVM", "trellis", "kvm", "(not in the paper)"),
    ("Trellis against the hybrid (one attention layer in four)", "trellis", "hybrid", "(not in the paper)"),
)


def findings(full: list[dict[str, Any]]) -> list[str]:
    """Each direction's test perplexities over seeds; it holds (or fails) only when the seed
    ranges do not overlap, else it is unresolved at this scale."""
    def ppls(model: str) -> list[float]:
        return [r["test_ppl"] for r in full if r["model"] == model]

    lines = ["", "## Findings over seeds (test perplexity at the training length)", "",
             "| direction | paper | ours: first / second | reading |", "|---|---|---|---|"]
    for title, first, second, paper in DIRECTIONS:
        a, b = ppls(first), ppls(second)
        if not a or not b:
            lines.append(f"| {title} | {paper} | not run yet | |")
            continue
        if min(len(a), len(b)) < 2:
            lower = first if statistics.fmean(a) < statistics.fmean(b) else second
            reading = f"one seed only: {lower} lower, not resolved"
        elif max(a) < min(b):
            reading = f"{first} lower in every seed ({statistics.fmean(b) / statistics.fmean(a) - 1:+.1%} for {second})"
        elif max(b) < min(a):
            reading = f"{second} lower in every seed ({statistics.fmean(a) / statistics.fmean(b) - 1:+.1%} for {first})"
        else:
            reading = "seed ranges overlap: no difference resolved at this scale"
        lines.append(f"| {title} | {paper} | {spread(a)} / {spread(b)} | {reading} |")
    trellis, llama = ppls("trellis"), ppls("llama")
    lines += ["", "## The issue's goals (reported, not tuned for)", ""]
    if trellis and llama:
        ratio = statistics.fmean(trellis) / statistics.fmean(llama)
        lines.append(f"- Trellis test perplexity within 3% of Llama's or better: {ratio - 1:+.1%} -> "
                     f"{'met' if ratio <= 1.03 else 'not met'}.")
    runs = [r for r in full if r["model"] == "trellis"]
    if runs:
        lengths = list(runs[0]["ppl_by_length"])
        one = statistics.fmean(r["ppl_by_length"][lengths[0]] for r in runs)
        sixteen = str(16 * int(lengths[0]))
        if sixteen in runs[0]["ppl_by_length"]:
            at16 = statistics.fmean(r["ppl_by_length"][sixteen] for r in runs)
            lines.append(f"- Trellis perplexity at 16x the training length at most 10% above 1x: {at16 / one - 1:+.1%} -> "
                         f"{'met' if at16 <= 1.1 * one else 'not met'}.")
        eight = str(8 * int(lengths[0]))
        if eight in runs[0]["passkey"]:
            key = statistics.fmean(r["passkey"][eight] for r in runs)
            lines.append(f"- Trellis passkey >= 90% at 8x the training length: {key:.0%} -> {'met' if key >= 0.9 else 'not met'}.")
    return lines


def plots(records: list[dict[str, Any]], full: list[dict[str, Any]], page: Path) -> list[str]:
    """PNG figures beside the page: learning curves, perplexity by position, passkey by length."""
    if not full:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = page.parent / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r["model"] for r in full))
    figures = []

    def save(fig, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        figures.append(f"![{title}](figures/{name})")

    fig, ax = plt.subplots(figsize=(7, 4))
    for model in models:
        run = next(r for r in full if r["model"] == model)
        steps, losses = zip(*run["curve"])
        ax.plot(steps, losses, label=model)
    ax.set(xlabel="step", ylabel="training loss (seed 0)", title="Learning curves at the best rate")
    ax.legend(fontsize=7)
    save(fig, "lm_learning_curves.png", "learning curves")
    # Every position bucket for perplexity ("start-end", plotted at its end), every length for passkey.
    for key, name, label, title in (("ppl_by_position", "lm_ppl_by_position.png", "perplexity", "Perplexity by position"),
                                    ("passkey", "lm_passkey.png", "passkey accuracy", "Passkey retrieval by length")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for model in models:
            runs = [r for r in full if r["model"] == model]
            keys = list(runs[0][key])
            ax.plot([int(k.split("-")[-1]) for k in keys], [statistics.fmean(r[key][k] for r in runs) for k in keys],
                    marker="o", label=model)
        ax.set(xscale="log", xlabel="tokens (the end of each position bucket)", ylabel=label, title=title)
        ax.legend(fontsize=7)
        save(fig, name, title.lower())
    return ["", "## Figures", ""] + figures


def main() -> None:
    args = study_arguments(__doc__, PRESETS, "lm_study.json", ROOT / "docs" / "results_lm.md", "models")
    if not args.render_only:
        run_study(args, PRESETS[args.preset], args.out)
    render(args.out, args.page)


if __name__ == "__main__":
    main()
