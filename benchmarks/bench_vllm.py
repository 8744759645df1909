"""vLLM serving on CPU: a same-size Llama beside all-Trellis and the hybrid, three workloads.

    .venv-vllm/bin/python benchmarks/bench_vllm.py contexts --json benchmarks/results/vllm_cpu.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py contexts --contexts 256 --requests 2 --decode-steps 4  # a minute
    .venv-vllm/bin/python benchmarks/bench_vllm.py shared-prefix --json benchmarks/results/vllm_prefix.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py shared-prefix --speculative-tokens 3 --new-tokens 128 --embedding-scale 30
    .venv-vllm/bin/python benchmarks/bench_vllm.py copy --json benchmarks/results/vllm_speculative.json
    .venv-vllm/bin/python benchmarks/bench_vllm.py contexts --contexts 1024 --baseline-src /path/to/old/src
    .venv-vllm/bin/python benchmarks/bench_vllm.py contexts --contexts 1024 --models llama trellis --op-backend compiled

Runs in the vLLM venv (``make test-vllm`` makes it). Models (float32 unless ``--dtype``, random weights, one
seed): 4 layers of width 256 (4 heads of 64; Trellis 64 slots, chunks of 64; SwiGLU of 682;
vocabulary 4096; the head tied to the embeddings): a ``LlamaForCausalLM``, all-Trellis, and
the hybrid (three Trellis layers, then attention). Each (model, variant) gets its own engine (``enforce_eager``), in a
subprocess; ``--rounds`` repeats the whole list in turn, so that every ratio to Llama is
taken between runs made side by side (the machine is shared: compare ratios, not times; with
``--cpu-time`` every time is CPU seconds of an engine on one core, which other work on the
machine does not stretch as it stretches wall time).

Workloads:

- ``contexts``: ``--requests`` random prompts of each context submitted together (after a
  short warm-up request; no prefix caching): time to first token (median and last: every
  prefill done, chunked and interleaved with the decodes of the sequences already started),
  then output tokens per second over ``--decode-steps`` engine steps in which every sequence
  decodes. Memory: bytes one sequence holds at the context (the slots of the memory layers;
  K and V of every token in the attention layers), and how many such sequences fit the cache
  budget (``--kv-space`` GiB, vLLM's ``VLLM_CPU_KVCACHE_SPACE``, the same for every model;
  vLLM's own page rounding aside).
- ``shared-prefix``: ``--requests`` prompts of one ``--prefix``-token prefix and a distinct
  ``--suffix``, submitted together, ``--new-tokens`` greedy tokens each (16 unless given), with
  and without prefix caching, and with ``--speculative-tokens`` n-gram drafts (0: none) beside
  prefix caching, vLLM's defaults: the share of prompt tokens vLLM took from its cache, times to
  first token, decode tokens per second (as ``copy``), and whether the tokens equal those
  without caching.
- ``copy``: copy-heavy prompts (a random passage of ``--passage`` tokens said twice, then
  its first quarter again), ``--requests`` of them decoded greedily (``--new-tokens`` each)
  with and without n-gram speculation (``--speculative-tokens``, no prefix caching for any
  model): draft acceptance, decode tokens per second (the tokens every sequence gets after
  the last one's first token, over that time), and whether the tokens are the same. Random
  models do not copy the passage as a trained one would: the drafts match where a model's
  own greedy text repeats (a head tied to the embeddings makes it repeat often, every model
  alike; untied, all-Trellis's greedy text drew no draft at all).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, Callable

SIZES = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, intermediate_size=682)
MODELS = ("llama", "trellis", "hybrid")
FIRST_TOKEN = 3  # ids below are special


def save(kind: str, folder: Path, embedding_scale: float = 1.0, **settings: Any) -> None:
    """A random model of ``kind`` saved in ``folder``; ``settings``: TrellisConfig fields (Trellis models)."""
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
                                                 mixer_types=kinds, tie_word_embeddings=True,
                                                 **settings, **SIZES))
    with torch.no_grad():  # --embedding-scale (the head is tied: the logits scale with it)
        model.get_input_embeddings().weight.mul_(embedding_scale)
    model.save_pretrained(folder)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, SIZES["vocab_size"]) for _ in range(length)]


DTYPE = "BENCH_VLLM_DTYPE"  # set in an engine's environment by --dtype


def engine(folder: str, max_model_len: int, requests: int, **options: Any) -> Any:
    import torch
    from vllm import LLM

    # vLLM's dtype argument names no float64; it takes the torch dtype itself.
    dtype = getattr(torch, os.environ.get(DTYPE, "float32"))
    return LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
               enforce_eager=True, seed=0, max_num_seqs=max(requests, 1), disable_log_stats=False, **options)


CPU_TIME = "BENCH_VLLM_CPU_TIME"  # set in an engine's environment by --cpu-time


def clock() -> float:
    """Seconds: wall, or with ``--cpu-time`` the CPU seconds of this process, which then runs
    the engine (on one core): on a machine shared with other work, the CPU seconds a step
    takes stay what its work costs while its wall time does not."""
    return time.process_time() if os.environ.get(CPU_TIME) else time.perf_counter()


def counter(llm: Any, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


# --- the workloads: each runs in one engine, in a subprocess (see `main`) ---

def contexts_case(folder: str, context: int, requests: int, decode_steps: int) -> dict:
    from vllm import SamplingParams

    room = 8192  # for the tokens a sequence decodes while the others are still in prefill
    llm = engine(folder, context + room, requests, enable_prefix_caching=False)
    rng = random.Random(context)
    prompts = [random_prompt(rng, context) for _ in range(requests)]
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:2]], SamplingParams(max_tokens=4), use_tqdm=False)
    core = llm.llm_engine
    params = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), {"prompt_token_ids": prompt}, params)
    first: dict[str, float] = {}
    start = clock()
    while len(first) < requests:  # until every sequence has its first token
        for out in core.step():
            if out.outputs and out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = clock() - start
    tokens, begin = 0, clock()
    for _ in range(decode_steps):  # every sequence decoding
        tokens += sum(1 for out in core.step() if out.outputs)
    decode = clock() - begin
    core.abort_request([str(i) for i in range(requests)])
    ttft = sorted(first.values())
    return {"ttft_median_s": ttft[len(ttft) // 2], "ttft_last_s": ttft[-1], "decode_tokens_per_s": tokens / decode}


def run_together(llm: Any, prompts: list[list[int]], params: Any) -> dict:
    """Submit ``prompts`` at once and step the engine until all finish: each request's tokens (in
    prompt order) and time to its first token, and the decode rate once every sequence has its
    first token: the tokens they get after that over its time, and per engine step."""
    core = llm.llm_engine
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), {"prompt_token_ids": prompt}, params)
    got: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    done: set[str] = set()
    at_first: dict[str, int] = {}  # tokens each sequence had when the last first token came
    begin, steps, start = 0.0, 0, clock()
    while len(done) < len(prompts):
        for out in core.step():
            if out.outputs and out.outputs[0].token_ids:
                got[out.request_id] = list(out.outputs[0].token_ids)
                first.setdefault(out.request_id, clock() - start)
            if out.finished:
                done.add(out.request_id)
        steps += bool(at_first)
        if not at_first and len(first) == len(prompts):
            at_first = {k: len(v) for k, v in got.items()}
            begin = clock()
    decode = clock() - begin
    tokens = sum(len(got[k]) - at_first[k] for k in got)
    return {"tokens": [got[str(i)] for i in range(len(prompts))], "ttft": [first[str(i)] for i in range(len(prompts))],
            "decode_tokens_per_s": tokens / decode if decode else None, "tokens_per_step": tokens / steps if steps else None}


def speculation(drafts: int) -> Any:
    """n-gram speculative decoding of ``drafts`` tokens (``None``: none)."""
    return {"method": "ngram", "num_speculative_tokens": drafts, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4} if drafts else None


def drafts_counted(llm: Any) -> dict:
    drafted = counter(llm, "vllm:spec_decode_num_draft_tokens")
    accepted = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def shared_prefix_case(folder: str, prefix: int, suffix: int, requests: int, caching: bool, new_tokens: int = 16,
                       drafts: int = 0) -> dict:
    from vllm import SamplingParams

    rng = random.Random(prefix)
    shared = random_prompt(rng, prefix)
    prompts = [shared + random_prompt(rng, suffix) for _ in range(requests)]
    llm = engine(folder, prefix + suffix + new_tokens + 64, requests, enable_prefix_caching=caching,
                 speculative_config=speculation(drafts))
    warm = random_prompt(random.Random(1), 64)  # distinct from every prompt: hits nothing
    llm.generate([{"prompt_token_ids": warm}], SamplingParams(max_tokens=4), use_tqdm=False)
    run = run_together(llm, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    cached = counter(llm, "vllm:prefix_cache_hits")
    ttft = sorted(run["ttft"])
    return {"prompt_tokens": sum(map(len, prompts)), "cached_tokens": cached,
            "hit_share": cached / sum(map(len, prompts)), "ttft_median_s": ttft[len(ttft) // 2],
            "ttft_last_s": ttft[-1], "decode_tokens_per_s": run["decode_tokens_per_s"],
            "tokens_per_step": run["tokens_per_step"], **drafts_counted(llm), "tokens": run["tokens"]}


def copy_prompts(passage: int, requests: int) -> list[list[int]]:
    """Copy-heavy prompts: a random passage said twice, then its first quarter again."""
    rng = random.Random(passage)
    texts = [random_prompt(rng, passage) for _ in range(requests)]
    return [text + text + text[: passage // 4] for text in texts]


def copy_case(folder: str, passage: int, requests: int, new_tokens: int, drafts: int) -> dict:
    """Greedy decoding of the copy prompts, with n-gram drafts of ``drafts`` tokens (0: none)."""
    from vllm import SamplingParams

    prompts = copy_prompts(passage, requests)
    # No prefix caching for any model: the measure of speculation alone, as it was first taken.
    llm = engine(folder, len(prompts[0]) + new_tokens + 64, requests, enable_prefix_caching=False,
                 speculative_config=speculation(drafts))
    llm.generate([{"prompt_token_ids": random_prompt(random.Random(1), 64)}], SamplingParams(max_tokens=4),
                 use_tqdm=False)
    run = run_together(llm, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return {"decode_tokens_per_s": run["decode_tokens_per_s"], "tokens_per_step": run["tokens_per_step"],
            **drafts_counted(llm), "tokens": run["tokens"]}


CASES: dict[str, Callable[..., dict]] = {"contexts": contexts_case, "shared-prefix": shared_prefix_case,
                                         "copy": copy_case}


# --- memory held per sequence (contexts workload) ---

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


# --- the driver ---

def run_case(workload: str, folder: Path, case: dict, env: dict) -> dict:
    """One engine in a subprocess (a fresh process per engine: vLLM holds its engine process and
    memory until the interpreter exits)."""
    run = subprocess.run([sys.executable, __file__, workload, "--case", json.dumps({"folder": str(folder), **case})],
                         env=env, capture_output=True, text=True)
    log = run.stdout + run.stderr
    result = re.search(r"^RESULT (.*)$", log, re.M)
    if result is None:
        raise RuntimeError(f"{workload} {case} on {folder.name} failed:\n{log[-4000:]}")
    return json.loads(result.group(1))


def variants(args: argparse.Namespace) -> list[dict]:
    """The cases each model runs, in order."""
    if args.workload == "contexts":
        return [{"context": c, "requests": args.requests, "decode_steps": args.decode_steps} for c in args.contexts]
    if args.workload == "shared-prefix":
        new_tokens = 16 if args.new_tokens is None else args.new_tokens
        runs = [(False, 0), (True, 0)] + ([(True, args.speculative_tokens)] if args.speculative_tokens else [])
        return [{"prefix": args.prefix, "suffix": args.suffix, "requests": args.requests, "caching": caching,
                 "new_tokens": new_tokens, "drafts": drafts} for caching, drafts in runs]
    if args.workload == "copy":
        new_tokens = 256 if args.new_tokens is None else args.new_tokens
        return [{"passage": args.passage, "requests": args.requests, "new_tokens": new_tokens, "drafts": drafts}
                for drafts in (0, args.speculative_tokens or 3)]
    raise ValueError(f"unknown workload {args.workload!r}")


def median_rows(runs: list[dict], keys: tuple[str, ...]) -> dict:
    """One row from the rounds of a (model, case): the median of each timing in ``keys``."""
    row = dict(runs[0])
    for key in keys:
        row[key] = statistics.median(r[key] for r in runs)
    row["rounds"] = len(runs)
    return row


TIMINGS = {"contexts": ("ttft_median_s", "ttft_last_s", "decode_tokens_per_s"),
           "shared-prefix": ("ttft_median_s", "ttft_last_s", "decode_tokens_per_s"), "copy": ("decode_tokens_per_s",)}


def ratios(workload: str, rows: list[dict], rounds: list[list[dict]]) -> None:
    """Each row's ratios to Llama's row of the same case, taken round by round (medians)."""
    def same_case(a: dict, b: dict) -> bool:
        return a["case"] == b["case"] and a["model"] != b["model"]

    for row, row_rounds in zip(rows, rounds):
        llama_index = next((i for i, r in enumerate(rows) if r["model"] == "llama" and same_case(row, r)), None)
        if llama_index is None and row["model"] != "llama":
            continue
        llama_rounds = rounds[llama_index] if llama_index is not None else row_rounds
        for key in TIMINGS[workload]:
            row[f"{key}_vs_llama"] = statistics.median(a[key] / b[key] for a, b in zip(row_rounds, llama_rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=sorted(CASES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=2048, help="shared-prefix: tokens every prompt shares")
    parser.add_argument("--suffix", type=int, default=64, help="shared-prefix: distinct tokens after the prefix")
    parser.add_argument("--passage", type=int, default=256, help="copy: tokens of the passage each prompt repeats")
    parser.add_argument("--new-tokens", type=int, help="copy, shared-prefix: greedy tokens per request (256, 16)")
    parser.add_argument("--speculative-tokens", type=int, help="copy: n-gram draft tokens per step (3); shared-prefix: "
                        "also run with this many beside prefix caching")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=1, help="repeat every (model, case) in turn")
    parser.add_argument("--kv-space", type=int, default=6, help="VLLM_CPU_KVCACHE_SPACE, GiB, every engine")
    parser.add_argument("--baseline-src", type=Path, help="also run the Trellis models with trellis_lm imported from "
                        "this folder (another checkout's src/), as '<model>@baseline': before and after in one run")
    parser.add_argument("--cpu-time", action="store_true", help="time in CPU seconds of the engine's process (one "
                        "core) instead of wall seconds: for a machine shared with other work")
    parser.add_argument("--core", type=int, default=0, help="with --cpu-time: the core the engines run on (two runs "
                        "side by side each take their own)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="also run the Trellis models saved with compile_decode=True (their single-token and draft "
                             "rows through torch.compile; the first steps compile)")
    parser.add_argument("--op-backend", help="also run the Trellis models saved with this op_backend (e.g. compiled: "
                        "their prefills' substitutions compiled, in the warm-up request), named +op-<name>; with "
                        "--compile-decode, saved with compile_decode=True too")
    parser.add_argument("--embedding-scale", type=float, default=1.0,
                        help="every model's embeddings times this (copy: 30 makes every random model's greedy text "
                             "repeat itself, as the tests' copying checkpoints do, so drafts come on most steps)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="every engine's dtype: float64 tells float32's rounding from a served path's error where "
                             "tokens differ (models without attention layers: vLLM's CPU attention takes no float64)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one engine's case (the subprocess's side)
    args = parser.parse_args()
    if args.case:
        case = json.loads(args.case)
        print("RESULT " + json.dumps(CASES[args.workload](**case)), flush=True)
        return

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_space), DTYPE: args.dtype}
    if args.cpu_time:  # the engine in the case's own process, on one core, one thread
        # NUMBA_NUM_THREADS: vLLM's n-gram drafter runs numba's parallel loop on one thread, but numba
        # starts a pool of one thread per core, whose idle threads spun on the engine's core: every
        # engine with drafts measured 2-100x its CPU seconds (the process's CPU time counts them).
        env.update({CPU_TIME: "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": str(args.core),
                    "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"})
    cases = variants(args)
    results: dict[tuple[str, int], list[dict]] = {}
    with tempfile.TemporaryDirectory() as work:
        folders = {}
        for kind in args.models:
            folders[kind] = Path(work) / kind
            save(kind, folders[kind], embedding_scale=args.embedding_scale)
        engines = [(kind, kind, folders[kind], env) for kind in args.models]
        if args.baseline_src:  # the Trellis models again, on the baseline's trellis_lm
            baseline = {**env, "PYTHONPATH": os.pathsep.join([str(args.baseline_src.resolve()), env.get("PYTHONPATH", "")])}
            engines += [(f"{kind}@baseline", kind, folders[kind], baseline) for kind in args.models if kind != "llama"]
        # The Trellis models again, saved with other settings: --compile-decode, --op-backend.
        saved_with = {"compiled": {"compile_decode": True}} if args.compile_decode else {}
        if args.op_backend:  # with --compile-decode too: what a server compiling both would run
            saved_with[f"op-{args.op_backend}"] = {"op_backend": args.op_backend, "compile_decode": args.compile_decode}
        for suffix, settings in saved_with.items():
            for kind in args.models:
                if kind != "llama":
                    save(kind, Path(work) / f"{kind}+{suffix}", embedding_scale=args.embedding_scale, **settings)
                    engines.append((f"{kind}+{suffix}", kind, Path(work) / f"{kind}+{suffix}", env))
        for round_ in range(args.rounds):
            for i, case in enumerate(cases):
                for name, kind, folder, engine_env in engines:
                    result = run_case(args.workload, folder, case, engine_env)
                    if args.workload == "contexts" and name == kind:  # this checkout's layouts, not a baseline's
                        held = state_bytes(kind, folders[kind], case["context"])
                        result.update(bytes_per_sequence=held, sequences_that_fit=args.kv_space * 2**30 // held)
                    results.setdefault((name, i), []).append({"model": name, "case": case, **result})
                    print(json.dumps({k: v for k, v in results[(name, i)][-1].items() if k != "tokens"}), flush=True)
    order = [name for name, *_ in sorted(engines, key=lambda e: (MODELS.index(e[1]), e[0] != e[1]))]
    keys = sorted(results, key=lambda k: (k[1], order.index(k[0])))
    rows = [median_rows(results[k], TIMINGS[args.workload]) for k in keys]
    ratios(args.workload, rows, [results[k] for k in keys])
    def same_model(row: dict, **case: Any) -> int:
        """The index of ``row``'s model's row whose case is ``row``'s with ``case``'s fields."""
        return next(i for i, r in enumerate(rows) if r["model"] == row["model"] and r["case"] == {**row["case"], **case})

    for key, row in zip(keys, rows):
        if args.workload == "shared-prefix" and row["case"]["caching"]:  # against the same model without caching
            row["tokens_equal_without_caching"] = row["tokens"] == rows[same_model(row, caching=False, drafts=0)]["tokens"]
        if row["case"].get("drafts"):  # with drafts against the same model without, round by round
            plain = same_model(row, drafts=0)
            row["speedup_vs_no_drafts"] = statistics.median(
                a["decode_tokens_per_s"] / b["decode_tokens_per_s"] for a, b in zip(results[key], results[keys[plain]]))
            row["tokens_equal_without_drafts"] = row["tokens"] == rows[plain]["tokens"]
    print_table(args.workload, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        kept = [{k: v for k, v in row.items() if k != "tokens"} for row in rows]
        args.json.write_text(json.dumps({"date": str(date.today()), "machine": platform.processor() or platform.machine(),
                                         "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items()
                                                                          if k not in ("json", "case")},
                                         "rows": kept}, indent=1, default=str))


def print_table(workload: str, rows: list[dict]) -> None:
    nan = float("nan")
    if workload == "contexts":
        print(f"\n{'model':16} {'context':>7} {'TTFT med s':>10} {'last s':>7} {'x Llama':>7} {'decode tok/s':>12} "
              f"{'x Llama':>7} {'MiB/seq':>8} {'seqs fit':>9}")
        for r in rows:
            print(f"{r['model']:16} {r['case']['context']:7d} {r['ttft_median_s']:10.2f} {r['ttft_last_s']:7.2f} "
                  f"{r.get('ttft_last_s_vs_llama', nan):7.2f} {r['decode_tokens_per_s']:12.1f} "
                  f"{r.get('decode_tokens_per_s_vs_llama', nan):7.2f} {r.get('bytes_per_sequence', nan) / 2**20:8.2f} "
                  f"{r.get('sequences_that_fit', -1):9d}")
    elif workload == "shared-prefix":
        print(f"\n{'model':16} {'caching':>7} {'drafts':>6} {'hit share':>9} {'TTFT med s':>10} {'last s':>7} "
              f"{'x Llama':>7} {'decode tok/s':>12} {'x Llama':>7} {'x no drafts':>11} {'same tokens':>11}")
        for r in rows:
            same = r.get("tokens_equal_without_caching", "")
            print(f"{r['model']:16} {str(r['case']['caching']):>7} {r['case']['drafts']:6d} {r['hit_share']:9.3f} "
                  f"{r['ttft_median_s']:10.2f} {r['ttft_last_s']:7.2f} {r.get('ttft_last_s_vs_llama', nan):7.2f} "
                  f"{r['decode_tokens_per_s']:12.1f} {r.get('decode_tokens_per_s_vs_llama', nan):7.2f} "
                  f"{r.get('speedup_vs_no_drafts', nan):11.2f} {str(same):>11}")
    elif workload == "copy":
        print(f"\n{'model':16} {'drafts':>6} {'acceptance':>10} {'tok/step':>8} {'decode tok/s':>12} {'x Llama':>7} "
              f"{'x no drafts':>11} {'same tokens':>11}")
        for r in rows:
            acceptance = "" if r["acceptance"] is None else f"{r['acceptance']:.3f}"
            print(f"{r['model']:16} {r['case']['drafts']:6d} {acceptance:>10} {r['tokens_per_step']:8.2f} "
                  f"{r['decode_tokens_per_s']:12.1f} "
                  f"{r.get('decode_tokens_per_s_vs_llama', nan):7.2f} {r.get('speedup_vs_no_drafts', nan):11.2f} "
                  f"{str(r.get('tokens_equal_without_drafts', '')):>11}")


if __name__ == "__main__":
    main()
