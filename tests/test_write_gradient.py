"""``TrellisConfig.write_gradient`` at the model level: which function a config computes, what an
old checkpoint or cache file means, and the exact form's independence of the chunk size."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import random_tokens, tiny_config, tiny_model
from trellis_lm import TrellisCache, TrellisConfig, TrellisForCausalLM
from trellis_lm.cache_trellis import CACHE_ARG
from trellis_lm.remote_code import AUTO_MAP


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


def _legacy_checkpoint(folder, **overrides):
    """An anchored model saved with a config.json that lacks every field with a legacy value (as
    checkpoints saved before those fields existed), and that model."""
    model = tiny_model(seed=7, write_gradient="anchored", **overrides)
    model.save_pretrained(folder)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    assert set(TrellisConfig.legacy_values()) <= set(saved)
    path.write_text(json.dumps({k: v for k, v in saved.items() if k not in TrellisConfig.legacy_values()}))
    return model


def _remote_config_class(folder):
    """The configuration class of ``folder``'s own code (``trust_remote_code``), not this package's."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    remote = get_class_from_dynamic_module(AUTO_MAP["AutoConfig"], folder)
    assert remote is not TrellisConfig and remote.__name__ == "TrellisConfig"
    return remote


READERS = {
    "from_json_file": lambda folder: TrellisConfig.from_json_file(folder / "config.json"),
    "from_dict": lambda folder: TrellisConfig.from_dict(json.loads((folder / "config.json").read_text())),
    "from_pretrained": lambda folder: TrellisConfig.from_pretrained(folder),
    "AutoConfig": lambda folder: __import__("transformers").AutoConfig.from_pretrained(folder),
    "remote from_pretrained": lambda folder: _remote_config_class(folder).from_pretrained(folder),
    "remote from_json_file": lambda folder: _remote_config_class(folder).from_json_file(folder / "config.json"),
    "remote from_dict": lambda folder: _remote_config_class(folder).from_dict(
        json.loads((folder / "config.json").read_text())),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_of_a_saved_config_applies_the_legacy_rule(tmp_path, monkeypatch, reader):
    """Issue 72: ``from_json_file`` gave ``"exact"`` for a config.json saved before the field (a
    model built from it computed another function) while ``from_pretrained`` gave ``"anchored"``.
    Every way to read a saved config, the checkpoint's own code too, gives what the model computed
    with; a config.json that holds the field keeps its value."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    model = _legacy_checkpoint(tmp_path / "old", schedule="kvm-hybrid")
    config = READERS[reader](tmp_path / "old")
    assert {name: getattr(config, name) for name in TrellisConfig.legacy_values()} == TrellisConfig.legacy_values()
    ids = random_tokens(2, 11)
    rebuilt = TrellisForCausalLM(TrellisConfig.from_dict(config.to_dict()))
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    tiny_model(seed=7, schedule="kvm-hybrid").save_pretrained(tmp_path / "new")  # holds write_gradient="exact"
    assert READERS[reader](tmp_path / "new").write_gradient == "exact"


def test_files_whose_signature_predates_the_field_are_the_legacy_model_s(tmp_path):
    """A cache file read without a model (its recorded model then binds it) and a file of carried
    training states both read a signature without ``write_gradient`` as an anchored model's."""
    from trellis_lm.state_passing import StatePassing

    exact, anchored = tiny_model(seed=6, schedule="hybrid"), tiny_model(seed=6, schedule="hybrid", write_gradient="anchored")
    ids = random_tokens(1, 6)
    cache = getattr(anchored(ids, use_cache=True), CACHE_ARG)
    cache.signature = {k: v for k, v in cache.signature.items() if k != "write_gradient"}
    cache.save(tmp_path / "old.safetensors")
    loaded = TrellisCache.load(tmp_path / "old.safetensors")
    anchored(ids[:, :1], use_cache=True, **{CACHE_ARG: loaded})
    loaded.save(tmp_path / "again.safetensors")  # what it binds to is recorded whole
    with pytest.raises(ValueError, match="write_gradient='anchored', this model has write_gradient='exact'"):
        TrellisCache.load(tmp_path / "again.safetensors", config=exact.config)

    passing = StatePassing(probability=1.0)
    with passing.attached(anchored.train()):
        anchored(random_tokens(2, 6))
    passing.signature = {k: v for k, v in passing.signature.items() if k != "write_gradient"}
    passing.save(tmp_path / "states.safetensors")
    StatePassing().load(tmp_path / "states.safetensors", anchored)
    with pytest.raises(ValueError, match="write_gradient='anchored', this model has write_gradient='exact'"):
        StatePassing().load(tmp_path / "states.safetensors", exact)
