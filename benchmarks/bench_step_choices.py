"""Two size limits of the eager decode step on a CPU, each measured as a choice between two forms in
one process: the Trellis step's memory products (``BROADCAST_PRODUCTS_MAX`` in
``trellis_lm/ops/trellis/step.py``: broadcast multiply-and-sum against batched matmul) and the
read-out's GELU (``ERFC_GELU_MAX`` in ``trellis_lm/mixers/base.py``: ``x erfc(-x / sqrt 2) / 2`` against torch's
``gelu`` kernel).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_choices.py            # ~5 min on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/bench_step_choices.py --quick    # seconds: checks it runs

For each choice and (model size, batch): an all-Trellis model of ``bench_decode.py`` after 256 random
tokens takes eager single-token steps inside ``inference_span`` (as ``generate()`` runs them) from
two copies of one cache, one with the limit set so that every call takes the first form, one so that
every call takes the second, in turns of 8 steps, each form first in every other pair of turns (the
second of a pair ran about 3% faster in an A/A run; the first step of each turn not counted); medians.
A ratio below 1: the second form (the one the limit admits) is the faster at that size. The sizes a
limit reads: memory entries ``N H M D`` (products), ``N H d`` elements (GELU).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
from datetime import date

import torch
from bench_decode import SIZES, Stepper, build_models, prefill

from trellis_lm.compiled_decode import inference_span
from trellis_lm.mixers import base as mixers_base
from trellis_lm.ops.trellis import step as trellis_step

# A 12-head model of width 768 (GPT-2 small's mixer shape), two layers to keep the run short.
WIDE = dict(hidden=768, layers=2, heads=12, head_dim=64, slots=64, vocab=4096)
CASES = [("small", SIZES["small"], 1), ("small", SIZES["small"], 8), ("default", SIZES["default"], 1),
         ("default", SIZES["default"], 8), ("wide", WIDE, 1), ("wide", WIDE, 8), ("wide", WIDE, 32)]
QUICK_CASES = [("quick", dict(hidden=64, layers=2, heads=2, head_dim=32, slots=16, vocab=256), 1)]
# Each choice: the module and limit it sets, the value for each form, and the size the limit reads.
CHOICES = {
    "products": (trellis_step, "BROADCAST_PRODUCTS_MAX", {"matmul": 0, "broadcast": 2**62},
                 lambda size, batch: batch * size["heads"] * size["slots"] * size["head_dim"]),
    "gelu": (mixers_base, "ERFC_GELU_MAX", {"gelu kernel": -1, "erfc": 2**62},
             lambda size, batch: batch * size["heads"] * size["head_dim"]),
}


def measure(choice: str, size: dict, batch: int, rounds: int) -> dict[str, float]:
    """Median ms per step of each form of ``choice``, in alternating turns."""
    module, limit, forms, _ = CHOICES[choice]
    model = build_models(size, compiled=False, quick=False)["trellis"]
    with contextlib.ExitStack() as span:
        span.enter_context(inference_span(model))
        prefilled = prefill(model, 256, size["vocab"])
        steppers = {form: Stepper(model, prefilled, batch) for form in forms}
        times = {form: [] for form in forms}
        for turn in range(rounds):
            for form in (forms if turn % 2 == 0 else reversed(forms)):
                setattr(module, limit, forms[form])
                times[form] += [steppers[form].step() for _ in range(8)][1:]
    return {form: statistics.median(t) * 1e3 for form, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one tiny model: checks the script runs")
    parser.add_argument("--rounds", type=int, default=None, help="turns of 8 steps per form (default 24; quick 2)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 24)
    kept = {choice: getattr(module, limit) for choice, (module, limit, _, _) in CHOICES.items()}
    print(f"# {date.today()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__} | limits: " + ", ".join(f"{CHOICES[c][1]} = {v}" for c, v in kept.items()))
    try:
        for choice, (_, limit, forms, size_read) in CHOICES.items():
            first, second = forms
            print(f"\n{limit}\n\n| size | batch | size the limit reads | {first} ms | {second} ms | {second} / {first} |")
            print("|---|---|---|---|---|---|")
            for name, size, batch in QUICK_CASES if args.quick else CASES:
                ms = measure(choice, size, batch, rounds)
                print(f"| {name} | {batch} | {size_read(size, batch)} | {ms[first]:.2f} | {ms[second]:.2f} | "
                      f"{ms[second] / ms[first]:.3f} |", flush=True)
    finally:
        for choice, (module, limit, _, _) in CHOICES.items():
            setattr(module, limit, kept[choice])


if __name__ == "__main__":
    main()
