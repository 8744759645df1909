"""Per-layer mixers: configuration, and the model-level guarantees for every schedule.

Each schedule of ``SCHEDULES`` (all Trellis, all Lattice, a hybrid with an attention layer)
must give, in float64: prefill then token-by-token decode equal to one forward; each row of a
padded batch what it gets alone; packed documents what they get alone; a cache whose size is
constant for memory layers and grows only by the attention layers' keys and values.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import SCHEDULES, left_pad, random_tokens, right_pad, tiny_config, tiny_model
from transformers_names import cache_of
from trellis_lm import TrellisCache, TrellisConfig, TrellisForCausalLM
from trellis_lm.mixers import AttentionMixer, LatticeMixer, TrellisMixer

EXACT = dict(rtol=1e-9, atol=1e-9)


def logits_in_pieces(model, ids, sizes, mask=None):
    cache, logits, start = TrellisCache(model.config), [], 0
    for size in sizes:
        piece_mask = None if mask is None else mask[:, : start + size]
        logits.append(model(ids[:, start : start + size], attention_mask=piece_mask, past_key_values=cache).logits)
        start += size
    return torch.cat(logits, dim=1), cache


# ----------------------------------------------------------------------------- configuration


def test_mixer_types_default_to_trellis_and_set_layer_types():
    config = tiny_config()
    assert config.mixer_types is None and config.layer_kinds == ["trellis", "trellis"]
    assert config.layer_types == ["linear_attention", "linear_attention"]
    hybrid = tiny_config("hybrid")
    assert hybrid.layer_types == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    model = tiny_model(schedule="hybrid")
    kinds = [type(layer.self_attn) for layer in model.model.layers]
    assert kinds == [TrellisMixer, TrellisMixer, AttentionMixer, LatticeMixer]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(mixer_types=["trellis"]), r"mixer_types must be None or a list of num_hidden_layers = 2"),
        (dict(mixer_types="trellis"), r"mixer_types must be None or a list"),
        (dict(mixer_types=["trellis", "mamba"]), r"mixer_types\[1\] must be one of \('trellis', 'lattice', 'attention'"),
        (dict(lattice_variant="orth"), r"lattice_variant must be one of"),
        (dict(num_key_value_heads=3), r"num_key_value_heads must be None or an integer >= 1 that divides num_heads = 2"),
        (dict(rope_theta=0.0), r"rope_theta must be a finite number > 0"),
        (dict(attention_bias=1), r"attention_bias must be True or False"),
        (dict(kvm_rope_dims=3), r"kvm_rope_dims must be None or an even integer in \[0, head_dim = 8\)"),
        (dict(kvm_rope_dims=8), r"kvm_rope_dims must be .* the state keys .* would all be one vector"),
        (dict(kvm_budget_scale=0.0), r"kvm_budget_scale must be a finite number > 0"),
        (dict(kvm_budget_saturation=float("inf")), r"kvm_budget_saturation must be a finite number > 0"),
        (dict(kvm_budget_min=5), r"kvm_budget_min must be None \(kvm_chunk_size\) or an integer in \[0, kvm_state_size = 4\]"),
        (dict(kvm_state_size=2), r"kvm_state_size must be an integer in \[kvm_chunk_size = 3, 65536\]"),
        (dict(kvm_sinks=3), r"kvm_sinks must be an integer in \[0, kvm_chunk_size = 3\)"),
        (dict(kvm_budget="grow"), r"kvm_budget must be one of"),
        (dict(layer_types=["full_attention", "linear_attention"]), r"layer_types is set from mixer_types"),
    ],
)
def test_bad_schedules_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**overrides)


def test_fields_are_checked_again_when_a_model_is_built():
    config = tiny_config()
    config.num_hidden_layers = 3
    config.mixer_types = ["trellis", "attention"]
    with pytest.raises(ValueError, match="mixer_types must be None or a list of num_hidden_layers = 3"):
        TrellisForCausalLM(config)


def test_the_schedule_round_trips_through_a_saved_config(tmp_path):
    tiny_config("hybrid", lattice_variant="sim", num_key_value_heads=1, rope_theta=500.0).save_pretrained(tmp_path)
    loaded = TrellisConfig.from_pretrained(tmp_path)
    assert loaded.mixer_types == SCHEDULES["hybrid"] and loaded.lattice_variant == "sim"
    assert loaded.num_key_value_heads == 1 and loaded.rope_theta == 500.0


@pytest.mark.parametrize(
    "schedule, unused",
    [
        ("trellis", dict(lattice_variant="enc", num_key_value_heads=1, rope_theta=7.0, attention_bias=True,
                         kvm_chunk_size=5, kvm_window_chunks=3, kvm_state_size=9, kvm_budget="power_law")),
        ("kvm", dict(num_slots=9, chunk_size=5, compress_fn="l2norm", lattice_variant="sim", conv_size=2,
                     num_key_value_heads=1, attention_bias=True)),
        ("lattice", dict(compress_fn="l2norm", mix_fn="softmax", use_forget_gate=False, gate_logit_normalizer=3.0,
                         num_key_value_heads=1, rope_theta=7.0)),
        ("hybrid", dict()),  # every field is used somewhere
    ],
)
def test_a_field_no_layer_uses_does_not_change_the_model(schedule, unused):
    ids = random_tokens(2, 9)
    base = tiny_model(schedule=schedule)
    other = tiny_model(schedule=schedule, **unused)
    assert base.state_dict().keys() == other.state_dict().keys()
    torch.testing.assert_close(other(ids).logits, base(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "schedule, field, value",
    [("lattice", "lattice_variant", "enc"), ("lattice", "lattice_variant", "sim"), ("hybrid", "rope_theta", 7.0),
     ("hybrid", "num_key_value_heads", 1), ("hybrid", "lattice_variant", "sim"), ("lattice", "chunk_size", 3),
     ("lattice", "num_slots", 9), ("kvm", "kvm_window_chunks", 2), ("kvm", "kvm_chunk_size", 2),
     ("kvm", "kvm_state_size", 6), ("kvm", "kvm_sinks", 0), ("kvm", "kvm_rope_dims", 0),
     ("kvm", "rope_theta", 7.0)],
)
def test_fields_a_layer_uses_change_the_model(schedule, field, value):
    ids = random_tokens(1, 11)
    changed = tiny_model(schedule=schedule, **{field: value})(ids).logits
    assert not torch.allclose(changed, tiny_model(schedule=schedule)(ids).logits)


def test_kvm_budgets_differ_at_small_sizes():
    # Chunks of 3, a window of one chunk and a cap of 12 rows: after 36 tokens the fixed budget
    # holds all 12, the growable ones what their laws allow (floors 3 = the chunk, by default).
    ids = random_tokens(1, 36)

    def rows_used(**budget):
        model = tiny_model(schedule="kvm", kvm_state_size=12, **budget)
        return cache_of(model(ids)).layers[0].state.used.item()

    used = {
        "fixed": rows_used(),
        "power_law": rows_used(kvm_budget="power_law", kvm_budget_scale=1.0),   # floor(sqrt(t))
        "saturation": rows_used(kvm_budget="saturation", kvm_budget_saturation=8.0),  # floor(8t / (8 + t))
        "power_law, floor 12": rows_used(kvm_budget="power_law", kvm_budget_scale=1.0, kvm_budget_min=12),
    }
    assert used["fixed"] == 12 == used["power_law, floor 12"]
    assert len({used["fixed"], used["power_law"], used["saturation"]}) == 3, used


# ----------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("sizes", [[5] + [1] * 8, [3, 1, 6, 3], [1] * 6])
def test_prefill_then_decode_equals_one_forward(schedule, sizes):
    model = tiny_model(seed=2, dtype=torch.float64, schedule=schedule, chunk_size=3, num_key_value_heads=1)
    ids = random_tokens(2, sum(sizes), seed=len(sizes))
    pieces, _ = logits_in_pieces(model, ids, sizes)
    torch.testing.assert_close(pieces, model(ids).logits, **EXACT)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pad", [left_pad, right_pad])
def test_a_padded_batch_gives_each_row_what_it_gets_alone(schedule, pad):
    model = tiny_model(seed=3, dtype=torch.float64, schedule=schedule)
    rows = [random_tokens(1, n, seed=n)[0] for n in (9, 2, 5)]
    ids, mask = pad(rows)
    out = model(ids, attention_mask=mask).logits
    for i, row in enumerate(rows):
        torch.testing.assert_close(out[i][mask[i].bool()], model(row[None]).logits[0], **EXACT)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_left_padded_prefill_then_decode_equals_each_row_alone(schedule):
    model = tiny_model(seed=4, dtype=torch.float64, schedule=schedule, chunk_size=3)
    rows = [random_tokens(1, n, seed=n)[0] for n in (7, 3)]
    ids, mask = left_pad(rows)
    more = random_tokens(2, 4, seed=11)
    full_ids = torch.cat([ids, more], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    pieces, _ = logits_in_pieces(model, full_ids, [ids.shape[1], 1, 2, 1], full_mask)
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, more[i]])[None]).logits[0]
        torch.testing.assert_close(pieces[i][full_mask[i].bool()], alone, **EXACT)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_packed_documents_give_each_document_what_it_gets_alone(schedule):
    model = tiny_model(seed=5, dtype=torch.float64, schedule=schedule)
    docs = [random_tokens(1, n, seed=n)[0] for n in (6, 3, 5)]
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    out = model(ids, position_ids=positions).logits[0]
    start = 0
    for doc in docs:
        torch.testing.assert_close(out[start : start + len(doc)], model(doc[None]).logits[0], **EXACT)
        start += len(doc)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_new_packed_document_after_a_cache_starts_afresh(schedule):
    # The row's first document continues the cache; the second starts from nothing.
    model = tiny_model(seed=6, dtype=torch.float64, schedule=schedule)
    a, b, c = (random_tokens(1, n, seed=n)[0] for n in (4, 3, 5))
    cache = cache_of(model(a[None]))
    ids = torch.cat([b, c])[None]
    positions = torch.cat([torch.arange(4, 7), torch.arange(5)])[None]
    out = model(ids, position_ids=positions, past_key_values=cache).logits[0]
    torch.testing.assert_close(out[:3], model(torch.cat([a, b])[None]).logits[0, 4:], **EXACT)
    torch.testing.assert_close(out[3:], model(c[None]).logits[0], **EXACT)
    # ...and what follows continues the second document only.
    d = random_tokens(1, 2, seed=9)
    after = model(d, past_key_values=cache).logits[0]
    torch.testing.assert_close(after, model(torch.cat([c, d[0]])[None]).logits[0, 5:], **EXACT)


# ----------------------------------------------------------------------------- the cache


def attention_bytes_per_token(config) -> int:
    """Keys and values of every attention layer, plus its visibility flag, per row and token."""
    per_layer = 2 * config.key_value_heads * config.head_dim * 4 + 1
    return per_layer * config.layer_kinds.count("attention")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cache_size_grows_only_by_the_attention_keys_and_values(schedule):
    model = tiny_model(schedule=schedule)
    ids = random_tokens(2, 40)
    short = cache_of(model(ids[:, :9]))
    long = cache_of(model(ids))
    assert long.nbytes() - short.nbytes() == 2 * 31 * attention_bytes_per_token(model.config)
    for _ in range(3):
        model(ids[:, :1], past_key_values=long)
    assert long.nbytes() - short.nbytes() == 2 * 34 * attention_bytes_per_token(model.config)
    if "attention" not in SCHEDULES[schedule]:
        assert long.nbytes() == short.nbytes()


def test_a_kvm_cache_grows_to_its_window_and_state_then_stays():
    model = tiny_model(schedule="kvm")
    c = model.config
    window, size, d = c.kvm_window_chunks * c.kvm_chunk_size, c.kvm_state_size, c.head_dim
    ids = random_tokens(1, 300, seed=3)
    full = cache_of(model(ids)).nbytes()
    # Per layer: S rows and W slots of key, value and radius / gate (float32), three int64 counters.
    assert full == c.num_hidden_layers * (4 * c.num_heads * (size + window) * (2 * d + 1) + 3 * 8)
    # Full once S tokens have been folded (they left the window); a short input holds only what it needs.
    assert cache_of(model(ids[:, : size + window])).nbytes() == full
    assert cache_of(model(ids[:, :2])).nbytes() < full


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_save_load_and_beam_reorder_for_every_schedule(tmp_path, schedule):
    model = tiny_model(seed=7, dtype=torch.float64, schedule=schedule)
    ids, mask = left_pad([random_tokens(1, 8)[0], random_tokens(1, 5, seed=1)[0]])
    expected = model(ids, attention_mask=mask).logits[:, 6:]
    cache = cache_of(model(ids[:, :6], attention_mask=mask[:, :6]))
    cache.save(tmp_path / "cache.safetensors")
    loaded = TrellisCache.load(tmp_path / "cache.safetensors", config=model.config)
    assert loaded.kinds == model.config.layer_kinds
    # Reversing the rows (beam search's reorder) and the inputs with them gives reversed rows.
    loaded.reorder_cache(torch.tensor([1, 0]))
    flipped = model(ids[:, 6:].flip(0), attention_mask=mask.flip(0), past_key_values=loaded).logits
    torch.testing.assert_close(flipped.flip(0), expected, **EXACT)


def test_a_cache_refuses_a_model_of_another_schedule(tmp_path):
    hybrid = tiny_model(schedule="hybrid")
    cache = cache_of(hybrid(random_tokens(1, 5)))
    cache.save(tmp_path / "cache.safetensors")
    other = tiny_model(schedule="hybrid", mixer_types=["trellis", "attention", "attention", "lattice"])
    with pytest.raises(ValueError, match=r"made for layers \['trellis', 'trellis', 'attention', 'lattice'\]"):
        other(random_tokens(1, 1), past_key_values=cache)
    with pytest.raises(ValueError, match="made for layers"):
        TrellisCache.load(tmp_path / "cache.safetensors", config=other.config)


@pytest.mark.parametrize("schedule", ["lattice", "hybrid", "kvm", "kvm-hybrid"])
def test_generate_modes_for_every_schedule(schedule):
    model = tiny_model(seed=8, schedule=schedule)
    # Every call runs its full length: a row stopping at EOS (then padded in a batch, real in a
    # continuation's mask) would compare stopping rules rather than the model's numbers.
    model.generation_config.eos_token_id = None
    ids, mask = left_pad([random_tokens(1, 6)[0], random_tokens(1, 3, seed=2)[0]])
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for i in range(2):
        row = ids[i][mask[i].bool()][None]
        alone = model.generate(row, max_new_tokens=5, do_sample=False, pad_token_id=0)
        assert greedy[i, -5:].tolist() == alone[0, -5:].tolist()
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, num_return_sequences=2,
                           do_sample=False, pad_token_id=0)
    assert beams.shape == (4, ids.shape[1] + 4)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    cont = model.generate(out.sequences, attention_mask=torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1),
                          past_key_values=cache_of(out), max_new_tokens=2, do_sample=False, pad_token_id=0)
    fresh = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert cont.tolist() == fresh.tolist()


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_ids=torch.tensor([5, 6, 7])), r"input_ids must be 2-D \[batch, tokens\], got shape \(3,\)"),
        (dict(input_ids=torch.ones(1, 2, 3, dtype=torch.long)), r"input_ids must be 2-D"),
        (dict(inputs_embeds=torch.ones(1, 3)), r"inputs_embeds must be 3-D \[batch, tokens, hidden_size = 32\]"),
        (dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[1, -1]])), r"1 at real tokens and 0"),
        (dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[0.5, 1.0]])), r"1 at real tokens and 0"),
        (dict(input_ids=torch.tensor([[5, 6]]), attention_mask=torch.tensor([[float("nan"), 1.0]])),
         r"1 at real tokens and 0"),
    ],
)
def test_malformed_inputs_get_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model()(**kwargs)


def test_generate_refuses_a_cache_that_has_seen_more_than_the_input():
    model = tiny_model(schedule="hybrid")
    ids = random_tokens(1, 5)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    with pytest.raises(ValueError, match=r"has already taken in 7 tokens, but input_ids holds 2"):
        model.generate(random_tokens(1, 2, seed=4), past_key_values=cache_of(out), max_new_tokens=2)
