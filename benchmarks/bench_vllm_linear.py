"""What vLLM's CPU matrix products would give the served model: all-Trellis (the size of
``bench_vllm.py``'s models) with every ``nn.Linear`` run by torch's ``F.linear`` against the
same layers run by vLLM's CPU GEMM dispatch (``create_onednn_mm``/``onednn_mm``: oneDNN with the
weights packed once, what vLLM's ``UnquantizedLinearMethod`` picks on an x86 CPU for these
shapes), on the two steps a server runs: a prefill step (4 prompts of 1,024 tokens) and a decode
step (16 sequences, one token each). Rounds alternate the two, in one process on one thread;
times are CPU seconds, and the ratio is taken round by round.

    .venv-vllm/bin/python benchmarks/bench_vllm_linear.py [--rounds 5]

Runs in the vLLM venv (``make test-vllm`` makes it), with ``trellis_lm`` importable.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch import nn


def model() -> nn.Module:
    from bench_vllm import SIZES

    from trellis_lm import TrellisConfig, TrellisForCausalLM

    torch.manual_seed(0)
    config = TrellisConfig(num_heads=4, head_dim=64, num_slots=64, chunk_size=64, mixer_types=["trellis"] * 4,
                           tie_word_embeddings=True, **SIZES)
    return TrellisForCausalLM(config).eval()


def use_onednn(net: nn.Module, on: bool) -> None:
    """Every ``nn.Linear`` of ``net`` through vLLM's oneDNN product (``on``) or torch's own."""
    from vllm import _custom_ops as ops

    for layer in net.modules():
        if isinstance(layer, nn.Linear):
            if not on:
                layer.__dict__.pop("forward", None)
                continue
            if not hasattr(layer, "onednn"):
                layer.onednn = ops.create_onednn_mm(layer.weight.detach().t(), 32)
            layer.forward = lambda x, layer=layer: ops.onednn_mm(layer.onednn, x, layer.bias)


def steps(net: nn.Module) -> dict[str, Callable[[], None]]:
    prompts = torch.randint(3, net.config.vocab_size, (4, 1024))
    decoding = net(torch.randint(3, net.config.vocab_size, (16, 64)), use_cache=True)
    cache, token = decoding.past_key_values, decoding.logits[:, -1:].argmax(-1)

    def decode() -> None:  # 20 steps, each of the same token (a step costs the same at any context)
        for _ in range(20):
            net(token, past_key_values=cache, use_cache=True, logits_to_keep=1)

    return {"prefill step (4 x 1024 tokens)": lambda: net(prompts, logits_to_keep=1),
            "decode, 20 steps of 16 sequences": decode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = model()
    with torch.no_grad():
        for name, run in steps(net).items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for on in (False, True):  # warm-up: oneDNN builds its handlers, both paths their buffers
                use_onednn(net, on)
                run()
            for _ in range(args.rounds):
                for on in (False, True):
                    use_onednn(net, on)
                    start = time.process_time()
                    run()
                    times[on].append(time.process_time() - start)
            ratio = statistics.median(a / b for a, b in zip(times[False], times[True]))
            print(f"{name}: torch {statistics.median(times[False]):.3f} s, vLLM oneDNN "
                  f"{statistics.median(times[True]):.3f} s (CPU, medians of {args.rounds}); torch / oneDNN {ratio:.2f}x")


if __name__ == "__main__":
    main()
