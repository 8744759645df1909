"""Multi-query associative recall (MQAR), the synthetic recall task of the Zoology study.

An example is a context of key-value pairs followed by queries::

    k1 v1 k2 v2 ... kP vP  0 0 kq vq 0 kr vr 0 ...
    '---- 2P tokens ----'  '-- queries with power-law gaps in filler --'

Keys come from the lower half of the vocabulary and values from the upper half, keys are
distinct within an example, and each query repeats a key of the context followed by its
value. The model must predict that value from the query key, so the loss and the accuracy
look only at the value tokens that follow queries.

Labels follow the model's own convention: ``labels`` is aligned with ``input_ids`` and the
model shifts it inside (logits at ``t`` predict ``labels[t + 1]``). Hence ``labels[t]`` is the
value token sitting at position ``t`` (right after its query key) and -100 everywhere else,
and ``model(input_ids, labels=labels).loss`` is the cross-entropy on the answers only.
"""

from __future__ import annotations

import numpy as np
import torch

IGNORE_INDEX = -100
# Token 0 is the filler between queries; keys therefore start at 1.
FILLER_TOKEN = 0


def make_mqar(
    num_examples: int,
    seq_len: int,
    num_kv_pairs: int,
    vocab_size: int,
    seed: int,
    *,
    power_a: float = 0.01,
    num_queries: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build ``num_examples`` MQAR sequences, deterministically from ``seed``.

    Args:
        num_examples: N, the number of sequences.
        seq_len: T, tokens per sequence; must hold the 2P context tokens and 2Q query tokens.
        num_kv_pairs: P, the key-value pairs at the start of each sequence.
        vocab_size: V; keys are drawn from ``[1, V // 2)`` and values from ``[V // 2, V)``.
        seed: seed of the generator (same arguments and seed give the same tensors).
        power_a: exponent ``a`` of the gap distribution ``p(g) ~ a * g ** (a - 1)`` over the
            distance ``g >= 1`` (in query slots) between the end of the context and a query.
            Small ``a`` puts most queries right after the context and some far away; ``a = 1``
            is uniform.
        num_queries: Q, queries per sequence, each asking for a distinct key (default P).

    Returns:
        ``input_ids [N, T]`` long and ``labels [N, T]`` long: the value token at each
        position that holds the answer to a query (the position after its key), -100 elsewhere.
    """
    num_queries = num_kv_pairs if num_queries is None else num_queries
    _check_args(num_examples, seq_len, num_kv_pairs, vocab_size, power_a, num_queries)
    rng = np.random.default_rng(seed)

    context_len = 2 * num_kv_pairs
    # Queries occupy aligned two-token slots after the context, so a key and its value never
    # overlap another query.
    num_slots = (seq_len - context_len) // 2
    gaps = np.arange(1, num_slots + 1, dtype=np.float64)
    slot_probs = power_a * gaps ** (power_a - 1)
    slot_probs /= slot_probs.sum()

    input_ids = np.full((num_examples, seq_len), FILLER_TOKEN, dtype=np.int64)
    labels = np.full((num_examples, seq_len), IGNORE_INDEX, dtype=np.int64)
    half = vocab_size // 2
    for n in range(num_examples):
        keys = rng.choice(np.arange(1, half), size=num_kv_pairs, replace=False)
        values = rng.integers(half, vocab_size, size=num_kv_pairs)
        input_ids[n, 0:context_len:2] = keys
        input_ids[n, 1:context_len:2] = values

        asked = rng.choice(num_kv_pairs, size=num_queries, replace=False)
        slots = rng.choice(num_slots, size=num_queries, replace=False, p=slot_probs)
        key_pos = context_len + 2 * slots
        input_ids[n, key_pos] = keys[asked]
        input_ids[n, key_pos + 1] = values[asked]
        labels[n, key_pos + 1] = values[asked]
    return torch.from_numpy(input_ids), torch.from_numpy(labels)


def _check_args(
    num_examples: int, seq_len: int, num_kv_pairs: int, vocab_size: int, power_a: float, num_queries: int
) -> None:
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if num_kv_pairs < 1:
        raise ValueError(f"num_kv_pairs must be >= 1, got {num_kv_pairs}")
    if not 1 <= num_queries <= num_kv_pairs:
        raise ValueError(f"num_queries must be in [1, num_kv_pairs = {num_kv_pairs}], got {num_queries}")
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a}")
    num_keys = vocab_size // 2 - 1
    if num_keys < num_kv_pairs:
        raise ValueError(
            f"vocab_size {vocab_size} gives {max(num_keys, 0)} distinct keys (ids 1 .. vocab_size // 2 - 1), "
            f"fewer than num_kv_pairs = {num_kv_pairs}; use vocab_size >= {2 * (num_kv_pairs + 1)}"
        )
    needed = 2 * num_kv_pairs + 2 * num_queries
    if seq_len < needed:
        raise ValueError(
            f"seq_len {seq_len} is too short for {num_kv_pairs} key-value pairs and {num_queries} queries "
            f"(2 tokens each): need seq_len >= {needed}"
        )


def answer_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Which answers a model got right.

    Args:
        logits: ``[N, T, V]`` next-token logits (position ``t`` predicts token ``t + 1``).
        labels: ``[N, T]`` as returned by :func:`make_mqar`.

    Returns:
        ``[N, T]`` bool on ``labels``' device: True at each answer position (label not -100)
        whose value is the argmax of the logits one position before.
    """
    target = labels[:, 1:]
    hits = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    hits[:, 1:] = (logits[:, :-1].argmax(-1).to(labels.device) == target) & (target != IGNORE_INDEX)
    return hits


def answer_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Count the answers a model got right: ``(correct, total)`` over the positions whose label
    is not -100 (shapes as :func:`answer_hits`)."""
    return int(answer_hits(logits, labels).sum()), int((labels[:, 1:] != IGNORE_INDEX).sum())


def _check_hits(hits: torch.Tensor, labels: torch.Tensor) -> None:
    if hits.shape != labels.shape:
        raise ValueError(f"hits {tuple(hits.shape)} and labels {tuple(labels.shape)} must have the same shape")


def accuracy_by_query_position(
    hits: torch.Tensor, labels: torch.Tensor, num_kv_pairs: int, parts: int = 4
) -> list[float | None]:
    """Accuracy split by where each query sits: the query region (every position after the
    ``2 * num_kv_pairs`` context tokens) is cut into ``parts`` equal stretches, nearest the
    context first, and each query counts in the stretch holding its key. A model that recalls
    only the queries far from the context (or only the near ones) shows here, where the overall
    accuracy would hide it.

    Args:
        hits: ``[N, T]`` bool, True at each answer position answered right (see ``labels``).
        labels: ``[N, T]`` as returned by :func:`make_mqar`.

    Returns:
        ``parts`` accuracies, ``None`` for a stretch no query falls in.
    """
    _check_hits(hits, labels)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    context = 2 * num_kv_pairs
    region = labels.shape[1] - context
    rows, answers = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
    # The key sits right before its answer.
    stretch = ((answers - 1 - context).clamp(min=0) * parts) // max(region, 1)
    scores: list[float | None] = []
    for part in range(parts):
        chosen = stretch == part
        scores.append(float(hits[rows[chosen], answers[chosen]].float().mean()) if chosen.any() else None)
    return scores


def first_query_accuracy(hits: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Accuracy on each example's first query only (its earliest answer position).

    Every key of the context is asked once (with the default number of queries), so a model
    that binds no key to its value can still answer later queries by elimination: it names a
    context value that no earlier answer in the query region named, and is right with
    probability ``1 / (P - j)`` at the ``j``-th query, 1 at the last (mean about ``H_P / P``:
    0.52 at 4 pairs, 0.21 at 16). The first query has nothing to eliminate, so such a model
    scores ``1 / P`` on it; only binding scores more.

    Args:
        hits: ``[N, T]`` bool as :func:`answer_hits` returns.
        labels: ``[N, T]`` as returned by :func:`make_mqar`.

    Returns:
        The accuracy over the rows that hold an answer, ``None`` if none does.
    """
    _check_hits(hits, labels)
    answers = labels != IGNORE_INDEX
    rows = answers.any(dim=1)
    if not rows.any():
        return None
    first = answers.to(torch.int8).argmax(dim=1)  # the first True of each row
    return float(hits[rows, first[rows]].float().mean())


__all__ = [
    "FILLER_TOKEN", "IGNORE_INDEX", "accuracy_by_query_position", "answer_accuracy", "answer_hits",
    "first_query_accuracy", "make_mqar",
]
