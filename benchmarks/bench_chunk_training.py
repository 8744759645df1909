"""Training speed of Trellis against its chunk size C, its write rule and its mixing function
(CPU), for the chunk tables of ``docs/results_lm.md`` and ``docs/results_lm_extrapolation.md`` and
the mixing functions, slot counts and short convolutions of ``docs/results_lm_defaults.md``.

    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_chunk_training.py            # ~5 min on 2 cores
    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_chunk_training.py --chunks 16 --forms exact --mix-fns ln_silu,softmax \
        --num-slots 32,64
    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_chunk_training.py --chunks 16 --forms exact --mix-fns softmax \
        --num-slots 64 --conv-sizes 4,2,0                 # the short convolution's cost (docs/results_lm_defaults.md)
    PYTHONPATH=src:. .venv/bin/python benchmarks/bench_chunk_training.py --quick

The language-modelling study's model (``STUDY_SIZE``: 4 layers of width 128, 4 heads of 32, 32
slots or each of ``--num-slots``, vocabulary 4096; the MLP fitted to the Llama's count) at each C,
``write_gradient`` (``"anchored"`` and ``"exact"``), ``mix_fn`` (the studies' ``ln_silu`` unless
``--mix-fns`` names others) and ``conv_size`` (the study size's 4 unless ``--conv-sizes`` names others),
one training step each (forward, backward, AdamW) on a batch of 16 rows of 128 random tokens with state
passing on (p = 0.9, the recipes' default once it begins), **in turns**: ``--rounds`` rounds of
``--steps`` steps per model (every other round in reverse order), the first of each turn not counted. Figures are medians;
compare the ratios (to the first form and mixing function at C = 32, the study's first C, or
else to the first model), measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from datetime import date

import torch

from studies.lm import STUDY_SIZE, StudyModel, build_study_model
from trellis_lm.state_passing import StatePassing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two chunk sizes, few steps: checks the script runs")
    parser.add_argument("--chunks", default="1,16,32,64")
    parser.add_argument("--forms", default="anchored,exact", help="write_gradient values to time at each C")
    parser.add_argument("--mix-fns", default="ln_silu", help="mix_fn values to time at each C and form")
    parser.add_argument("--num-slots", default=str(STUDY_SIZE.num_slots), help="M values to time (comma-separated)")
    parser.add_argument("--conv-sizes", default=str(STUDY_SIZE.conv_size),
                        help="conv_size values to time (comma-separated)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunks = [8, 32] if args.quick else [int(c) for c in args.chunks.split(",")]
    forms, mixes, slots = args.forms.split(","), args.mix_fns.split(","), [int(m) for m in args.num_slots.split(",")]
    convs = [int(w) for w in args.conv_sizes.split(",")]
    # C = 1 is the same function either way: timed once, anchored (the per-token chunk loop).
    models = [(c, f, mix, m, w) for c in chunks for f in forms for mix in mixes for m in slots for w in convs
              if c > 1 or f == forms[0]]
    rounds, steps = (1, 2) if args.quick else (args.rounds, args.steps)
    batch, length, vocab = 16, 128, 4096
    size = dataclasses.replace(STUDY_SIZE, num_hidden_layers=2) if args.quick else STUDY_SIZE
    runs = {}
    for chunk, form, mix, num_slots, conv in models:
        torch.manual_seed(0)
        spec = StudyModel(f"trellis-C{chunk}-{form}-{mix}-M{num_slots}-conv{conv}",
                          overrides={"chunk_size": chunk, "write_gradient": form, "mix_fn": mix, "num_slots": num_slots,
                                     "conv_size": conv})
        model = build_study_model(spec, size, vocab, length)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        passing = StatePassing(0.9, seed=0)
        runs[chunk, form, mix, num_slots, conv] = (model, optimizer, passing)
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))

    def step(key: tuple) -> float:
        model, optimizer, passing = runs[key]
        start = time.perf_counter()
        with passing.attached(model):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    for key in models:
        step(key)  # warm-up: allocation, the first carried states
    times = {key: [] for key in models}
    for turn in range(rounds):
        # Every other round in reverse: a model's place in a round shifts its time a little.
        for key in models if turn % 2 == 0 else reversed(models):
            times[key] += [step(key) for _ in range(steps)][1:]
    print(f"# {date.today()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__} | {dataclasses.asdict(size)} with each row's chunk_size, mix_fn, num_slots and conv_size, batch {batch} x {length} "
          "tokens, state passing on")
    first = (32, forms[0], mixes[0], slots[0], convs[0])
    base = first if first in times else models[0]
    reference = statistics.median(times[base])
    print(f"\n| C | write_gradient | mix_fn | M | conv_size | ms per step | training tokens/s | speed / {' '.join(map(str, base))}'s |\n"
          "|---|---|---|---|---|---|---|---|")
    for key in models:
        ms = statistics.median(times[key]) * 1e3
        print(f"| {' | '.join(map(str, key))} | {ms:.0f} | {batch * length / ms * 1e3:.0f} | {reference * 1e3 / ms:.2f} |")


if __name__ == "__main__":
    main()
