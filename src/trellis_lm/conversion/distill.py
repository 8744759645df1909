"""Distil a Llama-family teacher into the Trellis model converted from it, with the Trainer.

Two stages, each a :class:`transformers.Trainer` run (progress bar, ``save_steps`` checkpoints,
``resume_from_checkpoint``):

1. :func:`distill_layerwise` trains only the new mixer parameters of the converted layers
   (:func:`~trellis_lm.conversion.llama.new_parameter_names`) to reproduce, layer by layer,
   the teacher's attention output from the teacher's own attention input. Forward hooks on the
   teacher's ``self_attn`` modules capture both for a batch; every layer's loss needs only its
   own pair, so all layers are optimised at once, in one backward pass, and nothing but the
   mixers enters the student side. Layers kept as softmax attention (a hybrid conversion) are
   the teacher's own: they are neither trained nor scored.
2. :func:`distill_logits` fine-tunes the whole student against the teacher's next-token
   distribution (KL divergence at a temperature), through LoRA adapters or on full weights.

Data is a list of texts (tokenized, joined with EOS and cut into blocks), a ``[N, T]`` tensor of
token ids, or any map-style dataset whose items hold ``input_ids`` (and optionally
``attention_mask``), e.g. a tokenized ``datasets.Dataset``. Batches are right-padded; padding
is left out of every loss.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainingArguments

from ..mixers.tokens import ValidTokens
from ..modeling_trellis import TrellisForCausalLM
from ..state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION, StatePassingCallback
from .llama import converted_layers, new_parameter_names

# The mixer's linear maps: the carried projections and the new ones. LoRA reaches nothing else
# (convs, norms and memories are not linear layers; stage 1 has fitted them).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "alpha_proj", "beta_proj", "gamma_proj", "g_proj")

TrainData = Union[Sequence[str], torch.Tensor, Dataset]


# ----------------------------------------------------------------------------- data


class TokenBlocks(Dataset):
    """Rows of token ids; item i is ``{"input_ids": LongTensor [T_i]}``."""

    def __init__(self, rows: Sequence[torch.Tensor]) -> None:
        self.rows = [torch.as_tensor(row, dtype=torch.long) for row in rows]

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, block_size: int) -> "TokenBlocks":
        """Tokenize ``texts``, join them with the EOS token, and cut the stream into blocks of
        ``block_size`` tokens (the last block may be shorter; one of fewer than 2 tokens is
        dropped, as it holds no prediction)."""
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        separator = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        stream = torch.tensor([token for row in ids for token in row + separator], dtype=torch.long)
        return cls([block for block in stream.split(block_size) if len(block) >= 2])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[index]}


def as_dataset(data: TrainData, tokenizer: Optional[PreTrainedTokenizerBase], block_size: int) -> Dataset:
    """A map-style dataset of ``{"input_ids"[, "attention_mask"]}`` items from any accepted form."""
    if isinstance(data, torch.Tensor):
        return TokenBlocks(list(data))
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], str):
        if tokenizer is None:
            raise ValueError("texts need a tokenizer: pass tokenizer=")
        return TokenBlocks.from_texts(data, tokenizer, block_size)
    return data


def pad_batch(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad ``input_ids`` (with 0: padding is masked out everywhere) -> ``[B, T]`` ids and mask."""
    rows = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
    masks = [torch.as_tensor(f.get("attention_mask", torch.ones_like(row)), dtype=torch.long)
             for f, row in zip(features, rows)]
    return {
        "input_ids": nn.utils.rnn.pad_sequence(rows, batch_first=True),
        "attention_mask": nn.utils.rnn.pad_sequence(masks, batch_first=True),
    }


def distillation_arguments(output_dir: str, **overrides: Any) -> TrainingArguments:
    """``TrainingArguments`` with defaults that suit both stages; ``overrides`` win.

    Checkpoints every 500 steps (the 2 latest kept), logs every 10, cosine schedule with 5%
    warm-up, no reporting integrations, and every dataset column kept (the stages read
    ``input_ids`` and ``attention_mask`` themselves).
    """
    defaults: dict[str, Any] = dict(
        per_device_train_batch_size=8, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0.05,
        weight_decay=0.0, save_steps=500, save_total_limit=2, logging_steps=10, report_to="none",
    )
    return TrainingArguments(output_dir=output_dir, **{**defaults, **overrides, "remove_unused_columns": False})


# ----------------------------------------------------------------------------- stage 1: layer-wise


@contextmanager
def captured_attention(
    teacher: PreTrainedModel, layers: Optional[Sequence[int]] = None
) -> Iterator[list[Optional[tuple[torch.Tensor, torch.Tensor]]]]:
    """While open, each teacher forward fills the yielded list, one entry per layer:
    ``(attention input [B, T, D] after input_layernorm, attention output [B, T, D] after o_proj)``;
    only ``layers`` (default all) are captured, the others stay ``None``."""
    all_layers = teacher.model.layers
    pairs: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * len(all_layers)
    wanted = range(len(all_layers)) if layers is None else layers

    def hook(index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        pairs[index] = (hidden.detach(), (output[0] if isinstance(output, tuple) else output).detach())

    handles = [
        all_layers[i].self_attn.register_forward_hook(lambda *a, i=i: hook(i, *a), with_kwargs=True)
        for i in wanted
    ]
    try:
        yield pairs
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_attention(
    teacher: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    layers: Optional[Sequence[int]] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The attention inputs and outputs ``[B, T, D]`` of ``layers`` (default all, in that order)
    for ``input_ids [B, T]`` (the teacher's body only: its LM head is not needed)."""
    with captured_attention(teacher, layers) as pairs:
        teacher.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    wanted = range(len(pairs)) if layers is None else layers
    return [pairs[i][0] for i in wanted], [pairs[i][1] for i in wanted]


class LayerwiseMixers(nn.Module):
    """The student's converted mixers (shared, not copied), scored against the teacher's attention.

    Layers kept as softmax attention are left out (``layer_indices`` lists the ones held). It
    is what the stage-1 Trainer optimises and checkpoints, so checkpoints hold these mixers only.
    """

    def __init__(self, student: TrellisForCausalLM) -> None:
        super().__init__()
        self.layer_indices = converted_layers(student)
        self.mixers = nn.ModuleList(student.model.layers[i].self_attn for i in self.layer_indices)

    def forward(
        self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], attention_mask: Optional[torch.Tensor]
    ) -> torch.Tensor:
        """Relative error of each held layer, ``[L_converted]``: sum over real tokens of
        ``|mixer(x) - y|^2`` over that of ``|y|^2`` (1.0 for an output of zero), for
        ``inputs``/``targets`` (the teacher's, of ``layer_indices``) ``[B, T, D]``."""
        if not self.layer_indices:
            return torch.zeros(0)
        batch, length = inputs[0].shape[:2]
        valid = ValidTokens.from_attention_mask(attention_mask, batch, length)
        real = None if valid is None else valid.mask[..., None]
        errors = []
        for mixer, x, y in zip(self.mixers, inputs, targets):
            out = mixer(x.to(mixer.o_proj.weight.dtype), valid, None)
            residual, y = (out.float() - y.float()), y.float()
            if real is not None:
                residual, y = residual * real, y * real
            errors.append(residual.pow(2).sum() / y.pow(2).sum().clamp_min(1e-12))
        return torch.stack(errors)


class _TeacherTrainer(Trainer):
    """A Trainer that also holds a frozen teacher on the training device."""

    def __init__(self, *args: Any, teacher: PreTrainedModel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device).eval().requires_grad_(False)


class LayerwiseTrainer(_TeacherTrainer):
    """Stage 1: the loss is the mean over layers of :class:`LayerwiseMixers`' relative errors."""

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        mask = inputs["attention_mask"]
        layers = model.layer_indices
        errors = model(*teacher_attention(self.teacher, inputs["input_ids"], mask, layers), mask)
        loss = errors.mean()
        return (loss, errors) if return_outputs else loss


def distill_layerwise(
    student: TrellisForCausalLM,
    teacher: PreTrainedModel,
    train_data: TrainData,
    args: TrainingArguments,
    *,
    tokenizer: Optional[PreTrainedTokenizerBase] = None,
    block_size: int = 1024,
    train_carried: bool = False,
    resume_from_checkpoint: Union[str, bool, None] = None,
) -> TrellisForCausalLM:
    """Stage 1: fit each converted mixer to its teacher attention layer; returns ``student``,
    updated in place.

    Only the new parameters of the converted layers train (``train_carried=True`` adds their
    carried ``q/k/v/o_proj``); layers kept as softmax attention, embeddings, MLPs and norms are
    not touched and never leave their device, and checkpoints (``args.save_steps``) hold the
    converted mixers only. ``args.learning_rate`` about 1e-3 suits the new
    parameters. The teacher is moved to ``args.device``; the student ends where it started.

    Args:
        student: the converted model (or one that went through this stage before).
        teacher: the model it was converted from, e.g. ``AutoModelForCausalLM.from_pretrained(src)``.
        train_data: texts, a ``[N, T]`` id tensor, or a dataset of ``input_ids`` items (module docstring).
        args: e.g. from :func:`distillation_arguments`.
        tokenizer: needed for texts; also saved with the checkpoints.
        block_size: tokens per training row when cutting texts.
        train_carried: also train the projections copied from the teacher.
        resume_from_checkpoint: a checkpoint folder, or True for the latest in ``args.output_dir``.

    Raises:
        ValueError: every layer of ``student`` is softmax attention (nothing to distil).
    """
    layers = converted_layers(student)
    if not layers:
        raise ValueError("every layer of the student is kept as softmax attention: stage 1 has nothing to train")
    device = student.device
    carried = ("q_proj", "k_proj", "v_proj", "o_proj") if train_carried else ()
    student.requires_grad_(False)
    for index in layers:
        mixer = student.model.layers[index].self_attn
        for name in new_parameter_names(mixer.kind) + carried:
            part = getattr(mixer, name, None)
            if part is not None:
                part.requires_grad_(True)
    args.remove_unused_columns = False
    trainer = LayerwiseTrainer(
        model=LayerwiseMixers(student), args=args, train_dataset=as_dataset(train_data, tokenizer, block_size),
        data_collator=pad_batch, processing_class=tokenizer, teacher=teacher,
    )
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return student.requires_grad_(True).to(device)


@torch.no_grad()
def layerwise_errors(
    student: TrellisForCausalLM,
    teacher: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Each converted layer's relative error ``[L_converted]``, in layer order (stage 1's
    measure; 1.0 right after conversion) on ``input_ids [B, T]``, with student and teacher on
    one device. Layers kept as softmax attention are left out (they are the teacher's own);
    :func:`~trellis_lm.conversion.llama.converted_layers` gives the indices of the entries."""
    mixers = LayerwiseMixers(student)
    if not mixers.layer_indices:
        return torch.zeros(0)
    return mixers(*teacher_attention(teacher, input_ids, attention_mask, mixers.layer_indices), attention_mask)


# ----------------------------------------------------------------------------- stage 2: logits


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    temperature: float = 1.0,
) -> torch.Tensor:
    """``T^2 KL(teacher || student)`` of the next-token distributions at temperature T, averaged
    over real tokens; logits ``[B, T, V]``, mask ``[B, T]``. The ``T^2`` keeps gradient sizes
    comparable across temperatures."""
    if attention_mask is not None:
        real = attention_mask.bool()
        student_logits, teacher_logits = student_logits[real], teacher_logits[real]
    log_p_student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = F.kl_div(log_p_student.flatten(0, -2), log_p_teacher.flatten(0, -2), log_target=True, reduction="batchmean")
    return kl * temperature**2


class LogitTrainer(_TeacherTrainer):
    """Stage 2: the loss is :func:`distillation_kl` between student and teacher logits."""

    def __init__(self, *args: Any, temperature: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.temperature = temperature

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, Any]]:
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs, use_cache=False).logits
        outputs = model(**inputs, use_cache=False)
        loss = distillation_kl(outputs.logits, teacher_logits, inputs["attention_mask"], self.temperature)
        return (loss, outputs) if return_outputs else loss


def distill_logits(
    student: TrellisForCausalLM,
    teacher: PreTrainedModel,
    train_data: TrainData,
    args: TrainingArguments,
    *,
    tokenizer: Optional[PreTrainedTokenizerBase] = None,
    block_size: int = 1024,
    temperature: float = 1.0,
    lora_rank: Optional[int] = 16,
    lora_alpha: Optional[float] = None,
    lora_targets: Sequence[str] = DEFAULT_LORA_TARGETS,
    resume_from_checkpoint: Union[str, bool, None] = None,
    state_passing: float = DEFAULT_PROBABILITY,
    state_passing_from: float = DEFAULT_START_FRACTION,
) -> TrellisForCausalLM:
    """Stage 2: fine-tune end to end against the teacher's logits; returns the trained student.

    ``state_passing`` > 0 starts each student row from the final memory states of a row of the
    previous batch with that probability (:mod:`trellis_lm.state_passing`), so the student learns
    to read its blocks after long reads (the teacher sees the block alone, as it would at its
    own context length), from the fraction ``state_passing_from`` of the steps on (default: 0.9
    over the last 30% of the steps, the recipes' default, see :mod:`trellis_lm.state_passing`);
    0 starts every row from the learned memories.

    With ``lora_rank`` (default 16), LoRA adapters of that rank (scale ``lora_alpha``, default
    ``2 * rank``) on ``lora_targets`` train and are merged into the returned model; with
    ``lora_rank=None`` every weight trains (then ``args.learning_rate`` about 1e-5; about 1e-4
    suits LoRA). Checkpoints hold the adapters, or the whole model. The teacher is moved to
    ``args.device``. Other arguments as in :func:`distill_layerwise`.
    """
    if lora_rank is None:
        model: nn.Module = student.requires_grad_(True)
    else:
        lora = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha if lora_alpha is not None else 2 * lora_rank,
            target_modules=list(lora_targets), lora_dropout=0.0, task_type="CAUSAL_LM",
        )
        model = get_peft_model(student, lora)
    args.remove_unused_columns = False
    trainer = LogitTrainer(
        model=model, args=args, train_dataset=as_dataset(train_data, tokenizer, block_size), data_collator=pad_batch,
        processing_class=tokenizer, teacher=teacher, temperature=temperature,
    )
    if state_passing:
        trainer.add_callback(StatePassingCallback(state_passing, state_passing_from, seed=args.seed))
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return (student if lora_rank is None else model.merge_and_unload()).requires_grad_(True)


@torch.no_grad()
def logit_kl(
    student: TrellisForCausalLM,
    teacher: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
) -> float:
    """Stage 2's measure, :func:`distillation_kl`, on ``input_ids [B, T]`` (models on one device)."""
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    student_logits, teacher_logits = (model(**inputs).logits for model in (student, teacher))
    return distillation_kl(student_logits, teacher_logits, attention_mask, temperature).item()


__all__ = [
    "DEFAULT_LORA_TARGETS",
    "LayerwiseMixers",
    "LayerwiseTrainer",
    "LogitTrainer",
    "TokenBlocks",
    "as_dataset",
    "captured_attention",
    "distill_layerwise",
    "distill_logits",
    "distillation_arguments",
    "distillation_kl",
    "layerwise_errors",
    "logit_kl",
    "pad_batch",
    "teacher_attention",
]
