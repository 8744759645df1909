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

The run itself is conversion.pipeline.convert_and_distill, which a Python caller can call too:
this module parses the command line and maps it onto that function's arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from ..arguments import command_words, config_fields, float_above, fraction, int_at_least, probability, report_error
from ..configuration_trellis import DEFAULT_KIND
from ..defaults import CHUNK_SIZE, NUM_SLOTS
from ..state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION
from .layer_choice import parse_auto
from .llama import CONVERTED_MIXERS
from .pipeline import ConversionOptions, DistillOptions, convert_and_distill


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert`` command's arguments to ``parser``."""
    positive, positive_float = int_at_least(1), float_above(0)
    parser.add_argument("src", help="local folder of a Llama, Mistral, Qwen2 or Qwen3 causal-LM checkpoint, or a "
                                    ".gguf file of one (or a folder holding exactly one .gguf)")
    parser.add_argument("dst", help="output folder for the Trellis model (new, or empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a DST folder that is not empty (once the new model is complete)")
    parser.add_argument("--num-slots", type=positive, default=NUM_SLOTS, help=f"memory slots M per head (default {NUM_SLOTS})")
    parser.add_argument("--chunk-size", type=positive, default=CHUNK_SIZE,
                        help=f"chunk size C of the op (default {CHUNK_SIZE}, the config's)")
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
                             "when it parses, else as a string); repeatable, or several separated by commas")

    distill = parser.add_argument_group("distillation (with --distill)")
    distill.add_argument("--distill", action="store_true", help="run stage 1 (layer-wise) and stage 2 (logits)")
    distill.add_argument("--data", nargs="+", action="extend", default=[], metavar="PATH",
                         help=".txt files (one text each), .jsonl files (a 'text' field per line) or folders of them; "
                              "repeatable")
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
    """Run the command parsed by :func:`add_convert_arguments` (:func:`~.pipeline.convert_and_distill`
    with its arguments); returns the exit status."""
    try:
        with command_words(option):
            overrides = config_fields(args.set, "argument --set")
            auto_kept = parse_auto(args.keep_attention) if _is_auto(args.keep_attention) else None
            if auto_kept is not None and not args.distill:
                raise ValueError("argument --keep-attention: auto:K chooses the layers after stage 1 and needs --distill")
            if args.heldout_blocks and not args.distill:
                raise ValueError("argument --heldout-blocks: held-out blocks measure stage 1, which runs with --distill")
            conversion = ConversionOptions(
                num_slots=args.num_slots, chunk_size=args.chunk_size, seed=args.seed, mixer=args.mixer,
                keep_attention=None if auto_kept is not None else parse_layer_list(args.keep_attention),
                attention_every=args.attention_every, overrides=overrides,
            )
            distill = _distill_options(args, auto_kept) if args.distill else None
            convert_and_distill(args.src, args.dst, conversion, distill, overwrite=args.overwrite)
    except ValueError as error:
        return report_error("trellis-lm convert", str(error))
    return 0


# The arguments whose option is not spelt after their name.
_OPTIONS = {"src": "src", "dst": "dst", "keep_dearest": "--keep-attention", "overrides": "--set"}


def option(name: str) -> str:
    """The option (or positional argument) of this command that sets the argument ``name`` of
    :func:`~.pipeline.convert_and_distill` or of its options (the errors' words,
    :func:`~trellis_lm.arguments.command_words`)."""
    return _OPTIONS.get(name, "--" + name.replace("_", "-"))


def _distill_options(args: argparse.Namespace, auto_kept: Optional[int]) -> DistillOptions:
    """The distillation options: each field is the option of the same name, but ``keep_dearest``."""
    names = [field.name for field in dataclasses.fields(DistillOptions) if field.name != "keep_dearest"]
    return DistillOptions(**{name: getattr(args, name) for name in names}, keep_dearest=auto_kept)


def _is_auto(text: Optional[str]) -> bool:
    return isinstance(text, str) and text.startswith("auto")


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


__all__ = ["add_convert_arguments", "parse_layer_list", "run_convert"]
