"""Single-needle-in-a-haystack retrieval (S-NIAH, in the style of RULER's simplest task).

A haystack of filler text hides one *needle*, a sentence that binds a key word to a value
(a number or a UUID), at a chosen depth; a question about the key ends the prompt and the
model must generate the value. Everything is built offline and seeded::

    example = make_niah_example(tokenizer, context_tokens=512, depth=0.5, needle_kind="uuid", seed=0)
    accuracy = score_niah(model, tokenizer, [example], max_new_tokens=24)

Haystacks: ``"noise"`` repeats a few short sentences (RULER's "noise" haystack idea),
``"prose"`` uses docstrings of the Python standard library read with :mod:`ast` (no module is
imported), or pass any text.
"""

from __future__ import annotations

import ast
import functools
import inspect
import random
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

NEEDLE_KINDS = ("number", "uuid")
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
# Keys the needle binds its value to; a word rather than a number, so it cannot be confused
# with the answer.
NEEDLE_KEYS = (
    "amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
    "kestrel", "lantern", "meadow", "nectar", "orchid", "pebble", "quartz", "raven", "saffron", "tundra",
)


@dataclass(frozen=True)
class NIAHExample:
    """One retrieval prompt.

    Attributes:
        prompt: haystack with the needle inside, then the question; the answer follows it.
        answer: the needle's value, the string the completion must contain.
        depth: the requested depth in [0, 1] (0 = needle first, 1 = needle last).
        needle_char_start: where the needle sentence starts in ``prompt``.
        haystack_chars: length of the haystack part of ``prompt`` (needle included).
    """

    prompt: str
    answer: str
    depth: float
    needle_char_start: int
    haystack_chars: int


def make_niah_example(
    tokenizer: Any,
    context_tokens: int,
    depth: float,
    needle_kind: str,
    seed: int,
    haystack: str = "noise",
) -> NIAHExample:
    """Build a prompt of about ``context_tokens`` tokens with one needle at ``depth``.

    Args:
        tokenizer: a Transformers tokenizer; lengths are measured with it.
        context_tokens: the target prompt length in tokens (haystack, needle and question);
            the prompt is at most this long, give or take a token at sentence joins.
        depth: where the needle goes, as a fraction of the haystack's sentences (0..1).
        needle_kind: ``"number"`` (a 7-digit number) or ``"uuid"``.
        seed: seeds the key, the value and, for prose, the starting sentence.
        haystack: ``"noise"``, ``"prose"`` or a text to split into sentences.
    """
    if needle_kind not in NEEDLE_KINDS:
        raise ValueError(f"needle_kind must be one of {NEEDLE_KINDS}, got {needle_kind!r}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = rng.choice(NEEDLE_KEYS)
    value = str(rng.randrange(1_000_000, 10_000_000)) if needle_kind == "number" else str(uuid.UUID(int=rng.getrandbits(128), version=4))
    noun = "number" if needle_kind == "number" else "code"
    needle = f"The special magic {noun} for {key} is {value}."
    question = f"\nQuestion: what is the special magic {noun} for {key}?\nAnswer: The special magic {noun} for {key} is"

    # Memoised: a noise haystack repeats the same few sentences thousands of times.
    @functools.lru_cache(maxsize=None)
    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    budget = context_tokens - count(needle) - count(question) - 1
    if budget < 0:
        raise ValueError(f"context_tokens {context_tokens} cannot hold the needle and the question")
    sentences = _haystack_sentences(haystack)
    start = 0 if haystack == "noise" else rng.randrange(len(sentences))
    chosen: list[str] = []
    used = 0
    # Sentences are measured one by one with a leading space, as they appear in the prompt.
    while True:
        sentence = sentences[(start + len(chosen)) % len(sentences)]
        cost = count(" " + sentence)
        if used + cost > budget:
            break
        chosen.append(sentence)
        used += cost

    split = round(depth * len(chosen))
    before, after = " ".join(chosen[:split]), " ".join(chosen[split:])
    head = before + " " if before else ""
    body = head + needle + (" " + after if after else "")
    return NIAHExample(prompt=body + question, answer=value, depth=depth, needle_char_start=len(head),
                       haystack_chars=len(body))


def _haystack_sentences(haystack: str) -> list[str]:
    if haystack == "noise":
        return list(NOISE_SENTENCES)
    text = _stdlib_prose() if haystack == "prose" else haystack
    sentences = [s.strip() + "." for s in " ".join(text.split()).split(". ") if s.strip()]
    if not sentences:
        raise ValueError("the haystack text holds no sentence")
    return sentences


@functools.lru_cache(maxsize=1)
def _stdlib_prose(max_chars: int = 200_000) -> str:
    """Module docstrings of the standard library, as one text (read once per process).

    Module docstrings read as prose, while function docstrings are mostly signatures.
    """
    parts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            doc = _module_docstring(path.read_text(encoding="utf-8"))
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            continue
        if doc and len(doc) > 200:
            parts.append(doc)
            total += len(doc)
            if total >= max_chars:
                break
    return "\n".join(parts)


def _module_docstring(source: str) -> str | None:
    """The docstring at the top of ``source``, or None.

    Only the leading string literal is evaluated: parsing whole modules with :mod:`ast`
    takes tens of seconds over the standard library.
    """
    lines = source.splitlines()
    while lines and (not lines[0].strip() or lines[0].lstrip().startswith("#")):
        lines.pop(0)
    head = "\n".join(lines)
    prefix = "r" if head[:1] in "rR" else ""
    quote = head[len(prefix) : len(prefix) + 3]
    if quote not in ('"""', "'''"):
        return None
    end = head.find(quote, len(prefix) + 3)
    if end < 0:
        return None
    return inspect.cleandoc(ast.literal_eval(head[: end + 3]))


def niah_tokenizer(vocab_size: int = 512, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer trained offline on S-NIAH text (noise haystack, needles,
    questions), for models trained on the task from scratch."""
    from ..tokenization_trellis import train_tokenizer

    rng = random.Random(seed)
    haystack = " ".join(NOISE_SENTENCES)

    def corpus():
        for _ in range(2000):
            key, value = rng.choice(NEEDLE_KEYS), rng.randrange(1_000_000, 10_000_000)
            yield (f"{haystack} The special magic number for {key} is {value}. {haystack}\nQuestion: what is the "
                   f"special magic number for {key}?\nAnswer: The special magic number for {key} is {value}")

    return train_tokenizer(corpus(), vocab_size)


def make_niah_training_data(
    tokenizer: Any, num_examples: int, context_tokens: int, seed: int, *, needle_kind: str = "number",
    haystack: str = "noise",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S-NIAH examples to train on: each prompt (needle at a uniformly drawn depth) followed by
    its answer and EOS, tokenized apart as ``generate()`` will see them.

    Returns:
        ``input_ids``, ``labels`` and ``attention_mask``, each ``[N, T]`` with T the longest
        row; rows are right-padded, and ``labels`` is -100 everywhere but the answer and EOS.
    """
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer needs an eos and a pad token to build training examples")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        example = make_niah_example(tokenizer, context_tokens, rng.random(), needle_kind, rng.getrandbits(32), haystack)
        prompt = tokenizer(example.prompt)["input_ids"]
        answer = tokenizer(" " + example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt, answer))
    length = max(len(p) + len(a) for p, a in rows)
    input_ids = torch.full((num_examples, length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((num_examples, length), -100, dtype=torch.long)
    attention_mask = torch.zeros(num_examples, length, dtype=torch.long)
    for i, (prompt, answer) in enumerate(rows):
        end = len(prompt) + len(answer)
        input_ids[i, :end] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : end] = torch.tensor(answer)
        attention_mask[i, :end] = 1
    return input_ids, labels, attention_mask


def niah_match(completion: str, answer: str) -> bool:
    """Whether a completion states the answer: exact substring match after trimming spaces."""
    return answer.strip() in completion


@torch.no_grad()
def score_niah(
    model: Any, tokenizer: Any, examples: Sequence[NIAHExample], max_new_tokens: int, batch_size: int = 8
) -> float:
    """Fraction of ``examples`` whose greedy completion contains the answer.

    Prompts are batched and left-padded so every row's generation starts right after its
    prompt; only the new tokens are decoded and matched.
    """
    if not examples:
        raise ValueError("score_niah needs at least one example")
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        hits = 0
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            inputs = tokenizer([e.prompt for e in batch], return_tensors="pt", padding=True).to(model.device)
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
            completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            hits += sum(niah_match(c, e.answer) for c, e in zip(completions, batch))
    finally:
        tokenizer.padding_side = padding_side
    return hits / len(examples)


__all__ = [
    "NEEDLE_KINDS", "NIAHExample", "make_niah_example", "make_niah_training_data", "niah_match", "niah_tokenizer",
    "score_niah",
]
