"""vLLM serving on CPU: a same-size Llama against all-Trellis and the hybrid, by context.

    .venv-vllm/bin/python benchmarks/bench_vllm.py --json benchmarks/results/vllm_cpu.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py --contexts 256 --requests 2 --decode-steps 4   # a minute

Runs in the vLLM venv (``make test-vllm`` makes it). Models (float32, random weights, one
seed): 4 layers of width 256 (4 heads of 64; Trellis 64 slots, chunks of 64; SwiGLU of 682;
vocabulary 4096): a ``LlamaForCausalLM``, all-Trellis, and the hybrid (three Trellis layers,
then attention). Each (model, context) gets its own engine (``enforce_eager``, no prefix
caching: the prompts are random and distinct), in a subprocess, and serves ``--requests``
prompts of ``context`` tokens submitted together (after a short warm-up request): time to
first token (median and last: every prefill done, chunked and interleaved with the decodes
of the sequences already started), then output tokens per second over ``--decode-steps``
engine steps in which every sequence decodes.

Memory: bytes one sequence holds at the context (the slots of the memory layers; K and V of
every token in the attention layers), and how many such sequences fit the cache budget
(``--kv-space`` GiB, vLLM's ``VLLM_CPU_KVCACHE_SPACE``, the same for every model; vLLM's own
page rounding aside). Compare ratios measured in one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, intermediate_size=682)
MODELS = ("llama", "trellis", "hybrid")


def save(kind: str, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trellis_lm import TrellisConfig, TrellisForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                                             max_position_embeddings=1 << 17, tie_word_embeddings=True, **SIZES))
    else:
        kinds = ["trellis"] * 4 if kind == "trellis" else ["trellis", "trellis", "trellis", "attention"]
        model = TrellisForCausalLM(TrellisConfig(num_heads=4, head_dim=64, num_slots=64, chunk_size=64,
                                                 mixer_types=kinds, **SIZES))
    model.save_pretrained(folder)


def serve(folder: str, context: int, requests: int, decode_steps: int) -> dict:
    """One engine: the run's timings (called in a subprocess, see ``main``)."""
    import random

    from vllm import LLM, SamplingParams

    # Room for the tokens a sequence decodes while the others are still in prefill.
    room = 8192
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="float32", max_model_len=context + room,
              enforce_eager=True, enable_prefix_caching=False, seed=0, max_num_seqs=max(requests, 1))
    rng = random.Random(context)
    prompts = [[rng.randrange(3, SIZES["vocab_size"]) for _ in range(context)] for _ in range(requests)]
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    start = time.perf_counter()
    while len(first) < requests:  # until every sequence has its first token
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
    tokens, begin = 0, time.perf_counter()
    for _ in range(decode_steps):  # every sequence decoding
        tokens += sum(1 for out in engine.step() if out.outputs)
    decode = time.perf_counter() - begin
    engine.abort_request([str(i) for i in range(requests)])
    ttft = sorted(first.values())
    return {"ttft_median_s": ttft[len(ttft) // 2], "ttft_last_s": ttft[-1], "decode_tokens_per_s": tokens / decode}


def state_bytes(kind: str, folder: Path, context: int) -> int:
    """Bytes one sequence holds after ``context`` tokens, as vLLM stores them (float32)."""
    import torch

    per_token_kv = 2 * 4 * 64 * 4  # K and V of one attention layer: 4 heads of 64, float32
    if kind == "llama":
        return SIZES["num_hidden_layers"] * per_token_kv * context
    from transformers import AutoConfig

    from trellis_lm.integrations.vllm.model import slot_layouts
    from trellis_lm.mixers import MIXERS, MemoryMixer

    config = AutoConfig.from_pretrained(folder)
    layouts = slot_layouts(config, torch.float32)
    return sum(layouts[k].nbytes if issubclass(MIXERS[k], MemoryMixer) else per_token_kv * context
               for k in config.layer_kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--kv-space", type=int, default=6, help="VLLM_CPU_KVCACHE_SPACE, GiB, every engine")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", nargs=3, metavar=("FOLDER", "CONTEXT", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        folder, context, requests = args.serve
        print("RESULT " + json.dumps(serve(folder, int(context), int(requests), args.decode_steps)), flush=True)
        return

    rows = []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space)}
    with tempfile.TemporaryDirectory() as work:
        for kind in args.models:
            folder = Path(work) / kind
            save(kind, folder)
            for context in args.contexts:
                run = subprocess.run([sys.executable, __file__, "--decode-steps", str(args.decode_steps), "--serve",
                                      str(folder), str(context), str(args.requests)],
                                     env=env, capture_output=True, text=True)
                log = run.stdout + run.stderr
                result = re.search(r"^RESULT (.*)$", log, re.M)
                if result is None:
                    raise RuntimeError(f"{kind} at {context} failed:\n{log[-4000:]}")
                held = state_bytes(kind, folder, context)
                row = {"model": kind, "context": context, **json.loads(result.group(1)), "bytes_per_sequence": held,
                       "sequences_that_fit": args.kv_space * 2**30 // held}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for row in rows:
        llama = next(r for r in rows if r["model"] == "llama" and r["context"] == row["context"]) \
            if "llama" in args.models else None
        if llama:
            row["decode_vs_llama"] = row["decode_tokens_per_s"] / llama["decode_tokens_per_s"]
            row["ttft_vs_llama"] = row["ttft_last_s"] / llama["ttft_last_s"]
            if row["sequences_that_fit"] and llama["sequences_that_fit"]:
                row["fit_vs_llama"] = row["sequences_that_fit"] / llama["sequences_that_fit"]
    print(f"\n{'model':8} {'context':>7} {'TTFT med s':>10} {'last s':>7} {'decode tok/s':>12} {'x Llama':>7} "
          f"{'MiB/seq':>8} {'seqs fit':>9} {'x Llama':>8}")
    for r in rows:
        print(f"{r['model']:8} {r['context']:7d} {r['ttft_median_s']:10.1f} {r['ttft_last_s']:7.1f} "
              f"{r['decode_tokens_per_s']:12.1f} "
              f"{r.get('decode_vs_llama', float('nan')):7.2f} {r['bytes_per_sequence'] / 2**20:8.2f} "
              f"{r['sequences_that_fit'] or float('nan'):9.1f} {r.get('fit_vs_llama', float('nan')):8.1f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": platform.processor() or platform.machine(),
                                         "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items() if k != "json"
                                                                          and k != "serve"},
                                         "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
