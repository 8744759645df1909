"""``config.compile_decode``: a decode step's runs of Trellis and Lattice blocks, each run one
compiled function (CPU) or one CUDA graph (GPU), the span that ``generate()`` sets up for
inference (:func:`inference_span`), and the compiled mixer calls of the vLLM plugin
(:func:`advanced_compiled`).

On a CPU a one-token step costs mostly per-operation overhead, not arithmetic (BENCHMARKS.md,
issue 40). ``torch.compile`` turns a memory block's hundreds of small operations into a few fused
C++ loops around its matrix products. The unit compiled is a run of consecutive blocks (norms,
mixer, MLP), not each mixer alone: every compiled call pays for its guards and its wrapper
(about a tenth of a millisecond each on the measured CPU), so one call per run instead of one
per layer is what brought a step under a same-size Llama's. Blocks of other mixers (attention,
whose keys grow with the context, and KVM, whose step folds its window on a data-dependent
condition) run eagerly between runs.

The compiled function takes the blocks and their carried entries as arguments, so one
compilation per process serves every model whose runs share shapes, dtypes and settings; past
torch.compile's recompile limit new ones decode eagerly (the same function) with a warning.

**On a GPU** a one-token step of a small model is bound by the host: every block launches dozens
of small kernels, and each launch costs the host more than the kernel costs the GPU
(BENCHMARKS.md, issue 39: 12.5 ms per token for a 12-layer model whose kernels need well under
one). A memory block's decode step has fixed shapes (its state does not grow) and reads nothing
back from the device, so each run of blocks that would compile on a CPU is captured once as a
CUDA graph and replayed each step: one launch for the run (:func:`decode_graphs`).

A graph reads and writes fixed addresses, and the cache's tensors are never written into (a
failed call restores the entries it began with, two caches may take turns on one model). So a
step copies the hidden state and the carried entries into the graph's inputs, replays it, and
hands the cache copies of its outputs, each side one grouped copy (``torch._foreach_copy_``).

Graphs live for one span in which the weights do not change, :func:`inference_span` (what
``generate()`` and the benchmarks hold: the stacked projections of :mod:`.projection_stacks`,
which the graphs read, and the graphs), captured on a span's first step of each shape and freed
when it ends.
"""

from __future__ import annotations

import itertools
import warnings
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .cache_entries import MemoryEntry
from .cache_trellis import CacheCall
from .mixers.valid_tokens import ValidTokens
from .projection_stacks import plain_forward_hooks, stacked_projections

# What runs a run of blocks instead of run_blocks: (blocks, hidden, carried) -> (hidden, carried after).
RunOfBlocks = Callable[[tuple[nn.Module, ...], torch.Tensor, list[MemoryEntry]],
                       tuple[torch.Tensor, list[MemoryEntry]]]


def compiles_decode(model: nn.Module, hidden: torch.Tensor, valid: Optional[ValidTokens], call: Optional[CacheCall],
                    output_hidden_states: Optional[bool]) -> bool:
    """Whether ``model`` (a :class:`~trellis_lm.TrellisModel`) runs this call's blocks through
    :func:`decode_blocks`: ``config.compile_decode``, one token per row of ``hidden [B, 1, D]``
    on a CPU, or on a GPU within a span of CUDA graphs (``model.decode_graphs``, see
    :func:`decode_graphs`: ``generate()`` holds one; other GPU calls run eagerly),
    autograd off (a step that records gradients runs eagerly: the compiled step is traced for
    inference), no padding among the step's tokens (packing padded rows depends on the mask's values; a
    padded prompt's steps have none), a cache that records no calls for rollback (it keeps each
    mixer's input), no per-block hidden states asked for, and no global forward hook (it
    expects every module to be called). Which blocks then compile is :func:`compiles`'s
    answer, block by block."""
    return bool(model.config.compile_decode and call is not None and hidden.shape[1] == 1
                and (model.decode_graphs is not None or hidden.device.type == "cpu") and not torch.is_grad_enabled()
                and valid is None and not call.cache.records_calls
                and not output_hidden_states and plain_forward_hooks())


def compiles(block: nn.Module, call: CacheCall) -> bool:
    """Whether ``block`` runs compiled in this step: its mixer is ``compilable`` and past its
    first call (a carried state), no activation checkpointing in training, and no forward hook
    or pre-hook on any module of the block. The compiled run is shared by every model of its
    shapes and does not call the modules' hooks: one added after it was traced (here or on
    another model) would be skipped, or its effect kept from the trace, so a hooked block runs
    eagerly."""
    mixer = block.self_attn
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in block.modules())
    return (mixer.compilable and not hooked and not (block.training and block.gradient_checkpointing)
            and mixer.carried(call).state is not None)


def decode_blocks(blocks: Sequence[nn.Module], hidden: torch.Tensor, call: CacheCall,
                  graphs: Optional[RunOfBlocks] = None) -> torch.Tensor:
    """The decoder ``blocks`` on ``hidden [B, 1, D]``, continuing ``call``'s cache, each run of
    blocks that :func:`compiles` by one compiled call (:func:`compiled_or_eager`), or by one
    replay of its CUDA graph where ``graphs`` (a :class:`DecodeGraphs`)
    are given, the others as usual. Returns the last block's output ``[B, 1, D]``."""
    for compiled, run in itertools.groupby(blocks, key=lambda block: compiles(block, call)):
        run = tuple(run)
        if not compiled:
            for block in run:
                hidden = block(hidden, None, call)
            continue
        carried = [_contiguous(block.self_attn.carried(call)) for block in run]
        hidden, after = (graphs or compiled_or_eager)(run, hidden, carried)
        for block, entry in zip(run, after):
            block.self_attn.keep(call, entry)
    return hidden


def run_blocks(blocks: tuple[nn.Module, ...], hidden: torch.Tensor,
               carried: list[MemoryEntry]) -> tuple[torch.Tensor, list[MemoryEntry]]:
    """Memory ``blocks`` in order on ``hidden [B, T, D]`` (every token real), each mixer
    continuing its ``carried`` entry. Returns the output ``[B, T, D]`` and each mixer's entry
    after it: what is compiled."""
    after = []
    for block, entry in zip(blocks, carried):
        def mix(x: torch.Tensor, mixer: nn.Module = block.self_attn, entry: MemoryEntry = entry) -> torch.Tensor:
            out, kept = mixer.advance(x, None, entry)
            after.append(_contiguous(kept))
            return out

        hidden = block.around(hidden, mix)
    return hidden, after


def _contiguous(entry: MemoryEntry) -> MemoryEntry:
    """``entry`` with every tensor contiguous. A compiled function is specialised to its inputs'
    strides; a prefill leaves its tails with other strides than a step does (views of
    differently sized buffers), which would compile the step twice."""
    def dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t if t is None or t.is_contiguous() else t.contiguous()

    state = entry.state
    if not all(t.is_contiguous() for t in state.tensors().values()):
        state = state.map(dense)
    return MemoryEntry(dense(entry.q_tail), dense(entry.k_tail), state)


@cache
def compiled_blocks() -> Callable:
    """:func:`run_blocks` compiled, once per process (the blocks are an argument, not constants)."""
    return torch.compile(run_blocks, fullgraph=True, dynamic=False)


def compiled_or_eager(blocks: tuple[nn.Module, ...], hidden: torch.Tensor,
                      carried: list[MemoryEntry]) -> tuple[torch.Tensor, list[MemoryEntry]]:
    """:func:`run_blocks` compiled, or eagerly once torch.compile has compiled it for as many
    shapes, dtypes and settings as its recompile limit allows (``torch._dynamo.config.
    recompile_limit``; a process that decodes many different models can reach it): a warning,
    not a failure. The limit is met before the compiled code runs, so nothing is computed twice."""
    try:
        return compiled_blocks()(blocks, hidden, carried)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _warn_recompile_limit()
        return run_blocks(blocks, hidden, carried)


@cache
def _warn_recompile_limit() -> None:
    warnings.warn(
        "compile_decode: torch.compile reached its recompile limit for the decode step (one compilation per "
        "shape, dtype and setting met in this process); further new ones decode eagerly (same numbers, slower). "
        "Raise torch._dynamo.config.recompile_limit to compile more.", RuntimeWarning, stacklevel=3,
    )


def _advance(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry) -> tuple[torch.Tensor, MemoryEntry]:
    return mixer.advance(x, None, entry)


def _advance_each(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry) -> tuple[torch.Tensor, list[MemoryEntry]]:
    return mixer.advance_each(x, entry)


@cache
def _compiled_mixer(each: bool) -> Callable:
    return torch.compile(_advance_each if each else _advance, fullgraph=True)


def advanced_compiled(mixer: nn.Module, x: torch.Tensor, entry: MemoryEntry,
                      each: bool) -> tuple[torch.Tensor, Any]:
    """A memory ``mixer``'s :meth:`~trellis_lm.mixers.MemoryMixer.advance` on ``x [B, T, D]``
    (every token real; ``each``: :meth:`~trellis_lm.mixers.MemoryMixer.advance_each`) from
    ``entry``, through ``torch.compile``: the unit a server compiles (the vLLM plugin under
    ``compile_decode``: its single-token rows and rows of draft tokens, whose steps are mostly
    per-operation overhead on a CPU). As :func:`compiled_or_eager`: one compiled function per
    process, eager past the recompile limit, with a warning.

    The compiled function guards on its inputs' layout and kind: a server hands in views of its
    state slots (at offsets, strided), copies, and tensors made in inference mode (which carry
    other dispatch keys), so each input that is not a plain dense tensor of its own is copied
    into one first (outside inference mode), a tensor the entry holds under two names (a
    state's stand-ins, see :class:`~trellis_lm.integrations.vllm.slots.SlotLayout`) once: one
    compilation per batch shape, not one per mix."""
    with torch.inference_mode(False), torch.no_grad():
        copies: dict[int, torch.Tensor] = {}  # one copy of a tensor the entry holds twice: still one

        def plain(t: torch.Tensor) -> torch.Tensor:
            return copies.setdefault(id(t), _plain(t))

        x = _plain(x)
        entry = MemoryEntry(*(None if t is None else plain(t) for t in (entry.q_tail, entry.k_tail)),
                            entry.state.map(plain))
        if x.shape[0] > 1:  # any batch of several rows: one compilation (a batch of one is its own)
            for t in (x, *entry_tensors([entry])):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        try:
            return _compiled_mixer(each)(mixer, x, entry)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            _warn_recompile_limit()
            return (_advance_each if each else _advance)(mixer, x, entry)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a dense copy where it is a view at an offset or with other strides than a dense
    tensor's (those of its dims of size 1 too: a compiled function guards on them), or an
    inference tensor."""
    dense, step = [], 1
    for size in reversed(t.shape):
        dense.append(step)
        step *= size
    plain = t.stride() == tuple(reversed(dense)) and t.storage_offset() == 0 and not t.is_inference()
    return t if plain else t.clone(memory_format=torch.contiguous_format)


# Eager calls before a capture: the first compiles the Triton kernels and sets up cuBLAS (neither
# may happen inside a capture); the next runs as the capture will.
WARMUP_CALLS = 2

Capture = Callable[[Callable[[], list[torch.Tensor]]], tuple[Any, list[torch.Tensor]]]


def capture_cuda_graph(fn: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """``fn`` (no arguments, returning tensors) captured as a CUDA graph after warm-up calls on a
    side stream, as PyTorch's documentation prescribes. Returns the graph and the tensors of the
    captured call, which every ``graph.replay()`` overwrites with the new results."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def entry_tensors(entries: Sequence[MemoryEntry]) -> list[torch.Tensor]:
    """Every tensor of mixers' carried entries, in order (tails where present, then the state's)."""
    flat = []
    for q_tail, k_tail, state in entries:
        flat += [t for t in (q_tail, k_tail) if t is not None]
        flat += list(state.tensors().values())
    return flat


def entries_from(like: Sequence[MemoryEntry], tensors: Iterator[torch.Tensor]) -> list[MemoryEntry]:
    """Entries shaped as ``like`` holding the next tensors of ``tensors`` (see :func:`entry_tensors`)."""
    return [MemoryEntry(None if q_tail is None else next(tensors), None if k_tail is None else next(tensors),
                        state.map(lambda _: next(tensors))) for q_tail, k_tail, state in like]


def signature(entries: Sequence[MemoryEntry], inputs: Sequence[torch.Tensor]) -> tuple:
    """What a graph is specialised to: the shapes, dtypes and devices of its ``inputs`` (the
    hidden state, then :func:`entry_tensors` of ``entries``), and which tails are absent."""
    absent = tuple((q is None, k is None, type(s)) for q, k, s in entries)
    return absent, tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


class GraphedRun:
    """A run of memory ``blocks`` (:func:`run_blocks`) captured for ``inputs``
    like these: the hidden state ``[B, 1, D]``, then the tensors of ``carried`` (each mixer's
    entry, :func:`entry_tensors`)."""

    def __init__(self, blocks: tuple[nn.Module, ...], carried: Sequence[MemoryEntry], inputs: Sequence[torch.Tensor],
                 capture: Capture) -> None:
        self.inputs = [t.clone() for t in inputs]
        static = iter(self.inputs)
        static_hidden, static_carried = next(static), entries_from(carried, static)
        self._after_like: list[MemoryEntry] = []

        def step() -> list[torch.Tensor]:
            out, after = run_blocks(blocks, static_hidden, static_carried)
            self._after_like = after
            return [out, *entry_tensors(after)]

        self.graph, self.outputs = capture(step)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[MemoryEntry]]:
        """The run on ``inputs`` (the hidden state, then the carried entries' tensors, as at the
        capture): the output ``[B, 1, D]`` and each mixer's entry after it, all new tensors
        (nothing given is written into)."""
        torch._foreach_copy_(self.inputs, list(inputs))
        self.graph.replay()
        fresh = [torch.empty_like(t) for t in self.outputs]
        torch._foreach_copy_(fresh, self.outputs)
        tensors = iter(fresh)
        return next(tensors), entries_from(self._after_like, tensors)


class DecodeGraphs:
    """The graphs of one span (see :func:`decode_graphs`) of a model on ``device``, one per run of
    blocks and signature. A capture that fails (an operation a CUDA graph cannot hold, memory)
    leaves the span's steps eager, with a warning saying why: the same numbers, not a failed
    ``generate()``."""

    def __init__(self, capture: Capture, device: torch.device) -> None:
        self.capture = capture
        self.device = device
        self.runs: dict[tuple, GraphedRun] = {}
        self.failed = False

    def __call__(self, blocks: tuple[nn.Module, ...], hidden: torch.Tensor,
                 carried: Sequence[MemoryEntry]) -> tuple[torch.Tensor, list[MemoryEntry]]:
        """:func:`run_blocks` of ``blocks`` by the graph captured for this run and
        signature (captured now on the first such step), or eagerly after a failed capture."""
        if self.failed:
            return run_blocks(blocks, hidden, carried)
        inputs = [hidden, *entry_tensors(carried)]
        key = (tuple(id(block) for block in blocks), signature(carried, inputs))
        # Captures and replays go to the current stream of the model's device, not of the current one.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            run = self.runs.get(key)
            if run is None:
                try:
                    run = self.runs[key] = GraphedRun(blocks, carried, inputs, self.capture)
                except RuntimeError as error:
                    self.failed = True
                    self.runs.clear()
                    warnings.warn(f"compile_decode: capturing a decode step as a CUDA graph failed ({error}); "
                                  "this generate() call decodes eagerly (same numbers, slower)",
                                  RuntimeWarning, stacklevel=2)
                    return run_blocks(blocks, hidden, carried)
            return run(inputs)


@contextmanager
def decode_graphs(model: nn.Module, capture: Optional[Capture] = None) -> Iterator[None]:
    """Within the block, ``compile_decode`` steps of every :class:`~trellis_lm.TrellisModel` in
    ``model`` whose weights are all on one CUDA device replay CUDA graphs of their runs of memory
    blocks (a model split across devices decodes eagerly); the graphs are freed at its end. For a
    span in which the weights do not change (one ``generate`` call): a graph reads the weights
    and stacked projections where they were at its capture. ``capture`` replaces
    :func:`capture_cuda_graph` (and then a model on one device of any kind takes part: tests run
    the same bookkeeping on a CPU). Nested blocks keep the outer one's graphs."""
    made = []
    try:
        for module in model.modules():
            if "decode_graphs" not in vars(module) or module.decode_graphs is not None:
                continue
            devices = {p.device for p in module.parameters()}
            if len(devices) == 1 and (capture is not None or next(iter(devices)).type == "cuda"):
                module.decode_graphs = DecodeGraphs(capture or capture_cuda_graph, devices.pop())
                made.append(module)
        yield
    finally:
        for module in made:
            module.decode_graphs = None


@contextmanager
def inference_span(model: nn.Module) -> Iterator[None]:
    """What ``generate()`` sets up for its call, for any loop that steps ``model`` as it does (the
    benchmarks): each layer's projections of one input stacked once
    (:func:`~trellis_lm.projection_stacks.stacked_projections`) and, with ``compile_decode`` on a
    GPU, the CUDA graphs of its decode steps (:func:`decode_graphs`). The weights must not change
    within the block; a no-op for models that are not Trellis models."""
    with stacked_projections(model), decode_graphs(model):
        yield
