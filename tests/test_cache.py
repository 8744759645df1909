"""TrellisCache: fixed size, token count, row operations, saving and resuming."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tiny_models import left_pad, random_tokens, tiny_model
from transformers_names import cache_of
from trellis_lm import TrellisCache

TOL = dict(rtol=1e-4, atol=1e-4)


def prefilled(model, ids, mask=None) -> TrellisCache:
    return cache_of(model(ids, attention_mask=mask, use_cache=True))


def test_size_does_not_depend_on_tokens_seen():
    model = tiny_model()
    ids = random_tokens(2, 200)
    short, long = prefilled(model, ids[:, :10]), prefilled(model, ids)
    assert short.get_seq_length() == 10 and long.get_seq_length() == 200
    assert short.nbytes() == long.nbytes()
    # Per layer and row: two conv tails (3 x H*d) and four [H, M, d] float32 memories, plus the offset.
    config = model.config
    per_row = 2 * 3 * 16 * 4 + 4 * 2 * 6 * 8 * 4 + 8
    assert long.nbytes() == config.num_hidden_layers * 2 * per_row
    # Nothing held is a view into a larger buffer (such as the prefill's projected inputs): the
    # storages behind the cache's tensors (a pair of memories may share one) hold no more bytes
    # than the tensors themselves.
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for layer in long.layers for t in layer.tensors().values()}
    assert sum(storages.values()) <= long.nbytes()
    for _ in range(5):
        model(ids[:, :1], past_key_values=long)
    assert long.nbytes() == short.nbytes() and long.get_seq_length() == 205


def test_seq_length_counts_columns_including_padding():
    model = tiny_model()
    ids, mask = left_pad([random_tokens(1, 6)[0], random_tokens(1, 2)[0]])
    cache = prefilled(model, ids, mask)
    assert cache.get_seq_length() == 6 and cache.batch_size == 2
    assert TrellisCache(["trellis"] * 2).get_seq_length() == 0 and TrellisCache(["trellis"] * 2).batch_size is None


@pytest.mark.parametrize("conv_size", [4, 0])
def test_save_load_then_continue_equals_uninterrupted(tmp_path, conv_size):
    model = tiny_model(seed=1, conv_size=conv_size, chunk_size=3)
    ids, mask = left_pad([random_tokens(1, 12)[0], random_tokens(1, 7, seed=1)[0]])
    expected = model(ids, attention_mask=mask).logits[:, 5:]
    cache = prefilled(model, ids[:, :5], mask[:, :5])
    cache.save(tmp_path / "memory.safetensors")
    del cache
    loaded = TrellisCache.load(tmp_path / "memory.safetensors", device="cpu")
    assert loaded.get_seq_length() == 5 and len(loaded.layers) == 2
    resumed = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=loaded).logits for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(resumed, dim=1)[mask[:, 5:].bool()], expected[mask[:, 5:].bool()], **TOL)


def test_an_empty_cache_saves_and_loads(tmp_path):
    TrellisCache(["trellis"] * 3).save(tmp_path / "empty.safetensors")
    loaded = TrellisCache.load(tmp_path / "empty.safetensors")
    assert len(loaded.layers) == 3 and loaded.nbytes() == 0 and loaded.batch_size is None


def test_load_rejects_other_files(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "weights.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not a Trellis cache"):
        TrellisCache.load(tmp_path / "weights.safetensors")


GOOD_HEADER = {"format": "trellis-cache", "format_version": "2", "layer_kinds": '["trellis"]', "seen_tokens": "3",
               "signature": "null"}


@pytest.mark.parametrize(
    "changes, tensors, match",
    [
        ({"format_version": "1", "num_layers": "2000000"}, {}, r"format version '1'"),
        ({"layer_kinds": None}, {}, r"metadata 'layer_kinds' must be a JSON list"),
        ({"layer_kinds": '["trellis", "mamba"]'}, {}, r"metadata 'layer_kinds' must be a JSON list of layer kinds"),
        ({"layer_kinds": "2000000"}, {}, r"metadata 'layer_kinds'"),
        ({"seen_tokens": "-4"}, {}, r"metadata 'seen_tokens' must be a whole number >= 0"),
        ({"seen_tokens": "many"}, {}, r"metadata 'seen_tokens'"),
        ({"seen_tokens": None}, {}, r"metadata 'seen_tokens'"),
        ({"signature": "[1]"}, {}, r"metadata 'signature' must be a JSON object or null"),
        ({}, {"m_k": torch.zeros(1)}, r"tensor 'm_k' is not 'layers.<index < 1>.<name>'"),
        ({}, {"layers.-1.m_k": torch.zeros(1)}, r"tensor 'layers.-1.m_k'"),
        ({}, {"layers.1.m_k": torch.zeros(1)}, r"tensor 'layers.1.m_k'"),
        ({}, {"layers.0.m_k": torch.zeros(1)}, r"a trellis layer's state needs tensors"),
    ],
)
def test_load_checks_the_header_before_allocating(tmp_path, changes, tensors, match):
    header = {key: value for key, value in {**GOOD_HEADER, **changes}.items() if value is not None}
    save_file(tensors, tmp_path / "bad.safetensors", metadata=header)
    with pytest.raises(ValueError, match=match):
        TrellisCache.load(tmp_path / "bad.safetensors")


@pytest.mark.parametrize(
    "field, value",
    [("compress_fn", "l2norm"), ("mix_fn", "ln_silu"), ("chunk_size", 2), ("hidden_size", 32), ("num_heads", 4),
     ("head_dim", 6), ("conv_size", 2), ("use_forget_gate", False)],
)
def test_a_cache_remembers_the_model_that_made_it(tmp_path, field, value):
    # Same tensor shapes or not, a cache from a model with another layer function is refused by name.
    maker = tiny_model(hidden_size=48) if field == "hidden_size" else tiny_model()
    cache = prefilled(maker, random_tokens(1, 5))
    other = tiny_model(**{field: value})
    with pytest.raises(ValueError, match=f"made by a model with {field}="):
        other(random_tokens(1, 1), past_key_values=cache)
    cache.save(tmp_path / "cache.safetensors")
    with pytest.raises(ValueError, match=f"made by a model with {field}="):
        TrellisCache.load(tmp_path / "cache.safetensors", config=other.config)


def test_row_operations_act_like_running_the_rows():
    model = tiny_model(seed=2)
    ids = random_tokens(3, 6)
    nxt = random_tokens(3, 1, seed=5)

    def next_logits(cache, rows):
        return model(nxt[rows], past_key_values=cache).logits

    expected = next_logits(prefilled(model, ids), [0, 1, 2])
    reordered = prefilled(model, ids)
    reordered.reorder_cache(torch.tensor([2, 2, 0]))
    torch.testing.assert_close(next_logits(reordered, [2, 2, 0]), expected[[2, 2, 0]])
    selected = prefilled(model, ids)
    selected.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(next_logits(selected, [1]), expected[[1]])
    repeated = prefilled(model, ids)
    repeated.batch_repeat_interleave(2)
    torch.testing.assert_close(next_logits(repeated, [0, 0, 1, 1, 2, 2]), expected[[0, 0, 1, 1, 2, 2]])


def test_reset_and_what_the_cache_cannot_do():
    model = tiny_model()
    cache = prefilled(model, random_tokens(2, 5))
    # Without a rollback window a cache keeps nothing to roll back (tests/test_rollback.py has the rest).
    assert cache.is_compileable is False and cache.is_croppable is False
    with pytest.raises(ValueError, match="rollback_window = 0; 0 keeps nothing to roll back"):
        cache.crop(-1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    fresh = model(random_tokens(2, 3))
    torch.testing.assert_close(model(random_tokens(2, 3), past_key_values=cache).logits, fresh.logits)


def test_the_model_checks_the_cache_it_is_given():
    model = tiny_model()
    cache = prefilled(model, random_tokens(2, 4))
    with pytest.raises(ValueError, match="holds 2 rows, the input 3"):
        model(random_tokens(3, 1), past_key_values=cache)
    with pytest.raises(ValueError, match=r"made for layers \['trellis', 'trellis', 'trellis'\], the model has"):
        model(random_tokens(2, 1), past_key_values=TrellisCache(["trellis"] * 3))
