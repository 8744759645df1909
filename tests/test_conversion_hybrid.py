"""Hybrid conversion: teacher layers kept as softmax attention, the others Trellis or Lattice.

Teachers are tiny random Llama (grouped-query attention) and Qwen2 (q/k/v biases) models of
three or four layers, saved to temporary folders like the ones of ``test_conversion.py``.
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import rotate_half

from test_conversion import SHAPE, quick_args, save_random_teacher
from tiny_models import random_tokens
from trellis_lm.conversion import convert_llama_to_trellis, distill_layerwise, layer_mixers, layerwise_errors
from trellis_lm.conversion.cli import add_convert_arguments, run_convert
from trellis_lm.conversion.distill import LayerwiseMixers, distillation_kl
from trellis_lm.conversion.layer_choice import choose_attention_layers, conversion_costs, keep_as_attention, parse_auto
from trellis_lm.conversion.llama import repeat_kv_heads
from trellis_lm.mixers import AttentionMixer, LatticeMixer, TrellisMixer

SMALL_MEMORY = dict(num_slots=8, chunk_size=8)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig, dict(rope_theta=500.0, tie_word_embeddings=False)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(tie_word_embeddings=True)),
}


def make_teacher(family: str, folder, layers: int = 3, seed: int = 0, shared_direction: float = 0.0, **fields):
    """A tiny random teacher of ``layers`` layers (4 query heads, 2 key/value heads of 8), with
    nonzero biases and norm weights, saved with a word tokenizer; returned in eval mode.
    ``shared_direction`` as in ``test_conversion.make_teacher``."""
    model_class, config_class, extra = FAMILIES[family]
    config = config_class(**{**SHAPE, "num_hidden_layers": layers, **extra, **fields})
    return save_random_teacher(model_class, config, folder, seed, shared_direction)


@contextmanager
def in_float64(teacher) -> Iterator[None]:
    """Make a float64 teacher compute in float64 throughout: transformers computes rotary angles
    and RMSNorm statistics in float32 whatever the model's dtype, which would limit a float64
    comparison to float32 rounding."""
    rotary = teacher.model.rotary_emb
    config = teacher.config
    theta = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def rotary_forward(x, position_ids):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles = position_ids.to(torch.float64)[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def norm_forward(norm):
        return lambda x: norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)

    patched = [(rotary, rotary_forward)] + [
        (module, norm_forward(module)) for module in teacher.modules() if type(module).__name__.endswith("RMSNorm")
    ]
    for module, forward in patched:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in patched:
            del module.forward


@contextmanager
def attention_removed(teacher, layers) -> Iterator[None]:
    """The teacher with the attention outputs of ``layers`` replaced by zero."""
    handles = [
        teacher.model.layers[i].self_attn.register_forward_hook(
            lambda module, args, output: (torch.zeros_like(output[0]), output[1])
        )
        for i in layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def attention_tensors(model, layer: int) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.self_attn."
    return {name[len(prefix):]: t for name, t in model.state_dict().items() if name.startswith(prefix)}


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_layer_kept_gives_the_teacher(tmp_path, family):
    """All layers kept: the converted model is the teacher, to float64 precision."""
    teacher = make_teacher(family, tmp_path / "teacher")
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", attention_every=1, **SMALL_MEMORY)
    config = student.config
    assert config.mixer_types == ["attention"] * 3
    assert (config.num_key_value_heads, config.attention_bias) == (2, family == "qwen2")
    assert config.rope_theta == teacher.config.rope_parameters["rope_theta"]
    assert all(isinstance(layer.self_attn, AttentionMixer) for layer in student.model.layers)

    teacher, student = teacher.double(), student.double()
    ids = random_tokens(2, 40, seed=4)
    with in_float64(teacher):
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=0, atol=1e-10)
    # transformers' own float32 angles and norms differ from float64 by float32 rounding only.
    torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=0, atol=1e-5)
    # Right padding: the real tokens' logits agree too.
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with in_float64(teacher):
        expected = teacher(ids, attention_mask=mask).logits
    got = student(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=0, atol=1e-10)
    # Decoding with the cache follows the teacher's greedy path.
    prompt = ids[:, :8]
    with in_float64(teacher):
        expected = teacher.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(student.generate(prompt, max_new_tokens=6, do_sample=False), expected)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trellis", dtype=torch.float64)
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, rtol=0, atol=0)


def test_rotary_of_the_attention_mixer_is_the_teachers():
    """The attention mixer's RoPE is Llama's rotate-half RoPE: same q rotation, any theta."""
    from trellis_lm.mixers.attention import rotary_cos_sin

    positions = torch.arange(12)[None]
    cos, sin = rotary_cos_sin(positions, 8, 500.0, torch.float64)
    q = torch.randn(1, 12, 8, dtype=torch.float64)
    angle = positions[0, :, None].double() * 500.0 ** (-torch.arange(0, 8, 2).double() / 8)
    by_hand = torch.cat([q[..., :4] * angle.cos() - q[..., 4:] * angle.sin(),
                         q[..., 4:] * angle.cos() + q[..., :4] * angle.sin()], dim=-1)
    torch.testing.assert_close(q * cos + rotate_half(q) * sin, by_hand)


@pytest.mark.parametrize("mixer", ["trellis", "lattice"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_keeps_listed_layers_exactly_and_starts_as_documented(tmp_path, family, mixer):
    """Kept layers hold the teacher's own tensors; before training, the model is the teacher
    with the attention outputs of the converted layers (only) removed."""
    teacher = make_teacher(family, tmp_path / "teacher", layers=4)
    student = convert_llama_to_trellis(
        tmp_path / "teacher", tmp_path / "trellis", mixer=mixer, keep_attention=[3, 1], **SMALL_MEMORY
    )
    assert student.config.mixer_types == [mixer, "attention", mixer, "attention"]
    kinds = {"trellis": TrellisMixer, "lattice": LatticeMixer}
    assert [type(layer.self_attn) for layer in student.model.layers] == [kinds[mixer], AttentionMixer] * 2
    for layer in (1, 3):
        kept, original = attention_tensors(student, layer), attention_tensors(teacher, layer)
        assert set(kept) == set(original) == (
            {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"}
            | ({"q_proj.bias", "k_proj.bias", "v_proj.bias"} if family == "qwen2" else set())
        )
        for name, tensor in original.items():
            assert torch.equal(kept[name], tensor), (layer, name)
    assert student.model.layers[1].self_attn.k_proj.weight.shape == (2 * 8, 32)  # the teacher's own KV heads

    ids = random_tokens(2, 20, seed=5)
    teacher64, student64 = teacher.double(), student.double()
    with in_float64(teacher64), attention_removed(teacher64, [0, 2]):
        expected = teacher64(ids).logits
    torch.testing.assert_close(student64(ids).logits, expected, rtol=0, atol=1e-10)
    teacher.float(), student.float()
    assert layerwise_errors(student, teacher, ids).tolist() == [1.0, 1.0]  # converted layers only
    assert LayerwiseMixers(student).layer_indices == [0, 2]


def test_lattice_layers_take_projected_teacher_queries_and_keys(tmp_path):
    """M == d: q/k copied (keys expanded), v expanded, o copied. M != d: q and k of each head go
    through one orthonormal map, which keeps their inner products (M > d)."""
    teacher = make_teacher("llama", tmp_path / "teacher", layers=3)
    state = teacher.state_dict()
    same = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "a", mixer="lattice", num_slots=8, chunk_size=8)
    layer = same.model.layers[0].self_attn
    assert torch.equal(layer.q_proj.weight, state["model.layers.0.self_attn.q_proj.weight"])
    for proj in ("k_proj", "v_proj"):
        expanded = repeat_kv_heads(state[f"model.layers.0.self_attn.{proj}.weight"], 2, 8)
        assert torch.equal(getattr(layer, proj).weight, expanded)
    assert torch.equal(layer.o_proj.weight, state["model.layers.0.self_attn.o_proj.weight"])
    assert not layer.g_proj.weight.any() and not layer.gamma_proj.weight.any() and not layer.gamma_proj.bias.any()
    assert torch.equal(layer.q_conv.weight[..., -1], torch.ones_like(layer.q_conv.weight[..., -1]))
    assert not layer.q_conv.weight[..., :-1].any()

    wide = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "b", mixer="lattice", num_slots=12, chunk_size=8)
    q = state["model.layers.2.self_attn.q_proj.weight"].double().view(4, 8, 32)
    k = repeat_kv_heads(state["model.layers.2.self_attn.k_proj.weight"], 2, 8).double().view(4, 8, 32)
    q_slots = wide.model.layers[2].self_attn.q_proj.weight.double().view(4, 12, 32)
    k_slots = wide.model.layers[2].self_attn.k_proj.weight.double().view(4, 12, 32)
    torch.testing.assert_close(q_slots.transpose(1, 2) @ k_slots, q.transpose(1, 2) @ k, rtol=1e-5, atol=1e-5)
    again = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "c", mixer="lattice", num_slots=12, chunk_size=8)
    assert all(torch.equal(a, b) for a, b in zip(wide.state_dict().values(), again.state_dict().values()))


# ----------------------------------------------------------------------------- stage 1


@pytest.mark.parametrize("mixer, bound", [("trellis", 0.6), ("lattice", 0.8)])
def test_layerwise_distillation_trains_only_converted_layers(tmp_path, mixer, bound):
    teacher = make_teacher("llama", tmp_path / "teacher", layers=3, seed=1, shared_direction=0.5)
    student = convert_llama_to_trellis(
        tmp_path / "teacher", tmp_path / "trellis", mixer=mixer, keep_attention=[1], **SMALL_MEMORY
    )
    kept_before = {name: t.clone() for name, t in attention_tensors(student, 1).items()}
    held_out = random_tokens(8, 32, seed=99)
    before = layerwise_errors(student, teacher, held_out)
    distill_layerwise(student, teacher, random_tokens(96, 32, seed=1),
                      quick_args(tmp_path / "run", max_steps=60, learning_rate=1e-2))
    after = layerwise_errors(student, teacher, held_out)
    assert before.tolist() == [1.0, 1.0] and (after <= bound * before).all(), after
    for name, tensor in attention_tensors(student, 1).items():
        assert torch.equal(tensor, kept_before[name]), name
    assert all(p.requires_grad for p in student.parameters())
    # The checkpointed stage-1 module holds the converted mixers only.
    assert json.loads((tmp_path / "run" / "checkpoint-60" / "trainer_state.json").read_text())["global_step"] == 60


def test_layerwise_distillation_refuses_a_student_with_nothing_converted(tmp_path):
    teacher = make_teacher("llama", tmp_path / "teacher", layers=2)
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", keep_attention=[0, 1])
    assert layerwise_errors(student, teacher, random_tokens(2, 8)).numel() == 0
    with pytest.raises(ValueError, match="nothing to train"):
        distill_layerwise(student, teacher, random_tokens(8, 8), quick_args(tmp_path / "run", max_steps=1))


# ----------------------------------------------------------------------------- arguments


def test_attention_every_keeps_every_nth_layer():
    assert layer_mixers(8, attention_every=4) == ["trellis"] * 3 + ["attention"] + ["trellis"] * 3 + ["attention"]
    assert layer_mixers(3, attention_every=1) == ["attention"] * 3
    assert layer_mixers(5, attention_every=2, mixer="lattice") == ["lattice", "attention"] * 2 + ["lattice"]
    assert layer_mixers(3, keep_attention=[]) == ["trellis"] * 3
    assert layer_mixers(3, keep_attention=(2, 0)) == ["attention", "trellis", "attention"]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(keep_attention=[1], attention_every=2), "keep_attention and attention_every are mutually exclusive"),
        (dict(keep_attention=[3]), "keep_attention index 3 is out of range"),
        (dict(keep_attention=[-1]), "keep_attention index -1 is out of range"),
        (dict(keep_attention=[0, 2, 0]), "keep_attention lists layer 0 more than once"),
        (dict(keep_attention=[1.0]), "keep_attention must hold integer layer indices"),
        (dict(keep_attention="1"), "keep_attention must be a sequence"),
        (dict(attention_every=0), "attention_every must be an integer >= 1, got 0"),
        (dict(attention_every=4), "attention_every=4 keeps no layer"),
        (dict(mixer="kvm"), "mixer must be one of"),
        (dict(mixer_types=["attention"] * 3), "cannot set mixer_types"),
        (dict(keep_attention=[0], num_key_value_heads=4), "cannot set num_key_value_heads=4"),
    ],
)
def test_rejects_invalid_layer_choices(tmp_path, arguments, message):
    LlamaConfig(**{**SHAPE, "num_hidden_layers": 3}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        convert_llama_to_trellis(tmp_path, tmp_path / "out", **SMALL_MEMORY, **arguments)


@pytest.mark.parametrize(
    "config, message",
    [
        (Qwen3Config(**SHAPE, head_dim=16), "Qwen3 attention applies RMSNorm"),
        (LlamaConfig(**SHAPE, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
         "RoPE is of type 'llama3'"),
        (LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0}), "RoPE is of type 'linear'"),
        (LlamaConfig(**SHAPE, partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
        (MistralConfig(**SHAPE, sliding_window=16), "layer 1 attends within a sliding window"),
        (Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1),
         "layer 1 attends within a sliding window"),
    ],
    ids=["qwen3", "llama3-rope", "linear-rope", "partial-rotary", "mistral-window", "qwen2-window"],
)
def test_refuses_to_keep_attention_it_cannot_reproduce(tmp_path, config, message):
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"keep_attention: cannot keep layer.*{message}"):
        convert_llama_to_trellis(tmp_path, tmp_path / "out", keep_attention=[1], **SMALL_MEMORY)


def test_windowless_layers_of_a_sliding_window_teacher_can_be_kept(tmp_path):
    """Qwen2 slides its window only from layer max_window_layers on: layer 0 is full attention."""
    Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=1)
                     ).save_pretrained(tmp_path / "t")
    student = convert_llama_to_trellis(tmp_path / "t", tmp_path / "out", keep_attention=[0], **SMALL_MEMORY)
    assert student.config.mixer_types == ["attention", "trellis"]


def test_mistral_and_qwen3_convert_when_no_layer_is_kept(tmp_path):
    MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=16)).save_pretrained(tmp_path / "m")
    mistral = convert_llama_to_trellis(tmp_path / "m", tmp_path / "a", mixer="lattice", **SMALL_MEMORY)
    assert mistral.config.mixer_types == ["lattice", "lattice"]
    Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)).save_pretrained(tmp_path / "q")
    assert convert_llama_to_trellis(tmp_path / "q", tmp_path / "b", **SMALL_MEMORY).config.mixer_types is None


# ----------------------------------------------------------------------------- command line


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    return run_convert(parser.parse_args([str(a) for a in argv]))


def test_cli_keeps_attention_layers(tmp_path, capsys):
    make_teacher("qwen2", tmp_path / "teacher", layers=4)
    small = ("--num-slots", 8, "--chunk-size", 8)
    assert run_cli(tmp_path / "teacher", tmp_path / "a", *small, "--keep-attention", "0,2") == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["mixer_types"] == [
        "attention", "trellis", "attention", "trellis"]
    assert run_cli(tmp_path / "teacher", tmp_path / "b", *small, "--attention-every", 2, "--mixer", "lattice") == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["mixer_types"] == ["lattice", "attention", "lattice", "attention"] and config["attention_bias"]

    assert run_cli(tmp_path / "teacher", tmp_path / "c", *small, "--keep-attention", "1,x") == 2
    assert "expected comma-separated layer indices" in capsys.readouterr().err
    assert run_cli(tmp_path / "teacher", tmp_path / "c", *small, "--keep-attention", "1,1") == 2
    assert "keep_attention lists layer 1 more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: the two options exclude each other
        run_cli(tmp_path / "teacher", tmp_path / "c", "--keep-attention", "1", "--attention-every", 2)


# ----------------------------------------------------------------------------- choosing kept layers


def test_conversion_costs_price_each_layer_alone(tmp_path):
    """Right after conversion each converted mixer outputs 0, so converting layer i alone is
    the teacher with layer i's attention removed: the costs are those KLs, and the k dearest
    layers are kept."""
    teacher = make_teacher("llama", tmp_path / "teacher", layers=4, seed=3)
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", **SMALL_MEMORY)
    ids, mask = random_tokens(3, 24, seed=5), torch.ones(3, 24, dtype=torch.long)
    mask[0, 17:] = 0  # padding is left out
    costs = conversion_costs(student, teacher, ids, mask)
    reference = teacher(input_ids=ids, attention_mask=mask).logits
    for layer in range(4):
        with attention_removed(teacher, [layer]):
            expected = distillation_kl(teacher(input_ids=ids, attention_mask=mask).logits, reference, mask).item()
        assert costs[layer] == pytest.approx(expected, rel=1e-4, abs=1e-7)
    assert len(set(costs.values())) == 4 and all(c > 0 for c in costs.values())
    dearest = sorted(costs, key=costs.get)[-2:]
    assert choose_attention_layers(costs, 2) == sorted(dearest)
    assert choose_attention_layers(costs, 0) == []
    with pytest.raises(ValueError, match=r"k must be an integer in \[0, 4\]"):
        choose_attention_layers(costs, 5)


def test_keep_as_attention_builds_the_hybrid_from_stage_one(tmp_path):
    teacher = make_teacher("llama", tmp_path / "teacher", layers=3, seed=1, shared_direction=0.5)
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", **SMALL_MEMORY)
    distill_layerwise(student, teacher, random_tokens(32, 16, seed=1), quick_args(tmp_path / "run", max_steps=5))
    hybrid = keep_as_attention(student, tmp_path / "teacher", tmp_path / "hybrid", [1], **SMALL_MEMORY)
    assert hybrid.config.layer_kinds == ["trellis", "attention", "trellis"]
    for index in (0, 2):
        for name, tensor in hybrid.model.layers[index].self_attn.state_dict().items():
            assert torch.equal(tensor, student.model.layers[index].self_attn.state_dict()[name]), (index, name)
    kept = attention_tensors(hybrid, 1)
    for name, tensor in attention_tensors(teacher, 1).items():
        assert torch.equal(kept[name], tensor), name
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid")
    assert torch.equal(reloaded.model.layers[0].self_attn.alpha_proj.weight, hybrid.model.layers[0].self_attn.alpha_proj.weight)


@pytest.mark.parametrize("value, expected", [("auto:7", 7), ("auto:0", 0), ([1, 2], None), (None, None)])
def test_auto_keep_attention_is_parsed(value, expected):
    assert parse_auto(value) == expected


def test_auto_keep_attention_refuses_other_strings():
    with pytest.raises(ValueError, match="'auto:k'"):
        parse_auto("auto")


def test_cli_keeps_the_dearest_layers(tmp_path, capsys):
    """--keep-attention auto:K: stage 1 on the all-converted model, the layers priced on
    held-out blocks, the K dearest kept, stage 2 on the hybrid."""
    make_teacher("llama", tmp_path / "teacher", layers=4, seed=2)
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": " ".join(f"w{3 + (i * j) % 90}" for j in range(40))})
                               for i in range(20)))
    distill = ("--num-slots", 8, "--chunk-size", 8, "--distill", "--data", texts, "--block-size", 16,
               "--batch-size", 4, "--stage1-steps", 2, "--stage2-steps", 2, "--cpu", "--choice-blocks", 3)
    assert run_cli(tmp_path / "teacher", tmp_path / "auto", *distill, "--keep-attention", "auto:2") == 0
    choice = json.loads((tmp_path / "auto-distill" / "layer_choice.json").read_text())
    costs = {int(layer): cost for layer, cost in choice["costs_kl"].items()}
    assert sorted(costs) == [0, 1, 2, 3] and choice["blocks"] == 3
    assert choice["kept"] == sorted(sorted(costs, key=costs.get)[-2:])
    kinds = json.loads((tmp_path / "auto" / "config.json").read_text())["mixer_types"]
    assert [i for i, kind in enumerate(kinds) if kind == "attention"] == choice["kept"]
    assert "kept as attention" in capsys.readouterr().out

    assert run_cli(tmp_path / "teacher", tmp_path / "x", "--keep-attention", "auto:2") == 2
    assert "needs --distill" in capsys.readouterr().err
    assert run_cli(tmp_path / "teacher", tmp_path / "y", *distill[:-2], "--choice-blocks", 500, "--keep-attention",
                   "auto:1") == 2
    assert "leaving none to train on" in capsys.readouterr().err


def test_layer_choice_refuses_costs_it_cannot_rank_and_layers_it_cannot_price(tmp_path):
    # Issue 50, item 7: a NaN sorts anywhere, so the kept layers would be arbitrary.
    for bad in (float("nan"), float("inf"), None):
        with pytest.raises(ValueError, match=r"the cost of layer 2 is .*, not a finite number"):
            choose_attention_layers({0: 0.1, 1: 0.5, 2: bad, 3: 0.2}, 2)
    teacher = make_teacher("llama", tmp_path / "teacher", layers=4, seed=3)
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", keep_attention=[1], **SMALL_MEMORY)
    ids = random_tokens(1, 8, seed=5)
    for layers in ([99], [1], [0, -1]):
        with pytest.raises(ValueError, match=rf"layers: layer {layers[-1]} is not a converted layer of the student, "
                                             r"whose converted layers are \[0, 2, 3\]"):
            conversion_costs(student, teacher, ids, layers=layers)
