"""TrellisConfig: defaults, validation, auto-class registration, save/load."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PreTrainedConfig

from tiny_models import tiny_config
from trellis_lm import TrellisConfig, TrellisForCausalLM, TrellisModel
from trellis_lm.mixers import MIXERS
from trellis_lm.ops import TRELLIS_BACKENDS as BACKENDS, COMPRESS_FNS, MIX_FNS


DEFAULTS = dict(
    vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=12, head_dim=64, num_slots=64,
    chunk_size=16, compress_fn="layernorm", mix_fn="softmax", conv_size=2, use_forget_gate=True,
    gate_logit_normalizer=16.0, intermediate_size=2048, rms_norm_eps=1e-6, initializer_range=0.02,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=True,
    op_backend="auto", compile_decode=False, mixer_types=None, lattice_variant="dec", num_key_value_heads=None,
    rope_theta=10000.0, attention_bias=False, kvm_chunk_size=256, kvm_window_chunks=2, kvm_rope_dims=None, kvm_sinks=1,
    kvm_state_size=256, kvm_budget="fixed", kvm_budget_scale=16.0, kvm_budget_exponent=0.5, kvm_budget_saturation=1024.0,
    kvm_budget_min=None,
)


def trellis_fields(config: TrellisConfig) -> dict:
    return {name: getattr(config, name) for name in DEFAULTS}


def test_defaults_match_the_design_page():
    config = TrellisConfig()
    assert trellis_fields(config) == DEFAULTS
    assert config.num_attention_heads == config.num_heads  # alias read by attention-model tooling


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("vocab_size", 0, "in [1, "),
        ("hidden_size", -3, "in [1, "),
        ("num_hidden_layers", 2.0, "integer"),
        ("num_heads", True, "integer"),
        ("head_dim", 0, "in [1, "),
        ("num_slots", 0, "in [1, "),
        ("chunk_size", 0, "in [1, "),
        ("chunk_size", 10**9, "in [1, 65536]"),
        ("num_hidden_layers", 2 * 10**6, "in [1, 4096]"),
        ("kvm_state_size", 10**9, ", 65536]"),
        ("chunk_size", 4.5, "integer"),
        ("intermediate_size", 0, "in [1, "),
        ("conv_size", -1, "in [0, "),
        ("compress_fn", "softmax", str(COMPRESS_FNS)),
        ("mix_fn", "relu", str(MIX_FNS)),
        ("op_backend", "cuda", "auto"),
        ("gate_logit_normalizer", 0.0, "> 0"),
        ("rms_norm_eps", -1e-6, "> 0"),
        ("rms_norm_eps", float("inf"), "finite"),
        ("gate_logit_normalizer", float("inf"), "finite"),
        ("rope_theta", float("nan"), "finite"),
        ("initializer_range", 0, "> 0"),
        ("use_forget_gate", 1, "True or False"),
        ("tie_word_embeddings", "yes", "True or False"),
        ("use_cache", None, "True or False"),
        ("compile_decode", "yes", "True or False"),
        ("pad_token_id", 97, "vocab_size"),
        ("eos_token_id", [2, -1], "token id"),
    ],
)
def test_invalid_values_name_the_field(field, value, expected):
    with pytest.raises(ValueError, match=f"TrellisConfig.{field} must be .*") as error:
        tiny_config(**{field: value})
    assert expected in str(error.value)


@pytest.mark.parametrize("compress_fn, mix_fn", [("layernorm", "ln_silu"), ("layernorm", "softmax"), ("l2norm", "ln_silu")])
def test_one_slot_is_refused_where_a_layernorm_runs_over_the_slots(compress_fn, mix_fn):
    # A LayerNorm over one slot is 0 with a zero gradient: ln_silu reads 0 for every input,
    # layernorm writes nothing. The layer would train as a constant.
    with pytest.raises(ValueError, match=r"TrellisConfig.num_slots must be at least 2 in Trellis layers"):
        tiny_config(num_slots=1, compress_fn=compress_fn, mix_fn=mix_fn)
    with pytest.raises(ValueError, match=r"num_slots must be at least 2"):
        MIXERS["trellis"](hidden_size=16, num_heads=2, head_dim=8, num_slots=1, compress_fn=compress_fn, mix_fn=mix_fn)
    # One slot is a working memory where nothing normalises over the slots, and for other kinds.
    assert tiny_config(num_slots=1, compress_fn="l2norm", mix_fn="softmax").num_slots == 1
    assert tiny_config("lattice", num_slots=1, compress_fn=compress_fn, mix_fn=mix_fn).num_slots == 1


def test_accepted_edge_values():
    config = tiny_config(conv_size=0, chunk_size=1, eos_token_id=[2, 1], pad_token_id=None, gate_logit_normalizer=8)
    assert config.conv_size == 0 and config.eos_token_id == [2, 1]
    for backend in ("auto",) + tuple(BACKENDS):
        assert tiny_config(op_backend=backend).op_backend == backend


def test_save_and_load_round_trip(tmp_path):
    config = tiny_config(compress_fn="l2norm", mix_fn="softmax", conv_size=4, use_forget_gate=False, op_backend="reference")
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "trellis"
    assert saved["auto_map"]["AutoConfig"] == "configuration_trellis.TrellisConfig"
    assert (tmp_path / "configuration_trellis.py").is_file()  # a config alone also carries its code
    for loaded in (TrellisConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is TrellisConfig
        assert trellis_fields(loaded) == trellis_fields(config)


def test_a_saved_config_names_every_trellis_field_so_a_changed_default_keeps_saved_models(tmp_path):
    """transformers writes only the fields that differ from a default; ours are no fields of its base
    config, so each is written even at its default. A default changed later (mix_fn became softmax
    on 2026-12-01) then leaves every saved model computing what it was trained to."""
    TrellisConfig().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    own = [name for name in DEFAULTS if name not in PreTrainedConfig().to_dict()]
    assert "mix_fn" in own and [name for name in own if name not in saved] == []
    saved["mix_fn"] = "ln_silu"  # as every config saved before the change holds it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert TrellisConfig.from_pretrained(tmp_path).mix_fn == "ln_silu"


def test_loading_an_invalid_config_fails(tmp_path):
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "num_slots": 0}))
    with pytest.raises(ValueError, match="TrellisConfig.num_slots"):
        AutoConfig.from_pretrained(tmp_path)


def test_auto_classes_pick_the_trellis_classes():
    config = tiny_config()
    assert type(AutoConfig.for_model("trellis", num_slots=6)) is TrellisConfig
    assert type(AutoModel.from_config(config)) is TrellisModel
    assert type(AutoModelForCausalLM.from_config(config)) is TrellisForCausalLM


def test_op_backend_must_be_one_every_layer_s_op_has():
    """No silent substitution: the Lattice and KVM ops have no Triton kernels, so a model with
    such layers refuses op_backend="triton" rather than running them on another backend."""
    assert tiny_config(op_backend="triton").op_backend == "triton"  # Trellis layers only
    for kinds, op in ((["trellis", "lattice"], "lattice_attention"), (["kvm", "trellis"], "kvm_attention")):
        with pytest.raises(ValueError, match=f"op_backend .*{op}.*got 'triton'"):
            tiny_config(mixer_types=kinds, op_backend="triton")
        assert tiny_config(mixer_types=kinds, op_backend="reference").op_backend == "reference"
