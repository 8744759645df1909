"""Train tiny models on MQAR with ``transformers.Trainer`` and score their recall.

One harness for every architecture, so Trellis variants and a full-attention Llama baseline
see the same data, optimizer, schedule and step budget::

    spec = ModelSpec("trellis")                         # or ModelSpec("llama"), variants below
    task = MQARTask(seq_len=64, num_kv_pairs=4)
    train = TrainSettings(max_steps=200)
    result = run_mqar(spec, task, ModelSize(), train)   # {"accuracy": ..., "train_seconds": ...}

``examples/synthetic_recall.py`` sweeps :func:`default_variants` over presets.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Trainer, TrainingArguments

from ..configuration_trellis import TrellisConfig
from ..modeling_trellis import TrellisForCausalLM
from .mqar import answer_accuracy, make_mqar
from .niah import make_niah_example, make_niah_training_data, niah_tokenizer, score_niah


@dataclass(frozen=True)
class ModelSpec:
    """One architecture of the comparison.

    Attributes:
        name: label in tables and plots.
        kind: ``"trellis"`` or ``"llama"`` (full softmax attention with RoPE).
        overrides: ``TrellisConfig`` fields that differ from :class:`ModelSize`'s defaults.
    """

    name: str
    kind: str = "trellis"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSize:
    """Width and depth shared by every architecture, so baselines are the same size."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 128
    num_slots: int = 32
    chunk_size: int = 16


@dataclass(frozen=True)
class MQARTask:
    """The data of one MQAR setting (see :func:`trellis_lm.eval.mqar.make_mqar`)."""

    seq_len: int = 64
    num_kv_pairs: int = 4
    vocab_size: int = 64
    num_train: int = 4000
    num_test: int = 500
    power_a: float = 0.01


@dataclass(frozen=True)
class NIAHTask:
    """S-NIAH trained at ``train_context`` tokens and scored at every length of ``eval_contexts``
    (see :mod:`trellis_lm.eval.niah`); number needles in the noise haystack."""

    train_context: int = 256
    eval_contexts: tuple[int, ...] = (256, 1024, 4096, 16384)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    num_train: int = 20_000
    tokenizer_vocab: int = 512


@dataclass(frozen=True)
class TrainSettings:
    max_steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_ratio: float = 0.1
    eval_batch_size: int = 128
    seed: int = 0


def default_variants() -> list[ModelSpec]:
    """The Llama baseline, the default Trellis, and one-change ablations of it."""
    return [
        ModelSpec("llama", kind="llama"),
        ModelSpec("trellis"),
        ModelSpec("trellis-delta", overrides={"compress_fn": "identity"}),
        ModelSpec("trellis-no-forget", overrides={"use_forget_gate": False}),
        ModelSpec("trellis-mix-softmax", overrides={"mix_fn": "softmax"}),
        ModelSpec("trellis-mix-l2silu", overrides={"mix_fn": "l2_silu"}),
        ModelSpec("trellis-C1", overrides={"chunk_size": 1}),
        ModelSpec("trellis-C16", overrides={"chunk_size": 16}),
        ModelSpec("trellis-C64", overrides={"chunk_size": 64}),
        ModelSpec("trellis-M16", overrides={"num_slots": 16}),
        ModelSpec("trellis-M64", overrides={"num_slots": 64}),
    ]


def build_model(spec: ModelSpec, size: ModelSize, vocab_size: int, max_len: int) -> PreTrainedModel:
    """A freshly initialised model of ``spec``'s architecture and ``size``."""
    if spec.kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
            num_hidden_layers=size.num_hidden_layers, num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_heads, head_dim=size.head_dim, max_position_embeddings=max_len,
            tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        )
        return LlamaForCausalLM(config)
    if spec.kind != "trellis":
        raise ValueError(f"unknown model kind {spec.kind!r}; expected 'trellis' or 'llama'")
    fields = dict(
        vocab_size=vocab_size, hidden_size=size.hidden_size, num_hidden_layers=size.num_hidden_layers,
        num_heads=size.num_heads, head_dim=size.head_dim, intermediate_size=size.intermediate_size,
        num_slots=size.num_slots, chunk_size=size.chunk_size,
        # MQAR's filler is token 0; the model must see it as an ordinary token, never as padding.
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    fields.update(spec.overrides)
    return TrellisForCausalLM(TrellisConfig(**fields))


class TensorDataset(Dataset):
    """Rows of ``input_ids [N, T]``, ``labels [N, T]`` and optionally ``attention_mask [N, T]``,
    as the dicts ``Trainer`` feeds the model."""

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        self.input_ids, self.labels, self.attention_mask = input_ids, labels, attention_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = {"input_ids": self.input_ids[index], "labels": self.labels[index]}
        if self.attention_mask is not None:
            row["attention_mask"] = self.attention_mask[index]
        return row


def train_model(model: PreTrainedModel, dataset: Dataset, train: TrainSettings) -> dict[str, float]:
    """Train ``model`` in place with ``transformers.Trainer`` (AdamW, warm-up then cosine).

    Returns:
        ``mean_train_loss`` (averaged over all steps) and ``train_seconds`` (wall clock).
    """
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=train.max_steps, per_device_train_batch_size=train.batch_size,
            learning_rate=train.learning_rate, weight_decay=train.weight_decay,
            warmup_steps=math.ceil(train.warmup_ratio * train.max_steps), lr_scheduler_type="cosine",
            logging_steps=max(1, train.max_steps // 10), save_strategy="no", report_to=[],
            disable_tqdm=True, seed=train.seed, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
            bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        started = time.perf_counter()
        output = trainer.train()
        return {"mean_train_loss": output.training_loss, "train_seconds": time.perf_counter() - started}


@torch.no_grad()
def mqar_accuracy(model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 128) -> float:
    """Fraction of answer positions whose argmax prediction equals the label.

    Args:
        input_ids, labels: ``[N, T]`` from :func:`make_mqar`.
    """
    model.eval()
    device = next(model.parameters()).device
    correct = total = 0
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        batch_correct, batch_total = answer_accuracy(logits.float().cpu(), labels[start : start + batch_size])
        correct, total = correct + batch_correct, total + batch_total
    return correct / total


def run_mqar(spec: ModelSpec, task: MQARTask, size: ModelSize, train: TrainSettings) -> dict[str, Any]:
    """Train ``spec`` on fresh MQAR data for ``train.max_steps`` and score it on held-out data.

    Train and test sets come from different seeds, so test keys, values and query positions
    are unseen combinations.

    Returns:
        A JSON-ready record: the spec, task and settings, ``accuracy``, the training loss
        averaged over all steps, the parameter count and the wall-clock training time.
    """
    def data(num: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return make_mqar(num, task.seq_len, task.num_kv_pairs, task.vocab_size, seed, power_a=task.power_a)

    train_ids, train_labels = data(task.num_train, seed=2 * train.seed)
    test_ids, test_labels = data(task.num_test, seed=2 * train.seed + 1)

    torch.manual_seed(train.seed)
    model = build_model(spec, size, task.vocab_size, task.seq_len)
    trained = train_model(model, TensorDataset(train_ids, train_labels), train)
    accuracy = mqar_accuracy(model, test_ids, test_labels, train.eval_batch_size)
    return {
        "model": spec.name, "kind": spec.kind, "overrides": dict(spec.overrides),
        "task": dataclasses.asdict(task), "size": dataclasses.asdict(size), "train": dataclasses.asdict(train),
        "accuracy": accuracy, **trained, "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def run_niah(spec: ModelSpec, task: NIAHTask, size: ModelSize, train: TrainSettings) -> dict[str, Any]:
    """Train ``spec`` on S-NIAH at ``task.train_context`` tokens, then score greedy retrieval with
    ``generate()`` at each context length and depth on unseen examples.

    Returns:
        A JSON-ready record like :func:`run_mqar`'s, with ``scores[length][depth]`` (fraction of
        ``task.samples`` examples whose completion holds the needle's value).
    """
    tokenizer = niah_tokenizer(task.tokenizer_vocab, seed=train.seed)
    ids, labels, mask = make_niah_training_data(tokenizer, task.num_train, task.train_context, seed=2 * train.seed)
    torch.manual_seed(train.seed)
    model = build_model(spec, size, len(tokenizer), max(task.eval_contexts) + 64)
    trained = train_model(model, TensorDataset(ids, labels, mask), train)
    model.eval()
    scores: dict[str, dict[str, float]] = {}
    for length in task.eval_contexts:
        for depth in task.depths:
            # Seeds far from the training data's draws: unseen keys, values and positions.
            examples = [make_niah_example(tokenizer, length, depth, "number", seed=10**9 + 1000 * i + length)
                        for i in range(task.samples)]
            scores.setdefault(str(length), {})[str(depth)] = score_niah(model, tokenizer, examples, max_new_tokens=10)
    return {
        "model": spec.name, "kind": spec.kind, "overrides": dict(spec.overrides), "task": dataclasses.asdict(task),
        "size": dataclasses.asdict(size), "train": dataclasses.asdict(train), "scores": scores, **trained,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


__all__ = [
    "MQARTask", "ModelSize", "ModelSpec", "NIAHTask", "TensorDataset", "TrainSettings", "build_model",
    "default_variants", "mqar_accuracy", "run_mqar", "run_niah", "train_model",
]
