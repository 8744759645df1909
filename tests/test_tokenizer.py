"""Tests for the byte-level BPE tokenizer (training, round trips, padding, persistence)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trellis_lm.tokenization_trellis import (
    DEFAULT_MODEL_MAX_LENGTH,
    TrellisTokenizerFast,
    train_tokenizer,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A trellis keeps a fixed-size memory for every attention head.",
    "Generation runs in constant memory, whatever the context length.",
    "Numbers like 3.14159, 2048 and -17 appear in text too.",
    "Café, naïve, façade, Zürich, São Paulo and Kraków.",
    "Съешь же ещё этих мягких французских булок.",
    "日本語のテキストも正しく扱えるはずです。",
    "emoji: 😀 🚀 🌍 👩‍💻 and flags 🇫🇷🇯🇵",
    "def f(x):\n    return x * 2  # code with tabs\tand newlines\n",
    "Ελληνικά, עברית, العربية, हिन्दी.",
]

# Deliberately includes text unseen in training: rare scripts, combining marks, control
# characters, surrogate-range emoji, odd whitespace; byte fallback must cover all of it.
ROUND_TRIP_TEXTS = [
    "",
    " ",
    "The quick brown fox.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nand\u00a0nbsp",
    "Zürich 😀 🚀 日本語",
    "zero\u200bwidth and e\u0301 combining accent",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 ꙮ 🧑🏽‍🚀",
    "\x00\x01 control \x7f bytes",
    "ünïcödé ŝtrïñg wîth ⓐⓛⓛ ⓚⓘⓝⓓⓢ of ✨ symbols ✨",
]

VOCAB_SIZE = 400


@pytest.fixture(scope="module")
def tokenizer() -> TrellisTokenizerFast:
    return train_tokenizer(CORPUS * 4, vocab_size=VOCAB_SIZE)


def test_special_token_ids(tokenizer: TrellisTokenizerFast) -> None:
    special = (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token)
    assert special == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token is None


def test_vocab_size_is_bounded_and_covers_bytes(tokenizer: TrellisTokenizerFast) -> None:
    assert 256 + 3 < len(tokenizer) <= VOCAB_SIZE


def test_defaults(tokenizer: TrellisTokenizerFast) -> None:
    assert tokenizer.padding_side == "left"
    assert tokenizer.model_max_length == DEFAULT_MODEL_MAX_LENGTH
    assert tokenizer.add_bos_token is True
    assert tokenizer.add_eos_token is False


def test_bos_is_prepended(tokenizer: TrellisTokenizerFast) -> None:
    with_special = tokenizer("hello world")["input_ids"]
    bare = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert with_special[0] == tokenizer.bos_token_id
    assert with_special[1:] == bare
    assert tokenizer.bos_token_id not in bare
    assert tokenizer.eos_token_id not in with_special


def test_no_token_type_ids(tokenizer: TrellisTokenizerFast) -> None:
    assert set(tokenizer("hello")) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_is_exact(tokenizer: TrellisTokenizerFast, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_training_merges_frequent_words(tokenizer: TrellisTokenizerFast) -> None:
    text = "The quick brown fox"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) < len(text.encode("utf-8"))


def test_batch_left_padding(tokenizer: TrellisTokenizerFast) -> None:
    texts = ["hi", "a noticeably longer prompt with more tokens"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    assert input_ids.shape == mask.shape
    lengths = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert mask.sum(dim=1).tolist() == lengths
    short = input_ids[0]
    n_pad = input_ids.shape[1] - lengths[0]
    assert n_pad > 0
    # Pads sit on the left, then the prompt starts with BOS and runs to the last column.
    assert torch.all(short[:n_pad] == tokenizer.pad_token_id)
    assert torch.all(mask[0, :n_pad] == 0) and torch.all(mask[0, n_pad:] == 1)
    assert short[n_pad].item() == tokenizer.bos_token_id
    assert short[n_pad:].tolist() == tokenizer(texts[0])["input_ids"]
    assert torch.all(mask[1] == 1)


def test_right_padding_can_be_requested(tokenizer: TrellisTokenizerFast) -> None:
    batch = tokenizer(["hi", "a longer prompt"], padding=True, padding_side="right")
    first = batch["input_ids"][0]
    assert first[0] == tokenizer.bos_token_id
    assert first[-1] == tokenizer.pad_token_id


def test_save_and_load_round_trip(tokenizer: TrellisTokenizerFast, tmp_path: Path) -> None:
    # A right-padded call leaves padding configured on the backend, which then gets
    # serialised into tokenizer.json; it must not change the loaded default.
    tokenizer(["a", "bcd efg"], padding=True, padding_side="right")
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = TrellisTokenizerFast.from_pretrained(tmp_path)

    assert isinstance(loaded, TrellisTokenizerFast)
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert loaded.model_max_length == tokenizer.model_max_length
    assert loaded.add_bos_token is True
    for text in ROUND_TRIP_TEXTS + CORPUS:
        ids = tokenizer(text)["input_ids"]
        assert loaded(text)["input_ids"] == ids
        assert loaded.decode(ids, skip_special_tokens=True) == text


def test_settings_survive_save(tmp_path: Path) -> None:
    tok = train_tokenizer(CORPUS, vocab_size=300, model_max_length=4096)
    tok.save_pretrained(tmp_path)
    loaded = TrellisTokenizerFast.from_pretrained(tmp_path)
    assert loaded.model_max_length == 4096
    assert TrellisTokenizerFast.from_pretrained(tmp_path, padding_side="right").padding_side == "right"


def test_wraps_backend_object(tokenizer: TrellisTokenizerFast) -> None:
    rewrapped = TrellisTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    text = "Zürich 😀 fox"
    assert rewrapped(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert rewrapped.padding_side == "left"


def test_add_bos_token_can_be_disabled(tokenizer: TrellisTokenizerFast) -> None:
    tok = TrellisTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    tok.add_bos_token = False
    assert tok("fox")["input_ids"] == tokenizer("fox", add_special_tokens=False)["input_ids"]


def test_generator_corpus_is_accepted() -> None:
    tok = train_tokenizer((line for line in CORPUS), vocab_size=300, min_frequency=1)
    assert tok.decode(tok("😀 fox")["input_ids"], skip_special_tokens=True) == "😀 fox"


@pytest.mark.parametrize("vocab_size", [0, 256, 258])
def test_vocab_size_too_small(vocab_size: int) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=vocab_size)


def test_smallest_vocab_is_bytes_plus_specials() -> None:
    tok = train_tokenizer(CORPUS, vocab_size=259)
    assert len(tok) == 259
    assert tok.decode(tok("Zürich 😀")["input_ids"], skip_special_tokens=True) == "Zürich 😀"


@pytest.mark.parametrize("texts", [[], [""], iter([])])
def test_empty_corpus(texts: object) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        train_tokenizer(texts, vocab_size=300)  # type: ignore[arg-type]


def test_non_string_inputs() -> None:
    with pytest.raises(TypeError):
        train_tokenizer("a single string", vocab_size=300)
    with pytest.raises(TypeError):
        train_tokenizer(["ok", 3], vocab_size=300)  # type: ignore[list-item]
