"""CPU benchmark of the Lattice op's forward: the chunk-parallel ``torch`` backend against the
per-token ``reference`` loop, both timed in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_lattice.py            # (B,T,H,M,D) = (1,2048,4,64,64), C = 64
    PYTHONPATH=src .venv/bin/python benchmarks/bench_lattice.py --quick    # a smoke run (small sizes, seconds)

The backends are timed in alternating rounds (one call of each per round, after a warm-up
call), so a noisy machine shifts both alike; the figures are medians over the rounds and the
ratio is of the medians. Wall-clock and process CPU time are both reported: on a shared machine
the CPU time of a single-threaded run is the steadier of the two.

One intra-op thread by default: on a small machine shared with other jobs, torch's own threads
wait on each other at every operation whenever a neighbour holds a core (measured here on two
shared cores: the quick shape ran 400x slower with two threads than with one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trellis_lm.ops.lattice import LATTICE_VARIANTS, lattice_attention


def make_inputs(B: int, T: int, H: int, M: int, D: int, dtype: torch.dtype, seed: int = 0):
    """Inputs shaped like the layer's: unit q, k, v; gamma = sigmoid(N(0, 1)); S0 with N(0, 1) rows."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    x = (F.normalize(rand(B, T, H, M), dim=-1), F.normalize(rand(B, T, H, M), dim=-1),
         F.normalize(rand(B, T, H, D), dim=-1), torch.sigmoid(rand(B, T, H)))
    return x, rand(B, H, M, D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shape, few rounds: a smoke run")
    parser.add_argument("--shape", type=int, nargs=5, metavar=("B", "T", "H", "M", "D"), default=None)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--variant", choices=LATTICE_VARIANTS, default="dec")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads; 0 keeps torch's choice (default 1)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shape = args.shape or ([1, 256, 2, 16, 16] if args.quick else [1, 2048, 4, 64, 64])
    rounds = args.rounds or (2 if args.quick else 5)
    x, s0 = make_inputs(*shape, dtype=torch.float32)

    def call(backend: str) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        lattice_attention(*x, initial_state=s0, chunk_size=args.chunk_size, variant=args.variant, backend=backend)
        return time.perf_counter() - wall, time.process_time() - cpu

    backends = ("torch", "reference")
    times: dict[str, list[float]] = {b: [] for b in backends}
    cpu_times: dict[str, list[float]] = {b: [] for b in backends}
    with torch.no_grad():
        for backend in backends:  # warm-up
            call(backend)
        for _ in range(rounds):
            for backend in backends:
                wall, cpu = call(backend)
                times[backend].append(wall)
                cpu_times[backend].append(cpu)

    B, T, H, M, D = shape
    print(f"lattice_attention forward, (B,T,H,M,D) = ({B},{T},{H},{M},{D}), C = {args.chunk_size}, "
          f"variant {args.variant}, float32, CPU, {torch.get_num_threads()} threads, {rounds} rounds")
    median = {b: statistics.median(t) for b, t in times.items()}
    cpu = {b: statistics.median(t) for b, t in cpu_times.items()}
    for backend in backends:
        print(f"  {backend:<9} wall median {median[backend] * 1e3:8.1f} ms "
              f"({', '.join(f'{t * 1e3:.1f}' for t in times[backend])}), {B * T / median[backend]:8.0f} tokens/s; "
              f"CPU time median {cpu[backend] * 1e3:8.1f} ms")
    print(f"  speed-up torch / reference: {median['reference'] / median['torch']:.1f}x wall, "
          f"{cpu['reference'] / cpu['torch']:.1f}x CPU time")


if __name__ == "__main__":
    main()
