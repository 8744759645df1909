"""Train tiny models on MQAR with ``transformers.Trainer`` and score their recall.

One harness for every architecture, so Trellis variants and a full-attention Llama baseline
see the same data, optimizer, schedule and step budget::

    spec = ModelSpec("trellis")                         # or ModelSpec("llama"), variants below
    task = MQARTask(seq_len=64, num_kv_pairs=4)
    train = TrainSettings(max_steps=200)
    result = run_mqar(spec, task, ModelSize(), train)   # {"accuracy": ..., "train_seconds": ...}

``studies/synthetic_recall.py`` sweeps :func:`default_variants` over presets.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig, LlamaForCausalLM, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments,
)

from trellis_lm.configuration_trellis import TrellisConfig
from trellis_lm.eval.mqar import IGNORE_INDEX, accuracy_by_query_position, answer_hits, first_query_accuracy, make_mqar
from trellis_lm.eval.niah import make_niah_example, make_niah_training_data, niah_tokenizer, score_niah
from trellis_lm.mixers.norms_convs import TrellisShortConv
from trellis_lm.modeling_trellis import TrellisForCausalLM
from trellis_lm.state_passing import StatePassingCallback


@dataclass(frozen=True)
class ModelSpec:
    """One architecture of the comparison.

    Attributes:
        name: label in tables and plots.
        kind: ``"trellis"`` or ``"llama"`` (full softmax attention with RoPE).
        overrides: ``TrellisConfig`` fields that differ from :class:`ModelSize`'s defaults.
        init: a name of :data:`INIT_VARIANTS`, applied after the model is built.
    """

    name: str
    kind: str = "trellis"
    overrides: dict[str, Any] = field(default_factory=dict)
    init: str = "default"


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
    # The mixing function every recorded study ran with: the package default until the defaults
    # study (docs/results_lm_defaults.md) made it softmax. Pinned here so that each study's command
    # still computes its page's models; a study of the new default sets it.
    mix_fn: str = "ln_silu"
    # Likewise the short convolution's width: 4 taps in every recorded study, 2 the package default
    # since the defaults study.
    conv_size: int = 4


@dataclass(frozen=True)
class MQARTask:
    """The data of one MQAR setting (see :func:`trellis_lm.eval.mqar.make_mqar`).

    Attributes:
        train_mix: further ``(seq_len, num_kv_pairs)`` settings whose examples are mixed into the
            training data, as the Zoology study trains (e.g. ``((64, 4), (128, 8))`` beside 256
            tokens and 16 pairs): ``num_train`` is split evenly over the task's own setting and
            these, every batch holds one setting, and validation and test stay at the task's own
            setting. Empty (the default): train on the task's setting only.
    """

    seq_len: int = 64
    num_kv_pairs: int = 4
    vocab_size: int = 64
    num_train: int = 4000
    num_test: int = 500
    power_a: float = 0.01
    train_mix: tuple[tuple[int, int], ...] = ()

    def train_settings(self) -> tuple[tuple[int, int], ...]:
        """``(seq_len, num_kv_pairs)`` of every setting trained on, the task's own first."""
        own = (self.seq_len, self.num_kv_pairs)
        return (own,) + tuple(dict.fromkeys(tuple(s) for s in self.train_mix if tuple(s) != own))


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
    """One training run.

    Attributes:
        eval_every: record a learning curve: accuracy on a held-out validation set (apart
            from the test set) every this many steps and at the last step; 0 records none.
        num_val: examples of that validation set (MQAR).
        stop_accuracy: stop once the validation accuracy reaches this (``None``: never); the
            record then says at which step it stopped.
        state_passing: probability that a training row starts from a row of the previous
            batch's final memory states (:mod:`trellis_lm.state_passing`; 0: never), from the
            fraction ``state_passing_from`` of the steps on.
    """

    max_steps: int = 200
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_ratio: float = 0.1
    eval_batch_size: int = 128
    seed: int = 0
    eval_every: int = 0
    num_val: int = 256
    stop_accuracy: float | None = None
    state_passing: float = 0.0
    state_passing_from: float = 0.0


@dataclass(frozen=True)
class Sweep:
    """How every (model, setting) is trained: ``seeds[0]`` at each of ``learning_rates``, then the
    remaining ``seeds`` at the learning rate whose ``seeds[0]`` run scored best on validation."""

    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    seeds: tuple[int, ...] = (0, 1, 2)


# KVM with a fixed 16-row state and a window of one 8-token chunk, shorter than the sequences:
# tokens further back than 8-16 positions are reachable only through the state.
KVM_OVERRIDES = {"mixer_types": ("kvm",), "kvm_chunk_size": 8, "kvm_window_chunks": 1, "kvm_state_size": 16,
                 "kvm_budget": "fixed"}


def default_variants() -> list[ModelSpec]:
    """The Llama baseline, the default Trellis, one-change ablations of it, Lattice's three write
    rules, KVM and a Trellis/attention hybrid.

    ``mixer_types`` overrides are patterns, repeated over the layers (see :func:`build_model`).
    """
    return [
        ModelSpec("llama", kind="llama"),
        ModelSpec("trellis"),
        ModelSpec("trellis-delta", overrides={"compress_fn": "identity"}),
        ModelSpec("trellis-no-forget", overrides={"use_forget_gate": False}),
        ModelSpec("trellis-mix-softmax", overrides={"mix_fn": "softmax"}),
        ModelSpec("trellis-mix-l2silu", overrides={"mix_fn": "l2_silu"}),
        ModelSpec("trellis-C1", overrides={"chunk_size": 1}),
        ModelSpec("trellis-C64", overrides={"chunk_size": 64}),
        ModelSpec("trellis-M16", overrides={"num_slots": 16}),
        ModelSpec("trellis-M64", overrides={"num_slots": 64}),
        ModelSpec("lattice-dec", overrides={"mixer_types": ("lattice",), "lattice_variant": "dec"}),
        ModelSpec("lattice-enc", overrides={"mixer_types": ("lattice",), "lattice_variant": "enc"}),
        ModelSpec("lattice-sim", overrides={"mixer_types": ("lattice",), "lattice_variant": "sim"}),
        ModelSpec("kvm", overrides=dict(KVM_OVERRIDES)),
        # The merge rule itself: a window of 4 tokens and 8 state rows, so at 32 tokens 28 tokens
        # leave the window into 8 rows (20 of them merged), every key-value pair among them.
        ModelSpec("kvm-merge", overrides=dict(KVM_OVERRIDES, kvm_chunk_size=4, kvm_state_size=8)),
        # One attention layer per Trellis layer: ["trellis", "attention"] at 2 layers.
        ModelSpec("hybrid", overrides={"mixer_types": ("trellis", "attention")}),
    ]


def layer_schedule(spec: ModelSpec, num_layers: int) -> list[str]:
    """Each layer's mixer for ``spec``: its ``mixer_types`` pattern repeated over ``num_layers``
    layers (``"attention"`` everywhere for Llama, ``"trellis"`` when no pattern is given)."""
    if spec.kind == "llama":
        return ["attention"] * num_layers
    pattern = spec.overrides.get("mixer_types") or ("trellis",)
    return [pattern[i % len(pattern)] for i in range(num_layers)]


def build_model(spec: ModelSpec, size: ModelSize, vocab_size: int, max_len: int) -> PreTrainedModel:
    """A freshly initialised model of ``spec``'s architecture and ``size``, with ``spec.init``
    (:data:`INIT_VARIANTS`) applied; Llama takes the default init only."""
    if spec.kind == "llama":
        if spec.init != "default":
            raise ValueError(f"init variants are for Trellis models; {spec.name!r} asks for {spec.init!r}")
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
            num_hidden_layers=size.num_hidden_layers, num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_heads, head_dim=size.head_dim, max_position_embeddings=max_len,
            # The same head as the default Trellis rows (untied; tied before 2026-11-22).
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        )
        return LlamaForCausalLM(config)
    if spec.kind != "trellis":
        raise ValueError(f"unknown model kind {spec.kind!r}; expected 'trellis' or 'llama'")
    fields = dict(
        vocab_size=vocab_size, hidden_size=size.hidden_size, num_hidden_layers=size.num_hidden_layers,
        num_heads=size.num_heads, head_dim=size.head_dim, intermediate_size=size.intermediate_size,
        num_slots=size.num_slots, chunk_size=size.chunk_size, mix_fn=size.mix_fn, conv_size=size.conv_size,
        # MQAR's filler is token 0; the model must see it as an ordinary token, never as padding.
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    fields.update(spec.overrides)
    fields["mixer_types"] = layer_schedule(spec, size.num_hidden_layers)
    variant = INIT_VARIANTS[spec.init]
    if variant.tie_head is not None:
        fields["tie_word_embeddings"] = variant.tie_head
    model = TrellisForCausalLM(TrellisConfig(**fields))
    apply_init(model, variant)
    return model


@dataclass(frozen=True)
class InitVariant:
    """An initialisation applied on top of the model's own (``_init_weights``: every linear and
    the embedding N(0, ``initializer_range``); the head untied since 2026-11-22, tied before), to
    study which part of it sets how long MQAR stays at chance.

    Attributes:
        description: what it changes, in words (tables, records).
        tie_head: the model's ``tie_word_embeddings`` (``None``: the config's default, untied);
            an untied head is initialised by the model's ``_init_weights``.
        embedding_std: re-draw the input embedding from N(0, this) (``None``: keep the model's).
        linears: ``"model"`` keeps them; ``"kaiming"`` re-draws the weight of every linear with
            PyTorch's Kaiming-uniform default (a tied head excepted) except ``alpha_proj``, whose
            scale is its own factor, and keeps every bias; ``"torch"`` calls ``reset_parameters()``
            of every linear, weights and biases, ``alpha_proj`` and the gate biases included.
        alpha_std: re-draw every ``alpha_proj`` weight from N(0, this).
        forget_bias: set every head's ``beta_proj`` bias to this (the same for all heads).
        kaiming_convs: re-draw every short conv's taps with PyTorch's Kaiming-uniform default
            (the model's own until 2026-11-23) instead of the model's current-token query and
            previous-token key taps.
    """

    description: str
    tie_head: bool | None = None
    embedding_std: float | None = None
    linears: str = "model"
    alpha_std: float | None = None
    forget_bias: float | None = None
    kaiming_convs: bool = False


INIT_VARIANTS: dict[str, InitVariant] = {
    "default": InitVariant("the model's own: N(0, 0.02) linears and embedding, an untied N(0, 0.02) head, "
                           "alpha_proj N(0, 1/sqrt(hidden)), forget-gate bias spread over heads, short convs "
                           "passing the current token to q and the previous one to k"),
    # The short convs' default until 2026-11-23: every study recorded before then ran it
    # (cpu-kaiming-convs.json, goal-kaiming-convs.json and older); this comparison changed the default.
    "conv-kaiming": InitVariant("the model's own with Kaiming-uniform short-conv taps (the default until "
                                "2026-11-23)", kaiming_convs=True),
    # The default until 2026-11-22: every study recorded before then (cpu-tied.json, init_split.json's
    # "tied" rows) ran it; this split is why the default changed.
    "tied": InitVariant("the model's own with the head tied to the embedding (the default until 2026-11-22)",
                        tie_head=True),
    "torch": InitVariant("PyTorch's defaults: embedding N(0, 1), untied head, reset_parameters() of every linear "
                         "(Kaiming-uniform weights and uniform biases, alpha_proj and gate biases included)",
                         tie_head=False, embedding_std=1.0, linears="torch"),
    "emb1": InitVariant("embedding N(0, 1), head tied (so the head is N(0, 1) too)", tie_head=True, embedding_std=1.0),
    "emb0.3": InitVariant("embedding N(0, 0.3), head tied", tie_head=True, embedding_std=0.3),
    "emb1-untied": InitVariant("embedding N(0, 1) and an untied N(0, 0.02) head", tie_head=False, embedding_std=1.0),
    "untied": InitVariant("untied head, a fresh N(0, 0.02) one", tie_head=False),
    "kaiming": InitVariant("Kaiming-uniform weights of every linear but alpha_proj and the tied head; biases, "
                           "alpha_proj, embedding as the model's", tie_head=True, linears="kaiming"),
    "kaiming-all": InitVariant("reset_parameters() of every linear but the tied head (weights and biases, "
                               "alpha_proj and the gate biases included)", tie_head=True, linears="torch"),
    "alpha02": InitVariant("alpha_proj N(0, 0.02), the generic scale, instead of N(0, 1/sqrt(hidden)); tied head",
                           tie_head=True, alpha_std=0.02),
    # logsigmoid(0) / 16: beta = 0.5 ** (1 / 16) = 0.958 in every head, what PyTorch's near-zero
    # uniform bias gives, instead of the 0.9 .. 0.999 spread.
    "gate-flat": InitVariant("forget-gate bias 0 in every head (beta = 0.958 each) instead of the spread; tied head",
                             tie_head=True, forget_bias=0.0),
}


@torch.no_grad()
def apply_init(model: PreTrainedModel, variant: InitVariant) -> None:
    """Re-initialise a freshly built ``model`` in place as ``variant`` says (its ``tie_head`` acts
    at build time, see :func:`build_model`). Draws from torch's global generator."""
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if variant.embedding_std is not None:
        torch.nn.init.normal_(model.get_input_embeddings().weight, std=variant.embedding_std)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or (tied and module is head):
            continue
        is_alpha = name.endswith("alpha_proj")
        if variant.linears == "torch":
            module.reset_parameters()
        elif variant.linears == "kaiming" and not is_alpha:
            # Only the weight: reset_parameters() would also redraw the gate biases.
            torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        if is_alpha and variant.alpha_std is not None:
            torch.nn.init.normal_(module.weight, std=variant.alpha_std)
        if name.endswith("beta_proj") and variant.forget_bias is not None:
            module.bias.fill_(variant.forget_bias)
    if variant.kaiming_convs:
        for module in model.modules():
            if isinstance(module, TrellisShortConv):
                torch.nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))


def escape_step(curve: list[list[float]], threshold: float = 0.1) -> float | None:
    """The first step of a learning curve (``[[step, validation accuracy], ...]``) whose accuracy
    is above ``threshold`` (MQAR chance is ``2 / vocab_size``), or ``None`` when none is."""
    return next((step for step, score in curve if score > threshold), None)


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


class SettingBatches(Dataset):
    """Whole training batches, each drawn from one of several same-length example sets (a mixture
    of MQAR settings whose sequences differ in length), so no batch needs padding. Item ``i`` is a
    batch dict ``{"input_ids": [B, T_s], "labels": [B, T_s]}``; :func:`train_model` feeds these with a
    loader batch size of one. Each set is cut into batches after a seeded shuffle (its last partial
    batch kept), and the order of batches is the loader's, which ``Trainer`` shuffles every epoch."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        generator = torch.Generator().manual_seed(seed)
        self.batches = []
        for ids, labels in parts:
            order = torch.randperm(ids.shape[0], generator=generator)
            self.batches += [(ids[rows], labels[rows]) for rows in order.split(batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels = self.batches[index]
        return {"input_ids": ids, "labels": labels}

    @staticmethod
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        (batch,) = items
        return batch


class _Curve(TrainerCallback):
    """Records ``(step, evaluate(model))`` every ``every`` steps and at the last step; stops the
    training once the score reaches ``stop_at``."""

    def __init__(self, evaluate: Callable[[PreTrainedModel], float], every: int, stop_at: float | None) -> None:
        self.evaluate, self.every, self.stop_at = evaluate, every, stop_at
        self.points: list[list[float]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if step % self.every == 0 or step >= state.max_steps:
            score = self.evaluate(model)
            model.train()
            self.points.append([step, score])
            if self.stop_at is not None and score >= self.stop_at:
                control.should_training_stop = True
        return control


def train_model(
    model: PreTrainedModel, dataset: Dataset, train: TrainSettings,
    evaluate: Callable[[PreTrainedModel], float] | None = None,
) -> dict[str, Any]:
    """Train ``model`` in place with ``transformers.Trainer`` (AdamW, warm-up then cosine).

    Args:
        evaluate: scores the model on held-out data; with ``train.eval_every > 0`` it is called
            every ``eval_every`` steps and at the last step, and its scores form ``curve``.

    Returns:
        ``mean_train_loss`` (averaged over the steps run), ``train_seconds`` (wall clock, curve
        evaluations included), ``steps_run`` and ``curve`` (``[[step, score], ...]``, empty
        without ``evaluate`` or ``eval_every``).
    """
    curve = _Curve(evaluate, train.eval_every, train.stop_accuracy) if evaluate and train.eval_every > 0 else None
    # A SettingBatches item is already a batch of train.batch_size rows.
    whole_batches = isinstance(dataset, SettingBatches)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=train.max_steps,
            per_device_train_batch_size=1 if whole_batches else train.batch_size,
            learning_rate=train.learning_rate, weight_decay=train.weight_decay,
            warmup_steps=math.ceil(train.warmup_ratio * train.max_steps), lr_scheduler_type="cosine",
            logging_steps=max(1, train.max_steps // 10), save_strategy="no", report_to=[],
            disable_tqdm=True, seed=train.seed, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
            bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        )
        callbacks = ([curve] if curve else []) + (
            [StatePassingCallback(train.state_passing, train.state_passing_from, seed=train.seed)]
            if train.state_passing else [])
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks or None,
                          data_collator=SettingBatches.collate if whole_batches else None)
        started = time.perf_counter()
        output = trainer.train()
        return {"mean_train_loss": output.training_loss, "train_seconds": time.perf_counter() - started,
                "steps_run": output.global_step, "curve": curve.points if curve else []}


@torch.no_grad()
def mqar_hits(
    model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 128
) -> torch.Tensor:
    """``[N, T]`` bool on the CPU: :func:`~trellis_lm.eval.mqar.answer_hits` of ``model``'s
    logits, ``batch_size`` rows at a time.

    Args:
        input_ids, labels: ``[N, T]`` from :func:`make_mqar`.
    """
    model.eval()
    device = next(model.parameters()).device
    # The argmax runs where the logits are; only the [rows, T] hits come back.
    return torch.cat([
        answer_hits(model(input_ids=input_ids[rows].to(device), use_cache=False).logits, labels[rows].to(device)).cpu()
        for rows in (slice(start, start + batch_size) for start in range(0, input_ids.shape[0], batch_size))
    ])


def mqar_accuracy(model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 128) -> float:
    """Fraction of answer positions whose argmax prediction equals the label.

    Args:
        input_ids, labels: ``[N, T]`` from :func:`make_mqar`.
    """
    return hit_rate(mqar_hits(model, input_ids, labels, batch_size), labels)


def hit_rate(hits: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of answer positions (``labels`` not -100) that ``hits [N, T]`` marks right."""
    return int(hits.sum()) / int((labels != IGNORE_INDEX).sum())


# Validation data (learning curves, learning-rate choice) comes from seeds far from the train
# (2 * seed) and test (2 * seed + 1) seeds, so the test set never steers a choice.
VALIDATION_SEED = 10**6


def run_mqar(spec: ModelSpec, task: MQARTask, size: ModelSize, train: TrainSettings) -> dict[str, Any]:
    """Train ``spec`` on fresh MQAR data for ``train.max_steps`` and score it on held-out data.

    Train, validation and test sets come from different seeds, so held-out keys, values and
    query positions are unseen combinations.

    Returns:
        A JSON-ready record: the spec, task and settings, ``accuracy`` (test set),
        ``accuracy_by_query_position`` (the test accuracy in each quarter of the query region,
        nearest the context first: :func:`~trellis_lm.eval.mqar.accuracy_by_query_position`),
        ``first_query_accuracy`` (each test example's first query only, where guessing among
        the values not yet answered cannot help: :func:`~trellis_lm.eval.mqar.first_query_accuracy`),
        ``val_accuracy`` (validation set, the last point of ``curve`` when one is recorded),
        the training loss averaged over all steps, ``steps_run``, ``curve``, the parameter
        count, the layer schedule and the wall-clock training time.
    """
    def data(num: int, seed: int, seq_len: int = task.seq_len, pairs: int = task.num_kv_pairs):
        return make_mqar(num, seq_len, pairs, task.vocab_size, seed, power_a=task.power_a)

    settings = task.train_settings()
    if len(settings) == 1:
        dataset: Dataset = TensorDataset(*data(task.num_train, seed=2 * train.seed))
    else:
        # The task's own setting draws from the seed an unmixed run uses; the others from seeds
        # apart from every test (2 * seed + 1) and validation seed.
        share = -(-task.num_train // len(settings))
        parts = [data(share, 2 * train.seed + 2 * VALIDATION_SEED * i, seq_len, pairs)
                 for i, (seq_len, pairs) in enumerate(settings)]
        dataset = SettingBatches(parts, train.batch_size, seed=train.seed)
    test_ids, test_labels = data(task.num_test, seed=2 * train.seed + 1)
    val_ids, val_labels = data(train.num_val, seed=VALIDATION_SEED + train.seed)

    def validate(model: PreTrainedModel) -> float:
        return mqar_accuracy(model, val_ids, val_labels, train.eval_batch_size)

    torch.manual_seed(train.seed)
    model = build_model(spec, size, task.vocab_size, max(seq_len for seq_len, _ in settings))
    trained = train_model(model, dataset, train, validate)
    hits = mqar_hits(model, test_ids, test_labels, train.eval_batch_size)
    accuracy = hit_rate(hits, test_labels)
    val_accuracy = trained["curve"][-1][1] if trained["curve"] else validate(model)
    return {
        "model": spec.name, "kind": spec.kind, "overrides": dict(spec.overrides), "init": spec.init,
        "mixer_types": layer_schedule(spec, size.num_hidden_layers),
        "task": dataclasses.asdict(task), "size": dataclasses.asdict(size), "train": dataclasses.asdict(train),
        "accuracy": accuracy, "val_accuracy": val_accuracy, "escape_step": escape_step(trained["curve"]),
        "accuracy_by_query_position": accuracy_by_query_position(hits, test_labels, task.num_kv_pairs),
        "first_query_accuracy": first_query_accuracy(hits, test_labels), **trained,
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }


def run_niah(spec: ModelSpec, task: NIAHTask, size: ModelSize, train: TrainSettings) -> dict[str, Any]:
    """Train ``spec`` on S-NIAH at ``task.train_context`` tokens, then score greedy retrieval with
    ``generate()`` at each context length and depth on unseen examples.

    Returns:
        A JSON-ready record like :func:`run_mqar`'s, with ``scores[length][depth]`` (fraction of
        ``task.samples`` examples whose completion holds the needle's value), ``accuracy`` (their
        mean over depths at the training length) and ``val_accuracy`` (the same on other needles,
        which the learning-rate choice reads).
    """
    tokenizer = niah_tokenizer(task.tokenizer_vocab, seed=train.seed)
    ids, labels, mask = make_niah_training_data(tokenizer, task.num_train, task.train_context, seed=2 * train.seed)
    torch.manual_seed(train.seed)
    model = build_model(spec, size, len(tokenizer), max(task.eval_contexts) + 64)

    def retrieval(length: int, depth: float, offset: int) -> float:
        # Seeds far from the training data's draws: unseen keys, values and positions.
        examples = [make_niah_example(tokenizer, length, depth, "number", seed=offset + 1000 * i + length)
                    for i in range(task.samples)]
        return score_niah(model, tokenizer, examples, max_new_tokens=10)

    def validate(trained_model: PreTrainedModel) -> float:
        trained_model.eval()
        return sum(retrieval(task.train_context, d, 10**8) for d in task.depths) / len(task.depths)

    trained = train_model(model, TensorDataset(ids, labels, mask), train, validate)
    model.eval()
    scores: dict[str, dict[str, float]] = {}
    for length in task.eval_contexts:
        for depth in task.depths:
            scores.setdefault(str(length), {})[str(depth)] = retrieval(length, depth, 10**9)
    at_train = scores.get(str(task.train_context))
    accuracy = sum(at_train.values()) / len(at_train) if at_train else retrieval(task.train_context, 0.5, 10**9)
    return {
        "model": spec.name, "kind": spec.kind, "overrides": dict(spec.overrides),
        "mixer_types": layer_schedule(spec, size.num_hidden_layers), "task": dataclasses.asdict(task),
        "size": dataclasses.asdict(size), "train": dataclasses.asdict(train), "scores": scores,
        "accuracy": accuracy, "val_accuracy": trained["curve"][-1][1] if trained["curve"] else validate(model),
        **trained, "num_parameters": sum(p.numel() for p in model.parameters()),
    }


# ---------------------------------------------------------------- learning-rate sweep and seeds


def setting_key(record: dict[str, Any]) -> tuple:
    """What a run trained on, apart from its learning rate and seed: model and task."""
    return (record["model"], json.dumps(record["task"], sort_keys=True))


def best_learning_rate(records: list[dict[str, Any]], sweep: Sweep) -> float | None:
    """The learning rate of ``sweep`` whose ``seeds[0]`` run reached the highest validation
    accuracy among ``records`` (one model and setting); ties go to the lower mean training
    loss, then to the smaller rate. ``None`` until every rate of the sweep has run."""
    first = {r["train"]["learning_rate"]: r for r in records if r["train"]["seed"] == sweep.seeds[0]}
    if any(lr not in first for lr in sweep.learning_rates):
        return None
    return max(sweep.learning_rates,
               key=lambda lr: (first[lr]["val_accuracy"], -first[lr]["mean_train_loss"], -lr))


def sweep_runs(
    units: list[tuple[Callable[..., dict[str, Any]], tuple]], sweep: Sweep,
    submit: Callable[..., Future], on_result: Callable[[dict[str, Any]], None] | None = None,
    max_in_flight: int = 1,
) -> list[dict[str, Any]]:
    """Train each unit over ``sweep``: every learning rate at ``seeds[0]``, then the other seeds at
    the unit's best rate (:func:`best_learning_rate`) as soon as its sweep is done.

    At most ``max_in_flight`` runs are submitted at a time and seed runs go before waiting
    learning-rate runs, so units finish one after another: a study stopped early leaves
    complete units rather than many half-done ones.

    Args:
        units: ``(fn, args)`` with ``fn(*args[:-1], train)`` training once and ``args[-1]`` the
            :class:`TrainSettings` whose learning rate and seed the sweep replaces
            (:func:`run_mqar` and :func:`run_niah` fit).
        submit: ``submit(fn, *args) -> Future``, e.g. an executor's.
        on_result: called with each record as it arrives (to save partial results).

    Returns:
        Every run's record, each with ``sweep_role`` ``"lr"`` or ``"seed"``, grouped by unit in
        the order of ``units``.
    """
    waiting = [(index, lr, sweep.seeds[0], "lr") for index in range(len(units)) for lr in sweep.learning_rates]
    running: dict[Future, tuple[int, str]] = {}
    done: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(units))}

    while waiting or running:
        while waiting and len(running) < max(1, max_in_flight):
            index, lr, seed, role = waiting.pop(0)
            fn, args = units[index]
            train = dataclasses.replace(args[-1], learning_rate=lr, seed=seed)
            running[submit(fn, *args[:-1], train)] = (index, role)
        finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
        for future in finished:
            index, role = running.pop(future)
            record = {**future.result(), "sweep_role": role}
            done[index].append(record)
            if on_result is not None:
                on_result(record)
            if role == "lr":
                best = best_learning_rate(done[index], sweep)
                if best is not None:
                    waiting[:0] = [(index, best, seed, "seed") for seed in sweep.seeds[1:]]
    return [record for index in range(len(units)) for record in done[index]]


class InlineExecutor:
    """``submit`` that runs at once and returns a finished future (for ``--jobs 1`` and tests)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        future.set_result(fn(*args))
        return future


def summarize(records: list[dict[str, Any]], sweep: Sweep) -> list[dict[str, Any]]:
    """One summary per model and setting (in order of first appearance): ``best_lr``,
    ``lr_scores`` (``seeds[0]``'s test accuracy at each rate), ``seeds`` and ``accuracies`` (test
    accuracy of each seed at the best rate), ``median``, ``min``, ``max``, ``by_query_position`` (the
    median over those seeds of each quarter of :func:`run_mqar`'s breakdown; ``None`` when a record
    has none), ``first_query`` (the median of their ``first_query_accuracy``; ``None`` likewise)
    and ``mean_seconds``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault(setting_key(record), []).append(record)
    summaries = []
    for group in groups.values():
        best = best_learning_rate(group, sweep)
        if best is None:  # an unfinished sweep: the best rate run so far
            first = [r for r in group if r["train"]["seed"] == sweep.seeds[0]]
            best = max(first, key=lambda r: (r["val_accuracy"], -r["mean_train_loss"]))["train"]["learning_rate"]
        at_best = sorted((r for r in group if r["train"]["learning_rate"] == best), key=lambda r: r["train"]["seed"])
        accuracies = [r["accuracy"] for r in at_best]
        # Records made before the breakdown existed have none.
        positions = [r["accuracy_by_query_position"] for r in at_best if r.get("accuracy_by_query_position")]
        firsts = [r["first_query_accuracy"] for r in at_best if r.get("first_query_accuracy") is not None]
        summaries.append({
            "model": group[0]["model"], "task": group[0]["task"], "overrides": group[0]["overrides"],
            "mixer_types": group[0].get("mixer_types"), "best_lr": best,
            "lr_scores": {r["train"]["learning_rate"]: r["accuracy"] for r in group
                          if r["train"]["seed"] == sweep.seeds[0]},
            "seeds": [r["train"]["seed"] for r in at_best], "accuracies": accuracies,
            "median": statistics.median(accuracies), "min": min(accuracies), "max": max(accuracies),
            "by_query_position": [
                statistics.median(part) if (part := [p for p in column if p is not None]) else None
                for column in zip(*positions)
            ] if len(positions) == len(at_best) else None,
            "first_query": statistics.median(firsts) if len(firsts) == len(at_best) else None,
            "mean_seconds": statistics.fmean(r["train_seconds"] for r in group),
        })
    return summaries


__all__ = [
    "INIT_VARIANTS", "InitVariant", "InlineExecutor", "MQARTask", "ModelSize", "ModelSpec", "NIAHTask",
    "SettingBatches", "Sweep", "TensorDataset", "TrainSettings", "apply_init", "best_learning_rate", "build_model",
    "default_variants", "escape_step", "layer_schedule", "mqar_accuracy", "mqar_hits", "run_mqar", "run_niah",
    "setting_key", "summarize", "sweep_runs", "train_model",
]
