"""The ``trellis-lm`` command: generate, train, eval, bench and convert.

    trellis-lm generate MODEL "The memory" --max-new-tokens 40
    trellis-lm train pretrain --data_files corpus.txt --output_dir outputs/my-model
    trellis-lm train finetune --model outputs/my-model --data_files chats.jsonl --lora
    trellis-lm eval MODEL --tasks trellis_demo
    trellis-lm bench --quick
    trellis-lm convert SRC DST

Each command's ``--help`` explains it. ``python -m trellis_lm`` runs the same. Heavy imports
(transformers' Trainer, lm-eval, the conversion code) happen inside the commands.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from . import __version__

Handler = Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- generate


def _add_generate(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="continue prompts with a saved model",
        description="Load a checkpoint (folder or Hub id) with its tokenizer and print a continuation of each "
                    "prompt; prompts are read from standard input, one per line, when none is given. The "
                    "prompts run as one left-padded batch through generate() and the fixed-size cache.",
    )
    parser.add_argument("model", help="checkpoint folder or Hub id")
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line of standard input)")
    parser.add_argument("--max-new-tokens", type=int, default=50, help="tokens to generate (default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search width (default: %(default)s)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the tokenizer's chat template")
    parser.add_argument("--seed", type=int, default=None, help="random seed (for sampling)")
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda:0 (default: a GPU if there is one)")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default: %(default)s)")
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("trellis-lm generate: no prompt given", file=sys.stderr)
        return 2
    if args.seed is not None:
        set_seed(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "left"  # new tokens are appended on the right
    if args.chat:
        from .training import ensure_chat_template

        ensure_chat_template(tokenizer)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        inputs = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    else:
        inputs = tokenizer(prompts, padding=True, return_tensors="pt")
    sampling = {name: value for name in ("temperature", "top_p", "top_k") if (value := getattr(args, name)) is not None}
    output = model.generate(
        **inputs.to(device), max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, num_beams=args.num_beams,
        **sampling,
    )
    continuations = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    for prompt, continuation in zip(prompts, continuations):
        print(continuation if args.chat else prompt + continuation)
    return 0


# ----------------------------------------------------------------------------- train


RECIPES = ("pretrain", "finetune")


def _add_train(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="pretrain or fine-tune with the transformers Trainer",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""Train with the stock transformers Trainer (recipes of trellis_lm.training).

  pretrain   stream paragraphs of text files, pack them (DataCollatorWithFlattening) and train
             a new small model (or --model); without --data_files, a sample corpus is used
  finetune   supervised fine-tuning on JSONL chats, loss on assistant turns only, --lora for
             PEFT adapters; without --data_files, synthetic chats are used

Options are the recipe's and every TrainingArguments option (--output_dir, --max_steps,
--per_device_train_batch_size, --learning_rate, --bf16, --gradient_checkpointing, --save_steps,
--resume_from_checkpoint last, ...): `trellis-lm train RECIPE --help` lists them all. Under
torchrun / accelerate launch the same command trains on several processes.""",
    )
    parser.add_argument("recipe", choices=RECIPES, help="which recipe to run")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the recipe's options and TrainingArguments")
    parser.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from . import training

    if args.recipe == "pretrain":
        recipe, arguments_class, defaults = training.pretrain, training.PretrainArguments, training.PRETRAIN_DEFAULTS
    else:
        recipe, arguments_class, defaults = training.finetune, training.FinetuneArguments, training.FINETUNE_DEFAULTS
    recipe_args, training_args = training.parse_recipe_arguments(
        arguments_class, defaults, argv=args.options, prog=f"trellis-lm train {args.recipe}"
    )
    trainer = recipe(recipe_args, training_args)
    if trainer.is_world_process_zero():
        print(f"trained {trainer.state.global_step} steps; model saved to {training_args.output_dir}")
    return 0


# ----------------------------------------------------------------------------- eval


def _add_eval(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "eval", help="evaluate with lm-evaluation-harness",
        description="Run lm-evaluation-harness tasks on a checkpoint and print lm-eval's table. The bundled "
                    "offline tasks trellis_demo_choice (loglikelihood), trellis_demo_gen (generate_until) and "
                    "their group trellis_demo are always available; any lm-eval task name works too.",
    )
    parser.add_argument("model", help="checkpoint folder or Hub id")
    parser.add_argument("--tasks", nargs="+", default=["trellis_demo"], help="task or group names (default: %(default)s)")
    parser.add_argument("--model-type", choices=("trellis", "hf"), default="trellis",
                        help="lm-eval model: 'trellis' (this package) or 'hf' (stock, trust_remote_code=True)")
    parser.add_argument("--batch-size", default="8", help="requests per batch, or 'auto' (default: %(default)s)")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (or a fraction of them)")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context length lm-eval truncates to (default: the tokenizer's model_max_length)")
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda:0 (default: a GPU if there is one)")
    parser.add_argument("--include-path", default=None, help="a folder of more task YAMLs (the demo tasks are added)")
    parser.add_argument("--output", default=None, help="also write the results as JSON to this file")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from lm_eval.utils import make_table

    from .eval import TASKS_DIR
    from .eval.harness import evaluate

    model_args = {name: value for name in ("max_length", "dtype") if (value := getattr(args, name)) is not None}
    include_path = [str(TASKS_DIR)] + ([args.include_path] if args.include_path else [])
    batch_size = args.batch_size if args.batch_size == "auto" or args.batch_size.startswith("auto:") else int(args.batch_size)
    results = evaluate(
        args.model, args.tasks, model=args.model_type, model_args=model_args, include_path=include_path,
        batch_size=batch_size, limit=args.limit, num_fewshot=args.num_fewshot, device=args.device,
    )
    print(make_table(results))
    if args.output:
        summary = {key: results[key] for key in ("results", "versions", "n-shot", "config") if key in results}
        Path(args.output).write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    return 0


# ----------------------------------------------------------------------------- bench


def _add_bench(subparsers: Any) -> None:
    from .benchmark import add_bench_arguments

    parser = subparsers.add_parser(
        "bench", help="CPU benchmark: op backends and decode cost against context length",
        description="Time the op's backends (forward, forward+backward) and decoding at two context lengths "
                    "against a Llama of the same size; every figure is a ratio measured in the same run. "
                    "The full run is what BENCHMARKS.md records; --quick checks it runs in seconds.",
    )
    add_bench_arguments(parser)
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import run_bench

    return run_bench(args)


# ----------------------------------------------------------------------------- convert


def _add_convert(subparsers: Any) -> None:
    help_line = "convert a Llama-family checkpoint to Trellis (optionally distil it)"
    try:
        conversion = importlib.import_module(".conversion.cli", __package__)
    except ImportError as error:
        reason = f"conversion is unavailable in this installation ({error})"
        parser = subparsers.add_parser("convert", help=f"{help_line}: unavailable here", description=reason)
        parser.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(handler=_unavailable(reason))
        return
    parser = subparsers.add_parser(
        "convert", help=help_line, description=conversion.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    conversion.add_convert_arguments(parser)
    parser.set_defaults(handler=conversion.run_convert)


def _unavailable(reason: str) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        print(f"trellis-lm convert: {reason}", file=sys.stderr)
        return 1

    return handler


# ----------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The ``trellis-lm`` argument parser, one sub-command per tool."""
    parser = argparse.ArgumentParser(
        prog="trellis-lm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"trellis-lm {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for add in (_add_generate, _add_train, _add_eval, _add_bench, _add_convert):
        add(subparsers)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``trellis-lm`` with ``argv`` (default: the command line); returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
