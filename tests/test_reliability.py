"""Inputs that used to lose a user's data or silently change an answer (issue 34): each test
here failed on the code before the fix."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tiny_models import SCHEDULES, random_tokens, tiny_config, tiny_model
from transformers_names import cache_of
from trellis_lm import TrellisCache

EXACT = dict(rtol=0, atol=0)


def snapshot(cache: TrellisCache) -> dict:
    """Every value a cache holds, cloned: what an all-or-nothing update must leave as it was."""
    return {
        "seen": cache.seen_tokens,
        "layers": [{name: t.clone() for name, t in layer.tensors().items()} for layer in cache.layers],
        "calls": [(c.length, sorted(c.layers)) for c in cache._calls],
        "window": cache.rollback_window,
    }


def assert_unchanged(cache: TrellisCache, before: dict) -> None:
    after = snapshot(cache)
    assert after["seen"] == before["seen"] and after["calls"] == before["calls"] and after["window"] == before["window"]
    for old, new in zip(before["layers"], after["layers"]):
        assert old.keys() == new.keys()
        for name in old:
            torch.testing.assert_close(new[name], old[name], **EXACT)


class Boom(Exception):
    pass


def fail_in_layer(model, index: int, error: type[BaseException] = Boom):
    """Make block ``index`` raise after its mixer has run (and updated its cache entry)."""

    def hook(*_):
        raise error(f"failure in layer {index}")

    return model.model.layers[index].mlp.register_forward_pre_hook(hook)


# ----------------------------------------------------------------------------- item 2


def test_generate_refuses_a_cache_with_use_cache_false():
    model = tiny_model()
    ids = random_tokens(1, 5)
    cache = TrellisCache(model.config)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache, use_cache=False)
    assert cache.get_seq_length() == 0
    # Without a cache, use_cache=False still gives greedy's tokens.
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False), greedy)


# ----------------------------------------------------------------------------- items 3 and 4


def cache_file(tmp_path, schedule: str, length: int = 5):
    model = tiny_model(schedule=schedule)
    cache = cache_of(model(random_tokens(2, length), use_cache=True))
    path = tmp_path / "cache.safetensors"
    cache.save(path)
    return model, path


def rewrite(path, change_tensors=None, change_metadata=None):
    with safe_open(str(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata()
    if change_tensors:
        change_tensors(tensors)
    if change_metadata:
        change_metadata(metadata)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_cache_file_missing_a_layer_s_tensors_is_refused(tmp_path, schedule):
    model, path = cache_file(tmp_path, schedule)
    last = len(model.config.layer_kinds) - 1
    rewrite(path, lambda t: [t.pop(k) for k in list(t) if k.startswith(f"layers.{last}.")])
    with pytest.raises(ValueError, match=rf"layer {last} \({model.config.layer_kinds[last]}\) holds no state"):
        TrellisCache.load(path)
    with pytest.raises(ValueError, match=rf"layer {last}"):
        TrellisCache.load(path, config=model.config)


@pytest.mark.parametrize("schedule", ["trellis", "kvm", "hybrid"])
def test_a_cache_file_with_a_missing_conv_tail_or_unknown_key_is_refused(tmp_path, schedule):
    model, path = cache_file(tmp_path, schedule)
    first = model.config.layer_kinds[0]
    if first != "kvm":
        rewrite(path, lambda t: t.pop("layers.0.k_tail"))
        with pytest.raises(ValueError, match=r"layer 0 \(trellis\).*k_tail"):
            TrellisCache.load(path, config=model.config)
        _, path = cache_file(tmp_path, schedule)
    rewrite(path, lambda t: t.update({"layers.0.extra": torch.zeros(1)}))
    with pytest.raises(ValueError, match=r"layer 0 .*unknown tensor 'extra'"):
        TrellisCache.load(path)


@pytest.mark.parametrize(
    "schedule, name, shape_change",
    [
        ("trellis", "layers.0.q_tail", lambda t: t[:, :-1]),  # a conv of another width
        ("trellis", "layers.1.m_k", lambda t: t[:, :, :-1]),  # fewer slots
        ("trellis", "layers.0.offset", lambda t: t[None]),
        ("lattice", "layers.0.memory", lambda t: t[..., :-1]),
        ("kvm", "layers.0.window_k", lambda t: torch.cat([t, t, t, t], dim=2)),  # past the window's bound
        ("hybrid", "layers.2.keys", lambda t: t[:, :1]),  # fewer key-value heads
        ("hybrid", "layers.2.visible", lambda t: t[:1]),  # rows disagree
    ],
)
def test_a_cache_file_whose_shapes_do_not_fit_the_model_is_refused(tmp_path, schedule, name, shape_change):
    model, path = cache_file(tmp_path, schedule, length=9)
    rewrite(path, lambda t: t.update({name: shape_change(t[name]).contiguous()}))
    short = name.split(".")[-1]
    with pytest.raises(ValueError, match=rf"layer {name.split('.')[1]} .*'{short}'"):
        loaded = TrellisCache.load(path, config=model.config)
        model(random_tokens(2, 1), cache=loaded)  # (fails deep inside today, or runs)


@pytest.mark.parametrize("schedule", ["trellis", "hybrid", "kvm"])
def test_seen_tokens_must_agree_with_the_state(tmp_path, schedule):
    model, path = cache_file(tmp_path, schedule)
    rewrite(path, change_metadata=lambda m: m.update(seen_tokens="0"))
    with pytest.raises(ValueError, match="seen_tokens"):
        TrellisCache.load(path, config=model.config)
    model, path = cache_file(tmp_path, schedule)
    rewrite(path, change_metadata=lambda m: m.update(seen_tokens="4"))  # the cache saw 5
    if schedule == "trellis":  # offsets modulo the chunk cannot tell 4 from 5 with padding; counters can't lie
        rewrite(path, lambda t: t.update({"layers.0.offset": torch.full_like(t["layers.0.offset"], 99)}))
    with pytest.raises(ValueError, match="seen_tokens|offset"):
        TrellisCache.load(path, config=model.config)


def test_a_cache_binds_to_the_first_model_that_uses_it(tmp_path):
    first, other = tiny_model(), tiny_model(chunk_size=3)
    cache = TrellisCache(["trellis"] * 2)
    first(random_tokens(1, 4), cache=cache)
    with pytest.raises(ValueError, match="made by a model with chunk_size=4"):
        other(random_tokens(1, 1), cache=cache)
    compress = tiny_model(compress_fn="l2norm")
    with pytest.raises(ValueError, match="made by a model with compress_fn="):
        compress(random_tokens(1, 1), cache=cache)
    # A file without a signature is refused where a config is given.
    _, path = cache_file(tmp_path, "trellis")
    rewrite(path, change_metadata=lambda m: m.update(signature="null"))
    with pytest.raises(ValueError, match="records no model"):
        TrellisCache.load(path, config=other.config)
    unbound = TrellisCache.load(path)
    first(random_tokens(2, 1), cache=unbound)
    with pytest.raises(ValueError, match="made by a model with chunk_size=4"):
        other(random_tokens(2, 1), cache=unbound)


# Issue 50, item 4: what a tampered file holds is refused without config= too (the file records
# its model, whose sizes bound every tensor), never computed with.
TAMPERED = [
    ("trellis", "layers.0.offset", lambda t: t + 4, r"'offset' holds values in \[5, 5\], allowed: \[0, 3\]"),
    ("trellis", "layers.0.offset", lambda t: t - 2, r"'offset' holds values in \[-1, -1\]"),
    ("trellis", "layers.0.offset", lambda t: t.double(), r"'offset' has dtype F64, the model needs one of \['I64'\]"),
    ("trellis", "layers.1.m_k", lambda t: t.long(), r"'m_k' has dtype I64"),
    ("trellis", "layers.1.m_v", lambda t: t.half(), r"'m_v' has dtype F16, the model needs one of \['F32', 'F64'\]"),
    ("trellis", "layers.0.q_tail", lambda t: t[:, :-1], r"'q_tail' has shape \[2, 2, 16\], the model needs \[rows, 3, 16\]"),
    ("lattice", "layers.1.offset", lambda t: t + 4, r"'offset' holds values in \[5, 5\]"),
    ("lattice", "layers.0.memory", lambda t: t.bfloat16(), r"'memory' has dtype BF16"),
    ("hybrid", "layers.2.positions", lambda t: t - 1, r"'positions' holds \[4, 4\], but the rows' visible columns count"),
    ("hybrid", "layers.2.positions", lambda t: t + 10, r"'positions' holds values in \[15, 15\], allowed: \[0, seen"),
    ("hybrid", "layers.2.keys", lambda t: t[:, :, :-1], r"'keys' has shape \[2, 2, 4, 8\], the model needs \[rows, 2, columns"),
    ("kvm", "layers.0.seen", lambda t: t + 10, r"'seen' holds values in \[15, 15\], allowed: \[0, seen_tokens = 5\]"),
    ("kvm", "layers.1.seen", lambda t: t - 3, r"layer 1 \(kvm\): its counters do not hold together"),
    ("kvm-hybrid", "layers.0.used", lambda t: t + 5, r"'used' holds values in \[8, 8\], allowed: \[0, 4\]"),
    ("kvm-hybrid", "layers.0.window_k", lambda t: t.float().half(), r"'window_k' has dtype F16"),
]


@pytest.mark.parametrize("schedule, key, change, match", TAMPERED, ids=[f"{s}-{k}-{i}" for i, (s, k, _, _) in enumerate(TAMPERED)])
def test_a_tampered_cache_file_is_refused_without_config_too(tmp_path, schedule, key, change, match):
    model, path = cache_file(tmp_path, schedule)
    rewrite(path, lambda t: t.update({key: change(t[key]).contiguous()}))
    with pytest.raises(ValueError, match=match):
        TrellisCache.load(path)
    with pytest.raises(ValueError, match=match.split(",")[0]):
        TrellisCache.load(path, config=model.config)


@pytest.mark.parametrize("tampered, match", [
    (TAMPERED[0], r"layer 0 \(trellis\) tensor 'offset' holds values in \[5, 5\], allowed: \[0, 3\]"),
    (TAMPERED[5], r"layer 0 \(trellis\) tensor 'q_tail' has shape"),
    (TAMPERED[6], r"layer 1 \(lattice\) tensor 'offset' holds values"),
    (TAMPERED[12], r"layer 1 \(kvm\): its counters do not hold together"),
], ids=["trellis-offset", "trellis-tail", "lattice-offset", "kvm-seen"])
def test_a_file_that_records_no_model_is_checked_by_the_first_model_that_uses_it(tmp_path, tampered, match):
    # Without a model to read sizes from, load checks what holds whatever the sizes; the rest
    # is checked when the cache binds, before any layer reads it.
    schedule, key, change, _ = tampered
    model, path = cache_file(tmp_path, schedule)
    rewrite(path, change_metadata=lambda m: m.update(signature="null"))
    ids = torch.cat([random_tokens(2, 5), random_tokens(2, 3, seed=3)], dim=1)  # what cache_file read, then more
    good = TrellisCache.load(path)
    torch.testing.assert_close(model(ids[:, 5:], cache=good).logits, model(ids).logits[:, 5:], rtol=1e-5, atol=1e-5)
    rewrite(path, lambda t: t.update({key: change(t[key]).contiguous()}))
    loaded = TrellisCache.load(path)
    before = snapshot(loaded)
    with pytest.raises(ValueError, match=r"^the cache: " + match):
        model(ids[:, 5:6], cache=loaded)
    assert_unchanged(loaded, before)
    assert loaded.signature is None


def test_a_folder_or_an_impossible_model_is_refused_as_a_cache_file(tmp_path):
    with pytest.raises(ValueError, match="is a folder: expected a cache file written by TrellisCache.save"):
        TrellisCache.load(tmp_path)
    model, path = cache_file(tmp_path, "trellis")
    rewrite(path, change_metadata=lambda m: m.update(signature=m["signature"].replace('"chunk_size": 4', '"chunk_size": 0')))
    with pytest.raises(ValueError, match=r"metadata 'signature' is not a model this code can build: .*chunk_size"):
        TrellisCache.load(path)
    _, path = cache_file(tmp_path, "trellis")
    rewrite(path, change_metadata=lambda m: m.update(layer_kinds='["lattice", "lattice"]'))
    with pytest.raises(ValueError, match=r"'signature' records the layers \['trellis', 'trellis'\], 'layer_kinds'"):
        TrellisCache.load(path)


# ----------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failing_forward_leaves_the_cache_as_it_was(schedule, window):
    model = tiny_model(schedule=schedule, dtype=torch.float64)
    ids = random_tokens(2, 12, seed=1)
    for index in range(len(model.model.layers)):
        cache = TrellisCache(model.config, rollback_window=window)
        model(ids[:, :5], cache=cache)
        before = snapshot(cache)
        # A one-token step, a call within the window and one longer than it (run as two calls).
        for piece in (ids[:, 5:6], ids[:, 5:7], ids[:, 5:12]):
            handle = fail_in_layer(model, index)
            with pytest.raises(Boom):
                model(piece, cache=cache)
            handle.remove()
            assert_unchanged(cache, before)
        torch.testing.assert_close(model(ids[:, 5:], cache=cache).logits, model(ids).logits[:, 5:], rtol=1e-10, atol=1e-10)


def test_an_interrupt_leaves_the_cache_as_it_was():
    model = tiny_model(schedule="hybrid")
    cache = cache_of(model(random_tokens(1, 6), use_cache=True))
    before = snapshot(cache)
    handle = fail_in_layer(model, 2, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        model(random_tokens(1, 3), cache=cache)
    handle.remove()
    assert_unchanged(cache, before)


@pytest.mark.parametrize("schedule", ["trellis", "hybrid", "kvm-hybrid"])
def test_a_failing_generate_leaves_the_cache_after_its_last_good_step(schedule):
    model = tiny_model(schedule=schedule, dtype=torch.float64)
    ids = random_tokens(1, 6)
    greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    steps = []
    cache = TrellisCache(model.config)

    def fail_at_step_4(*_):
        steps.append(1)
        if len(steps) == 4:
            raise Boom("step 4")

    handle = model.model.layers[-1].mlp.register_forward_pre_hook(fail_at_step_4)
    with pytest.raises(Boom):
        model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
    handle.remove()
    # The prefill and two decode steps went through: the cache holds exactly their tokens.
    assert cache.get_seq_length() == 8
    fresh = cache_of(model(greedy[:, :8], use_cache=True))
    for old, new in zip(fresh.layers, cache.layers):
        for name, tensor in old.tensors().items():
            torch.testing.assert_close(new.tensors()[name], tensor, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_failing_crop_leaves_the_cache_as_it_was(schedule):
    model = tiny_model(schedule=schedule)
    memory_layers = [i for i, kind in enumerate(model.config.layer_kinds) if kind != "attention"]
    ids = random_tokens(1, 10)
    for index in memory_layers:
        cache = TrellisCache(model.config, rollback_window=4)
        with torch.no_grad():
            model(ids, cache=cache)
        before = snapshot(cache)
        mixer = model.model.layers[index].self_attn
        # The replay the layer recorded fails midway (its function of the carried entry raises).
        mixer.mix = lambda *args, **kwargs: (_ for _ in ()).throw(Boom("replay"))
        try:
            with pytest.raises(Boom):
                cache.crop(-2)
        finally:
            del mixer.mix
        assert_unchanged(cache, before)
        cache.crop(-2)
        assert cache.get_seq_length() == 8


def test_a_crop_whose_model_is_gone_changes_nothing():
    # Attention first: its columns would be dropped before the memory layer finds its mixer gone.
    model = tiny_model(mixer_types=["attention", "trellis"])
    cache = TrellisCache(model.config, rollback_window=4)
    with torch.no_grad():
        model(random_tokens(1, 6), cache=cache)
    before = snapshot(cache)
    del model
    import gc

    gc.collect()
    with pytest.raises(ValueError, match="no longer exists"):
        cache.crop(-1)
    assert_unchanged(cache, before)


# ----------------------------------------------------------------------------- items 6 and 14


def test_crop_takes_python_ints_and_0_d_integer_tensors_only():
    model = tiny_model()
    cache = TrellisCache(model.config, rollback_window=4)
    with torch.no_grad():
        model(random_tokens(1, 8), cache=cache)
    cache.crop(torch.tensor(-2))
    assert cache.get_seq_length() == 6 and type(cache.seen_tokens) is int
    for bad in (True, 2.0, torch.tensor([1]), torch.tensor(1.5), "3", None):
        with pytest.raises(TypeError, match="max_length must be an int"):
            cache.crop(bad)
    assert cache.get_seq_length() == 6


def test_crop_errors_mention_packing_only_when_documents_were_packed():
    model = tiny_model()
    cache = TrellisCache(model.config, rollback_window=3)
    with torch.no_grad():
        model(random_tokens(1, 6), cache=cache)
    with pytest.raises(ValueError) as plain:
        cache.crop(-5)
    assert "packed" not in str(plain.value)
    packed = TrellisCache(model.config, rollback_window=8)
    with torch.no_grad():
        model(random_tokens(1, 6), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]), cache=packed)
    with pytest.raises(ValueError, match="packed documents are not replayed"):
        packed.crop(-1)


# ----------------------------------------------------------------------------- items 7 and 12


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_left_padded_packed_documents_with_positions_counting_padding(schedule):
    model = tiny_model(schedule=schedule, dtype=torch.float64)
    first, second = random_tokens(1, 5, seed=1)[0], random_tokens(1, 3, seed=2)[0]
    # The second document is left-padded by two, and its positions count the padding.
    ids = torch.cat([first, torch.zeros(2, dtype=torch.long), second])[None]
    mask = torch.tensor([[1] * 5 + [0, 0] + [1] * 3])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    out = model(ids, attention_mask=mask, position_ids=positions).logits[0]
    torch.testing.assert_close(out[:5], model(first[None]).logits[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out[7:], model(second[None]).logits[0], rtol=1e-10, atol=1e-10)
    # Boundaries come from the real tokens' positions whatever the padding's positions say.
    odd = torch.tensor([[0, 1, 2, 3, 4, 9, 9, 2, 3, 4]])
    torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=odd).logits[0][7:], out[7:], **EXACT)


def test_packing_arguments_must_be_integer_offsets_and_rising_document_indices():
    model = tiny_model()
    ids = random_tokens(1, 8)
    for bad in (torch.tensor([0.0, 4.0, 8.0]), torch.tensor([0.0, 4.5, 8.0])):
        with pytest.raises(ValueError, match="cu_seq_lens_q must be a 1-D integer tensor"):
            model(ids, cu_seq_lens_q=bad)
    with pytest.raises(ValueError, match="seq_idx must .*non-decreasing"):
        model(ids, seq_idx=torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2]]))
    with pytest.raises(ValueError, match="seq_idx must .*integer"):
        model(ids, seq_idx=torch.tensor([[0.0, 0, 1, 1, 1, 1, 2, 2]]))
    # Integer offsets and rising indices still read as documents.
    cu = model(ids, cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32)).logits
    torch.testing.assert_close(model(ids, seq_idx=torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])).logits, cu, **EXACT)


# ----------------------------------------------------------------------------- items 8, 9, 10


def test_an_odd_head_dim_is_refused_where_attention_rotates_it():
    with pytest.raises(ValueError, match="head_dim must be an even integer .*attention"):
        tiny_config("hybrid", head_dim=7)
    assert tiny_config("trellis", head_dim=7).head_dim == 7  # the memory mixers have no RoPE on head_dim


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_empty_input_is_refused_clearly(schedule):
    model = tiny_model(schedule=schedule)
    empty = torch.zeros(1, 0, dtype=torch.long)
    with pytest.raises(ValueError, match="no tokens"):
        model(empty)
    cache = cache_of(model(random_tokens(1, 3), use_cache=True))
    before = snapshot(cache)
    with pytest.raises(ValueError, match="no tokens"):
        model(empty, cache=cache)
    assert_unchanged(cache, before)
    with pytest.raises(ValueError, match="no tokens"):
        model(inputs_embeds=torch.zeros(1, 0, model.config.hidden_size))
    with pytest.raises(ValueError, match="no tokens"):
        model.generate(empty, max_new_tokens=2)


def test_prompt_lookup_and_assistant_drafts_are_bounded():
    model = tiny_model()
    ids = random_tokens(1, 6)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        model.generate(ids, max_new_tokens=2, do_sample=False, prompt_lookup_num_tokens=10**6)
    with pytest.raises(ValueError, match="num_assistant_tokens"):
        model.generate(ids, max_new_tokens=2, do_sample=False, assistant_model=tiny_model(seed=1),
                       num_assistant_tokens=10**6)
    # None, zero or negative drafts, or a fraction, are refused by name (issue 50), not with an
    # upstream message about n-gram sizes or a failed crop.
    for drafts in (0, -1, 2.5):
        with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens must be an integer in \[1, 256\]"):
            model.generate(ids, max_new_tokens=2, do_sample=False, prompt_lookup_num_tokens=drafts)
        with pytest.raises(ValueError, match=r"num_assistant_tokens must be an integer in \[1, 256\]"):
            model.generate(ids, max_new_tokens=2, do_sample=False, assistant_model=tiny_model(seed=1),
                           num_assistant_tokens=drafts)


# ----------------------------------------------------------------------------- item 13


@pytest.mark.parametrize("schedule", [*SCHEDULES, "attention"])
@pytest.mark.parametrize("where", ["mixers", "lm_head"])
def test_non_finite_weights_give_one_behaviour_on_every_path(schedule, where):
    overrides = {"mixer_types": ["attention"] * 2} if schedule == "attention" else {}
    model = tiny_model(schedule="trellis" if schedule == "attention" else schedule, **overrides)
    with torch.no_grad():
        if where == "lm_head":
            model.lm_head.weight[3] = float("nan")
        else:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.fill_(float("nan"))
    ids = random_tokens(1, 9)
    # forward (prefill and decode): NaN propagates, as in transformers' models.
    out = model(ids, use_cache=True)
    assert torch.isnan(out.logits).any()
    assert torch.isnan(model(random_tokens(1, 1), cache=cache_of(out)).logits).any()
    # generate: a clear error at the first non-finite logits.
    with pytest.raises(ValueError, match="non-finite logits"):
        model.generate(ids, max_new_tokens=3, do_sample=False)
