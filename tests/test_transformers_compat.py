"""What changes between transformers versions, and what the models accept from them.

The cache is called ``past_key_values`` up to transformers 5.23 and ``cache`` from 5.24 on; the
models take either name from users and from ``generate()``, and write the running version's.
CI runs this file on the newest transformers and on the lowest supported one.
"""

from __future__ import annotations

import inspect
import logging
import warnings

import numpy as np
import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening, GenerationMixin

from tiny_models import left_pad, random_tokens, tiny_model
from trainer_helpers import ROWS, sgd_trainer
from transformers_names import cache_of
from trellis_lm import TrellisCache, TrellisModel
from trellis_lm.cache_trellis import CACHE_ARG, CACHE_NAMES

# ----------------------------------------------------------------------------- the two cache names


@pytest.mark.parametrize("name", CACHE_NAMES)
def test_forward_takes_the_cache_under_either_name(name):
    model = tiny_model(seed=1)
    ids = random_tokens(2, 9)
    cache = TrellisCache(model.config)
    first = model(ids[:, :6], **{name: cache})
    assert cache_of(first) is cache and cache.get_seq_length() == 6
    rest = model(ids[:, 6:], **{name: cache}).logits
    torch.testing.assert_close(torch.cat([first.logits, rest], dim=1), model(ids).logits, rtol=1e-5, atol=1e-5)
    assert type(first).__dataclass_fields__.keys() >= {CACHE_ARG}


def test_both_cache_names_at_once_are_refused():
    model = tiny_model()
    ids = random_tokens(1, 4)
    with pytest.raises(ValueError, match="not both"):
        model(ids, cache=TrellisCache(model.config), past_key_values=TrellisCache(model.config))
    with pytest.raises(ValueError, match="not both"):
        model.model(ids, cache=TrellisCache(model.config), past_key_values=TrellisCache(model.config))
    with pytest.raises(ValueError, match="not both"):
        model.generate(ids, cache=TrellisCache(model.config), past_key_values=TrellisCache(model.config))


@pytest.mark.parametrize("name", CACHE_NAMES)
@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=2, do_sample=False)])
def test_generate_continues_a_cache_given_under_either_name(name, mode):
    model = tiny_model(seed=2, eos_token_id=None)
    ids, mask = left_pad([random_tokens(1, 5)[0], random_tokens(1, 3, seed=1)[0]])
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert isinstance(cache_of(first), TrellisCache)
    mask_so_far = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], dim=1)
    resumed = model.generate(first.sequences, attention_mask=mask_so_far, max_new_tokens=4, **{name: cache_of(first)}, **mode)
    straight = model.generate(first.sequences, attention_mask=mask_so_far, max_new_tokens=4, use_cache=False, **mode)
    assert torch.equal(resumed, straight)


def test_our_code_raises_no_deprecation_warning(caplog):
    model = tiny_model(seed=3)
    ids, mask = left_pad([random_tokens(1, 5)[0], random_tokens(1, 3, seed=1)[0]])
    transformers.utils.logging.warning_once.cache_clear()  # a warning shown before would be hidden
    transformers.utils.logging.enable_propagation()
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            out = model(ids, attention_mask=mask)
            cache_of(out)
            first = model.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True)
            mask_so_far = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1)
            model.generate(first.sequences, attention_mask=mask_so_far, max_new_tokens=2, **{CACHE_ARG: cache_of(first)})
    finally:
        transformers.utils.logging.disable_propagation()
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [text for text in said if "deprecated" in text.lower()], said


def test_trainer_predictions_leave_the_cache_out(tmp_path):
    # Under either name: `keys_to_ignore_at_inference` names both.
    assert set(CACHE_NAMES) <= set(tiny_model().config.keys_to_ignore_at_inference)
    assert set(CACHE_NAMES) <= set(TrellisModel._skip_keys_device_placement)
    trainer = sgd_trainer(str(tmp_path), per_device_eval_batch_size=4)
    predictions = trainer.predict(ROWS).predictions
    assert isinstance(predictions, np.ndarray) and predictions.shape[:2] == (len(ROWS), 9)


# ----------------------------------------------------------------------------- nothing dropped


def test_unknown_keyword_arguments_are_refused():
    model = tiny_model()
    ids = random_tokens(1, 4)
    with pytest.raises(TypeError, match=r"TrellisForCausalLM.forward\(\) got unexpected keyword arguments \['cache_postion'\]"):
        model(ids, cache_postion=3)
    with pytest.raises(TypeError, match=r"TrellisModel.forward\(\) got unexpected keyword arguments \['num_items_in_batch'\]"):
        model.model(ids, num_items_in_batch=4)  # a loss argument, and the base model has no loss
    with pytest.raises(ValueError, match="output_attentions=True is not available"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="is_causal=False is not available"):
        model(ids, is_causal=False)
    with pytest.raises(ValueError, match="token_type_ids must be all zeros"):
        model(ids, token_type_ids=torch.ones_like(ids))
    # What transformers passes with its fixed answers is accepted.
    model(ids, output_attentions=False, is_causal=True, output_router_logits=None, token_type_ids=torch.zeros_like(ids))


def test_flash_attention_packing_arguments_mark_the_documents():
    model = tiny_model(seed=4)
    docs = [random_tokens(1, n, seed=n)[0].tolist() for n in (3, 5, 2)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(
        [{"input_ids": d} for d in docs]
    )
    ids, positions = batch.pop("input_ids"), batch.pop("position_ids")
    batch.pop("labels")
    alone = torch.cat([model(torch.tensor([d])).logits for d in docs], dim=1)
    # Each packing convention alone, and all of them together (as the collator returns them).
    for given in ({"position_ids": positions}, {k: batch[k] for k in ("cu_seq_lens_q", "max_length_q")},
                  {"seq_idx": batch["seq_idx"]}, dict(batch, position_ids=positions)):
        torch.testing.assert_close(model(ids, **given).logits, alone, rtol=1e-5, atol=1e-5, msg=str(list(given)))


def test_packing_arguments_that_disagree_or_misfit_are_refused():
    model = tiny_model()
    ids = random_tokens(1, 10)
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q and position_ids describe different packed documents"):
        model(ids, position_ids=torch.arange(10)[None], cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="max_length_q = 4 is not the longest document"):
        model(ids, cu_seq_lens_q=cu, max_length_q=4)
    with pytest.raises(ValueError, match="max_length_k is only read with cu_seq_lens_k"):
        model(ids, max_length_k=5)
    with pytest.raises(ValueError, match="cu_seq_lens_q must be a 1-D tensor of document offsets rising from 0 to T = 10"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 3, 9]))
    with pytest.raises(ValueError, match="with a batch of 1"):
        model(random_tokens(2, 10), cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="seq_idx must be 2-D"):
        model(ids, seq_idx=torch.zeros(10, dtype=torch.long))


def test_an_attention_mask_must_cover_the_cache_and_the_input():
    model = tiny_model()
    ids = random_tokens(1, 6)
    cache = cache_of(model(ids[:, :5], use_cache=True))
    with pytest.raises(ValueError, match=r"past \+ T = 5 \+ 1\].*got shape \(1, 5\)"):
        model(ids[:, 5:], attention_mask=torch.ones(1, 5, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match=r"past \+ T = 5 \+ 1\].*got shape \(1, 1\)"):
        model(ids[:, 5:], attention_mask=torch.ones(1, 1, dtype=torch.long), past_key_values=cache)
    model(ids[:, 5:], attention_mask=torch.ones(1, 6, dtype=torch.long), past_key_values=cache)


# ----------------------------------------------------------------------------- private transformers names

# Names without a public equivalent that the models rely on, each with the transformers module
# that must still read it and what breaks when it stops. A failure names the moved API.
PRIVATE_NAMES = [
    ("_prepare_cache_for_generation", "generation.utils", "generate() would build a key-value cache, not a TrellisCache"),

    ("_skip_keys_device_placement", "modeling_utils", "accelerate would try to move the cache between devices"),
    ("_no_split_modules", "modeling_utils", "device_map='auto' and FSDP could split a block"),
    ("_tied_weights_keys", "modeling_utils", "tie_word_embeddings=True would stop sharing the embedding"),
    ("_init_weights", "modeling_utils", "models built from scratch would not be initialised"),
    ("_attn_implementation", "configuration_utils", "attention layers would not know which kernel to call"),
]


@pytest.mark.parametrize("name, module, consequence", PRIVATE_NAMES, ids=[n for n, *_ in PRIVATE_NAMES])
def test_the_private_transformers_names_we_rely_on_are_still_read(name, module, consequence):
    source = inspect.getsource(__import__(f"transformers.{module}", fromlist=["_"]))
    assert name in source, f"transformers {transformers.__version__} no longer reads `{name}` in transformers.{module}: {consequence}"


def test_generate_still_marks_a_users_cache_where_it_defers_its_stop_check():
    source = inspect.getsource(__import__("transformers.generation.utils", fromlist=["_"]))
    # Versions that may run one step past the stop (DeferredStopCheck, on MPS) read the mark
    # `_prepare_cache_for_generation` sets on a user's cache to keep it from that step.
    assert "DeferredStopCheck" not in source or "_is_user_defined" in source, (
        f"transformers {transformers.__version__} no longer reads `_is_user_defined` in transformers.generation.utils: "
        "generate() on MPS could run a step past the stop into a user's cache"
    )


def test_the_remote_code_loader_follows_every_import_we_flatten(tmp_path):
    # remote_code.py rewrites relative imports to flat names with its own pattern; transformers'
    # loader finds them with another. Where they disagree, a checkpoint lacks a file it imports.
    from transformers.dynamic_module_utils import get_relative_imports

    from trellis_lm.remote_code import export_code, relative_imports

    for path in export_code(tmp_path):
        ours = set(relative_imports(path.read_text(encoding="utf-8"), ""))
        assert set(get_relative_imports(path)) == ours, (
            f"transformers.dynamic_module_utils.get_relative_imports reads {path.name}'s relative imports differently"
        )


def test_the_generation_cache_hook_keeps_its_signature():
    expected = ["self", "generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"]
    got = list(inspect.signature(GenerationMixin._prepare_cache_for_generation).parameters)
    assert got == expected, f"GenerationMixin._prepare_cache_for_generation changed its parameters to {got}"
