"""The language-modelling studies on real local text: data, same-size models, training.

What ``studies/lm_study.py`` (``docs/results_lm.md``) and ``studies/lm_extrapolation.py`` run:

* :func:`stdlib_corpus`: the Python standard library's source files of the running interpreter
  (code with its comments and docstrings), split **by file** into train / validation / test by
  a hash of each file's path, so held-out files are never seen in training. The tokenizer is
  trained on the train split only (:func:`encode_corpus`).
* :func:`build_study_model`: every architecture at one parameter count: the MLP width of each
  model is chosen so that its total parameters (embeddings included) match the Llama's.
* :func:`train_lm`: AdamW, linear warm-up then cosine decay, gradient clipping, batches of
  random training windows; the same recipe for every model.
* Why length fails: :func:`memory_profile` (what the memories hold along a long read, each head's
  forget horizon) and :func:`capped_horizons` (every horizon capped at inference), both through
  the Trellis mixer's own forget-gate functions.

The measures a user calls live in :mod:`trellis_lm.eval` (perplexity, by position, passkey,
decode cost); the bookkeeping shared by the studies in :mod:`studies.records`. Nothing is
downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from trellis_lm.cache_trellis import CACHE_ARG
from trellis_lm.configuration_trellis import TrellisConfig
from trellis_lm.modeling_trellis import TrellisForCausalLM
from trellis_lm.state_passing import StatePassing
from trellis_lm.tokenization_trellis import train_tokenizer

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


def forget_gates(model: PreTrainedModel) -> list[tuple[int, torch.nn.Module]]:
    """``(layer index, mixer)`` of every layer whose mixer has a Trellis forget gate (its
    ``beta_proj``, read through the mixer's ``log_forget`` and ``forget_logit_cap``)."""
    return [(i, layer.self_attn) for i, layer in enumerate(model.model.layers)
            if getattr(layer.self_attn, "beta_proj", None) is not None]


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
    for i, mixer in forget_gates(model):
        def keep(module, inputs, output, i=i, mixer=mixer):
            gates.setdefault(i, []).append(mixer.log_forget(output.float()).flatten(0, -2))

        hooks.append(mixer.beta_proj.register_forward_hook(keep))
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
    for _, mixer in forget_gates(model):
        highest = mixer.forget_logit_cap(tokens)
        hooks.append(mixer.beta_proj.register_forward_hook(lambda module, inputs, output, h=highest: output.clamp(max=h)))
    try:
        yield len(hooks)
    finally:
        for hook in hooks:
            hook.remove()
