"""Convert a Llama, Mistral, Qwen2 or Qwen3 checkpoint on disk to Trellis, and optionally distil
the original model into it (see docs/conversion.md).

SRC is a Hugging Face checkpoint folder, or a GGUF file (or a folder holding exactly one),
which transformers dequantizes to float32; GGUF needs `pip install gguf`.

--keep-attention 3,7,11 keeps those teacher layers (0-based) as softmax attention layers, copied
exactly; --attention-every N keeps every N-th layer (N-1, 2N-1, ...); --keep-attention auto:K
(with --distill) keeps the K layers whose conversion alone costs most (KL to the teacher on
held-out blocks, after stage 1 on an all-converted model; see conversion.layer_choice). --mixer
lattice makes the other layers Lattice layers instead of Trellis layers.

Without --distill, DST is the converted model. With --distill, DST ends up holding the
distilled model, and each stage's checkpoints go to --work-dir (default DST-distill):
layerwise/ (stage 1, its result in layerwise/final) and logits/ (stage 2). --resume picks
every stage up where it stopped; the conversion itself is seeded, so it simply runs again.

DST is written only once complete: the model is built in a folder beside it and moved into
place at the end, so a failure or Ctrl-C leaves no half-written DST. A DST (or --work-dir) that
is SRC, lies inside it or holds it is refused, and so is a DST that is a file, or a folder that
is not empty unless --overwrite is given (the old folder is then replaced at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import AutoTokenizer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from ..arguments import float_above, fraction, int_at_least, probability, report_error
from ..mixers import DEFAULT_KIND
from ..modeling_trellis import TrellisForCausalLM
from ..state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION
from .distill import TokenBlocks, distill_layerwise, distill_logits, distillation_arguments, pad_batch
from .layer_choice import choose_attention_layers, conversion_costs, keep_as_attention, parse_auto
from .llama import CONVERTED_MIXERS, convert_llama_to_trellis
from .source import locate_source, path_overlap


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` command's arguments to ``parser``."""
    positive, positive_float = int_at_least(1), float_above(0)
    parser.add_argument("src", help="local folder of a Llama, Mistral, Qwen2 or Qwen3 causal-LM checkpoint, or a "
                                    ".gguf file of one (or a folder holding exactly one .gguf)")
    parser.add_argument("dst", help="output folder for the Trellis model (new, or empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a DST folder that is not empty (once the new model is complete)")
    parser.add_argument("--num-slots", type=positive, default=64, help="memory slots M per head (default 64)")
    parser.add_argument("--chunk-size", type=positive, default=16, help="chunk size C of the op (default 16, the config's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the new parameters' initialisation")
    parser.add_argument("--mixer", choices=CONVERTED_MIXERS, default=DEFAULT_KIND,
                        help=f"what the converted layers become (default {DEFAULT_KIND})")
    hybrid = parser.add_mutually_exclusive_group()
    hybrid.add_argument("--keep-attention", default=None, metavar="I,J,...|auto:K",
                        help="0-based teacher layers kept as softmax attention (copied exactly), e.g. 3,7,11; or "
                             "auto:K, the K layers whose conversion costs most in KL (needs --distill: chosen "
                             "after stage 1)")
    hybrid.add_argument("--attention-every", type=positive, default=None, metavar="N",
                        help="keep every N-th layer as softmax attention: layers N-1, 2N-1, ... (N=1 keeps all)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="another TrellisConfig field, e.g. --set compress_fn=l2norm (value read as JSON "
                             "when it parses, else as a string); repeatable")

    distill = parser.add_argument_group("distillation (with --distill)")
    distill.add_argument("--distill", action="store_true", help="run stage 1 (layer-wise) and stage 2 (logits)")
    distill.add_argument("--data", nargs="+", default=[], metavar="PATH",
                         help=".txt files (one text each), .jsonl files (a 'text' field per line) or folders of them")
    distill.add_argument("--work-dir", default=None, help="checkpoints of both stages (default: DST-distill)")
    distill.add_argument("--block-size", type=positive, default=1024, help="tokens per training row (default 1024)")
    distill.add_argument("--batch-size", type=positive, default=8, help="rows per device and step (default 8)")
    distill.add_argument("--grad-accum", type=positive, default=1, help="gradient accumulation steps (default 1)")
    distill.add_argument("--stage1-steps", type=positive, default=2000, help="stage 1 optimiser steps (default 2000)")
    distill.add_argument("--stage1-lr", type=positive_float, default=1e-3, help="stage 1 learning rate (default 1e-3)")
    distill.add_argument("--stage1-train-carried", action="store_true",
                         help="stage 1 also trains the q/k/v/o projections copied from the teacher")
    distill.add_argument("--stage1-cache-gib", type=float_above(0), default=None, metavar="GIB",
                         help="stage 1: run the teacher once per block and reuse its activations (up to GIB in "
                              "memory, the rest in WORK_DIR/teacher_activations, reused by --resume); default: "
                              "the teacher runs at every step")
    distill.add_argument("--heldout-blocks", type=int_at_least(0), default=0, metavar="N",
                         help="stage 1: the last N blocks of the data (after --choice-blocks), held out of "
                              "training, measure the layer errors every --eval-every steps "
                              "(WORK_DIR/layerwise/layer_errors.json)")
    distill.add_argument("--eval-every", type=positive, default=50, help="stage 1: steps between held-out measurements")
    distill.add_argument("--stage1-patience", type=positive, default=None, metavar="K",
                         help="stage 1: stop after K held-out measurements without a 1%% gain (needs --heldout-blocks)")
    distill.add_argument("--stage2-steps", type=positive, default=4000, help="stage 2 optimiser steps (default 4000)")
    distill.add_argument("--stage2-lr", type=positive_float, default=None,
                         help="stage 2 learning rate (default 1e-4 with LoRA, 1e-5 for full weights)")
    distill.add_argument("--lora-rank", type=int_at_least(0), default=16,
                         help="stage 2 LoRA rank; 0 trains full weights")
    distill.add_argument("--temperature", type=positive_float, default=1.0,
                         help="stage 2 softmax temperature (default 1)")
    distill.add_argument("--state-passing", type=probability, default=DEFAULT_PROBABILITY, metavar="P",
                         help="stage 2: a student row starts from a row of the previous batch's final memory "
                              "states with probability P (reads far past the block size; default %(default)s, "
                              "0 is off)")
    distill.add_argument("--state-passing-from", type=fraction, default=None, metavar="F",
                         help=f"stage 2: begin state passing at this fraction of the steps (default "
                              f"{DEFAULT_START_FRACTION}; refused with --state-passing 0)")
    distill.add_argument("--choice-blocks", type=positive, default=8, metavar="N",
                         help="with --keep-attention auto:K: the last N blocks of the data, held out of training, "
                              "price each layer (default 8)")
    distill.add_argument("--save-steps", type=positive, default=500, help="checkpoint every N steps (default 500)")
    distill.add_argument("--resume", action="store_true", help="continue each stage from its latest checkpoint")
    distill.add_argument("--bf16", action="store_true", help="bfloat16 autocast, and the teacher in bfloat16")
    distill.add_argument("--cpu", action="store_true", help="train on the CPU even if an accelerator is present")


def run_convert(args: argparse.Namespace) -> int:
    """Run the command parsed by :func:`add_convert_arguments`; returns the exit status."""
    try:
        target = _checked_destination(args)
        overrides = dict(_parse_field(item) for item in args.set)
        texts = read_texts(args.data) if args.distill else []  # before converting: fail fast
        if _auto_kept(args) is not None and not args.distill:
            raise ValueError("argument --keep-attention: auto:K chooses the layers after stage 1 and needs --distill")
        if args.stage1_patience is not None and not args.heldout_blocks:
            raise ValueError("argument --stage1-patience: stopping needs held-out blocks to measure (--heldout-blocks N)")
        if args.heldout_blocks and not args.distill:
            raise ValueError("argument --heldout-blocks: held-out blocks measure stage 1, which runs with --distill")
        if args.state_passing_from is not None and not args.state_passing:
            raise ValueError(f"argument --state-passing-from: state passing is off (--state-passing 0), so a start at "
                             f"{args.state_passing_from} would be ignored: drop one of them")
        _check_auto_kept(args)
        with _staged(target, args.dst) as staging:
            student = convert_llama_to_trellis(
                args.src, staging, keep_attention=None if _auto_kept(args) is not None else parse_layer_list(
                    args.keep_attention), attention_every=args.attention_every, **_conversion_options(args, overrides),
            )
            print(f"converted {args.src} -> {args.dst} ({student.num_parameters() / 1e6:.1f}M parameters)")
            if args.distill:
                _distill(student, texts, args, staging, overrides)
        if args.distill:
            print(f"distilled model written to {args.dst}")
    except ValueError as error:
        return report_error("trellis-lm convert", str(error))
    return 0


def _checked_destination(args: argparse.Namespace) -> Path:
    """Where DST really is (symlinks followed), after refusing what would harm SRC or DST: the
    source is read while the model is written, and a replaced DST takes what it holds with it."""
    try:
        source = locate_source(args.src)
    except ValueError as error:
        raise ValueError(f"argument src: {error}") from None
    # What is read: the folder, or only the GGUF file (a folder may hold it among other things).
    src, target = source.folder / (source.gguf_file or ""), Path(args.dst).resolve()
    relation = path_overlap(target, src)
    if relation:
        raise ValueError(f"argument dst: {args.dst} {relation} the source {args.src}: a conversion never writes "
                         "into its source")
    if target.exists() and not target.is_dir():
        raise ValueError(f"argument dst: {args.dst} is a file: expected a folder")
    if target.is_dir() and any(target.iterdir()) and not args.overwrite:
        raise ValueError(f"argument dst: {args.dst} is a folder that is not empty: pass --overwrite to replace it")
    if args.distill:
        work = _work_dir(args)
        if work.exists() and not work.is_dir():
            raise ValueError(f"argument --work-dir: {work} is a file: expected a folder for the stages' checkpoints")
        for other, name in ((src, f"the source {args.src}"), (target, f"dst {args.dst}")):
            relation = path_overlap(work, other)
            if relation:
                raise ValueError(f"argument --work-dir: {work} {relation} {name}: expected a folder of its own")
    return target


@contextlib.contextmanager
def _staged(target: Path, name: str) -> Iterator[Path]:
    """A new folder beside ``target`` (same file system, so the final move is a rename) to write
    the model into; it replaces ``target`` when the block completes and is removed when the block
    fails or is interrupted. ``name`` is DST as given, for messages."""
    staging = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as error:
        raise ValueError(f"argument dst: cannot create {name}: {error.strerror or error}") from None
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


def _work_dir(args: argparse.Namespace) -> Path:
    return Path(args.work_dir or f"{str(args.dst).rstrip('/')}-distill")


def _check_auto_kept(args: argparse.Namespace) -> None:
    """``--keep-attention auto:K`` keeps at most every layer of the teacher: checked against its
    config before stage 1 runs (which would otherwise run, and write, before the choice fails)."""
    kept = _auto_kept(args)
    if kept is None:
        return
    layers = locate_source(args.src).load_config().num_hidden_layers
    if kept > layers:
        raise ValueError(f"argument --keep-attention: auto:{kept} keeps more layers than the teacher's "
                         f"{layers} (expected auto:K with K <= {layers})")


def _auto_kept(args: argparse.Namespace) -> Optional[int]:
    """K of ``--keep-attention auto:K``, else ``None``."""
    text = args.keep_attention
    return parse_auto(text) if isinstance(text, str) and text.startswith("auto") else None


def _conversion_options(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    """The conversion's arguments besides the kept layers (the same for a re-conversion)."""
    return dict(num_slots=args.num_slots, chunk_size=args.chunk_size, seed=args.seed, mixer=args.mixer, **overrides)


def _distill(student: TrellisForCausalLM, texts: list[str], args: argparse.Namespace, out: Path,
             overrides: dict[str, Any]) -> None:
    """Distil ``student`` (converted into ``out``) into the model ``out`` ends up holding."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    data = TokenBlocks.from_texts(texts, tokenizer, args.block_size)
    auto_kept = _auto_kept(args)
    choice_rows = None
    if auto_kept is not None:
        if len(data) <= args.choice_blocks:
            raise ValueError(f"argument --choice-blocks: the data holds {len(data)} blocks of {args.block_size} tokens; "
                             f"pricing the layers holds {args.choice_blocks} out, leaving none to train on")
        choice_rows = data.rows[-args.choice_blocks:]
        data = TokenBlocks(data.rows[: -args.choice_blocks])
    heldout = None
    if args.heldout_blocks:
        if len(data) <= args.heldout_blocks:
            raise ValueError(f"argument --heldout-blocks: the data holds {len(data)} training blocks; holding "
                             f"{args.heldout_blocks} out leaves none to train on")
        heldout = pad_batch([{"input_ids": row} for row in data.rows[-args.heldout_blocks:]])  # the last may be short
        data = TokenBlocks(data.rows[: -args.heldout_blocks])
    teacher = locate_source(args.src).load_model(dtype=torch.bfloat16 if args.bf16 else torch.float32)
    saved_dtype = student.dtype
    work = _work_dir(args)

    layerwise_final = work / "layerwise" / "final"
    if args.resume and (layerwise_final / "config.json").is_file():
        student = TrellisForCausalLM.from_pretrained(layerwise_final, dtype=torch.float32)
    else:
        student = distill_layerwise(
            student.float(), teacher, data, _training_args(work / "layerwise", args, args.stage1_steps, args.stage1_lr),
            tokenizer=tokenizer, train_carried=args.stage1_train_carried,
            resume_from_checkpoint=_checkpoint(work / "layerwise", args),
            teacher_cache=None if args.stage1_cache_gib is None else work / "teacher_activations",
            cache_memory_bytes=int((args.stage1_cache_gib or 0) * 2**30), eval_every=args.eval_every,
            heldout=None if heldout is None else heldout["input_ids"], patience=args.stage1_patience,
            heldout_mask=None if heldout is None else heldout["attention_mask"],
        )
        student.save_pretrained(layerwise_final)
        tokenizer.save_pretrained(layerwise_final)
    if auto_kept is not None:
        student = _keep_dearest_layers(student, teacher, choice_rows, auto_kept, args, out, overrides)

    lora_rank = args.lora_rank or None
    stage2_lr = args.stage2_lr if args.stage2_lr is not None else (1e-4 if lora_rank else 1e-5)
    student = distill_logits(
        student, teacher, data, _training_args(work / "logits", args, args.stage2_steps, stage2_lr),
        tokenizer=tokenizer, temperature=args.temperature, lora_rank=lora_rank,
        resume_from_checkpoint=_checkpoint(work / "logits", args), state_passing=args.state_passing,
        state_passing_from=args.state_passing_from,
    )
    student.to(saved_dtype).save_pretrained(out)


def _keep_dearest_layers(student: TrellisForCausalLM, teacher: Any, rows: list[torch.Tensor], k: int,
                         args: argparse.Namespace, out: Path, overrides: dict[str, Any]) -> TrellisForCausalLM:
    """The hybrid keeping the ``k`` layers whose conversion costs most on ``rows`` (held-out
    blocks), the others' stage-1 mixers carried over; the costs go to the work dir."""
    batch = pad_batch([{"input_ids": row} for row in rows])
    device = next(teacher.parameters()).device
    costs = conversion_costs(student.to(device), teacher, batch["input_ids"].to(device), batch["attention_mask"].to(device))
    kept = choose_attention_layers(costs, k)
    record = {"costs_kl": {str(layer): cost for layer, cost in costs.items()}, "kept": kept, "blocks": len(rows)}
    (_work_dir(args) / "layer_choice.json").write_text(json.dumps(record, indent=1))
    print(f"kept as attention (largest KL when converted alone): {kept}")
    hybrid = keep_as_attention(student, args.src, out, kept, **_conversion_options(args, overrides))
    return hybrid.float()


def _training_args(output_dir: Path, args: argparse.Namespace, steps: int, learning_rate: float) -> TrainingArguments:
    return distillation_arguments(
        str(output_dir), max_steps=steps, learning_rate=learning_rate, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum, save_steps=args.save_steps, bf16=args.bf16, use_cpu=args.cpu,
    )


def _checkpoint(output_dir: Path, args: argparse.Namespace) -> Optional[str]:
    """The latest checkpoint to resume from, when ``--resume`` is given and one exists."""
    return get_last_checkpoint(str(output_dir)) if args.resume and output_dir.is_dir() else None


def read_texts(paths: list[str]) -> list[str]:
    """Texts from ``.txt`` files (one each), ``.jsonl`` files (field ``text``) and folders of them."""
    if not paths:
        raise ValueError("--distill needs training texts: pass --data")
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"--data {path}: no such file or folder")
        files.extend(sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl")) if path.is_dir() else [path])
    texts = []
    for file in files:
        if file.suffix == ".jsonl":
            lines = file.read_text(encoding="utf-8").splitlines()
            texts.extend(json.loads(line)["text"] for line in lines if line.strip())
        elif file.suffix == ".txt":
            texts.append(file.read_text(encoding="utf-8"))
        else:
            raise ValueError(f"--data {file}: expected a .txt or .jsonl file, or a folder of them")
    if not texts:
        raise ValueError(f"--data {' '.join(paths)}: no texts found")
    return texts


def parse_layer_list(text: Optional[str]) -> Optional[list[int]]:
    """``"3,7,11"`` -> ``[3, 7, 11]`` (``None`` stays ``None``); range and duplicates are checked
    by the conversion, which knows the number of layers."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        return [int(item) for item in items]
    except ValueError:
        raise ValueError(f"--keep-attention {text!r}: expected comma-separated layer indices, e.g. 3,7,11") from None


def _parse_field(item: str) -> tuple[str, Any]:
    name, sep, value = item.partition("=")
    if not sep:
        raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


__all__ = ["add_convert_arguments", "parse_layer_list", "read_texts", "run_convert"]
