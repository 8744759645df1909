"""KVM's chunked forward against full causal attention at the same shape, on CPU.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_kvm.py           # T = 16384, the issue's shape
    PYTHONPATH=src .venv/bin/python benchmarks/bench_kvm.py --quick   # a smoke run (seconds)

Both sides run in alternating rounds in one process, so a noisy machine slows both alike; the
figure printed is the ratio of their medians. One torch thread by default: on a shared machine
a second thread waits for a busy core at every parallel region, which costs KVM's fold loop (many
small ops) far more than one large attention call and makes the ratio meaningless; pass
``--threads N`` on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trellis_lm.ops import kvm_attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, one round")
    parser.add_argument("--length", type=int, default=None, help="T (default 16384, 2048 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 5, 2 with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    T = args.length or (2048 if args.quick else 16384)
    rounds = args.rounds or (2 if args.quick else 5)
    H, D, C, blocks, S = 4, 64, 256, 2, 256

    gen = torch.Generator().manual_seed(0)
    q, k = (F.layer_norm(torch.randn(1, T, H, D, generator=gen), (D,)) for _ in range(2))
    v = torch.randn(1, T, H, D, generator=gen)
    gate = 0.5 + torch.rand(1, T, H, generator=gen)
    params = dict(norm_weight=torch.ones(H, D), norm_bias=torch.zeros(H, D), temperature=torch.ones(H, 2))
    kw = dict(chunk_size=C, window_chunks=blocks, state_size=S, rope_dims=D // 2, sinks=1, backend="torch")
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

    def kvm():
        return kvm_attention(q, k, v, gate, **params, **kw)[0]

    def full():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    times = {"kvm": [], "sdpa": []}
    with torch.inference_mode():
        kvm(), full()  # warm-up
        for _ in range(rounds):
            for name, fn in (("kvm", kvm), ("sdpa", full)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    kvm_s, sdpa_s = statistics.median(times["kvm"]), statistics.median(times["sdpa"])
    print(f"T={T} H={H} Dk=Dv={D} C={C} window={blocks} chunks state={S} B=1 float32 CPU, "
          f"{torch.get_num_threads()} threads, {rounds} rounds")
    for label, name, median in (("kvm torch forward   ", "kvm", kvm_s), ("causal sdpa (full T)", "sdpa", sdpa_s)):
        every = ", ".join(f"{t * 1e3:.0f}" for t in times[name])
        print(f"{label} median {median * 1e3:9.1f} ms  (all: {every})")
    print(f"kvm is {sdpa_s / kvm_s:.2f}x faster than full causal attention")


if __name__ == "__main__":
    main()
