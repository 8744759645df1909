"""Passkey retrieval in held-out text: a five-digit key placed at a depth of a long prompt, asked
for at its end; scored by greedy decoding, or by whether the shown key is likelier than another."""

from __future__ import annotations

import random
import statistics
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


PASSKEY_LINE = "# The pass key is {key}. Remember it: {key}.\n"
PASSKEY_QUESTION = "\n# What is the pass key? The pass key is"


def passkey_prompts(tokenizer: Any, files: Sequence[torch.Tensor], length: int, depths: Sequence[float], trials: int,
                    seed: int) -> Iterator[tuple[list[int], str]]:
    """``trials`` prompts per depth: ``length`` tokens of held-out code (lines cut at token
    boundaries) with :data:`PASSKEY_LINE` at ``depth`` (a fraction of it) and
    :data:`PASSKEY_QUESTION` at the end; yields ``(token ids, the 5-digit key)``."""
    rng = random.Random(seed)
    pool = [f for f in files if f.numel() >= length]
    if not pool:
        raise ValueError(f"no held-out file holds {length} tokens")
    question = tokenizer(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    for depth in depths:
        for _ in range(trials):
            key = str(rng.randrange(10_000, 100_000))
            source = rng.choice(pool)
            needle = tokenizer(PASSKEY_LINE.format(key=key), add_special_tokens=False)["input_ids"]
            haystack = source[: max(1, length - len(needle) - len(question))].tolist()
            at = int(depth * len(haystack))
            yield haystack[:at] + needle + haystack[at:] + question, key


@torch.no_grad()
def passkey_accuracy(model: PreTrainedModel, tokenizer: Any, files: Sequence[torch.Tensor], length: int,
                     depths: Sequence[float], trials: int, seed: int) -> float:
    """Fraction of :func:`passkey_prompts` after which greedy decoding starts with the key."""
    hits = total = 0
    for prompt, key in passkey_prompts(tokenizer, files, length, depths, trials, seed):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        hits += answer.startswith(key)
        total += 1
    return hits / total


@torch.no_grad()
def passkey_preference(model: PreTrainedModel, tokenizer: Any, files: Sequence[torch.Tensor], length: int,
                       depths: Sequence[float], trials: int, seed: int) -> dict[str, float]:
    """Does the model use the needle at all? For each of :func:`passkey_prompts`, the
    log-probability of the shown key after the question (teacher-forced) against that of a fresh
    random key of the same form. Returns ``{"preferred": fraction of prompts where the shown key
    is the likelier, "margin_nats": mean log p(shown) - log p(other)}``: 0.5 and 0 are chance (the
    needle unused), and both move long before greedy decoding can copy all five digits, which
    :func:`passkey_accuracy` needs."""
    others = random.Random(seed + 1)
    margins = []
    for prompt, key in passkey_prompts(tokenizer, files, length, depths, trials, seed):
        other = key
        while other == key:
            other = str(others.randrange(10_000, 100_000))
        scores = []
        for candidate in (key, other):
            answer = tokenizer(" " + candidate, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer])
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0, len(prompt) - 1:].float()
            scores.append(-F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item())
        margins.append(scores[0] - scores[1])
    return {"preferred": sum(m > 0 for m in margins) / len(margins), "margin_nats": statistics.fmean(margins)}
