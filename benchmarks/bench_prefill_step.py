"""The vLLM plugin's prefill steps without vLLM: where a step's time goes, and a whole TTFT phase to A/B.

    .venv-vllm/bin/python benchmarks/bench_prefill_step.py                # 16 x 1,024 tokens, the phase timed
    .venv-vllm/bin/python benchmarks/bench_prefill_step.py --parts        # the same, the time split by part
    .venv-vllm/bin/python benchmarks/bench_prefill_step.py --op-backends torch compiled --rounds 3  # paired
    PYTHONPATH=/path/to/old/src .venv-vllm/bin/python benchmarks/bench_prefill_step.py   # another checkout's plugin

The all-Trellis model of ``bench_vllm.py`` (4 layers of width 256, random weights, float32, its
projections stacked and glibc's freed blocks kept, as the plugin does), its memory layers on slots
(:func:`~trellis_lm.integrations.vllm.slots.run_on_slots`), fed as vLLM's scheduler feeds them in
``bench_vllm.py contexts``: ``--requests`` prompts of ``--context`` tokens submitted together, each
step a token budget (``--budget``, vLLM's CPU default 4,096) spent on one token of every sequence
that has its first token, then on prompt chunks in order. Runs the steps until every sequence has
its first token (the phase ``bench_vllm.py`` reports as the time to the last first token, without
vLLM's own work) and prints its seconds. ``--parts``: the phase under cProfile, the time of the
functions named in ``PARTS`` (cumulative, so nested parts overlap; the plugin at this checkout).
``--op-backends``: the same weights with each ``op_backend`` in turn, every round in both orders
(ABBA), and the ratio of each to the first.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from trellis_lm import TrellisConfig, TrellisForCausalLM
from trellis_lm.integrations.vllm.allocator import keep_freed_memory
from trellis_lm.integrations.vllm.slots import SlotLayout, run_on_slots
from trellis_lm.projection_stacks import LinearStack

# Where a prefill step's time goes: (label, file suffix, function name), cumulative seconds.
PARTS = [
    ("whole steps (embeddings, blocks, final norm)", "bench_prefill_step.py", "step"),
    ("memory layers (run_on_slots)", "slots.py", "run_on_slots"),
    ("  slot reads (and fresh rows)", "slots.py", "_read_entries"),
    ("  slot writes", "slots.py", "_write_entries"),
    ("  fused projections q, k, v, gates", "base.py", "_fused_projections"),
    ("  short convs and q/k activations", "base.py", "_queries_keys"),
    ("  op inputs (v norm, gates)", "trellis.py", "op_inputs"),
    ("  the op (the backend auto takes)", "base.py", "run_op"),
    ("  read-out (norm, gate, o_proj)", "base.py", "read_out"),
    ("MLPs", "modeling_trellis.py", "forward"),  # the only forward of that file a step calls
]


def model(op_backend: str = "auto") -> TrellisForCausalLM:
    torch.manual_seed(0)
    config = TrellisConfig(num_heads=4, head_dim=64, num_slots=64, chunk_size=64, mixer_types=["trellis"] * 4,
                           tie_word_embeddings=True, vocab_size=4096, hidden_size=256, num_hidden_layers=4,
                           intermediate_size=682, op_backend=op_backend)
    built = TrellisForCausalLM(config).eval()
    for module in built.modules():  # as the plugin does once the weights load
        if getattr(type(module), "fusable_projections", ()):
            module.projection_stack = LinearStack.of(module, module.fusable_projections)
    return built


def schedule(requests: int, context: int, budget: int) -> list[list[tuple[int, int, int]]]:
    """Every step's ``(sequence, tokens computed before, tokens now)``, decodes first."""
    done, steps = [0] * requests, []
    while min(done) < context:
        step = [(i, done[i], 1) for i in range(requests) if done[i] >= context]
        left = budget - len(step)
        for i in range(requests):
            if done[i] < context and left > 0:
                take = min(context - done[i], left)
                step.append((i, done[i], take))
                left -= take
        for i, before, take in step:
            done[i] = before + take
        steps.append(step)
    return steps


def step(lm: TrellisForCausalLM, layers: list, ids: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    starts = torch.tensor([0] + [take for _, _, take in rows]).cumsum(0)
    computed = torch.tensor([before for _, before, _ in rows])
    slots = torch.tensor([i for i, _, _ in rows])
    hidden = lm.model.embed_tokens(ids)
    for layer, (layout, tensors) in zip(lm.model.layers, layers):
        hidden = layer.around(hidden, lambda x, layer=layer, layout=layout, tensors=tensors: run_on_slots(
            layer.self_attn, layout, tensors, x, starts, computed, slots))
    return lm.model.norm(hidden[starts[1:] - 1])  # what the sampler reads: each sequence's last token


def phase(lm: TrellisForCausalLM, requests: int, context: int, budget: int) -> float:
    """Seconds of the steps until every sequence has its first token (fresh slots)."""
    layers = []
    for layer in lm.model.layers:
        layout = SlotLayout(type(layer.self_attn), lm.config, torch.float32)
        layers.append((layout, layout.allocate(requests)))
    vocab = torch.Generator().manual_seed(context)
    prompts = torch.randint(3, lm.config.vocab_size, (requests, context), generator=vocab)
    start = time.perf_counter()
    with torch.no_grad():
        for rows in schedule(requests, context, budget):
            # A decode's token: any (its logits are not read); a prompt chunk's: the prompt's.
            ids = [prompts[i, before: before + take] if before < context else prompts[i, :1] for i, before, take in rows]
            step(lm, layers, torch.cat(ids), rows)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per step (vLLM's max_num_batched_tokens)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--parts", action="store_true", help="the phase under cProfile, split by part")
    parser.add_argument("--op-backends", nargs="+", default=None,
                        help="op_backend values compared on the same weights (the first is the base)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (one: what a shared machine times "
                        "steadily, as bench_vllm.py's --cpu-time engines on one core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the plugin does on a CPU
    if args.op_backends:
        compare(args.op_backends, args)
        return
    lm = model()
    phase(lm, 2, 64, args.budget)  # warm-up: first calls of every kernel
    if args.parts:
        profile = cProfile.Profile()
        total = profile.runcall(phase, lm, args.requests, args.context, args.budget)
        stats = pstats.Stats(profile).stats
        print(f"TTFT phase under cProfile: {total:.3f} s")
        for label, suffix, name in PARTS:
            seconds = sum(entry[3] for (file, _, function), entry in stats.items()
                          if file.endswith(suffix) and function == name)
            print(f"{label:48s} {seconds:7.3f} s  {seconds / total:6.1%}")
        return
    for _ in range(args.rounds):
        print(f"TTFT phase: {phase(lm, args.requests, args.context, args.budget):.3f} s")


def compare(backends: list[str], args: argparse.Namespace) -> None:
    """The phase with each ``op_backend`` on the same weights, rounds in alternating order."""
    models = {name: model(name) for name in backends}
    for lm in models.values():
        phase(lm, 2, 64, args.budget)  # warm-up: a compiled backend compiles here
    seconds = {name: [] for name in backends}
    for round_ in range(args.rounds):
        for name in backends if round_ % 2 == 0 else backends[::-1]:
            seconds[name].append(phase(models[name], args.requests, args.context, args.budget))
    base = sum(seconds[backends[0]])
    for name in backends:
        times = ", ".join(f"{t:.3f}" for t in seconds[name])
        print(f"op_backend {name:10s} TTFT phase s: {times}   {backends[0]} / {name}: {base / sum(seconds[name]):.2f}x")


if __name__ == "__main__":
    main()
