"""The ``trellis-lm`` command: generate, train, eval, bench and convert.

    trellis-lm generate MODEL "The memory" --max-new-tokens 40
    trellis-lm train pretrain --data_files corpus.txt --output_dir outputs/my-model
    trellis-lm train finetune --model outputs/my-model --data_files chats.jsonl --lora
    trellis-lm eval MODEL --tasks trellis_demo
    trellis-lm bench --quick
    trellis-lm convert SRC DST

Each command's ``--help`` explains it; every option takes hyphens or underscores
(``--max-new-tokens`` or ``--max_new_tokens``). ``python -m trellis_lm`` runs the same. The
model stack (torch, transformers' modeling code) is imported once a command runs, and only the
command named is built: ``trellis-lm --help`` and a command line argparse refuses answer without
it (from the ``trellis-lm`` script; see :mod:`trellis_lm_command`); heavier imports still
(transformers' Trainer, lm-eval, the conversion code) happen inside their commands.

Exit status: 0 on success; 2 for a bad argument or input, reported as one line on standard error
that names the argument (``trellis-lm generate: error: argument --num-beams: expected an integer
>= 1, got '0'``) before anything is written; 1 for a failure while running (conversion unavailable
in this installation, or an unexpected error with its traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Optional, TypeVar

from . import __version__, register_auto_classes
from .arguments import (
    GLOB_CHARACTERS, CommandLineError, Parser, blame, checkpoint, checkpoint_problem, eval_batch_size,
    existing_folder, first_line, float_above, int_at_least, output_file, report_error,
)

Handler = Callable[[argparse.Namespace], int]
T = TypeVar("T")

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
# `generate` prints it on a line of its own between the texts of several prompts.
SEPARATOR = "-" * 40
# Recipe and TrainingArguments fields that HfArgumentParser types but does not bound, and that
# fail only once a model is built and data is read (batch size 0, ...).
_TRAINING_MINIMUMS = {
    "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1, "max_length": 1, "vocab_size": 1,
    "shuffle_buffer": 1, "tokenizer_documents": 1, "lora_rank": 1,
}


def _device(text: Optional[str]) -> str:
    """``text`` if torch reads it as a device that is present; default: a GPU if there is one."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    with blame("--device", RuntimeError):
        device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandLineError(f"argument --device: {text} is not available here (no CUDA device)")
    return text


# ----------------------------------------------------------------------------- generate


def _on_a_checkpoint(parser: argparse.ArgumentParser, description: str) -> None:
    """A command that reads one checkpoint: its description and its first argument, ``model``."""
    parser.description = description
    parser.add_argument("model", type=checkpoint, help="checkpoint folder or Hub id")


def _add_generate(parser: argparse.ArgumentParser) -> None:
    _on_a_checkpoint(
        parser,
        "Load a checkpoint (folder or Hub id) with its tokenizer and print a continuation of each prompt, with a line "
        "of dashes between them; prompts are read from standard input, one per line, when none is given. The prompts "
        "run as one left-padded batch through generate() and the fixed-size cache.",
    )
    parser.add_argument("prompts", nargs="*", help="prompts (default: one per line of standard input)")
    parser.add_argument("--max-new-tokens", type=int_at_least(1), default=50,
                        help="tokens to generate, at least 1 (default: %(default)s)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float_above(0), default=None, help="sampling temperature, > 0")
    parser.add_argument("--top-p", type=float_above(0, 1), default=None, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int_at_least(1), default=None, help="sample among the k likeliest tokens")
    parser.add_argument("--num-beams", type=int_at_least(1), default=1, help="beam search width (default: %(default)s)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the tokenizer's chat template")
    parser.add_argument("--seed", type=int_at_least(0), default=None, help="random seed (for sampling)")
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda:0 (default: a GPU if there is one)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="weights' dtype (default: %(default)s)")
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise CommandLineError("argument prompts: none given, and no line on standard input")
    device = _device(args.device)
    if args.seed is not None:
        set_seed(args.seed)
    # A Hub id is only known to be wrong when it fails to load (not found, no network, ...).
    with blame("model", OSError, ValueError):
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
    empty = [index for index, count in enumerate(inputs["attention_mask"].sum(dim=1).tolist()) if not count]
    if empty:
        raise CommandLineError(f"argument prompts: prompt {empty[0] + 1} ({prompts[empty[0]]!r}) holds no tokens: "
                               "expected text to continue")
    with blame("model", OSError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    model = model.to(device).eval()
    sampling = {name: value for name in ("temperature", "top_p", "top_k") if (value := getattr(args, name)) is not None}
    output = model.generate(
        **inputs.to(device), max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, num_beams=args.num_beams,
        **sampling,
    )
    continuations = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        if index:
            print(SEPARATOR)  # a continuation may itself hold blank lines
        print(continuation if args.chat else prompt + continuation)
    return 0


# ----------------------------------------------------------------------------- train


RECIPES = ("pretrain", "finetune")


def _add_train(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = """Train with the stock transformers Trainer (recipes of trellis_lm.training).

  pretrain   stream paragraphs of text files, pack them (DataCollatorWithFlattening) and train
             a new small model (or --model); without --data_files, a sample corpus is used
  finetune   supervised fine-tuning on JSONL chats, loss on assistant turns only, --lora for
             PEFT adapters; without --data_files, synthetic chats are used

Options are the recipe's and every TrainingArguments option (--output_dir, --max_steps,
--per_device_train_batch_size, --learning_rate, --bf16, --gradient_checkpointing, --save_steps,
--resume_from_checkpoint last, ...): `trellis-lm train RECIPE --help` lists them all. Under
torchrun / accelerate launch the same command trains on several processes."""
    parser.add_argument("recipe", choices=RECIPES, help="which recipe to run")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="the recipe's options and TrainingArguments")
    parser.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from . import training

    args.prog = f"{args.prog} {args.recipe}"  # errors are about the recipe's options
    if args.recipe == "pretrain":
        recipe, arguments_class, defaults = training.pretrain, training.PretrainArguments, training.PRETRAIN_DEFAULTS
    else:
        recipe, arguments_class, defaults = training.finetune, training.FinetuneArguments, training.FINETUNE_DEFAULTS
    recipe_args, training_args = _quietly_parsed(lambda: training.parse_recipe_arguments(
        arguments_class, defaults, argv=args.options, prog=args.prog
    ))
    _check_training_arguments(recipe_args, training_args)
    trainer = recipe(recipe_args, training_args)
    if trainer.is_world_process_zero():
        print(f"trained {trainer.state.global_step} steps; {_saved_where(recipe_args, training_args.output_dir)}")
    return 0


def _saved_where(recipe_args: Any, output_dir: str) -> str:
    """Where the run left what it trained, and which folder loads as a model."""
    if not getattr(recipe_args, "lora", False):
        return f"model saved to {output_dir}"
    adapter = f"LoRA adapter saved to {output_dir} (PeftModel.from_pretrained(base_model, '{output_dir}'))"
    if not recipe_args.merge_lora:
        return adapter
    return f"{adapter}; the model with it merged, which loads on its own, to {Path(output_dir) / 'merged'}"


def _quietly_parsed(parse: Callable[[], T]) -> T:
    """``parse()`` with HfArgumentParser's errors as one line: argparse would print the usage of
    every TrainingArguments option (hundreds of lines) above the message."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            parsed = parse()
    except SystemExit as exit:
        if not exit.code:  # --help
            raise
        lines = captured.getvalue().strip().splitlines()
        message = lines[-1] if lines else f"exit status {exit.code}"
        raise CommandLineError(message.partition(": error: ")[2] or message) from None
    except ValueError as error:  # options no dataclass knows, and TrainingArguments' own checks
        raise CommandLineError(first_line(error)) from None
    sys.stderr.write(captured.getvalue())  # warnings of a successful parse still reach the user
    return parsed


def _check_training_arguments(recipe_args: Any, training_args: Any) -> None:
    """What HfArgumentParser leaves unchecked: ranges, and inputs that would fail after a model is built."""
    for name, minimum in _TRAINING_MINIMUMS.items():
        value = getattr(recipe_args, name, getattr(training_args, name, None))
        if value is not None and value < minimum:
            raise CommandLineError(f"argument --{name}: expected an integer >= {minimum}, got {value}")
    if recipe_args.model is not None:
        _check_model(recipe_args.model, "--model")
    missing = [name for name in recipe_args.data_files if GLOB_CHARACTERS.isdisjoint(name) and not Path(name).exists()]
    if missing:
        raise CommandLineError(f"argument --data_files: {missing[0]} does not exist")
    from .training import check_recipe_arguments

    try:
        check_recipe_arguments(recipe_args, training_args)
    except ValueError as error:  # each message starts with the option's name
        raise CommandLineError(f"argument {first_line(error)}") from None


def _check_model(name: str, argument: str, **config_kwargs: Any) -> None:
    """Refuse ``name`` unless it is a checkpoint whose config loads: cheap, unlike the model that
    the command loads later, and the only way to know a Hub id exists."""
    problem = checkpoint_problem(name)
    if problem:
        raise CommandLineError(f"argument {argument}: {problem}")
    from transformers import AutoConfig

    with blame(argument, OSError, ValueError):
        AutoConfig.from_pretrained(name, **config_kwargs)


# ----------------------------------------------------------------------------- eval


def _add_eval(parser: argparse.ArgumentParser) -> None:
    _on_a_checkpoint(
        parser,
        "Run lm-evaluation-harness tasks on a checkpoint and print lm-eval's table. The bundled offline tasks "
        "trellis_demo_choice (loglikelihood), trellis_demo_gen (generate_until) and their group trellis_demo are "
        "always available; any lm-eval task name works too.",
    )
    parser.add_argument("--tasks", nargs="+", default=["trellis_demo"],
                        help="task or group names, or task YAML files (default: %(default)s)")
    parser.add_argument("--model-type", choices=("trellis", "hf"), default="trellis",
                        help="lm-eval model: 'trellis' (this package) or 'hf' (stock, trust_remote_code=True)")
    parser.add_argument("--batch-size", type=eval_batch_size, default="8",
                        help="requests per batch (>= 1), or 'auto' / 'auto:N' (default: %(default)s)")
    parser.add_argument("--limit", type=float_above(0), default=None,
                        help="documents per task (or, below 1, a fraction of them)")
    parser.add_argument("--num-fewshot", type=int_at_least(0), default=None, help="few-shot examples per prompt")
    parser.add_argument("--max-length", type=int_at_least(1), default=None,
                        help="context length lm-eval truncates to (default: the tokenizer's model_max_length)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights' dtype (default: the checkpoint's)")
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda:0 (default: a GPU if there is one)")
    parser.add_argument("--include-path", type=existing_folder, default=None,
                        help="a folder of more task YAMLs (the demo tasks are added)")
    parser.add_argument("--output", type=output_file, default=None, help="also write the results as JSON to this file")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from lm_eval.utils import make_table

    from .eval import TASKS_DIR
    from .eval.harness import evaluate

    model_args = {name: value for name in ("max_length", "dtype") if (value := getattr(args, name)) is not None}
    include_path = [str(TASKS_DIR)] + ([args.include_path] if args.include_path else [])
    device = _device(args.device)
    _check_model(args.model, "model", trust_remote_code=args.model_type == "hf")
    _check_tasks(args.tasks, include_path)
    results = evaluate(
        args.model, args.tasks, model=args.model_type, model_args=model_args, include_path=include_path,
        batch_size=args.batch_size, limit=args.limit, num_fewshot=args.num_fewshot, device=device,
    )
    print(make_table(results))
    if args.output:
        summary = {key: results[key] for key in ("results", "versions", "n-shot", "config") if key in results}
        Path(args.output).write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    return 0


def _check_tasks(tasks: list[str], include_path: list[str]) -> None:
    """Refuse task names lm-eval does not know before the model loads (lm-eval looks them up after)."""
    from .eval.harness import task_manager

    manager = task_manager(include_path)
    unknown = [task for task in tasks if not manager.match_tasks([task]) and not Path(task).is_file()]
    if unknown:
        raise CommandLineError(f"argument --tasks: no lm-eval task, group or YAML file named {', '.join(unknown)}")


# ----------------------------------------------------------------------------- bench


def _add_bench(parser: argparse.ArgumentParser) -> None:
    from .benchmark import add_bench_arguments

    parser.description = (
        "Time the op's backends (forward, forward+backward) and decoding at two context lengths against a Llama of the "
        "same size; every figure is a ratio measured in the same run. The full run is what BENCHMARKS.md records; "
        "--quick checks it runs in seconds."
    )
    add_bench_arguments(parser)
    parser.set_defaults(handler=_bench)


def _bench(args: argparse.Namespace) -> int:
    from .benchmark import run_bench

    return run_bench(args)


# ----------------------------------------------------------------------------- convert


def _add_convert(parser: argparse.ArgumentParser) -> None:
    try:
        conversion = importlib.import_module(".conversion.cli", __package__)
    except ImportError as error:
        parser.description = f"conversion is unavailable in this installation ({error})"
        parser.add_argument("ignored", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(handler=_unavailable(parser.description))
        return
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = conversion.__doc__
    conversion.add_convert_arguments(parser)
    parser.set_defaults(handler=conversion.run_convert)


def _unavailable(reason: str) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        print(f"trellis-lm convert: {reason}", file=sys.stderr)
        return 1

    return handler


# ----------------------------------------------------------------------------- entry point


# Each command: its help line, and what adds its arguments to its parser (bench and convert import
# their modules, and with them the model stack).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "generate": ("continue prompts with a saved model", _add_generate),
    "train": ("pretrain or fine-tune with the transformers Trainer", _add_train),
    "eval": ("evaluate with lm-evaluation-harness", _add_eval),
    "bench": ("CPU benchmark: op backends and decode cost against context length", _add_bench),
    "convert": ("convert a Llama-family checkpoint to Trellis (optionally distil it)", _add_convert),
}


def build_parser(commands: Optional[Collection[str]] = None) -> argparse.ArgumentParser:
    """The ``trellis-lm`` argument parser, one sub-command per tool: those of ``commands`` (default:
    every one) with their arguments, the others with their name and help line alone."""
    parser = Parser(
        prog="trellis-lm", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"trellis-lm {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for name, (help_line, add) in COMMANDS.items():
        command = subparsers.add_parser(name, help=help_line)
        if commands is None or name in commands:
            add(command)
        command.set_defaults(prog=command.prog)  # errors found after parsing name their command
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``trellis-lm`` with ``argv`` (default: the command line); returns the exit status.

    A command line argparse cannot parse raises ``SystemExit(2)`` (after its usage and one line
    of error); a bad argument found later returns 2 after one line of error (see the module's doc).
    Only the command named is built (the top-level options take no value: it is the first word
    that is not an option), and the model is registered with transformers once it parsed
    (:func:`trellis_lm.register_auto_classes`; see :mod:`trellis_lm_command`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser({named} if named in COMMANDS else ()).parse_args(argv)
    register_auto_classes()
    try:
        return args.handler(args)
    except CommandLineError as error:
        return report_error(args.prog, str(error))


if __name__ == "__main__":
    raise SystemExit(main())
