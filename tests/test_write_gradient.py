"""``TrellisConfig.write_gradient`` at the model level: which function a config computes, what an
old checkpoint or cache file means, and the exact form's independence of the chunk size."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import random_tokens, tiny_config, tiny_model
from trellis_lm import TrellisCache, TrellisConfig, TrellisForCausalLM
from trellis_lm.cache_trellis import CACHE_ARG


def test_new_configs_are_exact_and_saved_configs_say_so(tmp_path):
    config = tiny_config()
    assert config.write_gradient == "exact"
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["write_gradient"] == "exact"
    assert TrellisConfig.from_pretrained(tmp_path).write_gradient == "exact"
    with pytest.raises(ValueError, match="TrellisConfig.write_gradient must be one of"):
        tiny_config(write_gradient="stale")


def test_a_checkpoint_saved_before_the_field_is_anchored(tmp_path):
    """Every checkpoint saved before ``write_gradient`` existed computes the anchored function:
    its config.json, which lacks the field, loads as that (not as the default of new configs),
    and gives the logits the anchored model gave; a keyword argument still overrides."""
    model = tiny_model(seed=1, write_gradient="anchored")
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    saved = json.loads(path.read_text())
    del saved["write_gradient"]
    path.write_text(json.dumps(saved))
    ids = random_tokens(2, 11)
    loaded = TrellisForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.write_gradient == "anchored"
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert TrellisConfig.from_pretrained(tmp_path, write_gradient="exact").write_gradient == "exact"
    # The anchored and exact functions differ here (chunks of 4, 11 tokens): the check can fail.
    exact = TrellisForCausalLM.from_pretrained(tmp_path, write_gradient="exact").eval()
    assert (exact(ids).logits - model(ids).logits).abs().max() > 1e-4


@pytest.mark.parametrize("write_gradient", ["exact", "anchored"])
def test_prefill_then_decode_equals_one_forward(write_gradient):
    """Token by token through the cache (the decode step, crossing chunk starts) equals one
    forward over the whole sequence, for both functions."""
    model = tiny_model(seed=2, dtype=torch.float64, write_gradient=write_gradient)
    ids = random_tokens(2, 13, seed=3)
    full = model(ids).logits
    out = model(ids[:, :5], use_cache=True)
    logits, cache = [out.logits], getattr(out, CACHE_ARG)
    for t in range(5, 13):
        out = model(ids[:, t : t + 1], use_cache=True, **{CACHE_ARG: cache})
        logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-9, atol=1e-9)


def test_exact_models_do_not_depend_on_the_chunk_size():
    """The same weights at C = 1, 3, 4 and 16 give the same logits (C only lays the tokens out).
    A cache still records its model's C (its offsets count within C's chunks), and a model at
    another C refuses it rather than continue from offsets laid out for another chunk."""
    model = tiny_model(seed=4, dtype=torch.float64)
    ids = random_tokens(2, 23, seed=5)
    expected = model(ids).logits
    for chunk in (1, 3, 16):
        model.config.chunk_size = chunk
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-9, atol=1e-9)
    cache = getattr(model(ids, use_cache=True), CACHE_ARG)  # made at C = 16
    model.config.chunk_size = 4
    with pytest.raises(ValueError, match="made by a model with chunk_size=16, this model has chunk_size=4"):
        model(ids[:, :1], use_cache=True, **{CACHE_ARG: cache})
    model.config.write_gradient = "anchored"
    assert (model(ids).logits - expected).abs().max() > 1e-4  # the anchored function at C = 4 differs


def test_a_cache_records_which_function_made_it(tmp_path):
    """A cache made by an exact model is refused by an anchored one (naming the field) and the
    reverse; a file whose signature predates the field is an anchored model's."""
    exact, anchored = tiny_model(seed=6), tiny_model(seed=6, write_gradient="anchored")
    ids = random_tokens(1, 6)
    cache = getattr(exact(ids, use_cache=True), CACHE_ARG)
    with pytest.raises(ValueError, match="write_gradient='exact'"):
        anchored(ids[:, :1], use_cache=True, **{CACHE_ARG: cache})
    old = getattr(anchored(ids, use_cache=True), CACHE_ARG)
    old.signature = {k: v for k, v in old.signature.items() if k != "write_gradient"}
    old.save(tmp_path / "old.safetensors")
    loaded = TrellisCache.load(tmp_path / "old.safetensors", config=anchored.config)
    anchored(ids[:, :1], use_cache=True, **{CACHE_ARG: loaded})  # accepted: the file's model was anchored
    with pytest.raises(ValueError, match="write_gradient=.anchored."):
        exact(ids[:, :1], use_cache=True, **{CACHE_ARG: TrellisCache.load(tmp_path / "old.safetensors")})
