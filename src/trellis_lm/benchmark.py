"""CPU benchmarks: op backends, and decode cost against context length (``trellis-lm bench``).

Every figure is a ratio measured in the same run, so a noisy machine shifts both sides alike.
Timings are medians over repeats after a warm-up call. ``benchmarks/bench_cpu.py`` runs the
same (its output is what BENCHMARKS.md records).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import time
from datetime import date
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from .arguments import int_at_least
from .cache_trellis import CACHE_ARG
from .compiled_decode import inference_span
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
    """A Trellis model, the same with ``compile_decode=True`` (same weights), and a Llama model
    of the same width and depth; all in eval mode."""
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 8 // 3,
                  tie_word_embeddings=True)
    trellis = TrellisForCausalLM(TrellisConfig(num_heads=heads, head_dim=head_dim, num_slots=slots, **common)).eval()
    compiled = copy.deepcopy(trellis)
    compiled.config.compile_decode = True
    llama = LlamaForCausalLM(LlamaConfig(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                                         max_position_embeddings=1 << 20, **common))
    return trellis, compiled, llama.eval()


class DecodeStepper:
    """A model with ``context`` tokens of ``batch`` rows already in its cache, on its device
    (prefilled in pieces, to bound an attention baseline's memory); each :meth:`step` times
    one single-token forward that extends the cache. ``cache``: one to prefill into (default:
    the one the model's first call makes); a subclass may step another way (:meth:`forward`)."""

    @torch.no_grad()
    def __init__(self, model, context: int, prefill_piece: int = 1024, batch: int = 1, cache: Any = None) -> None:
        self.model, device = model, model.device
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        gen = torch.Generator(device=device).manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=gen, device=device)
        self.cache = cache
        for start in range(0, context, prefill_piece):
            # One position's logits: a whole piece's would be batch x piece x vocab (33 GB at 64 x 8k x 32k, bf16).
            out = model(input_ids=ids[:, start : start + prefill_piece], use_cache=True, logits_to_keep=1,
                        **{CACHE_ARG: self.cache})
            self.cache = getattr(out, CACHE_ARG)
        self.token = out.logits[:, -1:].argmax(-1)

    def forward(self, token: torch.Tensor) -> Any:
        """The model's output for ``token [B, 1]`` continuing the cache: what :meth:`step` times."""
        return self.model(input_ids=token, use_cache=True, **{CACHE_ARG: self.cache})

    @torch.no_grad()
    def step(self) -> float:
        """Seconds for one decode step."""
        self.sync()
        start = time.perf_counter()
        out = self.forward(self.token)
        self.sync()
        elapsed = time.perf_counter() - start
        self.cache, self.token = getattr(out, CACHE_ARG), out.logits[:, -1:].argmax(-1)
        return elapsed


def as_generate_runs(models) -> contextlib.ExitStack:
    """A span in which ``models`` step as ``generate()`` steps them: each model within
    :func:`~trellis_lm.compiled_decode.inference_span`, generate's own set-up."""
    span = contextlib.ExitStack()
    for model in models:
        span.enter_context(inference_span(model))
    return span


def decode_ms_per_token(model, context: int, steps: int, prefill_piece: int = 1024, batch: int = 1,
                        stepper: Callable[..., DecodeStepper] = DecodeStepper) -> float:
    """Median milliseconds of a single-token forward after ``context`` tokens (see :class:`DecodeStepper`;
    ``stepper`` makes it from ``(model, context, prefill_piece, batch)``), stepped as ``generate()`` steps."""
    with as_generate_runs([model]):
        stepper = stepper(model, context, prefill_piece, batch)
        return statistics.median([stepper.step() for _ in range(steps + 1)][1:]) * 1e3


def interleaved_decode_ms(runs: dict, rounds: int, block: int = 8) -> dict:
    """Median ms/token of each run ``name -> (model, context)``, timed in turns of ``block``
    steps for ``rounds`` rounds, so that a machine whose speed drifts (a shared VM) slows every
    run alike. Each run takes one untimed step first (a compiled model compiles there), and the
    first step of each turn is not counted: it runs with the memory caches the previous run left.
    The steps run as ``generate()`` runs them (:func:`as_generate_runs`)."""
    with as_generate_runs({id(model): model for model, _ in runs.values()}.values()):
        steppers = {name: DecodeStepper(model, context) for name, (model, context) in runs.items()}
        for stepper in steppers.values():
            stepper.step()
        times = {name: [] for name in runs}
        for _ in range(rounds):
            for name, stepper in steppers.items():
                times[name] += [stepper.step() for _ in range(block)][1:]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_decode(contexts: list[int], rounds: int, **size) -> list[str]:
    trellis, compiled, llama = same_size_models(**size)
    n_t = sum(p.numel() for p in trellis.parameters()) / 1e6
    n_l = sum(p.numel() for p in llama.parameters()) / 1e6
    rows = [f"decode, batch 1, float32, {size}; Trellis {n_t:.1f}M params (eager, and with compile_decode=True), "
            f"Llama {n_l:.1f}M params (sdpa attention, DynamicCache); all runs timed in turns, {rounds} turns of 8 "
            "steps each:"]
    models = {"Trellis": trellis, "compiled": compiled, "Llama": llama}
    ms = interleaved_decode_ms({(name, c): (model, c) for c in contexts for name, model in models.items()}, rounds)
    for c in contexts:
        llama_ms = ms["Llama", c]
        rows.append(f"  context {c:6d}: Trellis {ms['Trellis', c]:7.2f} | compiled {ms['compiled', c]:7.2f} | Llama "
                    f"{llama_ms:7.2f} ms/token | Llama/Trellis {llama_ms / ms['Trellis', c]:.2f}x, "
                    f"Llama/compiled {llama_ms / ms['compiled', c]:.2f}x")
    lo, hi = contexts[0], contexts[-1]
    rows.append(f"  ms/token at {hi} / at {lo}: Trellis {ms['Trellis', hi] / ms['Trellis', lo]:.3f}, compiled "
                f"{ms['compiled', hi] / ms['compiled', lo]:.3f}  (Llama: {ms['Llama', hi] / ms['Llama', lo]:.3f})")
    return rows


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by ``trellis-lm bench`` and ``benchmarks/bench_cpu.py``)."""
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the benchmark runs (seconds)")
    parser.add_argument("--threads", type=int_at_least(1), default=torch.get_num_threads(),
                        help="torch CPU threads (default: %(default)s)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark chosen by :func:`add_bench_arguments`' options and print its table."""
    torch.set_num_threads(args.threads)
    print(f"# {date.today()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads"
          f" | torch {torch.__version__}")
    if args.quick:
        rows = bench_op(1, 128, 2, 16, 16, 16, repeats=3)
        rows += bench_decode([32, 256], rounds=1, hidden=64, layers=2, heads=2, head_dim=16, slots=16, vocab=256)
    else:
        rows = bench_op(1, 2048, 4, 64, 64, 64, repeats=9)
        rows += bench_decode([256, 8192], rounds=6, hidden=512, layers=4, heads=8, head_dim=64, slots=64, vocab=4096)
    print("\n".join(rows))
    return 0
