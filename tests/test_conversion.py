"""Conversion of Llama-family checkpoints to Trellis, and the two distillation stages.

Teachers are tiny random models of each supported family, built from configs and saved to
temporary folders with a word-level tokenizer, a chat template and a generation config.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    TrainingArguments,
)
from transformers.models.llama.modeling_llama import repeat_kv

from tiny_models import VOCAB, random_tokens, tiny_model
from trellis_lm import TrellisForCausalLM
from trellis_lm.conversion import (
    NEW_MIXER_PARAMETERS,
    conversion_costs,
    convert_llama_to_trellis,
    distill_layerwise,
    distill_logits,
    distillation_arguments,
    layerwise_errors,
    logit_kl,
)
from trellis_lm.conversion.cli import add_convert_arguments, run_convert
from trellis_lm.conversion.distill import TokenBlocks, block_perplexity, blocks_read, pad_batch
from trellis_lm.conversion.llama import repeat_kv_heads
from trellis_lm.conversion.teacher import TeacherActivations, pad_activations, teacher_attention

SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
# One teacher per family, varied where the families differ: untied/tied heads, a sliding
# window, Qwen2's q/k/v biases, Qwen3's head_dim with H * d != hidden_size and its q/k norms.
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SHAPE, tie_word_embeddings=False)),
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=16)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SHAPE, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True)),
}
SMALL_MEMORY = dict(num_slots=8, chunk_size=8)
CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace words w3..w96 over the teacher vocabulary, specials at 0-2 like the configs."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE,
    )


def make_teacher(family: str, folder, seed: int = 0, shared_direction: float = 0.0) -> torch.nn.Module:
    """Build, save (with tokenizer and generation config) and return a tiny random teacher.

    ``shared_direction`` adds a common vector of that size (relative to the embedding spread) to
    every token embedding: trained models' hidden states share such a direction, and a Trellis
    mixer, whose gate has no bias, needs one to set a token-independent output scale.
    """
    model_class, config = FAMILIES[family]
    teacher = save_random_teacher(model_class, config, folder, seed, shared_direction)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_new_tokens=5).save_pretrained(folder)
    return teacher


def save_random_teacher(model_class, config, folder, seed: int, shared_direction: float) -> torch.nn.Module:
    """``model_class(config)`` seeded, with non-trivial biases and norm weights (so dropping or
    copying them shows) and ``shared_direction`` added to the embeddings; saved with the word
    tokenizer; returned in eval mode."""
    torch.manual_seed(seed)
    teacher = model_class(config).eval()
    with torch.no_grad():
        for name, param in teacher.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
        embed = teacher.model.embed_tokens.weight
        embed += shared_direction * embed.std() * torch.randn(embed.shape[1])
    teacher.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return teacher


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    """(family, teacher, student returned by the conversion, its folder)."""
    root = tmp_path_factory.mktemp(request.param)
    teacher = make_teacher(request.param, root / "teacher")
    student = convert_llama_to_trellis(root / "teacher", root / "trellis", **SMALL_MEMORY)
    return request.param, teacher, student, root / "trellis"


# ----------------------------------------------------------------------------- conversion


def test_copies_shared_weights_exactly_and_expands_key_value_heads(converted):
    family, teacher, student, _ = converted
    source, target = teacher.state_dict(), student.state_dict()
    exact = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{part}.weight"
        for i in range(2)
        for part in ("input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "self_attn.q_proj", "self_attn.o_proj")
    ]
    for name in exact:
        assert torch.equal(target[name], source[name]), name
    heads, kv_heads, head_dim = 4, 2, 16 if family == "qwen3" else 8
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            kv = source[f"model.layers.{i}.self_attn.{proj}.weight"].view(kv_heads, head_dim, -1)
            expanded = target[f"model.layers.{i}.self_attn.{proj}.weight"].view(heads, head_dim, -1)
            for h in range(heads):
                assert torch.equal(expanded[h], kv[h // (heads // kv_heads)]), (proj, h)
    tied = teacher.config.tie_word_embeddings
    assert student.config.tie_word_embeddings == tied
    assert (student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()) == tied
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)
    assert (student.config.num_heads, student.config.head_dim) == (heads, head_dim)
    assert (student.config.num_slots, student.config.chunk_size) == (8, 8)
    assert (student.config.pad_token_id, student.config.bos_token_id, student.config.eos_token_id) == (0, 1, 2)


def test_repeat_kv_heads_matches_grouped_query_attention():
    """Projecting with the expanded weight gives the heads transformers' `repeat_kv` gives."""
    x, weight = torch.randn(3, 5, 32), torch.randn(2 * 8, 32)  # 2 key/value heads of 8
    by_attention = repeat_kv((x @ weight.T).view(3, 5, 2, 8).transpose(1, 2), 3)  # [B, 6, T, 8]
    by_weight = (x @ repeat_kv_heads(weight, 3, 8).T).view(3, 5, 6, 8).transpose(1, 2)
    assert torch.equal(by_weight, by_attention)


def test_converted_folder_loads_with_auto_classes_and_generates(converted):
    _, teacher, student, folder = converted
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert isinstance(loaded, TrellisForCausalLM) and loaded.dtype == teacher.dtype
    ids = random_tokens(2, 10)
    torch.testing.assert_close(loaded(ids).logits, student(ids).logits, rtol=0, atol=0)
    out = loaded.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, 14) and torch.equal(out[:, :10], ids)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer("w5 w17 w42")["input_ids"] == [5, 17, 42]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert loaded.generation_config.max_new_tokens == 5 and loaded.generation_config.eos_token_id == 2


def test_converted_model_is_the_teacher_without_attention(converted):
    """The documented starting point: every new mixer outputs exactly zero."""
    _, teacher, student, _ = converted
    handles = [
        layer.self_attn.register_forward_hook(lambda module, args, output: (torch.zeros_like(output[0]), output[1]))
        for layer in teacher.model.layers
    ]
    ids = random_tokens(2, 12, seed=3)
    try:
        without_attention = teacher(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(student(ids).logits, without_attention, rtol=0, atol=0)
    assert layerwise_errors(student, teacher, ids).tolist() == [1.0, 1.0]


def test_new_parameters_start_as_documented(converted):
    _, teacher, student, _ = converted
    attn = student.model.layers[1].self_attn
    assert set(NEW_MIXER_PARAMETERS) <= {name.split(".")[0] for name, _ in attn.named_parameters()}
    for conv in (attn.q_conv, attn.k_conv):
        assert torch.equal(conv.weight[..., -1], torch.ones_like(conv.weight[..., -1]))
        assert not conv.weight[..., :-1].any()
    assert not attn.g_proj.weight.any() and not attn.beta_proj.weight.any() and not attn.gamma_proj.weight.any()
    x = torch.randn(64, 32)
    beta = torch.exp(torch.nn.functional.logsigmoid(attn.beta_proj(x)) / student.config.gate_logit_normalizer)
    assert beta.min() > 0.89 and beta.max() < 0.9991 and beta.max() > 0.998
    torch.testing.assert_close(torch.sigmoid(attn.gamma_proj(x)), torch.full((64, 4), 0.5))
    # alpha entries have unit variance for a unit-RMS normalised input.
    x_hat = torch.randn(4096, 32)
    alpha = attn.alpha_proj(x_hat * teacher.model.layers[1].input_layernorm.weight)
    assert 0.8 < alpha.var().item() < 1.2
    assert torch.equal(attn.o_norm.weight, torch.ones_like(attn.o_norm.weight))


def test_conversion_is_reproducible_and_logs_what_it_drops(tmp_path, caplog):
    make_teacher("qwen3", tmp_path / "teacher")
    with caplog.at_level(logging.WARNING, logger="trellis_lm.conversion.llama"):
        first = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "a", **SMALL_MEMORY)
    second = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "b", **SMALL_MEMORY)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert "q_norm/k_norm weights are dropped" in caplog.text and "rotary" in caplog.text


@pytest.mark.parametrize(
    "family, drop", [("qwen2", "q/k/v_proj biases are dropped"), ("mistral", "sliding_window=16 is dropped")]
)
def test_logs_dropped_biases_and_windows(tmp_path, caplog, family, drop):
    make_teacher(family, tmp_path / "teacher")
    with caplog.at_level(logging.WARNING, logger="trellis_lm.conversion.llama"):
        convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", **SMALL_MEMORY)
    assert drop in caplog.text


@pytest.mark.parametrize(
    "config, message",
    [
        (GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB), "unsupported architecture: model_type 'gpt2'"),
        (LlamaConfig(**SHAPE, attention_bias=True), "attention_bias=True"),
        (LlamaConfig(**SHAPE, mlp_bias=True), "mlp_bias=True"),
        (LlamaConfig(**SHAPE, hidden_act="gelu"), "hidden_act='gelu'"),
        (LlamaConfig(**SHAPE, architectures=["LlamaForSequenceClassification"]), "unsupported architecture"),
    ],
)
def test_rejects_unsupported_architectures_and_options(tmp_path, config, message):
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        convert_llama_to_trellis(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"head_dim": 4}, "cannot set head_dim=4.*mismatched head dims"),
        ({"hidden_size": 64}, "cannot set hidden_size=64"),
        ({"num_slot": 4}, "'num_slot' is not a TrellisConfig field"),
        ({"compress_fn": "cube"}, "compress_fn must be one of"),
    ],
)
def test_rejects_conflicting_overrides(tmp_path, overrides, message):
    FAMILIES["llama"][1].save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        convert_llama_to_trellis(tmp_path, tmp_path / "out", **overrides)


@pytest.mark.parametrize("dst", ["same", "inside", "holding"])
def test_never_writes_into_its_source(tmp_path, dst):
    make_teacher("llama", tmp_path / "teacher")
    before = {p: p.read_bytes() for p in (tmp_path / "teacher").iterdir()}
    target = {"same": tmp_path / "teacher", "inside": tmp_path / "teacher" / "out", "holding": tmp_path}[dst]
    with pytest.raises(ValueError, match="a conversion never writes into its source"):
        convert_llama_to_trellis(tmp_path / "teacher", target, **SMALL_MEMORY)
    assert {p: p.read_bytes() for p in (tmp_path / "teacher").iterdir()} == before


def test_rejects_a_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="not a local checkpoint folder"):
        convert_llama_to_trellis(tmp_path / "missing", tmp_path / "out")


def test_overrides_reach_the_config(tmp_path):
    make_teacher("llama", tmp_path / "teacher")
    student = convert_llama_to_trellis(
        tmp_path / "teacher", tmp_path / "out", num_slots=4, chunk_size=2, compress_fn="l2norm", conv_size=0,
        use_forget_gate=False, head_dim=8,
    )
    assert (student.config.compress_fn, student.config.conv_size, student.config.num_slots) == ("l2norm", 0, 4)
    assert student.model.layers[0].self_attn.q_conv is None and student.model.layers[0].self_attn.beta_proj is None
    assert json.loads((tmp_path / "out" / "config.json").read_text())["chunk_size"] == 2


# ----------------------------------------------------------------------------- distillation


def quick_args(output_dir, **overrides) -> TrainingArguments:
    """Short CPU runs without progress bars; checkpoints only where a test asks."""
    fields = dict(
        per_device_train_batch_size=8, save_steps=1000, logging_steps=1000, use_cpu=True, disable_tqdm=True,
        warmup_steps=0, seed=0,
    )
    return distillation_arguments(str(output_dir), **{**fields, **overrides})


@pytest.fixture(scope="module")
def llm_like_teacher(tmp_path_factory):
    """(teacher, its folder): a Llama teacher whose embeddings share a direction, as trained ones do."""
    folder = tmp_path_factory.mktemp("llm_like") / "teacher"
    return make_teacher("llama", folder, seed=1, shared_direction=0.5), folder


def test_layerwise_distillation_halves_every_layer_error(llm_like_teacher, tmp_path):
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "trellis", **SMALL_MEMORY)
    carried_before = student.model.layers[0].self_attn.q_proj.weight.clone()
    held_out = random_tokens(8, 32, seed=99)
    before = layerwise_errors(student, teacher, held_out)
    args = quick_args(tmp_path / "run", max_steps=60, learning_rate=1e-2)
    distill_layerwise(student, teacher, random_tokens(96, 32, seed=1), args)
    after = layerwise_errors(student, teacher, held_out)
    assert before.tolist() == [1.0, 1.0] and (after <= 0.5 * before).all(), after
    assert torch.equal(student.model.layers[0].self_attn.q_proj.weight, carried_before)  # only new parameters train
    assert all(p.requires_grad for p in student.parameters())


def test_layerwise_distillation_checkpoints_and_resumes(llm_like_teacher, tmp_path):
    teacher, folder = llm_like_teacher
    data = random_tokens(32, 16, seed=2)
    run = tmp_path / "run"
    first = convert_llama_to_trellis(folder, tmp_path / "a", **SMALL_MEMORY)
    distill_layerwise(first, teacher, data, quick_args(run, max_steps=4, save_steps=2, learning_rate=1e-2))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]

    # A fresh conversion resumed from step 2 ends where the uninterrupted run ended.
    resumed = convert_llama_to_trellis(folder, tmp_path / "b", **SMALL_MEMORY)
    distill_layerwise(resumed, teacher, data, quick_args(tmp_path / "again", max_steps=4, learning_rate=1e-2),
                      resume_from_checkpoint=str(run / "checkpoint-2"))
    for a, b in zip(first.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_layerwise_distillation_with_carried_projections_fits_an_isotropic_teacher(tmp_path):
    """A random teacher without a shared direction averages the past uniformly, which the frozen
    projections fit poorly (about 0.7 after 300 steps); training them too gets below half."""
    make_teacher("llama", tmp_path / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")
    student = convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", **SMALL_MEMORY)
    args = quick_args(tmp_path / "run", max_steps=300, learning_rate=1e-2)
    distill_layerwise(student, teacher, random_tokens(256, 32, seed=1), args, train_carried=True)
    assert (layerwise_errors(student, teacher, random_tokens(16, 32, seed=99)) < 0.5).all()


@pytest.mark.parametrize("lora_rank, learning_rate", [(8, 1e-2), (None, 3e-3)], ids=["lora", "full"])
def test_logit_distillation_lowers_kl(llm_like_teacher, tmp_path, lora_rank, learning_rate):
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "trellis", **SMALL_MEMORY).float()
    held_out = random_tokens(8, 24, seed=98)
    before = logit_kl(student, teacher, held_out)
    run = tmp_path / "run"
    student = distill_logits(student, teacher, random_tokens(64, 24, seed=3), quick_args(
        run, max_steps=20, learning_rate=learning_rate, save_steps=10), lora_rank=lora_rank, temperature=2.0)
    assert isinstance(student, TrellisForCausalLM)
    assert logit_kl(student, teacher, held_out) < 0.8 * before
    checkpoint = run / "checkpoint-20"
    assert (checkpoint / ("adapter_model.safetensors" if lora_rank else "model.safetensors")).is_file()


def test_held_out_perplexity_records_stage_two_s_learning_curve(llm_like_teacher, tmp_path):
    """The curve's steps, its first point the student's perplexity before stage 2, its last the
    returned (LoRA-merged) student's, measured independently; a bad ``eval_every`` is refused."""
    import math

    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "trellis", **SMALL_MEMORY).float()
    heldout = random_tokens(5, 24, seed=97)  # 5 rows: the measure's batches of 4 leave one over

    def perplexity(model):
        with torch.no_grad():
            return math.exp(model.eval()(input_ids=heldout, labels=heldout).loss.item())

    before = perplexity(student)
    student = distill_logits(student, teacher, random_tokens(64, 24, seed=3), quick_args(
        tmp_path / "run", max_steps=7, learning_rate=1e-2), lora_rank=8, heldout=heldout, eval_every=3)
    curve = json.loads((tmp_path / "run" / "perplexity.json").read_text())
    assert [point["step"] for point in curve] == [0, 3, 6, 7]
    assert curve[0]["perplexity"] == pytest.approx(before, rel=1e-5)
    assert curve[-1]["perplexity"] == pytest.approx(perplexity(student), rel=1e-4)
    assert curve[-1]["perplexity"] != pytest.approx(curve[0]["perplexity"], rel=1e-4)  # measured as it trained
    with pytest.raises(ValueError, match="eval_every must be an integer >= 1"):
        distill_logits(student, teacher, random_tokens(8, 24, seed=3), quick_args(tmp_path / "bad", max_steps=1),
                       heldout=heldout, eval_every=0)


def test_padding_is_left_out_of_both_measures(converted):
    """Right-padding a batch with junk tokens changes neither the layer errors nor the KL."""
    _, teacher, _, folder = converted
    student = TrellisForCausalLM.from_pretrained(folder).eval()  # a copy: the fixture's model is shared
    torch.manual_seed(0)
    for layer in student.model.layers:  # a nonzero output, so the errors depend on the inputs
        torch.nn.init.normal_(layer.self_attn.g_proj.weight, std=0.3)
    ids = random_tokens(2, 10, seed=5)
    padded = torch.cat([ids, random_tokens(2, 4, seed=6)], dim=1)
    mask = torch.cat([torch.ones(2, 10), torch.zeros(2, 4)], dim=1).long()
    torch.testing.assert_close(
        layerwise_errors(student, teacher, padded, mask), layerwise_errors(student, teacher, ids)
    )
    torch.testing.assert_close(logit_kl(student, teacher, padded, mask), logit_kl(student, teacher, ids))


def test_token_blocks_join_texts_with_eos_and_cut_blocks():
    blocks = TokenBlocks.from_texts(["w3 w4 w5", "w6 w7", "w8"], word_tokenizer(), block_size=4)
    assert [b.tolist() for b in blocks.rows] == [[3, 4, 5, 2], [6, 7, 2, 8]]  # the tail [2] predicts nothing


# ----------------------------------------------------------------------------- command line


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    return run_convert(parser.parse_args([str(a) for a in argv]))


def test_cli_converts_and_distils(llm_like_teacher, tmp_path):
    _, folder = llm_like_teacher
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps({"text": " ".join(f"w{3 + (i * j) % 90}" for j in range(40))})
                               for i in range(20)))
    dst = tmp_path / "trellis"
    assert run_cli(folder, dst, "--num-slots", 8, "--chunk-size", 8, "--set", "compress_fn=l2norm") == 0
    assert json.loads((dst / "config.json").read_text())["compress_fn"] == "l2norm"

    # --overwrite: DST holds the plain conversion (and then the distilled model) from the run before.
    distill = ("--num-slots", 8, "--chunk-size", 8, "--distill", "--data", texts, "--block-size", 16,
               "--batch-size", 4, "--stage1-steps", 2, "--stage2-steps", 2, "--cpu", "--overwrite")
    assert run_cli(folder, dst, *distill) == 0
    distilled = AutoModelForCausalLM.from_pretrained(dst)
    assert distilled.model.layers[0].self_attn.g_proj.weight.any()  # trained away from its zero start
    assert AutoTokenizer.from_pretrained(dst).chat_template == CHAT_TEMPLATE
    work = tmp_path / "trellis-distill"
    assert (work / "layerwise" / "final" / "config.json").is_file()
    assert [p.name for p in (work / "logits").glob("checkpoint-*")] == ["checkpoint-2"]

    # Stage 1 on cached teacher activations, measured on held-out blocks.
    cached = (*distill[:-1], "--stage1-cache-gib", "0.001", "--heldout-blocks", 2, "--eval-every", 1)
    assert run_cli(folder, tmp_path / "cached", *cached, "--work-dir", tmp_path / "cached-work") == 0
    assert (tmp_path / "cached-work" / "teacher_activations" / "manifest.json").is_file()
    curve = json.loads((tmp_path / "cached-work" / "layerwise" / "layer_errors.json").read_text())
    assert [point["step"] for point in curve] == [0, 1, 2]

    # Resuming a finished run redoes nothing and writes the same model again.
    assert run_cli(folder, dst, *distill, "--resume") == 0
    again = AutoModelForCausalLM.from_pretrained(dst)
    for a, b in zip(distilled.state_dict().values(), again.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cli_reports_errors_with_exit_status_2(tmp_path, capsys):
    FAMILIES["llama"][1].save_pretrained(tmp_path / "teacher")
    assert run_cli(tmp_path / "teacher", tmp_path / "out", "--set", "head_dim=4") == 2
    assert "mismatched head dims" in capsys.readouterr().err
    assert run_cli(tmp_path / "teacher", tmp_path / "out", "--distill") == 2
    assert "argument --data: no training texts given" in capsys.readouterr().err


# ----------------------------------------------------------------------------- stage 1: cached teacher, held-out stop


def test_teacher_activations_are_the_teachers_and_reused_from_disk(llm_like_teacher, tmp_path):
    teacher, _ = llm_like_teacher
    blocks = TokenBlocks([random_tokens(1, n, seed=n)[0] for n in (16, 9, 16, 5)])
    cached = TeacherActivations(teacher, blocks, [0, 1], tmp_path / "acts", memory_bytes=0, batch_size=3)
    assert cached.computed == 4 and len(list((tmp_path / "acts").glob("block-*.safetensors"))) == 4
    for index in range(4):
        item = cached[index]
        inputs, targets = teacher_attention(teacher, item["input_ids"][None], None, [0, 1])
        torch.testing.assert_close(item["teacher_inputs"], torch.cat(inputs), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(item["teacher_targets"], torch.cat(targets), rtol=1e-5, atol=1e-6)
    batch = pad_activations([cached[1], cached[3]])
    assert batch["teacher_inputs"].shape == (2, 2, 9, 32) and not batch["teacher_inputs"][1, :, 5:].any()
    assert TeacherActivations(teacher, blocks, [0, 1], tmp_path / "acts", memory_bytes=0).computed == 0  # resumed
    assert TeacherActivations(teacher, blocks, [1], tmp_path / "acts", memory_bytes=0).computed == 4  # other layers
    in_memory = TeacherActivations(teacher, blocks, [0, 1], tmp_path / "mixed", memory_bytes=2 * 2 * 16 * 32 * 4)
    assert len(in_memory.memory) == 1 and len(list((tmp_path / "mixed").glob("block-*"))) == 3  # the budget holds one
    _, targets = teacher_attention(teacher, blocks[2]["input_ids"][None], None, [0, 1])
    torch.testing.assert_close(in_memory[2]["teacher_targets"], torch.cat(targets), rtol=1e-5, atol=1e-6)


def test_stage_one_on_cached_activations_equals_stage_one_on_the_teacher(llm_like_teacher, tmp_path):
    teacher, folder = llm_like_teacher
    data = random_tokens(24, 16, seed=4)
    students = []
    for cache in (None, tmp_path / "acts"):
        student = convert_llama_to_trellis(folder, tmp_path / f"s{len(students)}", **SMALL_MEMORY)
        distill_layerwise(student, teacher, data, quick_args(tmp_path / f"run{len(students)}", max_steps=6,
                                                             learning_rate=1e-2), teacher_cache=cache)
        students.append(student)
    assert students[0].model.layers[0].self_attn.g_proj.weight.any()
    for a, b in zip(students[0].state_dict().values(), students[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_held_out_layer_errors_record_the_curve_and_stop_a_stalled_run(llm_like_teacher, tmp_path):
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "s", **SMALL_MEMORY)
    heldout = random_tokens(4, 16, seed=99)
    distill_layerwise(student, teacher, random_tokens(64, 16, seed=1), quick_args(tmp_path / "run", max_steps=12,
                      learning_rate=1e-2), teacher_cache=True, heldout=heldout, eval_every=3)
    curve = json.loads((tmp_path / "run" / "layer_errors.json").read_text())
    assert [point["step"] for point in curve] == [0, 3, 6, 9, 12]
    assert curve[0]["layers"] == {"0": 1.0, "1": 1.0} and curve[-1]["mean"] < curve[0]["mean"]
    torch.testing.assert_close(torch.tensor(list(curve[-1]["layers"].values())),
                               layerwise_errors(student, teacher, heldout), rtol=1e-5, atol=1e-6)
    # Nothing can improve at a learning rate of 0: stopped after `patience` measurements.
    stalled = convert_llama_to_trellis(folder, tmp_path / "t", **SMALL_MEMORY)
    distill_layerwise(stalled, teacher, random_tokens(64, 16, seed=1), quick_args(tmp_path / "stalled", max_steps=40,
                      learning_rate=0.0), heldout=heldout, eval_every=2, patience=2)
    steps = [point["step"] for point in json.loads((tmp_path / "stalled" / "layer_errors.json").read_text())]
    assert steps == [0, 2, 4]


def test_a_cached_stage_one_computes_only_the_blocks_its_steps_read(llm_like_teacher, tmp_path):
    """64 blocks given, 2 steps of 8 rows: 16 blocks cached, evenly spaced over the data (the
    cache is bounded by the run, not by the data's size)."""
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "s", **SMALL_MEMORY)
    data = random_tokens(64, 16, seed=1)
    distill_layerwise(student, teacher, data, quick_args(tmp_path / "run", max_steps=2, learning_rate=1e-2),
                      teacher_cache=tmp_path / "acts", cache_memory_bytes=0)
    assert len(list((tmp_path / "acts").glob("block-*.safetensors"))) == 16
    read = blocks_read(TokenBlocks(list(data)), quick_args(tmp_path / "x", max_steps=2))
    assert [int(i) for i in read.indices] == list(range(0, 64, 4))
    assert len(blocks_read(TokenBlocks(list(data)), quick_args(tmp_path / "x", max_steps=9))) == 64


# ----------------------------------------------------------------------------- issue 50: held-out padding, checks


def test_held_out_measures_leave_padding_out(llm_like_teacher, tmp_path):
    # Item 6: right-padded held-out blocks (the data's last block is short) are measured on their
    # real tokens, as rows read alone; padding is neither read nor counted as a target.
    teacher, folder = llm_like_teacher
    rows = [random_tokens(1, n, seed=n)[0] for n in (16, 7, 12)]
    batch = pad_batch([{"input_ids": row} for row in rows])
    junk = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 5)  # any token at padding
    model = tiny_model(seed=2, vocab_size=VOCAB).eval()
    losses = [model(input_ids=row[None], labels=row[None]).loss.item() * (len(row) - 1) for row in rows]
    expected = math.exp(sum(losses) / sum(len(row) - 1 for row in rows))
    for ids in (batch["input_ids"], junk):
        assert block_perplexity(model, ids, 2, batch["attention_mask"]) == pytest.approx(expected, rel=1e-5)

    student = convert_llama_to_trellis(folder, tmp_path / "s", **SMALL_MEMORY)
    distill_layerwise(student, teacher, random_tokens(16, 16, seed=1), quick_args(tmp_path / "one", max_steps=2,
                      learning_rate=1e-2), heldout=junk, heldout_mask=batch["attention_mask"], eval_every=1)
    curve = json.loads((tmp_path / "one" / "layer_errors.json").read_text())
    alone = torch.stack([layerwise_errors(student, teacher, row[None]) for row in rows])
    padded = layerwise_errors(student, teacher, junk, batch["attention_mask"])
    torch.testing.assert_close(torch.tensor(list(curve[-1]["layers"].values())), padded, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(padded, layerwise_errors(student, teacher, junk))  # (padding would count)
    assert alone.shape == (3, 2)

    tuned = distill_logits(student, teacher, random_tokens(8, 16, seed=3), quick_args(tmp_path / "two", max_steps=1),
                           lora_rank=None, heldout=junk, heldout_mask=batch["attention_mask"], eval_every=1)
    curve = json.loads((tmp_path / "two" / "perplexity.json").read_text())
    assert curve[-1]["perplexity"] == pytest.approx(block_perplexity(tuned.eval(), batch["input_ids"], 4,
                                                                     batch["attention_mask"]), rel=1e-4)


def test_cli_held_out_blocks_are_measured_on_their_real_tokens(llm_like_teacher, tmp_path):
    _, folder = llm_like_teacher
    texts = tmp_path / "texts.jsonl"  # 20 texts of 40 words and an EOS: 820 tokens, a last block of 4
    texts.write_text("\n".join(json.dumps({"text": " ".join(f"w{3 + (i * j) % 90}" for j in range(40))})
                               for i in range(20)))
    work = tmp_path / "work"
    assert run_cli(folder, tmp_path / "out", "--num-slots", 8, "--chunk-size", 8, "--distill", "--data", texts,
                   "--block-size", 16, "--batch-size", 4, "--stage1-steps", 2, "--stage2-steps", 1, "--cpu",
                   "--heldout-blocks", 2, "--eval-every", 1, "--work-dir", work) == 0
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    blocks = TokenBlocks.from_texts([json.loads(line)["text"] for line in texts.read_text().splitlines()], tokenizer, 16)
    assert len(blocks.rows[-1]) < 16  # the held-out blocks need padding
    heldout = pad_batch([{"input_ids": row} for row in blocks.rows[-2:]])
    stage1 = TrellisForCausalLM.from_pretrained(work / "layerwise" / "final")
    teacher = AutoModelForCausalLM.from_pretrained(folder)
    curve = json.loads((work / "layerwise" / "layer_errors.json").read_text())
    torch.testing.assert_close(torch.tensor(list(curve[-1]["layers"].values())),
                               layerwise_errors(stage1, teacher, heldout["input_ids"], heldout["attention_mask"]),
                               rtol=1e-4, atol=1e-6)


def test_stage_arguments_that_would_be_ignored_or_cannot_work_are_refused(llm_like_teacher, tmp_path):
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "s", **SMALL_MEMORY)
    data, args = random_tokens(8, 16, seed=1), quick_args(tmp_path / "run", max_steps=1)
    heldout = random_tokens(2, 16, seed=2)
    for kwargs, match in [
        (dict(heldout=heldout, patience=0), r"patience must be None or an integer >= 1"),
        (dict(heldout=heldout, patience=-2), r"patience must be None or an integer >= 1"),
        (dict(patience=3), r"patience stops stage 1 on held-out measurements: pass heldout"),
        (dict(eval_every=0), r"eval_every must be an integer >= 1"),
        (dict(teacher_cache=True, cache_memory_bytes=-1), r"cache_memory_bytes must be an integer >= 0"),
        (dict(heldout_mask=torch.ones(2, 16)), r"heldout_mask marks the real tokens of held-out blocks: pass heldout"),
        (dict(heldout=heldout, heldout_mask=torch.ones(2, 15)), r"heldout_mask must be \[N, T\] like heldout"),
    ]:
        with pytest.raises(ValueError, match=match):
            distill_layerwise(student, teacher, data, args, **kwargs)
    for kwargs, match in [
        (dict(state_passing=0, state_passing_from=0.5), r"state_passing_from=0.5 is given, but state_passing is 0"),
        (dict(state_passing=1.5), r"state_passing must be a probability in \[0, 1\]"),
        (dict(eval_every=0), r"eval_every must be an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            distill_logits(student, teacher, data, args, **kwargs)
    with pytest.raises(ValueError, match=r"memory_bytes must be an integer >= 0"):
        TeacherActivations(teacher, TokenBlocks(list(data)), [0, 1], tmp_path / "acts", memory_bytes=-1)
    assert not (tmp_path / "acts").exists() and not list((tmp_path / "run").glob("*"))


def test_ids_that_are_not_token_ids_are_refused_where_they_come_in(llm_like_teacher, tmp_path):
    """Issue 72: held-out ids as floats, or past the vocabulary, failed 24 frames inside the
    embedding (floats as training data were truncated silently). Each argument is checked as it
    comes in, by name, before a model runs or anything is written."""
    teacher, folder = llm_like_teacher
    student = convert_llama_to_trellis(folder, tmp_path / "s", **SMALL_MEMORY)
    vocab = student.config.vocab_size
    data, args = random_tokens(8, 16, seed=1), quick_args(tmp_path / "run", max_steps=1)
    ids = random_tokens(2, 16, seed=2)
    past = ids.clone()
    past[1, 7] = vocab
    negative = ids.clone()
    negative[0, 0] = -1
    bad = [(ids.float(), "must be a tensor of integer token ids, got torch.float32"),
           (ids.bool(), "must be a tensor of integer token ids, got torch.bool"),
           (past, rf"holds token ids in \[\d+, {vocab}\], but the models' vocabulary is \[0, {vocab}\)"),
           (negative, r"holds token ids in \[-1, \d+\]")]
    for stage in (distill_layerwise, distill_logits):
        for value, match in bad:
            with pytest.raises(ValueError, match=f"^heldout {match}"):
                stage(student, teacher, data, args, heldout=value)
            with pytest.raises(ValueError, match=f"^train_data {match}"):
                stage(student, teacher, value, args)
    for measure in (layerwise_errors, logit_kl, conversion_costs):
        for value, match in bad:
            with pytest.raises(ValueError, match=f"^input_ids {match}"):
                measure(student, teacher, value)
    assert not list((tmp_path / "run").glob("*"))


def test_teacher_activation_files_that_are_not_the_block_s_are_computed_again(llm_like_teacher, tmp_path):
    # A truncated, empty or swapped block file is never trained on: each block's file records its
    # run and its tokens, and one that safetensors cannot read whole or that is another's is redone.
    teacher, _ = llm_like_teacher
    blocks = TokenBlocks([random_tokens(1, n, seed=n)[0] for n in (16, 9, 16, 5)])
    acts = tmp_path / "acts"
    assert TeacherActivations(teacher, blocks, [0, 1], acts, memory_bytes=0, batch_size=1).computed == 4
    files = [acts / f"block-{i}.safetensors" for i in range(4)]
    files[0].write_bytes(files[0].read_bytes()[:-64])  # truncated
    files[1].write_bytes(b"")  # empty
    swapped = files[2].read_bytes()
    files[2].write_bytes(files[3].read_bytes())
    files[3].write_bytes(swapped)
    again = TeacherActivations(teacher, blocks, [0, 1], acts, memory_bytes=0, batch_size=1)
    assert again.computed == 4
    for index in range(4):
        inputs, targets = teacher_attention(teacher, blocks[index]["input_ids"][None], None, [0, 1])
        torch.testing.assert_close(again[index]["teacher_targets"], torch.cat(targets), rtol=1e-5, atol=1e-6)
    assert TeacherActivations(teacher, blocks, [0, 1], acts, memory_bytes=0, batch_size=1).computed == 0
    files[1].write_bytes(b"")  # changed under a running stage: named
    with pytest.raises(ValueError, match=r"block-1.safetensors: the teacher activations of block 1 cannot be read"):
        again[1]


def test_convert_refuses_distillation_options_it_cannot_honour_before_converting(llm_like_teacher, tmp_path, capsys):
    _, folder = llm_like_teacher
    texts = tmp_path / "texts.txt"
    texts.write_text(" ".join(f"w{3 + i % 90}" for i in range(400)))
    (tmp_path / "a-file").write_text("not a folder")
    small = ("--num-slots", 8, "--chunk-size", 8)
    distill = ("--distill", "--data", texts, "--block-size", 16, "--stage1-steps", 1, "--stage2-steps", 1, "--cpu")
    layers = AutoConfig.from_pretrained(folder).num_hidden_layers
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, match in [
        ((*small, "--heldout-blocks", 2), "argument --heldout-blocks: held-out blocks measure stage 1"),
        ((*small, *distill, "--work-dir", tmp_path / "a-file"), "argument --work-dir: .*a-file is a file"),
        ((*small, *distill, "--keep-attention", f"auto:{layers + 1}"),
         rf"argument --keep-attention: keeping {layers + 1} layers as attention is more than the teacher's {layers}"),
        ((*small, *distill, "--state-passing", 0, "--state-passing-from", 0.5),
         "argument --state-passing-from: state passing is off"),
    ]:
        assert run_cli(folder, tmp_path / "out", *argv) == 2
        err = capsys.readouterr().err
        assert re.search(match, err) and len(err.strip().splitlines()) == 1, err
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing converted, nothing written
