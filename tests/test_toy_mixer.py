"""A mixer kind defined here alone (op, state, cache entry, mixer) runs through the model, the
cache (save, load, crop), the model card and generate: each kind is one place, and nothing in
the package names the kinds it knows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
from torch import nn

from tiny_models import VOCAB, random_tokens
from trellis_lm import TrellisCache, TrellisConfig, TrellisForCausalLM
from trellis_lm.cache_entries import LAYER_CACHES, MemoryLayerCache
from trellis_lm.cache_layout import ROWS, TensorSpec
from trellis_lm.mixers import MIXERS, MemoryMixer
from trellis_lm.ops import OpState

KIND = "toy-linear"


@dataclass
class ToyState(OpState):
    """Un-normalised linear attention's sum of ``k v^T``: ``memory [N, H, d, d]``."""

    memory: torch.Tensor


def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, initial_state: ToyState,
                  output_final_state: bool, cu_seqlens: Optional[torch.Tensor], **unused: Any
                  ) -> tuple[torch.Tensor, Optional[ToyState]]:
    """``o_t = q_t S_t``, ``S_t = S_{t-1} + k_t v_t^T`` per sequence (rows, or the packed
    sequences of ``cu_seqlens``), token by token. ``[B, T, H, d]`` in and out."""
    bounds = [(row, 0, q.shape[1]) for row in range(q.shape[0])] if cu_seqlens is None else \
        [(0, int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    o, finals = torch.zeros_like(v), []
    for seq, (row, start, end) in enumerate(bounds):
        memory = initial_state.memory[seq]
        for t in range(start, end):
            memory = memory + k[row, t, :, :, None] * v[row, t, :, None, :]
            o[row, t] = torch.einsum("hd,hde->he", q[row, t], memory)
        finals.append(memory)
    return o, ToyState(torch.stack(finals)) if output_final_state else None


def toy_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: ToyState, **unused: Any
             ) -> tuple[torch.Tensor, ToyState]:
    return toy_attention(q, k, v, state, True, None)


@pytest.fixture(scope="module")
def toy_kind():
    """Defines the kind (its classes register themselves), and takes it out of the registries
    afterwards."""

    class ToyLayerCache(MemoryLayerCache):
        state_class = ToyState

    class ToyMixer(MemoryMixer):
        kind = KIND
        display_name = "toy linear attention"
        cache_class = ToyLayerCache
        state_class = ToyState
        op = staticmethod(toy_attention)
        step_op = staticmethod(toy_step)

        def __init__(self, config: Any, layer_idx: int) -> None:
            super().__init__(config, layer_idx)
            width = config.num_heads * config.head_dim
            self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
            self._build_output()

        @classmethod
        def describe_cache(cls, config: Any) -> str:
            return f"a {config.head_dim} x {config.head_dim} sum of key-value products per head"

        @classmethod
        def state_layout(cls, config: Any) -> dict[str, TensorSpec]:
            return {"memory": TensorSpec((ROWS, config.num_heads, config.head_dim, config.head_dim))}

        def op_inputs(self, proj, q, k, valid=None, state=None):
            shape = (*proj.x.shape[:2], self.config.num_heads, self.config.head_dim)
            return q.view(shape), k.view(shape) / self.config.head_dim, proj["v_proj"].view(shape)

        def fresh_state(self, rows: int) -> ToyState:
            heads, dim = self.config.num_heads, self.config.head_dim
            return ToyState(self.q_proj.weight.new_zeros(rows, heads, dim, dim))

        def op_settings(self) -> dict[str, Any]:
            return {}

    yield ToyMixer
    del MIXERS[KIND], LAYER_CACHES[KIND]


def toy_model(seed: int = 0) -> TrellisForCausalLM:
    config = TrellisConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=3, num_heads=2, head_dim=6,
                           intermediate_size=40, num_slots=5, chunk_size=4, mixer_types=[KIND, "trellis", KIND])
    torch.manual_seed(seed)
    return TrellisForCausalLM(config).eval()


def feed(model: TrellisForCausalLM, ids: torch.Tensor, pieces: list[int], cache: TrellisCache) -> torch.Tensor:
    logits, start = [], 0
    for size in pieces:
        logits.append(model(ids[:, start : start + size], cache=cache).logits)
        start += size
    return torch.cat(logits, dim=1)


@pytest.mark.usefixtures("toy_kind")
def test_a_kind_defined_outside_the_package_runs_through_the_model(tmp_path):
    model = toy_model()
    assert [type(layer.self_attn).__name__ for layer in model.model.layers] == ["ToyMixer", "TrellisMixer", "ToyMixer"]
    ids = random_tokens(2, 11, seed=1)
    with torch.no_grad():
        whole = model(ids).logits
        # Prefill, then single-token steps through one cache (the toy's step op), as one call.
        cache = TrellisCache(model.config)
        torch.testing.assert_close(feed(model, ids, [5, 1, 1, 4], cache), whole, rtol=1e-5, atol=1e-5)
        assert cache.kinds == [KIND, "trellis", KIND]

        # The cache file: written, read back against the mixers' declared layouts, continued.
        cache = TrellisCache(model.config)
        feed(model, ids, [7], cache)
        cache.save(tmp_path / "cache.safetensors")
        loaded = TrellisCache.load(tmp_path / "cache.safetensors", config=model.config)
        torch.testing.assert_close(feed(model, ids[:, 7:], [4], loaded), whole[:, 7:], rtol=1e-5, atol=1e-5)

        # Rollback: the toy layers replay through their mixer, as the package's own do.
        cache = TrellisCache(model.config, rollback_window=4)
        feed(model, ids, [7, 1, 1, 1], cache)
        cache.crop(-3)
        torch.testing.assert_close(feed(model, ids[:, 7:], [4], cache), whole[:, 7:], rtol=1e-5, atol=1e-5)

    # generate: greedy tokens with the cache equal those recomputed from scratch each step.
    prompt = ids[:, :5]
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    sequence = prompt
    with torch.no_grad():
        for _ in range(6):
            sequence = torch.cat([sequence, model(sequence).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, sequence)

    # The model card describes the kind in its own words.
    model.save_pretrained(tmp_path / "model")
    card = (tmp_path / "model" / "README.md").read_text()
    assert "2 toy linear attention layers (layers 0, 2) keep a 6 x 6 sum of key-value products per head" in card


@pytest.mark.usefixtures("toy_kind")
def test_a_kind_is_defined_once():
    # Another class under a registered kind (not the same definition imported again) is refused.
    with pytest.raises(ValueError, match=f"mixer kind '{KIND}' is already"):
        class Impostor(MIXERS[KIND]):
            kind = KIND


# Where the package's name "trellis" (TrellisConfig.model_type, which the Trellis kind shares)
# is written as the model type or library name, not as a layer kind.
MODEL_TYPE_NAME_IN = {
    "configuration_trellis.py",  # model_type
    "eval/harness.py",  # the lm-eval model name
    "cli.py",  # --model-type trellis|hf
    "model_card_trellis.py",  # the card's tag
    "remote_code.py",  # the flat module prefix
}


def test_no_kind_is_named_outside_the_mixers():
    # Every kind's knowledge lives in its mixer: outside mixers/ no code (docstrings aside)
    # writes a kind's name, so adding a kind touches no other module.
    import ast
    from pathlib import Path

    import trellis_lm

    root = Path(trellis_lm.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("mixers/"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in MIXERS and id(node) not in docstrings:
                if node.value == TrellisConfig.model_type and relative in MODEL_TYPE_NAME_IN:
                    continue
                found.append(f"{relative}:{node.lineno} {node.value!r}")
    assert not found, found
