"""CPU benchmarks: op backends, and decode cost against context length (``trellis-lm bench``).

Every figure is a ratio measured in the same run, so a noisy machine shifts both sides alike.
Timings are medians over repeats after a warm-up call. ``benchmarks/bench_cpu.py`` runs the
same (its output is what BENCHMARKS.md records).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from datetime import date

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from .configuration_trellis import TrellisConfig
from .modeling_trellis import TrellisForCausalLM
from .ops import trellis_attention


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for allocation and lazy initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_inputs(B: int, T: int, H: int, D: int, M: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    tensors = [
        F.normalize(rand(B, T, H, D), dim=-1), F.normalize(rand(B, T, H, D), dim=-1),
        F.normalize(rand(B, T, H, D), dim=-1), rand(B, T, H, M),
        F.logsigmoid(rand(B, T, H) + 3), torch.sigmoid(rand(B, T, H)),
    ]
    state = (rand(B, H, M, D), rand(B, H, M, D))
    return [t.requires_grad_(requires_grad) for t in tensors], state


def bench_op(B: int, T: int, H: int, D: int, M: int, C: int, repeats: int) -> list[str]:
    x, state = op_inputs(B, T, H, D, M)
    rows = [f"op forward, (B, T, H, D, M, C) = {(B, T, H, D, M, C)}, float32, no grad:"]
    with torch.no_grad():
        times = {
            backend: median_seconds(
                lambda: trellis_attention(*x, initial_state=state, chunk_size=C, backend=backend),
                repeats if backend == "torch" else max(1, repeats // 3),
            )
            for backend in ("torch", "reference")
        }
    rows.append(f"  reference {times['reference'] * 1e3:9.1f} ms | torch {times['torch'] * 1e3:8.1f} ms"
                f" | torch is {times['reference'] / times['torch']:.1f}x faster")
    x, state = op_inputs(B, T, H, D, M, requires_grad=True)

    def fwd_bwd(backend):
        o, _ = trellis_attention(*x, initial_state=state, chunk_size=C, backend=backend)
        o.sum().backward()

    times = {b: median_seconds(lambda: fwd_bwd(b), max(1, repeats // 3)) for b in ("torch", "reference")}
    rows.append(f"  forward+backward: reference {times['reference'] * 1e3:9.1f} ms | torch "
                f"{times['torch'] * 1e3:8.1f} ms | torch is {times['reference'] / times['torch']:.1f}x faster")
    return rows


def same_size_models(hidden: int, layers: int, heads: int, head_dim: int, slots: int, vocab: int):
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 8 // 3,
                  tie_word_embeddings=True)
    trellis = TrellisForCausalLM(TrellisConfig(num_heads=heads, head_dim=head_dim, num_slots=slots, **common))
    llama = LlamaForCausalLM(LlamaConfig(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                                         max_position_embeddings=1 << 20, **common))
    return trellis.eval(), llama.eval()


@torch.no_grad()
def decode_ms_per_token(model, context: int, steps: int, prefill_piece: int = 1024, batch: int = 1) -> float:
    """Prefill ``context`` tokens of ``batch`` rows (in pieces, to bound the attention baseline's
    memory) on the model's device, then time single-token forward passes that extend the cache."""
    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen, device=device)
    cache = None
    for start in range(0, context, prefill_piece):
        out = model(input_ids=ids[:, start : start + prefill_piece], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        sync()
        times.append(time.perf_counter() - start)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times[1:]) * 1e3


def bench_decode(contexts: list[int], steps: int, **size) -> list[str]:
    trellis, llama = same_size_models(**size)
    n_t = sum(p.numel() for p in trellis.parameters()) / 1e6
    n_l = sum(p.numel() for p in llama.parameters()) / 1e6
    rows = [f"decode, batch 1, float32, {size}; Trellis {n_t:.1f}M params, Llama {n_l:.1f}M params "
            "(sdpa attention, DynamicCache):"]
    trellis_ms = {c: decode_ms_per_token(trellis, c, steps) for c in contexts}
    llama_ms = {c: decode_ms_per_token(llama, c, steps) for c in contexts}
    for c in contexts:
        rows.append(f"  context {c:6d}: Trellis {trellis_ms[c]:7.2f} ms/token | Llama {llama_ms[c]:7.2f} ms/token"
                    f" | Llama/Trellis {llama_ms[c] / trellis_ms[c]:.2f}x")
    lo, hi = contexts[0], contexts[-1]
    rows.append(f"  Trellis ms/token at {hi} / at {lo}: {trellis_ms[hi] / trellis_ms[lo]:.3f}"
                f"  (Llama: {llama_ms[hi] / llama_ms[lo]:.3f})")
    return rows


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``trellis-lm bench`` and ``benchmarks/bench_cpu.py``)."""
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the benchmark runs (seconds)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch CPU threads (default: %(default)s)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark chosen by :func:`add_bench_arguments`' options and print its table."""
    torch.set_num_threads(args.threads)
    print(f"# {date.today()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads"
          f" | torch {torch.__version__}")
    if args.quick:
        rows = bench_op(1, 128, 2, 16, 16, 16, repeats=3)
        rows += bench_decode([32, 256], steps=5, hidden=64, layers=2, heads=2, head_dim=16, slots=16, vocab=256)
    else:
        rows = bench_op(1, 2048, 4, 64, 64, 64, repeats=9)
        rows += bench_decode([256, 8192], steps=40, hidden=512, layers=4, heads=8, head_dim=64, slots=64, vocab=4096)
    print("\n".join(rows))
    return 0
