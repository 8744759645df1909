"""CPU benchmarks for BENCHMARKS.md: op backends, and decode cost against context length.

    .venv/bin/python benchmarks/bench_cpu.py            # the full run recorded in BENCHMARKS.md
    .venv/bin/python benchmarks/bench_cpu.py --quick    # a smoke run (small sizes, seconds)

Every figure it prints is a ratio measured in the same run, so a noisy machine shifts both
sides alike. Timings are medians over repeats after a warm-up call. The code lives in
``trellis_lm.benchmark`` (``trellis-lm bench`` runs the same).
"""

from __future__ import annotations

import argparse

from trellis_lm.benchmark import add_bench_arguments, run_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_arguments(parser)
    raise SystemExit(run_bench(parser.parse_args()))


if __name__ == "__main__":
    main()
