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

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import Dataset, Subset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback, TrainingArguments

from ..mixers.valid_tokens import ValidTokens
from ..modeling_trellis import TrellisForCausalLM
from ..state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION, StatePassingCallback
from .data import TokenBlocks, TrainData, as_dataset, check_token_ids, pad_batch
from .llama import converted_layers, new_parameter_names
from .teacher import INPUTS, TARGETS, TeacherActivations, captured_attention, pad_activations, teacher_attention

# The mixer's linear maps: the carried projections and the new ones. LoRA reaches nothing else
# (convs, norms and memories are not linear layers; stage 1 has fitted them).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "alpha_proj", "beta_proj", "gamma_proj", "g_proj")

# ----------------------------------------------------------------------------- data


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


def blocks_read(dataset: Dataset, args: TrainingArguments) -> Dataset:
    """The blocks a run of ``args`` reads: every block when it runs whole epochs; with
    ``max_steps``, as many as its steps take (``max_steps`` x batch x accumulation x processes),
    evenly spaced over the data when that is fewer. What a cache of teacher activations holds is
    then bounded by the run, not by the size of the data it was given."""
    if args.max_steps is None or args.max_steps <= 0:
        return dataset
    needed = args.max_steps * args.train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    if needed >= len(dataset):
        return dataset
    return Subset(dataset, [i * len(dataset) // needed for i in range(needed)])


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


def checked_every(eval_every: Any) -> int:
    """``eval_every`` (steps between held-out measurements), or a ``ValueError`` naming it."""
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be an integer >= 1 (optimiser steps between measurements), got {eval_every!r}")
    return eval_every


def checked_heldout(heldout: Optional[torch.Tensor], heldout_mask: Optional[torch.Tensor],
                    eval_every: Any, *models: Any) -> Optional[torch.Tensor]:
    """``heldout_mask``, after checking the held-out arguments together: ``eval_every`` (always:
    an argument is never ignored unchecked), ids ``[N, T]`` of ``models``' vocabularies and a
    mask of their shape (1 at real tokens, every row starting with one), or no mask; a mask
    without blocks is refused."""
    checked_every(eval_every)
    if heldout is None:
        if heldout_mask is not None:
            raise ValueError("heldout_mask marks the real tokens of held-out blocks: pass heldout too")
        return None
    if not isinstance(heldout, torch.Tensor) or heldout.dim() != 2 or heldout.shape[1] < 2:
        raise ValueError(f"heldout must be a [N, T >= 2] tensor of token ids, got {getattr(heldout, 'shape', heldout)!r}")
    check_token_ids("heldout", heldout, *models)
    if heldout_mask is not None and (not isinstance(heldout_mask, torch.Tensor) or heldout_mask.shape != heldout.shape
                                     or not bool(heldout_mask[:, 0].bool().all())):
        raise ValueError(f"heldout_mask must be [N, T] like heldout ({tuple(heldout.shape)}), 1 at real tokens and "
                         "0 at right padding, every row starting with a real token")
    return heldout_mask


def _check_train_ids(train_data: TrainData, *models: Any) -> None:
    """Training data given as an id tensor holds token ids of ``models``' vocabularies."""
    if isinstance(train_data, torch.Tensor):
        check_token_ids("train_data", train_data, *models)


class HeldOutLayerErrors(TrainerCallback):
    """Stage 1's measure on held-out blocks, and its stopping rule: every ``every`` steps the
    layer errors of the held-out blocks are measured and recorded (``layer_errors.json`` in the
    run's folder); the run stops once their mean has not improved by ``min_gain`` (relative) for
    ``patience`` measurements.

    Args:
        mixers: the stage-1 module (:class:`~.distill.LayerwiseMixers`).
        teacher: the teacher.
        input_ids: ``[N, T]`` held-out blocks (never trained on).
        every: optimiser steps between measurements.
        patience: measurements without a gain of ``min_gain`` (relative, on the mean error)
            before the run stops; ``None`` never stops it.
        min_gain: the relative gain that counts as an improvement.
        attention_mask: ``[N, T]`` 1 at the blocks' real tokens (right padding 0: left out of
            the errors), or ``None`` (every token real).
    """

    def __init__(self, mixers: nn.Module, teacher: PreTrainedModel, input_ids: torch.Tensor, every: int = 50,
                 patience: Optional[int] = None, min_gain: float = 0.01,
                 attention_mask: Optional[torch.Tensor] = None) -> None:
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise ValueError(f"patience must be None or an integer >= 1 (measurements without a gain), got {patience!r}")
        self.mixers, self.teacher, self.input_ids, self.attention_mask = mixers, teacher, input_ids, attention_mask
        self.every, self.patience, self.min_gain = checked_every(every), patience, min_gain
        self.curve: list[dict[str, Any]] = []
        self.best, self.stale = float("inf"), 0

    @torch.no_grad()
    def measure(self) -> list[float]:
        device = next(self.mixers.parameters()).device
        ids = self.input_ids.to(device)
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        errors = self.mixers(*teacher_attention(self.teacher, ids, mask, self.mixers.layer_indices), mask)
        return errors.tolist()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.best = self._record(state.global_step, args)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            mean = self._record(state.global_step, args)
            if mean < self.best * (1 - self.min_gain):
                self.best, self.stale = mean, 0
            else:
                self.stale += 1
                if self.patience is not None and self.stale >= self.patience:
                    control.should_training_stop = True

    def _record(self, step: int, args: Any) -> float:
        was_training = self.mixers.training
        self.mixers.eval()
        errors = self.measure()
        self.mixers.train(was_training)
        mean = sum(errors) / max(len(errors), 1)
        self.curve.append({"step": step, "mean": mean, "layers": dict(zip(map(str, self.mixers.layer_indices), errors))})
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "layer_errors.json").write_text(json.dumps(self.curve, indent=1))
        return mean


@torch.no_grad()
def block_perplexity(model: nn.Module, input_ids: torch.Tensor, batch_size: int = 4,
                     attention_mask: Optional[torch.Tensor] = None) -> float:
    """exp of the mean next-token loss over the real tokens of the blocks ``input_ids [N, T]``
    (``attention_mask [N, T]``: 0 at right padding, which is neither read nor predicted; ``None``:
    every token real), ``batch_size`` rows at a time on the model's device, the model as it is
    (set evaluation mode first)."""
    device = next(model.parameters()).device
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    total, count = 0.0, 0
    for rows, real in zip(input_ids.split(batch_size), mask.split(batch_size)):
        rows, real = rows.to(device), real.to(device)
        labels = rows.masked_fill(real == 0, -100)
        targets = int((labels[:, 1:] != -100).sum())  # what the shifted loss averages over
        if targets:
            total += model(input_ids=rows, attention_mask=real, labels=labels, use_cache=False).loss.item() * targets
            count += targets
    return math.exp(total / count)


class HeldOutPerplexity(TrainerCallback):
    """Stage 2's learning curve: every ``every`` optimiser steps (and at the first and last), the
    perplexity of the model in training on held-out blocks ``input_ids [N, T]`` (never trained
    on), ``batch_size`` rows at a time, in evaluation mode (state passing leaves evaluation
    forwards alone); recorded in ``perplexity.json`` in the run's folder as ``[{"step",
    "perplexity"}]``. ``attention_mask [N, T]`` marks the real tokens of right-padded blocks."""

    def __init__(self, input_ids: torch.Tensor, every: int = 50, batch_size: int = 4,
                 attention_mask: Optional[torch.Tensor] = None) -> None:
        self.input_ids, self.every, self.batch_size = input_ids, checked_every(every), batch_size
        self.attention_mask = attention_mask
        self.curve: list[dict[str, Any]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        self._record(state.global_step, args, model)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self._record(state.global_step, args, model)

    def _record(self, step: int, args: Any, model: nn.Module) -> None:
        was_training = model.training
        model.eval()
        perplexity = block_perplexity(model, self.input_ids, self.batch_size, self.attention_mask)
        self.curve.append({"step": step, "perplexity": perplexity})
        model.train(was_training)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "perplexity.json").write_text(json.dumps(self.curve, indent=1))


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
        if INPUTS in inputs:  # computed once per block (TeacherActivations)
            pairs = (list(inputs[INPUTS].unbind(1)), list(inputs[TARGETS].unbind(1)))
        else:
            pairs = teacher_attention(self.teacher, inputs["input_ids"], mask, model.layer_indices)
        errors = model(*pairs, mask)
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
    teacher_cache: Union[str, Path, bool, None] = None,
    cache_memory_bytes: int = 2**30,
    heldout: Optional[torch.Tensor] = None,
    eval_every: int = 50,
    patience: Optional[int] = None,
    heldout_mask: Optional[torch.Tensor] = None,
) -> TrellisForCausalLM:
    """Stage 1: fit each converted mixer to its teacher attention layer; returns ``student``,
    updated in place.

    With ``teacher_cache`` the teacher runs once per training block before training
    (:class:`~.teacher.TeacherActivations`: in memory up to ``cache_memory_bytes``, the rest in
    the folder ``teacher_cache``, reused when the run resumes; ``True``: in memory only), so
    steps past the first epoch cost the mixers alone; without it the teacher runs at every step.
    With ``args.max_steps`` the run then trains on the blocks its steps take (:func:`blocks_read`:
    evenly spaced over the data when fewer than it holds), and only those are computed and kept.
    With ``heldout`` (``[N, T]`` ids of blocks never trained on), the layer errors on them are
    measured every ``eval_every`` steps into ``layer_errors.json`` in ``args.output_dir`` (the
    curve), and with ``patience`` the run stops once they stop improving
    (:class:`HeldOutLayerErrors`); ``heldout_mask`` (``[N, T]``, 0 at right padding) leaves
    padding out of them.

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
        ValueError: every layer of ``student`` is softmax attention (nothing to distil); ``heldout``
            or a ``train_data`` tensor that is not integer token ids of both models' vocabularies.
    """
    layers = converted_layers(student)
    if not layers:
        raise ValueError("every layer of the student is kept as softmax attention: stage 1 has nothing to train")
    heldout_mask = checked_heldout(heldout, heldout_mask, eval_every, student, teacher)
    _check_train_ids(train_data, student, teacher)
    if patience is not None and heldout is None:
        raise ValueError("patience stops stage 1 on held-out measurements: pass heldout too")
    if isinstance(cache_memory_bytes, bool) or not isinstance(cache_memory_bytes, int) or cache_memory_bytes < 0:
        raise ValueError(f"cache_memory_bytes must be an integer >= 0, got {cache_memory_bytes!r}")
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
    dataset, collate = as_dataset(train_data, tokenizer, block_size), pad_batch
    if teacher_cache:
        folder = None if teacher_cache is True else teacher_cache
        dataset = blocks_read(dataset, args)
        with torch.no_grad():
            dataset = TeacherActivations(teacher.to(args.device).eval(), dataset, layers, folder, cache_memory_bytes,
                                         batch_size=args.per_device_train_batch_size)
        collate = pad_activations
    mixers = LayerwiseMixers(student)
    trainer = LayerwiseTrainer(model=mixers, args=args, train_dataset=dataset, data_collator=collate,
                               processing_class=tokenizer, teacher=teacher)
    if heldout is not None:
        trainer.add_callback(HeldOutLayerErrors(mixers, trainer.teacher, heldout, eval_every, patience,
                                                attention_mask=heldout_mask))
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
    check_token_ids("input_ids", input_ids, student, teacher)
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
    state_passing_from: Optional[float] = None,
    heldout: Optional[torch.Tensor] = None,
    eval_every: int = 50,
    heldout_mask: Optional[torch.Tensor] = None,
) -> TrellisForCausalLM:
    """Stage 2: fine-tune end to end against the teacher's logits; returns the trained student.

    With ``heldout`` (``[N, T]`` ids of blocks never trained on), the student's perplexity on
    them is measured every ``eval_every`` steps into ``perplexity.json`` in ``args.output_dir``
    (:class:`HeldOutPerplexity`: the stage's learning curve); ``heldout_mask`` (``[N, T]``, 0 at
    right padding) leaves padding out of it, as tokens read and as targets.

    ``state_passing`` > 0 starts each student row from the final memory states of a row of the
    previous batch with that probability (:mod:`trellis_lm.state_passing`), so the student learns
    to read its blocks after long reads (the teacher sees the block alone, as it would at its
    own context length), from the fraction ``state_passing_from`` of the steps on (default
    ``None``: 0.9 over the last 30% of the steps, the recipes' default, see
    :mod:`trellis_lm.state_passing`); 0 starts every row from the learned memories, and a start
    given with it is refused (it would be ignored).

    With ``lora_rank`` (default 16), LoRA adapters of that rank (scale ``lora_alpha``, default
    ``2 * rank``) on ``lora_targets`` train and are merged into the returned model; with
    ``lora_rank=None`` every weight trains (then ``args.learning_rate`` about 1e-5; about 1e-4
    suits LoRA). Checkpoints hold the adapters, or the whole model. The teacher is moved to
    ``args.device``. Other arguments as in :func:`distill_layerwise`.
    """
    heldout_mask = checked_heldout(heldout, heldout_mask, eval_every, student, teacher)
    _check_train_ids(train_data, student, teacher)
    if isinstance(state_passing, bool) or not isinstance(state_passing, (int, float)) or not 0 <= state_passing <= 1:
        raise ValueError(f"state_passing must be a probability in [0, 1] (0: off), got {state_passing!r}")
    if state_passing_from is not None and not state_passing:
        raise ValueError(f"state_passing_from={state_passing_from!r} is given, but state_passing is 0 (off): it would "
                         "be ignored")
    start = DEFAULT_START_FRACTION if state_passing_from is None else state_passing_from
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
        trainer.add_callback(StatePassingCallback(state_passing, start, seed=args.seed))
    if heldout is not None:
        trainer.add_callback(HeldOutPerplexity(heldout, eval_every, attention_mask=heldout_mask))
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
    check_token_ids("input_ids", input_ids, student, teacher)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    student_logits, teacher_logits = (model(**inputs).logits for model in (student, teacher))
    return distillation_kl(student_logits, teacher_logits, attention_mask, temperature).item()


__all__ = [
    "DEFAULT_LORA_TARGETS",
    "HeldOutLayerErrors",
    "HeldOutPerplexity",
    "block_perplexity",
    "blocks_read",
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
