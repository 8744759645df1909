"""KVM on CPU: the chunked forward against full causal attention, and the single-token decode step.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_kvm.py           # the issue's shapes
    PYTHONPATH=src .venv/bin/python benchmarks/bench_kvm.py --quick   # a smoke run (seconds)

Shape: H = 4, Dk = Dv = 64, C = 256, a window of 2 chunks, 256 state rows, batch 1, float32.

1. Forward at T = 16384: ``kvm_attention`` (backend torch, chunked) against causal SDPA over the
   whole sequence.
2. Decode after prefills of 2k and 32k tokens: 2 C one-token calls (so exactly two of them fold
   a chunk) from each prefilled state, ms/token averaged over all of them; the step's cost must
   not follow the context.
3. The step against the prefill: the forward's ms/token (its time / T), the median plain step,
   the median folding step (the difference is the fold), for scale one-token calls through the
   chunked form (what decoding ran before the step existed), and the floor of any step: one read
   of the state rows and window slots per token (``softmax(q K^T) V`` on tensors laid out
   beforehand, nothing else).

Every side runs in alternating rounds in one process, so a noisy machine slows all alike; the
figures are medians over rounds, and comparisons are ratios. One torch thread by default: on a
shared machine a second thread waits for a busy core at every parallel region, which costs
KVM's many small operations (the fold loop, the decode step) far more than one large attention
call and makes the ratios meaningless; pass ``--threads N`` on an idle machine. Per-step
medians also drop the steps that lost the core to another process (a 4 ms scheduler tick),
which a round's mean keeps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from trellis_lm.ops import KVMState, kvm_attention
from trellis_lm.ops.kvm.chunked import chunked_forward
from trellis_lm.ops.kvm.functions import KVMConfig, ln_s

H, D, C, BLOCKS, S = 4, 64, 256, 2, 256


def make_inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``(q, k, v, gate)`` of one sequence, ``[1, length, H, D]`` (gate ``[1, length, H]``)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.layer_norm(torch.randn(1, length, H, D, generator=gen), (D,)) for _ in range(2))
    return q, k, torch.randn(1, length, H, D, generator=gen), 0.5 + torch.rand(1, length, H, generator=gen)


PARAMS = dict(norm_weight=torch.ones(H, D), norm_bias=torch.zeros(H, D), temperature=torch.ones(H, 2))
KW = dict(chunk_size=C, window_chunks=BLOCKS, state_size=S, rope_dims=D // 2, sinks=1)


def decode_round(tokens: tuple[torch.Tensor, ...], state: KVMState) -> tuple[list[float], list[bool]]:
    """One-token calls over ``tokens`` from ``state``: each call's seconds, and whether it folded."""
    times, folds = [], []
    for i in range(tokens[0].shape[1]):
        folds.append(bool(state.seen - state.covered == C * BLOCKS))  # the page's fold condition
        token = tuple(t[:, i : i + 1] for t in tokens)
        start = time.perf_counter()
        # check_values=False: as the model's decode steps call it (no value read-back per token).
        _, state = kvm_attention(*token, **PARAMS, **KW, initial_state=state, output_final_state=True,
                                 check_values=False)
        times.append(time.perf_counter() - start)
    return times, folds


def floor_round(tokens: tuple[torch.Tensor, ...], state: KVMState) -> list[float]:
    """The least any decode step must do, per token: read every state row and window slot once
    (one softmax over ``[state rows ; window]`` and the weighted sum of their values), on tensors
    laid out for it beforehand (the state rows as the step reads them: ``LN_s(SK)`` and
    ``r SV / |SV|``), with no state update, fold, masking or temperatures."""
    read_keys = ln_s(state.keys, PARAMS["norm_weight"], PARAMS["norm_bias"])
    read_values = state.radii[..., None] * state.values / state.values.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    keys = torch.cat([read_keys, state.window_k], dim=2)  # [1, H, S + W, D]
    values = torch.cat([read_values, state.window_v], dim=2)
    times = []
    for i in range(tokens[0].shape[1]):
        query = tokens[0][:, i].unsqueeze(2) * D**-0.5  # [1, H, 1, D], scaled as the step scales it
        start = time.perf_counter()
        torch.softmax(query @ keys.transpose(-1, -2), dim=-1) @ values
        times.append(time.perf_counter() - start)
    return times


def chunked_round(tokens: tuple[torch.Tensor, ...], state: KVMState) -> list[float]:
    """The same calls through the chunked form (how a one-token call ran before step.py)."""
    config = KVMConfig(C, BLOCKS, D // 2, 1, S)
    times = []
    for i in range(tokens[0].shape[1]):
        token = tuple(t[:, i : i + 1] for t in tokens)
        start = time.perf_counter()
        _, state = chunked_forward(*token, *PARAMS.values(), state, config, None)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--length", type=int, default=None, help="forward T (default 16384, 2048 with --quick)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="decode after these prefills (default 2048 32768; 512 2048 with --quick)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per side (default 5, 2 with --quick)")
    parser.add_argument("--chunked-steps", type=int, default=32, help="one-token chunked calls per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    T = args.length or (2048 if args.quick else 16384)
    contexts = args.contexts or ([512, 2048] if args.quick else [2048, 32768])
    rounds = args.rounds or (2 if args.quick else 5)
    steps = 2 * C

    q, k, v, gate = make_inputs(T, seed=0)
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    tokens = make_inputs(steps, seed=1)
    long_inputs = make_inputs(max(contexts), seed=2)

    def kvm():
        return kvm_attention(q, k, v, gate, **PARAMS, **KW, backend="torch")[0]

    def full():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    times: dict[str, list] = {"kvm": [], "sdpa": [], "chunked": [], "floor": []}
    decode: dict[int, list] = {n: [] for n in contexts}
    with torch.inference_mode():
        prefilled = {}
        for n in contexts:
            start = time.perf_counter()
            prefilled[n] = kvm_attention(
                *(t[:, :n] for t in long_inputs), **PARAMS, **KW, backend="torch", output_final_state=True
            )[1]
            print(f"prefill {n:6d} tokens: {time.perf_counter() - start:.2f} s (once, untimed below)")
        kvm(), full()  # warm-up
        for n in contexts:
            decode_round(tokens, prefilled[n])
        chunked_round(tuple(t[:, :2] for t in tokens), prefilled[contexts[0]])
        for _ in range(rounds):
            for name, fn in (("kvm", kvm), ("sdpa", full)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            for n in contexts:
                decode[n].append(decode_round(tokens, prefilled[n]))
            times["chunked"].extend(
                chunked_round(tuple(t[:, : args.chunked_steps] for t in tokens), prefilled[contexts[0]])
            )
            times["floor"].extend(floor_round(tokens, prefilled[contexts[0]]))

    kvm_s, sdpa_s = statistics.median(times["kvm"]), statistics.median(times["sdpa"])
    print(f"\nH={H} Dk=Dv={D} C={C} window={BLOCKS} chunks state={S} B=1 float32 CPU, "
          f"{torch.get_num_threads()} threads, {rounds} rounds")
    print(f"(a) forward, T={T}")
    for label, name, median in (("kvm torch forward   ", "kvm", kvm_s), ("causal sdpa (full T)", "sdpa", sdpa_s)):
        every = ", ".join(f"{t * 1e3:.0f}" for t in times[name])
        print(f"  {label} median {median * 1e3:9.1f} ms  (all: {every})")
    print(f"  kvm is {sdpa_s / kvm_s:.2f}x faster than full causal attention")

    print(f"(b) decode, {steps} one-token calls (2 fold) per round after each prefill; ms/token")
    per_token, robust, plain, folding = {}, {}, {}, {}
    for n in contexts:
        means = [sum(t) / len(t) * 1e3 for t, _ in decode[n]]
        per_token[n] = statistics.median(means)
        plain[n] = statistics.median([x * 1e3 for t, f in decode[n] for x, y in zip(t, f) if not y])
        folding[n] = statistics.median([x * 1e3 for t, f in decode[n] for x, y in zip(t, f) if y])
        # The same average from per-step medians: steps that lost the core to others drop out.
        robust[n] = plain[n] + (folding[n] - plain[n]) * 2 / steps
        every = ", ".join(f"{m:.3f}" for m in means)
        print(f"  context {n:6d}: mean {per_token[n]:.3f} ms/token (rounds: {every}); from medians "
              f"{robust[n]:.3f} ms/token = plain step {plain[n]:.3f} ms + 2 folding steps of {folding[n]:.2f} ms")
    lo, hi = contexts[0], contexts[-1]
    print(f"  at {hi} / at {lo}: mean ms/token {per_token[hi] / per_token[lo]:.3f}, from medians "
          f"{robust[hi] / robust[lo]:.3f} (plain step {plain[hi] / plain[lo]:.3f}, folding step "
          f"{folding[hi] / folding[lo]:.3f})")

    prefill = kvm_s / T * 1e3
    fold = folding[lo] - plain[lo]
    chunked = statistics.median(times["chunked"]) * 1e3
    print(f"(c) the step against the prefill (context {lo})")
    print(f"  prefill (a): {prefill:.4f} ms/token, {prefill * C:.2f} ms per chunk of {C}")
    print(f"  the fold (folding - plain step): {fold:.2f} ms = {fold / prefill:.0f} prefill tokens; "
          f"per decoded token {fold / C:.4f} ms")
    print(f"  plain step {plain[lo]:.3f} ms = {plain[lo] / prefill:.1f}x the prefill's ms/token; "
          f"decode ms/token {robust[lo]:.3f} (from medians) = {robust[lo] / prefill:.1f}x; "
          f"prefill share + fold / C = {prefill + fold / C:.4f} ms")
    print(f"  one-token call through the chunked form (before): median {chunked:.2f} ms = "
          f"{chunked / plain[lo]:.1f}x the plain step, {chunked / (prefill * C):.2f}x a prefill chunk")
    floor = statistics.median(times["floor"]) * 1e3
    rows = prefilled[lo].room
    print(f"  floor: one read of the {rows[0]} state rows and {rows[1]} window slots per token (softmax(q K^T) V on "
          f"laid-out tensors, nothing else): median {floor:.4f} ms = {floor / prefill:.2f}x the prefill's "
          f"ms/token; the plain step is {plain[lo] / floor:.1f}x the floor")


if __name__ == "__main__":
    main()
