"""Decode cost per token (CPU): every mixer kind against a same-size Llama, by context and batch.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_decode.py                 # ~10 min on 2 cores
    PYTHONPATH=src .venv/bin/python benchmarks/bench_decode.py --quick         # seconds: checks it runs
    PYTHONPATH=src .venv/bin/python benchmarks/bench_decode.py --json out.json --compiled
    PYTHONPATH=src .venv/bin/python benchmarks/bench_decode.py --size small --compiled --models trellis \
        --contexts 256,8192 --batches 1 --rounds 16                            # issue 73's goals

Models (float32, eval, one seed): 4 layers of width 256 (4 heads of 64, 64 slots, SwiGLU of 682,
vocabulary 4096, tied embeddings; ``--size small``: 3 layers of width 192, 3 heads of 64, 48
slots, SwiGLU of 512): all-Trellis, all-Lattice, all-KVM, the hybrid (three Trellis layers, then
attention) and a ``LlamaForCausalLM`` of the same width and depth (sdpa, ``DynamicCache``);
``--compiled`` adds the Trellis, Lattice and hybrid models with ``compile_decode=True`` (an
older checkout compiles Trellis layers only, or each mixer alone) and ``llama-compiled``, the
Llama in a ``StaticCache`` with its forward compiled (``torch.compile``, fullgraph; one
compilation per context and batch): transformers' recipe for fast decoding, against which the
compiled models' ratios are taken.

Each model reads ``context`` random tokens of one row (prefilled in pieces of 1024), then its
cache is repeated to each batch size (a decode step costs the same whatever the rows hold).
Every (model, context, batch) then takes single-token forward steps **in turns**: ``--rounds``
rounds of 8 steps each, the first step of each turn not counted (it runs with the memory caches
the previous turn left), so a machine whose speed drifts slows every run alike. Figures are
medians; compare the ratios (to the Llama of the same context and batch, measured in the same
run), not absolute times from a noisy machine.

``--json`` also records each model's cache bytes for one row after each context
(``benchmarks/plot_decode.py`` draws the figures of README.md and BENCHMARKS.md from such a file).

Operations per token: ``torch.profiler`` counts of every ``aten::`` call (nested ones included)
and of the top-level ones (those no other ``aten::`` call issued) over 5 steps at the first
context, batch 1, with each model's most frequent top-level operations.

The steps run as ``generate()`` runs them (inside its set-up, ``inference_span``, where the package
has it; older checkouts: ``stacked_projections``); otherwise only public API, so an older checkout
runs it unchanged (before/after tables).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import platform
import statistics
import time
from datetime import date

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from trellis_lm import TrellisConfig, TrellisForCausalLM

try:  # what generate() runs its steps in (older checkouts have no such span, or only the stacks)
    from trellis_lm.compiled_decode import inference_span
except ImportError:
    try:
        from trellis_lm.mixers.stacking import stacked_projections as inference_span
    except ImportError:
        inference_span = None
from trellis_lm.cache_trellis import CACHE_ARG  # the running transformers' name for the cache argument

SIZES = {
    "default": dict(hidden=256, layers=4, heads=4, head_dim=64, slots=64, vocab=4096),
    "small": dict(hidden=192, layers=3, heads=3, head_dim=64, slots=48, vocab=4096),  # issue 73's
}
QUICK_SIZE = dict(hidden=64, layers=4, heads=2, head_dim=32, slots=16, vocab=256)
SCHEDULES = {
    "trellis": ["trellis"],
    "lattice": ["lattice"],
    "kvm": ["kvm"],
    "hybrid": ["trellis", "trellis", "trellis", "attention"],
}


def build_models(size: dict, compiled: bool, quick: bool) -> dict[str, torch.nn.Module]:
    """The models compared, all in eval mode, each drawn from the same seed."""
    common = dict(vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                  intermediate_size=size["hidden"] * 8 // 3, tie_word_embeddings=True)
    # KVM at the quick size: chunks of 16 (a fold every 16 steps), so --quick exercises folds.
    kvm = dict(kvm_chunk_size=16, kvm_state_size=32) if quick else {}
    models = {}
    for name, pattern in SCHEDULES.items():
        torch.manual_seed(0)
        kinds = [pattern[i % len(pattern)] for i in range(size["layers"])]
        config = TrellisConfig(num_heads=size["heads"], head_dim=size["head_dim"], num_slots=size["slots"],
                               mixer_types=kinds, **common, **kvm)
        models[name] = TrellisForCausalLM(config).eval()
    if compiled:  # models with blocks that compile (KVM's folds are control flow on the data)
        for name in ("trellis", "lattice", "hybrid"):
            models[f"{name}-compiled"] = copy.deepcopy(models[name])
            models[f"{name}-compiled"].config.compile_decode = True
    torch.manual_seed(0)
    llama = LlamaConfig(num_attention_heads=size["heads"], num_key_value_heads=size["heads"], head_dim=size["head_dim"],
                        max_position_embeddings=1 << 20, **common)
    models["llama"] = LlamaForCausalLM(llama).eval()
    if compiled:  # the same Llama, stepped by StaticStepper
        models["llama-compiled"] = models["llama"]
    return models


def baseline(name: str) -> str:
    """The Llama a model is compared with: the compiled one for a compiled model."""
    return "llama-compiled" if name.endswith("-compiled") else "llama"


def cache_of(output):
    """The cache a forward returned (``past_key_values``; ``cache`` on newer transformers)."""
    for name in ("cache", "past_key_values"):
        cache = getattr(output, name, None)
        if cache is not None:
            return cache
    raise RuntimeError("the model returned no cache")


def cache_kwargs(cache) -> dict:
    return {} if cache is None else {CACHE_ARG: cache}


class Stepper:
    """One model after ``context`` tokens, its cache repeated to ``batch`` rows; :meth:`step`
    times one single-token forward that extends it (the untimed rest: the next token)."""

    def __init__(self, model, prefilled, batch: int) -> None:
        self.model = model
        cache, token = prefilled
        self.cache = copy.deepcopy(cache)
        if batch > 1:
            self.cache.batch_repeat_interleave(batch)
        self.token = token.repeat(batch, 1)

    def forward(self):
        return self.model(input_ids=self.token, use_cache=True, **cache_kwargs(self.cache))

    @torch.no_grad()
    def step(self) -> float:
        start = time.perf_counter()
        out = self.forward()
        elapsed = time.perf_counter() - start
        self.cache, self.token = cache_of(out), out.logits[:, -1:].argmax(-1)
        return elapsed


class StaticStepper(Stepper):
    """The Llama continuing a ``StaticCache`` that holds the prefilled keys and values of every
    row and room for ``steps`` more, each step by its forward compiled (a new compilation per
    context and batch, the first step)."""

    def __init__(self, model, prefilled, batch: int, steps: int) -> None:
        from transformers import StaticCache

        super().__init__(model, prefilled, batch)
        self.position = self.cache.get_seq_length()
        static = StaticCache(config=model.config, max_cache_len=self.position + steps)
        for layer, filled in zip(static.layers, self.cache.layers):
            layer.update(filled.keys, filled.values)
        self.cache = static
        self.compiled = torch.compile(model.forward, fullgraph=True)

    def forward(self):
        position = torch.tensor([self.position])
        self.position += 1
        return self.compiled(input_ids=self.token, use_cache=True, cache_position=position, **cache_kwargs(self.cache))


@torch.no_grad()
def prefill(model, context: int, vocab: int, piece: int = 1024):
    """``(cache, next token)`` after ``context`` random tokens of one row."""
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    cache = None
    for start in range(0, context, piece):
        out = model(input_ids=ids[:, start : start + piece], use_cache=True, **cache_kwargs(cache))
        cache = cache_of(out)
    return cache, out.logits[:, -1:].argmax(-1)


def cache_bytes(cache) -> int:
    """Bytes a cache holds for its rows: ``TrellisCache.nbytes()``, or the keys and values of
    every layer of a transformers ``DynamicCache``."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(tensor.nbytes for layer in cache.layers for tensor in (layer.keys, layer.values))


def count_ops(stepper: Stepper, steps: int = 5) -> dict:
    """aten operations per token (all, top-level) and the most frequent top-level ones."""
    for _ in range(2):
        stepper.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            stepper.step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = collections.Counter(e.name for e in events
                              if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return {"all": len(events) / steps, "top_level": sum(top.values()) / steps,
            "most_frequent": {name: n / steps for name, n in top.most_common(8)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and contexts: checks the script runs")
    parser.add_argument("--size", choices=sorted(SIZES), default="default", help="the models' sizes (see above)")
    parser.add_argument("--contexts", default=None, help="comma-separated (default 256,2048,8192,32768)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--rounds", type=int, default=None, help="turns of 8 steps per run (default 12; quick 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compiled", action="store_true", help="also Trellis, Lattice and the hybrid with compile_decode=True")
    parser.add_argument("--models", default=None, help="comma-separated subset (llama is always measured)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    size = QUICK_SIZE if args.quick else SIZES[args.size]
    contexts = [int(c) for c in (args.contexts or ("32,100" if args.quick else "256,2048,8192,32768")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rounds = args.rounds or (2 if args.quick else 12)
    models = build_models(size, args.compiled, args.quick)
    if args.models:  # each named model, its compiled form with --compiled, and the Llamas
        wanted = {f"{name}{suffix}" for name in args.models.split(",") for suffix in ("", "-compiled")}
        models = {name: m for name, m in models.items() if name in wanted | {"llama", "llama-compiled"}}
    # One compilation of the compiled Llama per context and batch.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(contexts) * len(batches))
    print(f"# {date.today()} | {platform.processor() or platform.machine()} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__} | {size}")
    params = {name: sum(p.numel() for p in m.parameters()) / 1e6 for name, m in models.items()}
    steps = 8 * rounds + 16  # what a StaticCache must hold room for: every timed and untimed step
    print("parameters (M): " + ", ".join(f"{n} {p:.2f}" for n, p in params.items()))

    spans = contextlib.ExitStack()
    if inference_span is not None:
        for model in models.values():
            if isinstance(model, TrellisForCausalLM):
                spans.enter_context(inference_span(model))
    steppers, nbytes = {}, {}
    for name, model in models.items():
        for context in contexts:
            start = time.perf_counter()
            prefilled = prefill(model, context, size["vocab"])
            nbytes[f"{name}|{context}"] = cache_bytes(prefilled[0])
            for batch in batches:
                steppers[name, context, batch] = (StaticStepper(model, prefilled, batch, steps)
                                                  if name == "llama-compiled" else Stepper(model, prefilled, batch))
            print(f"prefilled {name} at {context} tokens in {time.perf_counter() - start:.1f} s", flush=True)
    for stepper in steppers.values():
        stepper.step()  # untimed: a compiled model compiles here
    times = {key: [] for key in steppers}
    for _ in range(rounds):
        for key, stepper in steppers.items():
            times[key] += [stepper.step() for _ in range(8)][1:]
    ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}

    ops = {name: count_ops(steppers[name, contexts[0], batches[0]]) for name in models}
    header = " | ".join(f"{c} tokens" for c in contexts)
    print(f"\n| model | batch | {header} | flat ({contexts[-1]} / {contexts[0]}) | ms / its Llama's at {contexts[0]} | "
          f"its Llama / model at {contexts[-1]} |")
    print("|---|---|" + "---|" * (len(contexts) + 3))
    for name in models:
        llama = baseline(name)
        for batch in batches:
            row = [ms[name, c, batch] for c in contexts]
            print(f"| {name} | {batch} | " + " | ".join(f"{x:.2f}" for x in row) + f" | {row[-1] / row[0]:.3f} | "
                  f"{row[0] / ms[llama, contexts[0], batch]:.2f} | "
                  f"{ms[llama, contexts[-1], batch] / row[-1]:.2f} |")
    print("\n(its Llama: llama-compiled for a compiled model, else llama)")
    print(f"\naten operations per decoded token (context {contexts[0]}, batch {batches[0]}):\n")
    print("| model | all aten calls | top-level | most frequent top-level |")
    print("|---|---|---|---|")
    for name, counted in ops.items():
        frequent = ", ".join(f"{op.removeprefix('aten::')} {n:.0f}" for op, n in counted["most_frequent"].items())
        print(f"| {name} | {counted['all']:.0f} | {counted['top_level']:.0f} | {frequent} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "threads": torch.get_num_threads(), "rounds": rounds,
                       "ms": {f"{n}|{c}|{b}": v for (n, c, b), v in ms.items()}, "cache_bytes": nbytes, "ops": ops},
                      f, indent=1)


if __name__ == "__main__":
    main()
