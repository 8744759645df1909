"""Language modelling on real local text: same-size models, perplexity, length, passkey retrieval.

The pieces of ``examples/lm_study.py`` (which runs them and writes ``docs/results_lm.md``):

* :func:`stdlib_corpus`: the Python standard library's source files of the running interpreter
  (code with its comments and docstrings), split **by file** into train / validation / test by
  a hash of each file's path, so held-out files are never seen in training. The tokenizer is
  trained on the train split only (:func:`encode_corpus`).
* :func:`build_study_model`: every architecture at one parameter count: the MLP width of each
  model is chosen so that its total parameters (embeddings included) match the Llama's.
* :func:`train_lm`: AdamW, linear warm-up then cosine decay, gradient clipping, batches of
  random training windows; the same recipe for every model.
* Measures: :func:`perplexity` at the training length, :func:`perplexity_by_position` on long
  held-out files read in one pass, :func:`passkey_accuracy` (a number placed in held-out code at
  a depth, asked for at the end), :func:`decode_cost` (ms per token and cache bytes after a long
  context).
* Why length fails (``examples/lm_extrapolation.py``): :func:`passkey_preference` (is the shown
  key likelier than a fresh one), :func:`memory_profile` (what the memories hold along a long
  read, each head's forget horizon), :func:`capped_horizons` (every horizon capped at inference).
* The studies' bookkeeping: each finished run appended to a JSON file (:func:`append_record`), the
  learning-rate sweep widened while its best rate is at an edge (:func:`widened_rate`), the
  tables' runs at each model's best rate (:func:`chosen_runs`), the shared command line.

Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..cache_trellis import CACHE_ARG
from ..configuration_trellis import TrellisConfig
from ..modeling_trellis import TrellisForCausalLM
from ..state_passing import StatePassing
from ..tokenization_trellis import train_tokenizer
from .synthetic import ModelSize

SPLITS = ("train", "validation", "test")


# ----------------------------------------------------------------------------- data


@dataclass
class Corpus:
    """Files of the standard library by split, and what they are.

    Attributes:
        files: split name -> sorted list of paths.
        root: the standard library's folder.
        python: the interpreter's version string.
    """

    files: dict[str, list[Path]]
    root: Path
    python: str

    def describe(self) -> dict[str, Any]:
        return {"python": self.python, "root": str(self.root),
                "files": {split: len(paths) for split, paths in self.files.items()},
                "bytes": {split: sum(p.stat().st_size for p in paths) for split, paths in self.files.items()}}


def stdlib_corpus(held_out_percent: int = 5, root: Optional[Path] = None) -> Corpus:
    """The ``.py`` files under the standard library (``site-packages`` excluded), each assigned to
    a split by the SHA-1 of its path relative to the root: ``held_out_percent`` each to validation
    and test, the rest to train. The assignment depends only on the path, so it is the same on
    every machine with the same Python."""
    if not 0 < held_out_percent < 50:
        raise ValueError(f"held_out_percent must be in (0, 50), got {held_out_percent}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files: dict[str, list[Path]] = {split: [] for split in SPLITS}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if "site-packages" in relative.parts or not path.is_file():
            continue
        bucket = int(hashlib.sha1(str(relative).encode()).hexdigest(), 16) % 100
        split = "validation" if bucket < held_out_percent else "test" if bucket < 2 * held_out_percent else "train"
        files[split].append(path)
    if not all(files.values()):
        raise ValueError(f"the standard library at {root} is too small to split: {[len(v) for v in files.values()]}")
    return Corpus(files, root, sys.version.split()[0])


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass
class EncodedCorpus:
    """Token ids of every file (``eos`` after each), by split, and the tokenizer.

    Attributes:
        tokenizer: byte-level BPE trained on the train split.
        tokens: split -> 1-D int32 tensor of that split's files end to end.
        files: split -> list of each file's token ids (int32), for per-file evaluation.
    """

    tokenizer: Any
    tokens: dict[str, torch.Tensor]
    files: dict[str, list[torch.Tensor]]


def encode_corpus(corpus: Corpus, vocab_size: int, max_train_files: Optional[int] = None) -> EncodedCorpus:
    """Train the tokenizer on the train split (only), then encode every split."""
    train_paths = corpus.files["train"][:max_train_files] if max_train_files else corpus.files["train"]
    tokenizer = train_tokenizer((read_text(p) for p in train_paths), vocab_size)
    tokens, files = {}, {}
    for split, paths in corpus.files.items():
        paths = train_paths if split == "train" else paths
        ids = [torch.tensor(tokenizer(read_text(p), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
                            dtype=torch.int32) for p in paths]
        files[split] = ids
        tokens[split] = torch.cat(ids)
    return EncodedCorpus(tokenizer, tokens, files)


def random_windows(tokens: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, length + 1]`` windows at random offsets of ``tokens`` (inputs and next tokens)."""
    starts = torch.randint(0, tokens.numel() - length - 1, (batch,), generator=generator)
    return torch.stack([tokens[s : s + length + 1] for s in starts.tolist()]).long()


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class StudyModel:
    """One architecture of the study.

    Attributes:
        name: label in tables and plots.
        kind: ``"llama"`` or ``"trellis"`` (a :class:`TrellisConfig` with ``overrides``).
        overrides: config fields that differ from the Trellis defaults of :class:`ModelSize`
            (``mixer_types`` as a pattern repeated over the layers).
    """

    name: str
    kind: str = "trellis"
    overrides: dict[str, Any] = field(default_factory=dict)


# Every model shares the width of a :class:`~.synthetic.ModelSize` (the MQAR study's own), and
# each model's MLP width is then fitted to the Llama's parameter count (:func:`build_study_model`).
STUDY_SIZE = ModelSize(hidden_size=128, num_hidden_layers=4, num_heads=4, head_dim=32, intermediate_size=352,
                       num_slots=32, chunk_size=32)


def study_models(train_length: int) -> list[StudyModel]:
    """The issue's comparison: Llama (RoPE), Trellis, the gated delta rule, Trellis without the
    forget gate, with softmax mixing, at C = 1, Lattice (dec), KVM (a window of half the training
    length, state rows a quarter of it) and a hybrid with one attention layer in four."""
    kvm_chunk = max(train_length // 8, 2)
    return [
        StudyModel("llama", kind="llama"),
        StudyModel("trellis"),
        StudyModel("delta-rule", overrides={"compress_fn": "identity"}),
        StudyModel("trellis-no-forget", overrides={"use_forget_gate": False}),
        StudyModel("trellis-mix-softmax", overrides={"mix_fn": "softmax"}),
        StudyModel("trellis-C1", overrides={"chunk_size": 1}),
        StudyModel("lattice", overrides={"mixer_types": ("lattice",), "lattice_variant": "dec"}),
        StudyModel("kvm", overrides={"mixer_types": ("kvm",), "kvm_chunk_size": kvm_chunk, "kvm_window_chunks": 4,
                                     "kvm_state_size": 2 * kvm_chunk}),
        StudyModel("hybrid", overrides={"mixer_types": ("trellis", "trellis", "trellis", "attention")}),
    ]


def _make(spec: StudyModel, size: ModelSize, vocab_size: int, intermediate: int, max_len: int) -> PreTrainedModel:
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if spec.kind == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab_size, hidden_size=size.hidden_size, intermediate_size=intermediate,
            num_hidden_layers=size.num_hidden_layers, num_attention_heads=size.num_heads,
            num_key_value_heads=size.num_heads, head_dim=size.head_dim, max_position_embeddings=max_len, **special,
        ))
    if spec.kind != "trellis":
        raise ValueError(f"unknown model kind {spec.kind!r}; expected 'trellis' or 'llama'")
    fields = dict(vocab_size=vocab_size, hidden_size=size.hidden_size, num_hidden_layers=size.num_hidden_layers,
                  num_heads=size.num_heads, head_dim=size.head_dim, intermediate_size=intermediate,
                  num_slots=size.num_slots, chunk_size=size.chunk_size, **special)
    fields.update(spec.overrides)
    pattern = fields.pop("mixer_types", None) or ("trellis",)
    fields["mixer_types"] = [pattern[i % len(pattern)] for i in range(size.num_hidden_layers)]
    return TrellisForCausalLM(TrellisConfig(**fields))


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_study_model(spec: StudyModel, size: ModelSize, vocab_size: int, max_len: int,
                      target: Optional[int] = None) -> PreTrainedModel:
    """``spec`` at ``size`` with the MLP width (a multiple of 8) whose total parameter count is
    nearest ``target`` (the Llama's at ``size`` when ``None``)."""
    if target is None:
        target = num_parameters(_make(StudyModel("llama", kind="llama"), size, vocab_size, size.intermediate_size, max_len))
    base = num_parameters(_make(spec, size, vocab_size, 8, max_len))
    per_unit = (num_parameters(_make(spec, size, vocab_size, 16, max_len)) - base) / 8
    intermediate = max(8, 8 * round((8 + (target - base) / per_unit) / 8))
    return _make(spec, size, vocab_size, intermediate, max_len)


# ----------------------------------------------------------------------------- training


@dataclass(frozen=True)
class Recipe:
    """The training recipe every model gets (only the learning rate is swept)."""

    train_length: int = 128
    batch_size: int = 16
    tokens: int = 1_000_000
    warmup_fraction: float = 0.05
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    @property
    def steps(self) -> int:
        return max(1, self.tokens // (self.batch_size * self.train_length))


def train_lm(model: PreTrainedModel, data: torch.Tensor, recipe: Recipe, learning_rate: float, seed: int,
             progress: Optional[Callable[[int, float], None]] = None, state_passing: float = 0.0,
             state_passing_from: float = 0.0) -> dict[str, Any]:
    """Train ``model`` in place on random windows of ``data``; returns the loss curve (every
    5% of the steps, each point the mean of the steps since the last), tokens/s and seconds.
    ``state_passing`` > 0: each row starts from a row of the previous batch's final memory
    states with that probability (:mod:`trellis_lm.state_passing`; the draws have their own
    generator, so the windows and the weights' initialisation are those of the run without),
    from the step at fraction ``state_passing_from`` of the run on (0: from the start; the
    paper's post-training is a late start)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": other, "weight_decay": 0.0}], lr=learning_rate, betas=(0.9, 0.95))
    steps, warmup = recipe.steps, max(1, int(recipe.warmup_fraction * recipe.steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model.train()
    curve, pending, every = [], [], max(1, steps // 20)
    started = time.perf_counter()
    passing, first_passed = StatePassing(state_passing or 1.0, seed), int(state_passing_from * steps)
    with contextlib.ExitStack() as hooks:
        for step in range(steps):
            if state_passing and step == first_passed:
                hooks.enter_context(passing.attached(model))
            batch = random_windows(data, recipe.batch_size, recipe.train_length, generator)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss became {loss.item()} at step {step} (lr {learning_rate})")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(loss.item())
            if (step + 1) % every == 0 or step + 1 == steps:
                curve.append([step + 1, statistics.fmean(pending)])
                pending = []
            if progress is not None:
                progress(step + 1, loss.item())
    seconds = time.perf_counter() - started
    model.eval()
    return {"curve": curve, "train_seconds": seconds, "tokens_per_s": steps * recipe.batch_size * recipe.train_length / seconds}


# ----------------------------------------------------------------------------- measures


@torch.no_grad()
def perplexity(model: PreTrainedModel, files: Sequence[torch.Tensor], length: int, max_windows: int,
               batch_size: int = 16) -> float:
    """exp(mean next-token loss) over non-overlapping windows of ``length + 1`` tokens of the
    files (every token predicted from its window's earlier tokens only). Of all the files'
    windows at most ``max_windows`` are used, evenly spaced over the list, so every part of the
    split is sampled rather than its first files."""
    windows = [f[s : s + length + 1] for f in files for s in range(0, f.numel() - length - 1, length)]
    windows = evenly_spaced(windows, max_windows)
    if not windows:
        raise ValueError(f"no held-out file holds a window of {length + 1} tokens")
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = torch.stack(windows[i : i + batch_size]).long()
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


def evenly_spaced(items: list, count: int) -> list:
    """At most ``count`` of ``items``, evenly spaced over the list (all of them when fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def position_buckets(length: int, train_length: int) -> list[tuple[int, int]]:
    """``[0, L), [L, 2L), [2L, 4L), ...`` up to ``length`` (L the training length)."""
    buckets, start, end = [], 0, train_length
    while start < length:
        buckets.append((start, min(end, length)))
        start, end = end, 2 * end
    return buckets


@torch.no_grad()
def perplexity_by_position(model: PreTrainedModel, files: Sequence[torch.Tensor], length: int, train_length: int,
                           max_files: int, reset_every: Optional[int] = None) -> dict[str, float]:
    """Up to ``max_files`` held-out files of at least ``length + 1`` tokens (evenly spaced over
    the eligible ones), each read in one pass over its first ``length + 1`` tokens; perplexity per
    position bucket (:func:`position_buckets`), keyed ``"start-end"``.

    With ``reset_every``, each file is read instead in consecutive segments of that many tokens,
    each from a fresh state (every token then sees at most ``reset_every`` tokens of context):
    the same tokens scored, so the two readings differ only by what the model carries from far
    back."""
    if reset_every is not None and reset_every < 1:
        raise ValueError(f"reset_every must be a positive number of tokens or None, got {reset_every}")
    long_files = [f[: length + 1].long() for f in evenly_spaced([f for f in files if f.numel() > length], max_files)]
    if not long_files:
        raise ValueError(f"no held-out file holds {length + 1} tokens")
    segment = reset_every or length
    losses = torch.zeros(length)
    for tokens in long_files:
        for start in range(0, length, segment):
            piece = tokens[start : min(start + segment, length) + 1]
            logits = model(input_ids=piece[None, :-1], use_cache=False).logits[0]
            losses[start : start + piece.numel() - 1] += F.cross_entropy(logits.float(), piece[1:], reduction="none")
    losses /= len(long_files)
    return {f"{a}-{b}": math.exp(losses[a:b].mean().item()) for a, b in position_buckets(length, train_length)}


PASSKEY_LINE = "# The pass key is {key}. Remember it: {key}.\n"
PASSKEY_QUESTION = "\n# What is the pass key? The pass key is"


def passkey_prompts(tokenizer: Any, files: Sequence[torch.Tensor], length: int, depths: Sequence[float], trials: int,
                    seed: int) -> Iterator[tuple[list[int], str]]:
    """``trials`` prompts per depth: ``length`` tokens of held-out code (lines cut at token
    boundaries) with :data:`PASSKEY_LINE` at ``depth`` (a fraction of it) and
    :data:`PASSKEY_QUESTION` at the end; yields ``(token ids, the 5-digit key)``."""
    rng = random.Random(seed)
    pool = [f for f in files if f.numel() >= length]
    if not pool:
        raise ValueError(f"no held-out file holds {length} tokens")
    question = tokenizer(PASSKEY_QUESTION, add_special_tokens=False)["input_ids"]
    for depth in depths:
        for _ in range(trials):
            key = str(rng.randrange(10_000, 100_000))
            source = rng.choice(pool)
            needle = tokenizer(PASSKEY_LINE.format(key=key), add_special_tokens=False)["input_ids"]
            haystack = source[: max(1, length - len(needle) - len(question))].tolist()
            at = int(depth * len(haystack))
            yield haystack[:at] + needle + haystack[at:] + question, key


@torch.no_grad()
def passkey_accuracy(model: PreTrainedModel, tokenizer: Any, files: Sequence[torch.Tensor], length: int,
                     depths: Sequence[float], trials: int, seed: int) -> float:
    """Fraction of :func:`passkey_prompts` after which greedy decoding starts with the key."""
    hits = total = 0
    for prompt, key in passkey_prompts(tokenizer, files, length, depths, trials, seed):
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        hits += answer.startswith(key)
        total += 1
    return hits / total


@torch.no_grad()
def passkey_preference(model: PreTrainedModel, tokenizer: Any, files: Sequence[torch.Tensor], length: int,
                       depths: Sequence[float], trials: int, seed: int) -> dict[str, float]:
    """Does the model use the needle at all? For each of :func:`passkey_prompts`, the
    log-probability of the shown key after the question (teacher-forced) against that of a fresh
    random key of the same form. Returns ``{"preferred": fraction of prompts where the shown key
    is the likelier, "margin_nats": mean log p(shown) - log p(other)}``: 0.5 and 0 are chance (the
    needle unused), and both move long before greedy decoding can copy all five digits, which
    :func:`passkey_accuracy` needs."""
    others = random.Random(seed + 1)
    margins = []
    for prompt, key in passkey_prompts(tokenizer, files, length, depths, trials, seed):
        other = key
        while other == key:
            other = str(others.randrange(10_000, 100_000))
        scores = []
        for candidate in (key, other):
            answer = tokenizer(" " + candidate, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + answer])
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0, len(prompt) - 1:].float()
            scores.append(-F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item())
        margins.append(scores[0] - scores[1])
    return {"preferred": sum(m > 0 for m in margins) / len(margins), "margin_nats": statistics.fmean(margins)}


def forget_gates(model: PreTrainedModel) -> list[tuple[int, torch.nn.Linear, float]]:
    """``(layer index, beta_proj, gate_logit_normalizer)`` of every layer with a Trellis forget gate."""
    found = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.self_attn, "beta_proj", None)
        if gate is not None:
            found.append((i, gate, layer.self_attn.config.gate_logit_normalizer))
    return found


@torch.no_grad()
def memory_profile(model: PreTrainedModel, tokens: torch.Tensor, lengths: Sequence[int]) -> dict[str, Any]:
    """What a memory model's layers hold as a long text is read: ``tokens`` (1-D ids) are read in
    one pass with a cache, stopping at each of ``lengths`` (ascending) to take, per memory layer,
    the RMS of each memory tensor of its state (``m_k``, ``m_v``; Lattice's and KVM's states by
    their own names, anchors and counters left out). With Trellis's forget gate, also each
    layer's horizon per head over the whole read: ``-1 / mean(log beta)``, the tokens over which
    a write decays by e (``inf`` without forgetting).

    Returns ``{"rms": {"<length>": [{tensor name: rms} per memory layer]}, "horizon": [[tokens per
    head] per layer with a forget gate]}``.
    """
    gates: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, gate, normalizer in forget_gates(model):
        def keep(module, inputs, output, i=i, normalizer=normalizer):
            gates.setdefault(i, []).append((F.logsigmoid(output.float()) / normalizer).flatten(0, -2))

        hooks.append(gate.register_forward_hook(keep))
    rms: dict[str, list[dict[str, float]]] = {}
    cache, done = None, 0
    try:
        for length in lengths:
            out = model(input_ids=tokens[None, done:length].long(), use_cache=True,
                        **({CACHE_ARG: cache} if cache is not None else {}))
            cache, done = getattr(out, CACHE_ARG), length
            rms[str(length)] = [
                {name: tensor.float().pow(2).mean().sqrt().item() for name, tensor in layer.state.tensors().items()
                 if tensor.is_floating_point() and not name.startswith("anchor")}
                for layer in cache.layers if getattr(layer, "state", None) is not None
            ]
    finally:
        for hook in hooks:
            hook.remove()
    horizon = [(-1.0 / torch.cat(gates[i]).mean(0)).tolist() for i in sorted(gates)]
    return {"rms": rms, "horizon": horizon}


@contextlib.contextmanager
def capped_horizons(model: PreTrainedModel, tokens: float) -> Iterator[int]:
    """Within the block, every Trellis forget gate forgets at least as fast as a horizon of
    ``tokens`` (``beta <= exp(-1 / tokens)``, the gate's logit clamped by a hook on ``beta_proj``):
    an inference-time intervention, to test whether the heads that remember longer than the
    training length are what fails there. Yields the number of layers capped."""
    hooks = []
    for _, gate, normalizer in forget_gates(model):
        # logsigmoid(b) / normalizer <= -1 / tokens  <=>  b <= logit(exp(-normalizer / tokens))
        p = math.exp(-normalizer / tokens)
        highest = math.log(p) - math.log1p(-p)
        hooks.append(gate.register_forward_hook(lambda module, inputs, output, h=highest: output.clamp(max=h)))
    try:
        yield len(hooks)
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def decode_cost(model: PreTrainedModel, context: torch.Tensor, steps: int = 16) -> dict[str, float]:
    """ms per generated token (greedy, batch 1) after reading ``context`` (1-D ids) in one call,
    and the bytes of the model's cache then."""
    out = model(input_ids=context[None].long(), use_cache=True)
    cache = getattr(out, CACHE_ARG)
    token = out.logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, use_cache=True, **{CACHE_ARG: cache})
        cache = getattr(out, CACHE_ARG)
        token = out.logits[:, -1:].argmax(-1)
    ms = (time.perf_counter() - started) / steps * 1e3
    return {"ms_per_token": ms, "cache_bytes": cache_nbytes(cache)}


def cache_nbytes(cache: Any) -> int:
    """Bytes of every tensor a cache holds (a :class:`TrellisCache` or transformers' own)."""
    if hasattr(cache, "nbytes") and callable(cache.nbytes):
        return int(cache.nbytes())
    total = 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


# ----------------------------------------------------------------------------- bookkeeping


def study_arguments(doc: str, presets: Sequence[str], records: str, page: Path, what: str) -> argparse.Namespace:
    """The command line both study scripts share: ``--preset`` (of ``presets``), ``--out`` (the
    folder of the ``records`` JSON, created), ``--page``, ``--models`` (a comma-separated subset of
    ``what``, parsed to a list or ``None``), ``--render-only`` and ``--keep-models``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(presets), default="cpu")
    parser.add_argument("--out", default=str(page.parent / "results_data"), help=f"folder of {records}")
    parser.add_argument("--page", default=str(page), help="the page to write")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of the {what}")
    parser.add_argument("--render-only", action="store_true", help="write the page from the saved runs")
    parser.add_argument("--keep-models", default=None, help="a folder to save each trained model in "
                        "(save_pretrained, one sub-folder per run), for analysis after the study")
    args = parser.parse_args()
    args.out, args.page = Path(args.out), Path(args.page)
    args.out.mkdir(parents=True, exist_ok=True)
    args.models = args.models.split(",") if args.models else None
    return args


def load_records(path: Path) -> list[dict[str, Any]]:
    """The runs saved in a study's JSON file (a list of records; empty when there is no file)."""
    return json.loads(path.read_text()) if path.exists() else []


def save_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Write the runs to the JSON file through a new file renamed over the old one, so a study
    stopped mid-write keeps its earlier runs."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, path)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Add one finished run to the JSON file (:func:`save_records`)."""
    save_records(path, load_records(path) + [record])


def widened_rate(rates: list[float], best: Optional[float]) -> Optional[float]:
    """The rate to try next when ``best`` lies at an edge of the ``rates`` tried (the sweep has not
    bracketed the model's optimum, so the model could be held at a rate too low or too high for
    it): 2x beyond that edge; ``None`` when ``best`` is inside (or every rate diverged)."""
    if best is None or len(rates) < 2 or min(rates) < best < max(rates):
        return None
    return best * 2 if best == max(rates) else best / 2


def sweep_runs(records: list[dict[str, Any]], model: str, tokens: int | None = None) -> list[dict[str, Any]]:
    """The model's finished sweep runs (diverged rates excluded), of ``tokens`` tokens when given."""
    return [r for r in records if r["model"] == model and r["phase"] == "sweep" and r.get("val_ppl") is not None
            and (tokens is None or r["train_tokens"] == tokens)]


def best_rate(records: list[dict[str, Any]], model: str, tokens: int | None = None) -> Optional[float]:
    """The sweep's learning rate with the lowest validation perplexity (diverged rates excluded)."""
    sweep = sweep_runs(records, model, tokens)
    return min(sweep, key=lambda r: r["val_ppl"])["learning_rate"] if sweep else None


def chosen_runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluated full runs at each model's best rate (full runs at a rate a widened sweep
    superseded stay in the JSON and in the page's list of every run, not in its tables)."""
    best = {model: best_rate(records, model) for model in {r["model"] for r in records}}
    return [r for r in records if r["phase"] == "full" and r.get("test_ppl") is not None
            and r["learning_rate"] == best[r["model"]]]


def mean_and_spread(values: Iterable[float]) -> tuple[float, float, float]:
    """(mean, min, max)."""
    values = list(values)
    return statistics.fmean(values), min(values), max(values)
