"""Training recipes on the stock ``transformers.Trainer``: pretraining and chat fine-tuning.

Both recipes take two argument dataclasses, their own (:class:`PretrainArguments`,
:class:`FinetuneArguments`) and transformers' ``TrainingArguments`` (batch size, steps,
learning rate, ``--bf16``, ``--gradient_checkpointing``, checkpointing, logging, ...), so
``HfArgumentParser`` turns them into command lines (``examples/pretrain.py``,
``examples/finetune.py`` and ``trellis-lm train`` do just that).

- **Pretraining** streams paragraphs of local text files with ``datasets`` (nothing is held in
  memory), tokenizes them into pieces of at most ``max_length`` tokens, and packs
  ``per_device_train_batch_size`` pieces into one row with ``DataCollatorWithFlattening``:
  no padding, and the model restarts its memories and short convs at every piece (it reads
  the ``position_ids`` the collator writes).
- **Fine-tuning** renders chats (``{"messages": [{"role": ..., "content": ...}, ...]}``
  JSONL) with the tokenizer's chat template and trains on the assistant turns only (every
  other label is -100), optionally with LoRA adapters on :data:`LORA_TARGET_MODULES`.

Without data files, each recipe writes a small sample (standard-library docstrings; synthetic
arithmetic chats) into the output folder, so both run offline in about a minute on a CPU.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from .arguments import config_fields, first_line, json_lines
from .configuration_trellis import TrellisConfig
from .model_card_trellis import TrainingRun, write_model_card
from .modeling_trellis import TrellisForCausalLM
from .state_passing import DEFAULT_PROBABILITY, DEFAULT_START_FRACTION, StatePassingCallback
from .tokenization_trellis import train_tokenizer

# Every linear layer of a block that has a matrix worth adapting: the mixer's projections
# (q, k, v, the slot targets alpha, the output gate g, o) and the SwiGLU MLP. beta_proj and
# gamma_proj map to one number per head; train them fully (`modules_to_save`) if needed.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "alpha_proj", "g_proj", "gate_proj", "up_proj", "down_proj")

# The size of the models the recipes create when no checkpoint is given: trains in a minute
# on a laptop CPU. `--config_overrides "hidden_size=512,num_hidden_layers=8"` changes it.
SMALL_MODEL = dict(
    hidden_size=128, num_hidden_layers=2, num_heads=4, head_dim=32, num_slots=16, chunk_size=16,
    intermediate_size=384,
)

# Role markers are plain text, so any tokenizer can render it. Rendering a chat's first i
# messages gives a prefix of rendering it whole, which is how `tokenize_chat` finds the turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# ----------------------------------------------------------------------------- arguments


def _option(default: Any, help: str) -> Any:
    """A recipe argument as HfArgumentParser reads it: its ``default`` (a list is copied for
    every instance) and its ``--help`` text."""
    if isinstance(default, (list, tuple)):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class ModelArguments:
    """Which model to train: an existing checkpoint, or a new one of :data:`SMALL_MODEL` size."""

    model: Optional[str] = _option(None, "checkpoint folder or Hub id to start from; default: a new model and a new "
                                         "tokenizer trained on the data")
    config_overrides: Optional[str] = _option(
        None, "for a new model, TrellisConfig fields over the small default, e.g. "
              "'hidden_size=256,num_hidden_layers=4,chunk_size=64' (values read as JSON where they parse: true, "
              "1e-5, [\"trellis\", \"attention\"]; else as strings)")
    vocab_size: int = _option(1024, "vocabulary of a new tokenizer")
    max_length: int = _option(256, "tokens per training example (longer ones are cut)")
    state_passing: float = _option(
        DEFAULT_PROBABILITY, "probability that a training row starts from the final memory states of a row of the "
                             "previous batch (trellis_lm.state_passing: reads far past the training length); 0 "
                             "disables")
    state_passing_from: Optional[float] = _option(
        None, "with --state_passing, begin at this fraction of max_steps (default 0.7: over the last three tenths "
              "of the steps, which kept perplexity flat to 64x the training length for 2.5 percent more at the "
              "training length in docs/results_lm_extrapolation.md)")


@dataclass
class PretrainArguments(ModelArguments):
    """Data of the pretraining recipe (:func:`pretrain`)."""

    data_files: list[str] = _option([], "text files, one document per paragraph (blank-line separated); default: a "
                                        "sample of standard-library docstrings written to OUTPUT_DIR/sample_corpus.txt")
    shuffle_buffer: int = _option(1000, "documents in the streaming shuffle buffer")
    tokenizer_documents: int = _option(5000, "documents a new tokenizer is trained on")


@dataclass
class FinetuneArguments(ModelArguments):
    """Data and adapters of the chat fine-tuning recipe (:func:`finetune`)."""

    data_files: list[str] = _option([], 'JSONL files of {"messages": [{"role": ..., "content": ...}, ...]}; default: '
                                        "synthetic arithmetic chats written to OUTPUT_DIR/sample_chats.jsonl")
    lora: bool = _option(False, "train LoRA adapters instead of all weights")
    lora_rank: int = _option(8, "LoRA rank r")
    lora_alpha: int = _option(16, "LoRA scaling alpha")
    lora_target_modules: list[str] = _option(LORA_TARGET_MODULES, "module names LoRA adapts")
    merge_lora: bool = _option(True, "also save the merged model to OUTPUT_DIR/merged")


# What the recipes change in TrainingArguments' defaults: a short CPU-sized run with progress,
# logging and checkpoints. Anything given on the command line wins.
PRETRAIN_DEFAULTS = dict(
    output_dir="outputs/pretrain", max_steps=60, per_device_train_batch_size=16, learning_rate=3e-3,
    warmup_steps=10, lr_scheduler_type="cosine", weight_decay=0.01, logging_steps=10, save_steps=50,
    save_total_limit=2,
)
FINETUNE_DEFAULTS = dict(
    output_dir="outputs/finetune", max_steps=60, per_device_train_batch_size=16, learning_rate=3e-3,
    warmup_steps=10, lr_scheduler_type="cosine", logging_steps=10, save_steps=50, save_total_limit=2,
)


# ----------------------------------------------------------------------------- sample data


def stdlib_docstrings(max_chars: int) -> list[str]:
    """Module, class and function docstrings of this Python's standard library, up to
    ``max_chars`` characters in all (read with ``ast``; nothing is imported)."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "idlelib" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    texts.append(doc)
                    total += len(doc)
                    if total >= max_chars:
                        return texts
    return texts


def write_sample_corpus(path: Union[str, Path], max_chars: int = 1_000_000) -> Path:
    """Write standard-library docstrings to ``path``, one paragraph per document."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A docstring's own blank lines would split it into several paragraphs: keep it whole.
    documents = (" ".join(doc.split()) for doc in stdlib_docstrings(max_chars))
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path


def sample_chats(count: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """``count`` synthetic chats (a system prompt, then a question on sums and its answer)."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        chats.append({"messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
        ]})
    return chats


def write_sample_chats(path: Union[str, Path], count: int = 2000, seed: int = 0) -> Path:
    """Write :func:`sample_chats` to ``path`` as JSONL."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(chat) + "\n" for chat in sample_chats(count, seed)), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- data pipeline


def stream_documents(data_files: list[Union[str, Path]]) -> Any:
    """A streaming ``datasets.IterableDataset`` of ``{"text": paragraph}`` from local text files."""
    from datasets import load_dataset

    files = [str(f) for f in data_files]
    documents = load_dataset("text", data_files=files, sample_by="paragraph", streaming=True, split="train")
    return documents.filter(lambda example: bool(example["text"].strip()))


def document_pieces(ids: list[int], max_length: int) -> list[list[int]]:
    """Cut one document's token ids into consecutive pieces of at most ``max_length``."""
    return [ids[start : start + max_length] for start in range(0, len(ids), max_length)]


def tokenize_for_packing(documents: Any, tokenizer: PreTrainedTokenizerBase, max_length: int) -> Any:
    """Map ``{"text"}`` documents to ``{"input_ids"}`` pieces of at most ``max_length`` tokens,
    each document ending with EOS. Works on streaming and in-memory datasets alike."""

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        pieces = []
        for ids in tokenizer(batch["text"])["input_ids"]:
            pieces += document_pieces(ids + [tokenizer.eos_token_id], max_length)
        return {"input_ids": pieces}

    return documents.map(tokenize, batched=True, remove_columns=["text"])


def ensure_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give ``tokenizer`` :data:`CHAT_TEMPLATE` unless it has a chat template already."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHAT_TEMPLATE


def tokenize_chat(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, max_length: Optional[int] = None
) -> dict[str, list[int]]:
    """Token ids of a rendered chat and labels that train on the assistant turns only.

    Each turn is tokenized on its own, and an assistant turn's header (the generation prompt)
    apart from its content, so the prompt of every answer is tokenized exactly as
    ``apply_chat_template(..., add_generation_prompt=True)`` tokenizes it at inference.

    Returns ``{"input_ids": [L], "labels": [L]}`` (labels -100 outside assistant contents),
    cut to ``max_length``. Raises ``ValueError`` when the template does not render a chat's
    first messages as a prefix of the whole chat.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    rendered = ""

    def extend(text: str, train: bool) -> None:
        nonlocal rendered
        if not text.startswith(rendered):
            raise ValueError("the chat template must render the first messages of a chat as a prefix of the whole chat")
        ids = tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"]
        input_ids.extend(ids)
        labels.extend(ids if train else [-100] * len(ids))
        rendered = text

    def render(upto: int, add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=False, add_generation_prompt=add_generation_prompt)

    for i, message in enumerate(messages):
        is_answer = message["role"] == "assistant"
        if is_answer:
            extend(render(i, add_generation_prompt=True), train=False)
        extend(render(i + 1), train=is_answer)
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length]}


# ----------------------------------------------------------------------------- models


def model_and_tokenizer(
    args: ModelArguments, tokenizer_texts: Callable[[], Iterable[str]], checkpoint: Optional[str] = None
) -> tuple[TrellisForCausalLM, PreTrainedTokenizerBase]:
    """Load ``args.model``, or create a :data:`SMALL_MODEL`-sized model (with ``args.config_overrides``)
    and a tokenizer trained on ``tokenizer_texts()``, or read from the Trainer ``checkpoint`` this
    run resumes (whose weights the Trainer restores)."""
    if args.model is not None:
        return AutoModelForCausalLM.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    if checkpoint is not None:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    else:
        tokenizer = train_tokenizer(tokenizer_texts(), vocab_size=args.vocab_size)
    return TrellisForCausalLM(new_model_config(args, len(tokenizer), tokenizer)), tokenizer


def new_model_config(args: ModelArguments, vocab_size: int, tokenizer: Optional[PreTrainedTokenizerBase] = None
                     ) -> TrellisConfig:
    """The config of a new model: :data:`SMALL_MODEL` with ``args.config_overrides``
    (:func:`~trellis_lm.arguments.config_fields`), for a vocabulary of ``vocab_size`` and
    ``tokenizer``'s special ids (``None``: the config's defaults, those of the recipes'
    tokenizers). An override that is not a field, or a value its field cannot hold, is a
    ``ValueError`` starting with ``--config_overrides`` and naming the field."""
    overrides = config_fields([] if args.config_overrides is None else [args.config_overrides], "--config_overrides")
    special = {} if tokenizer is None else dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    try:
        TrellisConfig.check_field_names(overrides)
        return TrellisConfig(**{"vocab_size": vocab_size, **special, **SMALL_MODEL, **overrides})
    except ValueError as error:
        raise ValueError(f"--config_overrides: {first_line(error)}") from None


def _resumed_checkpoint(training_args: TrainingArguments) -> Optional[str]:
    """The checkpoint ``--resume_from_checkpoint`` names: a folder, or ``last`` for the newest
    one in the output folder (``None`` when there is none yet: the run starts afresh)."""
    resume = training_args.resume_from_checkpoint
    return get_last_checkpoint(training_args.output_dir) if resume == "last" else resume


def _output_dir(training_args: TrainingArguments) -> Path:
    if training_args.output_dir is None:
        raise ValueError("TrainingArguments.output_dir must be set")
    path = Path(training_args.output_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ----------------------------------------------------------------------------- recipes


def described_data(args: ModelArguments, sample: str) -> str:
    """The training data in words for the model card: the files given, or ``sample``, and the
    checkpoint the run started from."""
    data = f"Local files: {', '.join(Path(f).name for f in args.data_files)}" if args.data_files else sample
    return data if args.model is None else f"{data}; starting from the checkpoint {args.model}"


def training_run(trainer: Trainer, recipe: str, data: str, args: ModelArguments) -> TrainingRun:
    """What the card says of a finished run: its data, steps, main settings and last logged loss."""
    training_args = trainer.args
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    averages = [entry["train_loss"] for entry in trainer.state.log_history if "train_loss" in entry]
    scheduler = getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)
    passing = f"p = {args.state_passing:g} from {_passing_start(args):g} of the steps" if args.state_passing else "off"
    settings = {
        "batch": f"{training_args.per_device_train_batch_size} x {training_args.gradient_accumulation_steps} "
                 f"accumulated x {training_args.world_size} processes",
        "examples of at most": f"{args.max_length} tokens",
        "learning rate": f"{training_args.learning_rate:g} ({scheduler})",
        "state passing": passing,
    }
    return TrainingRun(recipe=recipe, data=data, steps=trainer.state.global_step, settings=settings,
                       final_loss=(losses or averages or [None])[-1])


def check_recipe_arguments(args: ModelArguments, training_args: TrainingArguments) -> None:
    """Refuse, before anything is built or written, what a recipe would otherwise meet only after
    building a model and creating its output folder: a ``ValueError`` naming the option as the
    command line spells it. (Checkpoints and Hub ids are checked where they load: the CLI checks
    ``--model`` first.)"""
    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not is_number(args.state_passing) or not 0 <= args.state_passing <= 1:
        raise ValueError(f"--state_passing must be a probability in [0, 1] (0: off), got {args.state_passing}")
    start = args.state_passing_from
    if start is not None and (not is_number(start) or not 0 <= start < 1):
        raise ValueError(f"--state_passing_from: expected a fraction of max_steps in [0, 1), got {start}")
    if start is not None and not args.state_passing:
        raise ValueError(f"--state_passing_from: state passing is off (--state_passing 0), so a start at {start} "
                         "would be ignored: drop one of them")
    if args.config_overrides is not None:
        if args.model is not None:
            raise ValueError("--config_overrides: it sets the fields of a new model, and --model loads a checkpoint with "
                             "its own config: drop one of them")
        new_model_config(args, args.vocab_size)
    streaming = isinstance(args, PretrainArguments)
    steps = training_args.max_steps
    if steps == 0 or steps < -1 or (streaming and steps < 1):
        allowed = "an integer >= 1 (the data is streamed)" if streaming else "an integer >= 1, or -1 (--num_train_epochs)"
        raise ValueError(f"--max_steps: expected {allowed}, got {steps}")
    output = training_args.output_dir
    if output is None or (Path(output).exists() and not Path(output).is_dir()):
        raise ValueError(f"--output_dir: expected a folder to write into, got {output!r}"
                         + (" (a file)" if output is not None else ""))
    resume = training_args.resume_from_checkpoint
    if resume is not None and resume != "last" and not Path(resume).is_dir():
        raise ValueError(f"--resume_from_checkpoint: {resume} is not a checkpoint folder (or 'last', the newest in "
                         "--output_dir)")
    for name in args.data_files:
        path = Path(name)
        if path.is_dir():
            raise ValueError(f"--data_files: {name} is a folder: expected files (or a glob pattern such as {name}/*.txt)")
        if isinstance(args, FinetuneArguments) and path.is_file():
            _check_chat_file(path)


def _check_chat_file(path: Path) -> None:
    """Every line of a fine-tuning file is blank or a JSON object with a list of ``messages``."""
    for number, chat in json_lines(path, "--data_files", '{"messages": [...]}'):
        if not isinstance(chat, dict) or not isinstance(chat.get("messages"), list):
            raise ValueError(f"--data_files: {path} line {number} is not a {{\"messages\": [...]}} object")


def _passing_start(args: ModelArguments) -> float:
    return DEFAULT_START_FRACTION if args.state_passing_from is None else args.state_passing_from


def _add_state_passing(trainer: Trainer, args: ModelArguments, training_args: TrainingArguments) -> None:
    if args.state_passing:
        trainer.add_callback(StatePassingCallback(args.state_passing, _passing_start(args), seed=training_args.seed))


def pretrain(args: PretrainArguments, training_args: TrainingArguments) -> Trainer:
    """Pretrain on packed documents streamed from ``args.data_files``; returns the Trainer.

    The final model and tokenizer are saved to ``training_args.output_dir`` (Hub-ready:
    weights, config, code, tokenizer, generation config, model card); checkpoints every
    ``save_steps`` go to ``checkpoint-N`` folders there.
    """
    check_recipe_arguments(args, training_args)
    output_dir = _output_dir(training_args)
    checkpoint = _resumed_checkpoint(training_args)
    data_files = args.data_files or [write_sample_corpus(output_dir / "sample_corpus.txt")]
    documents = stream_documents(data_files)
    model, tokenizer = model_and_tokenizer(
        args, lambda: (doc["text"] for doc in documents.take(args.tokenizer_documents)), checkpoint
    )
    shuffled = documents.shuffle(seed=training_args.seed, buffer_size=args.shuffle_buffer)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenize_for_packing(shuffled, tokenizer, args.max_length),
        # One row of `per_device_train_batch_size` pieces, with position ids restarting at each;
        # with state passing one piece per (right-padded) row, since a state is carried per row.
        data_collator=(DataCollatorForLanguageModeling(tokenizer, mlm=False) if args.state_passing
                       else DataCollatorWithFlattening()),
        processing_class=tokenizer,
    )
    _add_state_passing(trainer, args, training_args)
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        sample = "Docstrings of this Python's standard library (trellis_lm.training.write_sample_corpus)"
        run = training_run(trainer, "trellis_lm.training.pretrain", described_data(args, sample), args)
        write_model_card(output_dir, trainer.model, training=run)
    return trainer


def finetune(args: FinetuneArguments, training_args: TrainingArguments) -> Trainer:
    """Supervised fine-tuning on chats, loss on the assistant turns only; returns the Trainer.

    With ``args.lora``, only LoRA adapters train; ``output_dir`` then holds the adapter
    (``PeftModel.from_pretrained(base, output_dir)``) and, with ``args.merge_lora``,
    ``output_dir/merged`` the base model with the adapters merged in.
    """
    from datasets import load_dataset

    check_recipe_arguments(args, training_args)
    output_dir = _output_dir(training_args)
    checkpoint = _resumed_checkpoint(training_args)
    data_files = args.data_files or [write_sample_chats(output_dir / "sample_chats.jsonl")]
    chats = load_dataset("json", data_files=[str(f) for f in data_files], split="train")

    def chat_texts() -> Iterator[str]:
        for chat in chats:
            yield from (message["content"] for message in chat["messages"])

    model, tokenizer = model_and_tokenizer(args, chat_texts, checkpoint)
    ensure_chat_template(tokenizer)
    train_dataset = chats.map(
        lambda chat: tokenize_chat(chat["messages"], tokenizer, args.max_length), remove_columns=chats.column_names
    )
    if args.lora:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=args.lora_rank, lora_alpha=args.lora_alpha, target_modules=list(args.lora_target_modules),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora_config)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        # Pads input ids, the attention mask and (with -100) the labels.
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
        processing_class=tokenizer,
    )
    _add_state_passing(trainer, args, training_args)
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    if not trainer.is_world_process_zero():
        return trainer
    sample = "Synthetic chats on sums of two numbers (trellis_lm.training.sample_chats)"
    run = training_run(trainer, "trellis_lm.training.finetune" + (" with LoRA" if args.lora else ""),
                       described_data(args, sample) + "; loss on the assistant turns only", args)
    if not args.lora:
        write_model_card(output_dir, trainer.model, training=run)
    elif args.merge_lora:
        merged = trainer.model.merge_and_unload()
        merged.save_pretrained(output_dir / "merged")
        tokenizer.save_pretrained(output_dir / "merged")
        write_model_card(output_dir / "merged", merged, training=run)
    return trainer


def chat_reply(
    model: Any, tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **generate_kwargs: Any
) -> str:
    """The model's next assistant turn after ``messages`` (greedy unless ``generate_kwargs`` say otherwise)."""
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").to(model.device)
    generate_kwargs.setdefault("max_new_tokens", 32)
    generate_kwargs.setdefault("do_sample", False)
    output = model.generate(**inputs, **generate_kwargs)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def parse_recipe_arguments(
    recipe_args_class: type, defaults: dict[str, Any], argv: Optional[list[str]] = None, prog: Optional[str] = None
) -> tuple[Any, TrainingArguments]:
    """Parse ``argv`` into ``(recipe_args_class(...), TrainingArguments(...))`` with ``HfArgumentParser``;
    ``defaults`` replace TrainingArguments' own. Options take underscores or hyphens.

    ``--help`` lists the recipe's own options first, under a one-line usage: spelling out the
    usage of every TrainingArguments option would put a hundred lines above them.
    """
    from dataclasses import fields

    from transformers import HfArgumentParser

    own = ", ".join(f"--{f.name}" for f in fields(recipe_args_class))
    parser = HfArgumentParser(
        (recipe_args_class, TrainingArguments), prog=prog, usage="%(prog)s [RECIPE OPTIONS] [TRAININGARGUMENTS OPTIONS]",
        description=f"The recipe's own options come first below ({own}), then those of "
                    "transformers' TrainingArguments (--output_dir, --max_steps, --per_device_train_batch_size, "
                    "--learning_rate, --bf16, ...). Options take underscores or hyphens (--max_steps, --max-steps).",
    )
    parser.set_defaults(**defaults)
    return parser.parse_args_into_dataclasses(args=argv)


__all__ = [
    "CHAT_TEMPLATE",
    "FINETUNE_DEFAULTS",
    "FinetuneArguments",
    "LORA_TARGET_MODULES",
    "ModelArguments",
    "PRETRAIN_DEFAULTS",
    "PretrainArguments",
    "SMALL_MODEL",
    "chat_reply",
    "check_recipe_arguments",
    "document_pieces",
    "ensure_chat_template",
    "finetune",
    "parse_recipe_arguments",
    "pretrain",
    "sample_chats",
    "stdlib_docstrings",
    "stream_documents",
    "tokenize_chat",
    "tokenize_for_packing",
    "write_sample_chats",
    "write_sample_corpus",
]
