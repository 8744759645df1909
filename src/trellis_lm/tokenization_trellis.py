"""Byte-level BPE tokenizer for Trellis models.

This module is deliberately self-contained: it imports only ``transformers`` and
``tokenizers`` and has no relative imports, because ``save_pretrained`` copies it on
its own into checkpoints so they can be loaded with ``trust_remote_code=True``
without ``trellis_lm`` being installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tokenizers import Encoding, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_MODEL_MAX_LENGTH",
    "TrellisTokenizerFast",
    "train_tokenizer",
]

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
# Order matters: the trainer assigns ids in this order, giving pad=0, bos=1, eos=2.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# Trellis keeps a fixed-size memory per head instead of a KV cache and has no
# positional embeddings, so there is no architectural context limit. The value is
# still finite so that `truncation=True`, `padding="max_length"` and tools that read
# `model_max_length` (e.g. evaluation harnesses sizing their windows) stay
# well-defined; lower it to the training context length where that matters.
DEFAULT_MODEL_MAX_LENGTH = 1_000_000

_BYTE_ALPHABET_SIZE = 256


def _bos_post_processor(bos_token: str, bos_token_id: int) -> processors.TemplateProcessing:
    """Post-processor that starts every sequence (and each half of a pair) with BOS.

    The template is the same one ``transformers`` builds for ``add_bos_token=True``,
    so toggling that flag later on the wrapper stays consistent with it.
    """
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0",
        pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_token_id)],
    )


def _byte_level_pipeline(model: models.BPE) -> Tokenizer:
    """Wrap a BPE model with the byte-level pre-tokenizer and decoder.

    ``add_prefix_space=False`` is what makes ``decode(encode(text)) == text``: a
    prefix space would be inserted on encode and could not be told apart from a
    real leading space on decode.
    """
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


class TrellisTokenizerFast(PreTrainedTokenizerFast):
    """Fast byte-level BPE tokenizer used by Trellis language models.

    Special tokens default to ``<|pad|>``, ``<|bos|>`` and ``<|eos|>`` (ids 0, 1, 2
    for tokenizers made by :func:`train_tokenizer`); there is no unknown token since
    every byte is in the vocabulary.

    Padding defaults to the left: batched generation appends new tokens on the right,
    so prompts must end flush against them and their pads belong on the left. Pass
    ``padding_side="right"`` (or set the attribute) for training-style batches.

    The backend ``tokenizers.Tokenizer`` is the single source of truth, including
    its post-processor; ``add_bos_token``/``add_eos_token`` reflect what that
    post-processor does and can be toggled, which rebuilds it.

    Construct it from a trained backend (``tokenizer_object=``), a ``tokenizer.json``
    (``tokenizer_file=``), ``vocab=``/``merges=`` (the byte-level pipeline and a BOS
    post-processor are then rebuilt around them), or :meth:`from_pretrained`.

    Args:
        bos_token: Beginning-of-sequence token.
        eos_token: End-of-sequence token.
        pad_token: Padding token.
        unk_token: Unknown token; ``None`` because byte-level BPE never needs one.
        model_max_length: Nominal maximum sequence length, see
            :data:`DEFAULT_MODEL_MAX_LENGTH`.
        **kwargs: Forwarded to :class:`transformers.PreTrainedTokenizerFast`.
    """

    vocab_files_names = {"tokenizer_file": "tokenizer.json"}
    model_input_names = ["input_ids", "attention_mask"]
    padding_side = "left"
    slow_tokenizer_class = None

    def __init__(
        self,
        *,
        bos_token: Any = BOS_TOKEN,
        eos_token: Any = EOS_TOKEN,
        pad_token: Any = PAD_TOKEN,
        unk_token: Any = None,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
        **kwargs: Any,
    ) -> None:
        vocab = kwargs.pop("vocab", None)
        merges = kwargs.pop("merges", None)
        if kwargs.get("tokenizer_object") is None and kwargs.get("tokenizer_file") is None:
            if vocab is None or merges is None:
                raise ValueError(
                    "TrellisTokenizerFast needs `tokenizer_object`, `tokenizer_file` or both "
                    "`vocab` and `merges`; use `train_tokenizer` to make a new one."
                )
            kwargs["tokenizer_object"] = self._backend_from_vocab(vocab, merges, str(bos_token))

        flags_given = "add_bos_token" in kwargs or "add_eos_token" in kwargs
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        # Explicit, so that padding left on the backend by an earlier padded call (and
        # saved with it into tokenizer.json) cannot override the documented default.
        kwargs.setdefault("padding_side", type(self).padding_side)
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            pad_token=pad_token,
            unk_token=unk_token,
            model_max_length=model_max_length,
            **kwargs,
        )
        if not flags_given:
            self._sync_special_token_flags()

    def _sync_special_token_flags(self) -> None:
        """Set ``add_bos_token``/``add_eos_token`` from what the post-processor does.

        The base class defaults both to False whatever the backend does. Running the
        post-processor on an empty encoding (rather than encoding an empty string)
        keeps any padding configured on the backend out of the picture.
        """
        post_processor = self._tokenizer.post_processor
        ids = post_processor.process(Encoding()).ids if post_processor is not None else []
        # object.__setattr__ skips the property setters, which would rebuild the post-processor.
        object.__setattr__(self, "_add_bos_token", bool(ids) and ids[0] == self.bos_token_id)
        object.__setattr__(self, "_add_eos_token", bool(ids) and ids[-1] == self.eos_token_id)

    @classmethod
    def convert_to_native_format(cls, trust_remote_code: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Keep ``tokenizer.json`` as is when loading with :meth:`from_pretrained`.

        For subclasses that define ``__init__``, the base implementation swaps the file
        for its raw vocabulary, losing the merges, pre-tokenizer and decoder. Our
        ``tokenizer.json`` is complete, so the path is passed through untouched.
        """
        return kwargs

    @property
    def can_save_slow_tokenizer(self) -> bool:
        """There is no slow (pure Python) counterpart to save."""
        return False

    @staticmethod
    def _backend_from_vocab(
        vocab: dict[str, int],
        merges: Iterable[tuple[str, str] | list[str] | str],
        bos_token: str,
    ) -> Tokenizer:
        """Rebuild the full byte-level pipeline around a bare vocabulary and merges."""
        merge_pairs = [
            tuple(merge.split(" ")) if isinstance(merge, str) else (merge[0], merge[1]) for merge in merges
        ]
        backend = _byte_level_pipeline(models.BPE(vocab=dict(vocab), merges=merge_pairs))
        if bos_token in vocab:
            backend.post_processor = _bos_post_processor(bos_token, vocab[bos_token])
        return backend


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> TrellisTokenizerFast:
    """Train a byte-level BPE :class:`TrellisTokenizerFast` on ``texts``, offline.

    The initial alphabet holds all 256 byte symbols, so any text, in any script and
    including emoji, encodes without an unknown token and
    ``decode(encode(text), skip_special_tokens=True) == text`` exactly (provided the
    text does not itself contain a special token's literal string, which would be
    matched as that special token). ``pad``, ``bos`` and ``eos`` get ids 0, 1 and 2.
    Encoding prepends ``<|bos|>`` (the model conditions on it as a start marker);
    pass ``add_special_tokens=False`` to get the bare ids. EOS is not appended:
    callers add it where documents end.

    Args:
        texts: Training corpus, consumed once; a generator is fine.
        vocab_size: Upper bound on the vocabulary size, special tokens included. The
            result can be smaller when the corpus has too few frequent pairs.
        min_frequency: Minimum number of occurrences for a pair to be merged.
        model_max_length: Stored on the tokenizer, see
            :data:`DEFAULT_MODEL_MAX_LENGTH`.

    Returns:
        The trained tokenizer, padding on the left.

    Raises:
        ValueError: If ``vocab_size`` cannot hold the byte alphabet plus the special
            tokens, ``min_frequency`` is negative, or ``texts`` has no non-empty string.
        TypeError: If ``texts`` is a single string or yields a non-string.
    """
    min_vocab_size = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab_size:
        raise ValueError(
            f"vocab_size must be at least {min_vocab_size} (256 byte symbols + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}."
        )
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be non-negative, got {min_frequency}.")
    if isinstance(texts, str):
        # Iterating a str would train on single characters, almost surely a mistake.
        raise TypeError("texts must be an iterable of strings, not a single string.")

    non_empty = 0

    def checked(items: Iterable[str]) -> Iterator[str]:
        # Validates while streaming so large corpora never have to sit in memory.
        nonlocal non_empty
        for index, text in enumerate(items):
            if not isinstance(text, str):
                raise TypeError(f"texts[{index}] is {type(text).__name__}, expected str.")
            if text:
                non_empty += 1
            yield text

    backend = _byte_level_pipeline(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(checked(texts), trainer=trainer)
    if non_empty == 0:
        raise ValueError("texts contains no non-empty string; cannot train a tokenizer.")

    backend.post_processor = _bos_post_processor(BOS_TOKEN, backend.token_to_id(BOS_TOKEN))
    return TrellisTokenizerFast(tokenizer_object=backend, model_max_length=model_max_length)
