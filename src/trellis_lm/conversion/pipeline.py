"""The whole run of ``trellis-lm convert`` as a function: :func:`convert_and_distill`.

It converts a teacher checkpoint (:func:`~.llama.convert_source`) and, given
:class:`DistillOptions`, distils the teacher into the result (:func:`~.distill.distill_layerwise`,
then :func:`~.distill.distill_logits`, with the kept layers chosen between them for
``keep_dearest``). The source is located once, and DST and the work folder are checked against it
once, before anything is read or written; the model is built in a folder beside DST and moved into
place only when complete. The command (:mod:`.cli`) parses its arguments, maps them onto this
function's and reports its ``ValueError`` as one line.

Errors name an argument as a Python caller passes it (``DistillOptions.work_dir: ...``,
``pass overwrite=True``); the command runs this function in its own words
(:func:`~trellis_lm.arguments.command_words`: ``argument --work-dir: ...``, ``pass --overwrite``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from transformers import AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ..arguments import (
    ArgumentType, any_integer, argument, flag_problem, float_above, fraction, int_at_least, named, passing, probability,
)
from ..configuration_trellis import DEFAULT_KIND, TrellisConfig
from ..defaults import CHUNK_SIZE, NUM_SLOTS
from ..modeling_trellis import TrellisForCausalLM
from ..state_passing import DEFAULT_PROBABILITY
from .data import read_texts
from .distill import TokenBlocks, distill_layerwise, distill_logits, distillation_arguments, pad_batch
from .layer_choice import carry_converted_mixers, choose_attention_layers, conversion_costs
from .llama import convert_source
from .resume import begin_run, check_resumable, run_record
from .source import TeacherSource, locate_source, path_overlap

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class ConversionOptions:
    """How :func:`convert_and_distill` converts the teacher: the keyword arguments of
    :func:`~.llama.convert_llama_to_trellis` (``overrides`` are its further
    :class:`~trellis_lm.TrellisConfig` fields, ``--set FIELD=VALUE``)."""

    num_slots: int = NUM_SLOTS
    chunk_size: int = CHUNK_SIZE
    seed: int = 0
    mixer: str = DEFAULT_KIND
    keep_attention: Optional[Sequence[int]] = None
    attention_every: Optional[int] = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_fields(self, _CONVERSION_CHECKS)
        if not isinstance(self.overrides, Mapping):
            raise ValueError(f"{argument('ConversionOptions.overrides')}: expected a mapping of TrellisConfig fields "
                             f"to values, got {self.overrides!r}")
        own = sorted(set(self.overrides) & {f.name for f in dataclasses.fields(self)})
        if own:
            raise ValueError(f"{argument('ConversionOptions.overrides')}: {own[0]} has its own argument, "
                             f"{named('ConversionOptions.' + own[0])}, not a further config field")
        try:
            TrellisConfig.check_field_names(self.overrides)
        except ValueError as error:
            raise ValueError(f"{argument('ConversionOptions.overrides')}: {error}") from None

    def options(self) -> dict[str, Any]:
        """The conversion's arguments besides the kept layers (the same when a hybrid is converted again)."""
        return dict(num_slots=self.num_slots, chunk_size=self.chunk_size, seed=self.seed, mixer=self.mixer,
                    **self.overrides)


@dataclass(frozen=True)
class DistillOptions:
    """How :func:`convert_and_distill` distils the teacher into the converted model. Each field is
    the ``trellis-lm convert`` option of the same name (``--stage1-steps`` is ``stage1_steps``),
    except ``keep_dearest``, which is ``--keep-attention auto:K``; see ``docs/conversion.md``.

    ``data``: ``.txt`` files (one text each), ``.jsonl`` files (a ``text`` field per line) or
    folders of them; one path or a sequence of them. ``work_dir``: both stages' checkpoints (default: DST followed by
    ``-distill``). ``keep_dearest=K`` keeps as softmax attention the K layers whose conversion
    alone costs most in KL to the teacher, priced after stage 1 on the data's last
    ``choice_blocks`` blocks (held out of training); ``heldout_blocks`` are the last blocks before
    those, held out to measure stage 1 every ``eval_every`` steps (and stop it after
    ``stage1_patience`` measurements without a 1% gain). ``stage2_lr`` defaults to 1e-4 with LoRA
    (``lora_rank`` > 0) and 1e-5 for full weights. ``resume`` picks each stage up at its latest
    checkpoint, and is refused where the work folder's run was made with other options (see
:func:`convert_and_distill`). Numbers and flags are checked as they are made, as the command's
parser checks its options (a string or a float is not an integer). The rest are as in :func:`~.distill.distill_layerwise` (stage 1) and
    :func:`~.distill.distill_logits` (stage 2).
    """

    data: Union[PathLike, Sequence[PathLike]]
    work_dir: Optional[PathLike] = None
    block_size: int = 1024
    batch_size: int = 8
    grad_accum: int = 1
    stage1_steps: int = 2000
    stage1_lr: float = 1e-3
    stage1_train_carried: bool = False
    stage1_cache_gib: Optional[float] = None
    heldout_blocks: int = 0
    eval_every: int = 50
    stage1_patience: Optional[int] = None
    stage2_steps: int = 4000
    stage2_lr: Optional[float] = None
    lora_rank: int = 16
    temperature: float = 1.0
    state_passing: float = DEFAULT_PROBABILITY
    state_passing_from: Optional[float] = None
    keep_dearest: Optional[int] = None
    choice_blocks: int = 8
    save_steps: int = 500
    resume: bool = False
    bf16: bool = False
    cpu: bool = False

    def __post_init__(self) -> None:
        # A single path is one path (a string is also a sequence: of characters).
        data = (self.data,) if isinstance(self.data, (str, os.PathLike)) else self.data
        if not isinstance(data, Sequence) or not all(isinstance(path, (str, os.PathLike)) for path in data):
            raise ValueError(f"{argument('DistillOptions.data')}: expected a path or a sequence of paths, "
                             f"got {self.data!r}")
        object.__setattr__(self, "data", tuple(data))
        if self.work_dir is not None and not isinstance(self.work_dir, (str, os.PathLike)):
            raise ValueError(f"{argument('DistillOptions.work_dir')}: expected a folder path or None, got {self.work_dir!r}")
        _check_fields(self, _DISTILL_CHECKS)


_POSITIVE, _NONNEGATIVE = int_at_least(1), int_at_least(0)
# What each numeric or flag field of the options may hold, as the command's parser says it (a
# number as its argument type; a flag: True or False). `None` is allowed where the default is.
_CONVERSION_CHECKS = {"num_slots": _POSITIVE, "chunk_size": _POSITIVE, "seed": any_integer, "attention_every": _POSITIVE}
_DISTILL_CHECKS: dict[str, Optional[ArgumentType]] = {
    "block_size": _POSITIVE, "batch_size": _POSITIVE, "grad_accum": _POSITIVE, "stage1_steps": _POSITIVE,
    "stage1_lr": float_above(0), "stage1_train_carried": None, "stage1_cache_gib": float_above(0),
    "heldout_blocks": _NONNEGATIVE, "eval_every": _POSITIVE, "stage1_patience": _POSITIVE, "stage2_steps": _POSITIVE,
    "stage2_lr": float_above(0), "lora_rank": _NONNEGATIVE, "temperature": float_above(0),
    "state_passing": probability, "state_passing_from": fraction, "keep_dearest": _NONNEGATIVE,
    "choice_blocks": _POSITIVE, "save_steps": _POSITIVE, "resume": None, "bf16": None, "cpu": None,
}


def _check_fields(options: Any, checks: Mapping[str, Optional[ArgumentType]]) -> None:
    """Refuse the first field of ``options`` (a dataclass) that its check refuses (``None``: a flag)."""
    owner = type(options).__name__
    for field in dataclasses.fields(options):
        if field.name not in checks:
            continue
        value, check = getattr(options, field.name), checks[field.name]
        if value is None and field.default is None:
            continue
        problem = flag_problem(value) if check is None else check.problem(value)
        if problem:
            raise ValueError(f"{argument(f'{owner}.{field.name}')}: {problem}")


def convert_and_distill(
    src: PathLike,
    dst: PathLike,
    conversion: Optional[ConversionOptions] = None,
    distill: Optional[DistillOptions] = None,
    *,
    overwrite: bool = False,
) -> TrellisForCausalLM:
    """Convert the teacher checkpoint ``src`` into a Trellis model in the folder ``dst``, and
    distil the teacher into it when ``distill`` is given; returns the model ``dst`` holds.

    Args:
        src: a local Llama, Mistral, Qwen2 or Qwen3 checkpoint folder, or a ``.gguf`` file of one
            (or a folder holding exactly one); see :func:`~.source.locate_source`.
        dst: the output folder: new, or empty unless ``overwrite``.
        conversion: how to convert (default: :class:`ConversionOptions`' defaults).
        distill: run stage 1 (layer-wise) and stage 2 (logits) with these settings.
        overwrite: replace a ``dst`` folder that is not empty, once the new model is complete.

    Writes: ``dst``, built in a folder beside it (``.NAME.partial-XXXXXXXX``) and moved into place
    once complete, so a failure or an interrupt leaves no half-written ``dst`` (the folder beside
    it is removed). Without ``distill`` it holds the converted model; with it, the distilled model,
    and the work folder holds ``layerwise/`` (stage 1, its result in ``layerwise/final``),
    ``logits/`` (stage 2), with ``stage1_cache_gib`` ``teacher_activations/``, and with
    ``keep_dearest`` the prices of the layers (``layer_choice.json``). Progress goes to standard
    output. A distillation records its options in the work folder (``run.json``); one started
    without ``resume`` replaces the checkpoints an earlier run left there (``layerwise/``,
    ``logits/``), so that a later resume never continues another run's.

    Raises:
        ValueError, before anything is written: ``src`` is not a checkpoint;
            ``dst`` (or the work folder) is ``src``, lies inside it or holds it (symlinks
            followed); ``dst`` or the work folder is a file; ``dst`` is a folder that is not empty
            and ``overwrite`` is not given; the data holds no text, or a file that cannot be read
            (named with its line); ``resume`` where the work folder holds a run made with other
            options (the differing ones named) or made before runs recorded them; ``stage1_patience`` without
            ``heldout_blocks``; ``state_passing_from`` with ``state_passing=0``;
            ``keep_dearest`` with ``keep_attention`` or ``attention_every``, or above the teacher's
            number of layers; and what :func:`~.llama.convert_llama_to_trellis` refuses (which
            leaves nothing behind either). During the run, ``heldout_blocks`` or
            ``choice_blocks`` that leave no block to train on (DST is left as it was).
    """
    problem = flag_problem(overwrite)
    if problem:
        raise ValueError(f"{argument('overwrite')}: {problem}")
    for name, value, kind in (("conversion", conversion, ConversionOptions), ("distill", distill, DistillOptions)):
        if value is not None and not isinstance(value, kind):
            raise ValueError(f"{argument(name)}: expected {kind.__name__} or None, got {value!r}")
    try:
        source = locate_source(src)
    except ValueError as error:
        raise ValueError(f"{argument('src')}: {error}") from None
    target = _checked_destination(source, src, dst, overwrite)
    conversion = ConversionOptions() if conversion is None else conversion
    work, texts, record = None, [], None
    if distill is not None:  # all before converting: fail fast
        work = _checked_work_dir(distill, source, src, dst, target)
        texts = read_texts(distill.data, "DistillOptions.data")
        _check_distill_options(distill, source, conversion)
        record = run_record(source.path, conversion, distill)
        if distill.resume:
            check_resumable(work, record)
    options = conversion.options()
    with _staged(target, dst) as staging:
        # With keep_dearest, the hybrid is converted again once stage 1 has priced the layers.
        student = convert_source(source, staging, keep_attention=conversion.keep_attention,
                                 attention_every=conversion.attention_every, **options)
        print(f"converted {src} -> {dst} ({student.num_parameters() / 1e6:.1f}M parameters)")
        if distill is not None:
            begin_run(work, record, distill.resume)
            student = _distill(student, texts, source, distill, work, staging, options)
    if distill is not None:
        print(f"distilled model written to {dst}")
    return student


def _checked_destination(source: TeacherSource, src: PathLike, dst: PathLike, overwrite: bool) -> Path:
    """Where DST really is (symlinks followed), after refusing what would harm the source or DST:
    the source is read while the model is written, and a replaced DST takes what it holds with it."""
    target = Path(dst).resolve()
    relation = path_overlap(target, source.path)
    if relation:
        raise ValueError(f"{argument('dst')}: {dst} {relation} the source {src}: a conversion never writes "
                         "into its source")
    if target.exists() and not target.is_dir():
        raise ValueError(f"{argument('dst')}: {dst} is a file: expected a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{argument('dst')}: {dst} is a folder that is not empty: pass {passing('overwrite')} to "
                         "replace it")
    return target


def _checked_work_dir(distill: DistillOptions, source: TeacherSource, src: PathLike, dst: PathLike,
                      target: Path) -> Path:
    """The folder of the stages' checkpoints, refused where it is a file or shares files with
    the source or DST (replacing DST at the end would delete it)."""
    work = Path(distill.work_dir or f"{str(dst).rstrip('/')}-distill")
    if work.exists() and not work.is_dir():
        raise ValueError(f"{argument('DistillOptions.work_dir')}: {work} is a file: expected a folder for the stages' "
                         "checkpoints")
    for other, name in ((source.path, f"the source {src}"), (target, f"dst {dst}")):
        relation = path_overlap(work, other)
        if relation:
            raise ValueError(f"{argument('DistillOptions.work_dir')}: {work} {relation} {name}: expected a folder of "
                             "its own")
    return work


def _check_distill_options(distill: DistillOptions, source: TeacherSource, conversion: ConversionOptions) -> None:
    """Refuse settings that would be ignored or that fail only after stage 1 has run (and written)."""
    if distill.stage1_patience is not None and not distill.heldout_blocks:
        raise ValueError(f"{argument('DistillOptions.stage1_patience')}: stopping needs held-out blocks to measure "
                         f"({passing('heldout_blocks', 'N')})")
    if distill.state_passing_from is not None and not distill.state_passing:
        raise ValueError(f"{argument('DistillOptions.state_passing_from')}: state passing is off "
                         f"({passing('state_passing', 0)}), so a start at {distill.state_passing_from} would be ignored: "
                         "drop one of them")
    kept = distill.keep_dearest
    if kept is None:
        return
    if conversion.keep_attention is not None or conversion.attention_every is not None:
        raise ValueError(f"{argument('DistillOptions.keep_dearest')}: it chooses the kept layers itself: drop "
                         f"{named('ConversionOptions.keep_attention')} and {named('ConversionOptions.attention_every')}")
    layers = source.load_config().num_hidden_layers
    if kept > layers:
        raise ValueError(f"{argument('DistillOptions.keep_dearest')}: keeping {kept} layers as attention is more than "
                         f"the teacher's {layers} (expected at most {layers})")


@contextlib.contextmanager
def _staged(target: Path, name: PathLike) -> Iterator[Path]:
    """A new folder beside ``target`` (same file system, so the final move is a rename) to write
    the model into; it replaces ``target`` when the block completes and is removed when the block
    fails or is interrupted. ``name`` is DST as given, for messages."""
    staging = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:
        raise ValueError(f"{argument('dst')}: cannot create {name}: {error.strerror or error}") from None
    try:
        yield staging
        _replace(target, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _replace(target: Path, new: Path) -> None:
    """Move the folder ``new`` to ``target``; an existing ``target`` is set aside first and only
    deleted once ``new`` is in its place (renaming onto a folder fails where it is not empty)."""
    if not target.exists():
        new.rename(target)
        return
    old = new.with_name(f"{new.name}.old")
    target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old)


def _distill(student: TrellisForCausalLM, texts: list[str], source: TeacherSource, distill: DistillOptions,
             work: Path, out: Path, options: dict[str, Any]) -> TrellisForCausalLM:
    """Distil ``student`` (converted into ``out`` with ``options``) into the model ``out`` ends up
    holding, which is returned."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    data = TokenBlocks.from_texts(texts, tokenizer, distill.block_size)
    choice_rows = None
    if distill.keep_dearest is not None:
        if len(data) <= distill.choice_blocks:
            raise ValueError(f"{argument('DistillOptions.choice_blocks')}: the data holds {len(data)} blocks of {distill.block_size} "
                             f"tokens; pricing the layers holds {distill.choice_blocks} out, leaving none to train on")
        choice_rows = data.rows[-distill.choice_blocks:]
        data = TokenBlocks(data.rows[: -distill.choice_blocks])
    heldout = None
    if distill.heldout_blocks:
        if len(data) <= distill.heldout_blocks:
            raise ValueError(f"{argument('DistillOptions.heldout_blocks')}: the data holds {len(data)} training blocks; holding "
                             f"{distill.heldout_blocks} out leaves none to train on")
        heldout = pad_batch([{"input_ids": row} for row in data.rows[-distill.heldout_blocks:]])  # the last may be short
        data = TokenBlocks(data.rows[: -distill.heldout_blocks])
    teacher = source.load_model(dtype=torch.bfloat16 if distill.bf16 else torch.float32)
    saved_dtype = student.dtype

    layerwise_final = work / "layerwise" / "final"
    if distill.resume and (layerwise_final / "config.json").is_file():
        student = TrellisForCausalLM.from_pretrained(layerwise_final, dtype=torch.float32)
    else:
        student = distill_layerwise(
            student.float(), teacher, data,
            _training_args(work / "layerwise", distill, distill.stage1_steps, distill.stage1_lr),
            tokenizer=tokenizer, train_carried=distill.stage1_train_carried,
            resume_from_checkpoint=_checkpoint(work / "layerwise", distill),
            teacher_cache=None if distill.stage1_cache_gib is None else work / "teacher_activations",
            cache_memory_bytes=int((distill.stage1_cache_gib or 0) * 2**30), eval_every=distill.eval_every,
            heldout=None if heldout is None else heldout["input_ids"], patience=distill.stage1_patience,
            heldout_mask=None if heldout is None else heldout["attention_mask"],
        )
        student.save_pretrained(layerwise_final)
        tokenizer.save_pretrained(layerwise_final)
    if distill.keep_dearest is not None:
        student = _keep_dearest_layers(student, teacher, choice_rows, distill.keep_dearest, source, work, out, options)

    lora_rank = distill.lora_rank or None
    stage2_lr = distill.stage2_lr if distill.stage2_lr is not None else (1e-4 if lora_rank else 1e-5)
    student = distill_logits(
        student, teacher, data, _training_args(work / "logits", distill, distill.stage2_steps, stage2_lr),
        tokenizer=tokenizer, temperature=distill.temperature, lora_rank=lora_rank,
        resume_from_checkpoint=_checkpoint(work / "logits", distill), state_passing=distill.state_passing,
        state_passing_from=distill.state_passing_from,
    )
    student = student.to(saved_dtype)
    student.save_pretrained(out)
    return student


def _keep_dearest_layers(student: TrellisForCausalLM, teacher: Any, rows: list[torch.Tensor], k: int,
                         source: TeacherSource, work: Path, out: Path, options: dict[str, Any]) -> TrellisForCausalLM:
    """The hybrid keeping the ``k`` layers whose conversion costs most on ``rows`` (held-out
    blocks), the others' stage-1 mixers carried over; the costs go to the work dir."""
    batch = pad_batch([{"input_ids": row} for row in rows])
    device = next(teacher.parameters()).device
    costs = conversion_costs(student.to(device), teacher, batch["input_ids"].to(device), batch["attention_mask"].to(device))
    kept = choose_attention_layers(costs, k)
    record = {"costs_kl": {str(layer): cost for layer, cost in costs.items()}, "kept": kept, "blocks": len(rows)}
    (work / "layer_choice.json").write_text(json.dumps(record, indent=1))
    print(f"kept as attention (largest KL when converted alone): {kept}")
    hybrid = convert_source(source, out, keep_attention=kept, **options)
    return carry_converted_mixers(student, hybrid, out).float()


def _training_args(output_dir: Path, distill: DistillOptions, steps: int, learning_rate: float) -> TrainingArguments:
    return distillation_arguments(
        str(output_dir), max_steps=steps, learning_rate=learning_rate, per_device_train_batch_size=distill.batch_size,
        gradient_accumulation_steps=distill.grad_accum, save_steps=distill.save_steps, bf16=distill.bf16,
        use_cpu=distill.cpu,
    )


def _checkpoint(output_dir: Path, distill: DistillOptions) -> Optional[str]:
    """The latest checkpoint to resume from, when ``resume`` is set and one exists."""
    return get_last_checkpoint(str(output_dir)) if distill.resume and output_dir.is_dir() else None


__all__ = ["ConversionOptions", "DistillOptions", "convert_and_distill", "read_texts"]
