"""``config.compile_decode``: a decode step's runs of memory blocks (:mod:`.decode_step`: with the
embedding before the first and the head after the last when they start and end the model) each
one compiled function (CPU) or one CUDA graph (GPU), within the span that ``generate()`` sets up
(:func:`inference_span`).

On a CPU a one-token step costs mostly per-operation overhead, not arithmetic (BENCHMARKS.md,
issues 40 and 73). ``torch.compile`` turns a run's hundreds of small operations into a few fused
C++ loops around its matrix products, and every compiled call pays for its guards and its
wrapper, so the unit is the longest run there is: an all-Trellis or all-Lattice model's whole
step, tokens to logits, is one call. The compiled function takes the blocks, their carried
entries and the weights as arguments, so one compilation per process serves every model whose
runs share shapes, dtypes and settings; past torch.compile's recompile limit new ones decode
eagerly (the same function) with a warning.

**On a GPU** a one-token step of a small model is bound by the host: every block launches dozens
of small kernels, and each launch costs the host more than the kernel costs the GPU
(BENCHMARKS.md, issue 39). A run has fixed shapes (a memory block's state does not grow) and
reads nothing back from the device, so each run is captured once as a CUDA graph and replayed
each step: an all-memory model's step is one replay (:class:`DecodeGraphs`).

A graph reads and writes fixed addresses: its token (or hidden state) buffer, and two sets of
static buffers for the carried entries that it uses in turn, each replay reading one set and
writing the entries after into the other, which the cache then holds. So a cache that steps
again needs no copy at all, and a failed step leaves the cache its entries before, untouched.
Entries that are not the graph's (the prefill's, another cache's, reordered beams') are copied
in first, and a cache that still holds a set another cache's step is about to write gets a copy
of its own first. A cache that records its calls for rollback keeps its entries before each
call, so its steps are handed copies of the graph's outputs instead.

Graphs live for one span in which the weights do not change, :func:`inference_span` (what
``generate()`` and the benchmarks hold), captured on a span's first steps of each shape and
freed when it ends.
"""

from __future__ import annotations

import weakref
import warnings
from contextlib import contextmanager, nullcontext
from functools import cache
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .cache_entries import MemoryEntry, MemoryLayerCache
from .decode_step import Segment, SegmentRunner, decode_plans, run_eagerly, run_segment
from .projection_stacks import stacked_projections


# The fewest elements per thread for which a compiled loop runs on several threads: ATen's own
# grain for elementwise operations (at::internal::GRAIN_SIZE), where inductor's default is 512.
# A decode step's loops are a few thousand elements at batch 1, and each parallel region costs
# more than such a loop (a thread's wake-up; milliseconds on a CPU that other work shares).
MIN_CHUNK_SIZE = 32768


@cache
def compiled_segment() -> Callable:
    """:func:`~trellis_lm.decode_step.run_segment` compiled, once per process (the blocks and
    weights are arguments, not constants)."""
    return torch.compile(run_segment, fullgraph=True, dynamic=False, options={"cpp.min_chunk_size": MIN_CHUNK_SIZE})


class CompiledSegments:
    """The segment runner of ``compile_decode`` on a CPU: :func:`~trellis_lm.decode_step.run_segment`
    compiled, or eagerly once torch.compile has compiled it for as many shapes, dtypes and settings
    as its recompile limit allows (``torch._dynamo.config.recompile_limit``; a process that decodes
    many different models can reach it): a warning, not a failure. The limit is met before the
    compiled code runs, so nothing is computed twice.

    The compiled function is specialised to its inputs' strides, those of dims of size 1 too. Its
    own outputs are dense; entries from elsewhere (a prefill leaves its conv tails as views of
    differently sized buffers, by the prompt's length) are made dense first, as is the token
    column ``generate()`` slices from its sequences."""

    def __init__(self) -> None:
        self.last: dict[int, list[Any]] = {}  # by a run's first block: the states its last call gave out

    def __call__(self, segment: Segment, first: torch.Tensor, carried: Sequence[MemoryEntry],
                 holders: Sequence[MemoryLayerCache]) -> tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]:
        run = id(segment.blocks[0])
        last = self.last.get(run, ())
        if not (len(last) == len(carried) and all(entry.state is state for entry, state in zip(carried, last))):
            carried = [entry.map(plain_tensor) for entry in carried]
        try:
            out, after, inputs = compiled_segment()(segment, plain_tensor(first), carried)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warn_recompile_limit()
            return run_segment(segment, first, carried)
        self.last[run] = [entry.state for entry in after]
        return out, after, inputs


@cache
def warn_recompile_limit() -> None:
    warnings.warn(
        "compile_decode: torch.compile reached its recompile limit for the decode step (one compilation per "
        "shape, dtype and setting met in this process); further new ones decode eagerly (same numbers, slower). "
        "Raise torch._dynamo.config.recompile_limit to compile more.", RuntimeWarning, stacklevel=3,
    )


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
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
    return [t for entry in entries for t in entry.tensors().values()]


def entries_from(like: Sequence[MemoryEntry], tensors: Iterator[torch.Tensor]) -> list[MemoryEntry]:
    """Entries shaped as ``like`` holding the next tensors of ``tensors`` (see :func:`entry_tensors`)."""
    return [entry.map(lambda _: next(tensors)) for entry in like]


def signature(entries: Sequence[MemoryEntry], inputs: Sequence[torch.Tensor]) -> tuple:
    """What a graph is specialised to: the shapes, dtypes and devices of its ``inputs`` (the
    token ids or hidden state, then :func:`entry_tensors` of ``entries``), and which tails are absent."""
    absent = tuple((q is None, k is None, type(s)) for q, k, s in entries)
    return absent, tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


def _holds(holder: MemoryLayerCache, entry: MemoryEntry) -> bool:
    return holder.state is entry.state


class CaptureFailed(Exception):
    """A CUDA graph could not be captured (the ``RuntimeError`` the capture raised is its cause)."""


class GraphedSegment:
    """A run of blocks (a :class:`~trellis_lm.decode_step.Segment`) captured for inputs like ``first``
    and ``carried``: a static buffer for the token ids (or hidden state), two sets of static
    buffers for the carried entries, and up to four graphs, by the set they read and whether they
    hand out copies (for a cache that records its calls) or write the entries after into the other
    set, which the cache then holds (see the module doc)."""

    def __init__(self, segment: Segment, first: torch.Tensor, carried: Sequence[MemoryEntry], capture: Capture) -> None:
        self.segment, self.capture, self.like = segment, capture, list(carried)
        self.first = first.clone()
        self.sets = [[t.clone() for t in entry_tensors(carried)] for _ in range(2)]
        self.entries = [entries_from(carried, iter(tensors)) for tensors in self.sets]
        self.graphs: dict[tuple[int, bool], tuple[Any, list[torch.Tensor]]] = {}
        self.holders: list[weakref.ref] = []  # the layer entries last handed a set

    def __call__(self, first: torch.Tensor, carried: Sequence[MemoryEntry], holders: Sequence[MemoryLayerCache],
                 copied: bool) -> tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]:
        """:func:`~trellis_lm.decode_step.run_segment` of ``first`` and ``carried`` by a replay: the
        output, the entries after, for ``holders`` (the layer entries that will hold them), and
        when ``copied`` (a recording cache) the mixers' inputs, all copies; else the entries are a
        set of buffers. Raises :class:`CaptureFailed` when a graph it needs cannot be captured."""
        read = next((i for i, entries in enumerate(self.entries)
                     if all(mine.state is theirs.state for mine, theirs in zip(entries, carried))), None)
        if read is None:  # not the graph's buffers: copied into the first set (its holder gets a copy first)
            read = 0
            self._evict(read)
            torch._foreach_copy_(self.sets[read], entry_tensors(carried))
        if not copied:
            self._evict(1 - read)
        self.first.copy_(first)
        graph, outputs = self._graph(read, copied)
        graph.replay()
        if copied:
            fresh = iter([t.clone() for t in outputs])
            return next(fresh), entries_from(self.like, fresh), list(fresh)
        self.holders = [weakref.ref(holder) for holder in holders]
        return outputs[0].clone(), self.entries[1 - read], []

    def _graph(self, read: int, copied: bool) -> tuple[Any, list[torch.Tensor]]:
        """The graph reading set ``read``, captured on its first use."""
        if (read, copied) not in self.graphs:
            segment = self.segment._replace(keep_inputs=copied)
            entries, written = self.entries[read], self.sets[1 - read]

            def step() -> list[torch.Tensor]:
                out, after, inputs = run_segment(segment, self.first, entries)
                if copied:
                    return [out, *entry_tensors(after), *inputs]
                torch._foreach_copy_(written, entry_tensors(after))
                return [out]

            try:
                self.graphs[read, copied] = self.capture(step)
            except RuntimeError as error:
                raise CaptureFailed(str(error)) from error
        return self.graphs[read, copied]

    def _evict(self, index: int) -> None:
        """Give each layer entry that holds set ``index`` a copy of it, before the set is written."""
        held = {id(entry.state) for entry in self.entries[index]}
        for ref in self.holders:
            holder = ref()
            if holder is not None and id(holder.state) in held:
                holder.hold(holder.entry.map(torch.clone))


class DecodeGraphs:
    """The segment runner of a span (:class:`~trellis_lm.decode_step.DecodePlan`) for a model on
    ``device``: one :class:`GraphedSegment` per run of blocks and signature. A capture that fails
    (an operation a CUDA graph cannot hold, memory) leaves the span's steps eager, with a warning
    saying why: the same numbers, not a failed ``generate()``."""

    def __init__(self, capture: Capture, device: torch.device) -> None:
        self.capture = capture
        self.device = device
        self.segments: dict[tuple, GraphedSegment] = {}
        self.failed = False

    def __call__(self, segment: Segment, first: torch.Tensor, carried: Sequence[MemoryEntry],
                 holders: Sequence[MemoryLayerCache]) -> tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]:
        """:func:`~trellis_lm.decode_step.run_segment` by the segment's graphs (captured on first
        use), or eagerly after a failed capture."""
        if self.failed:
            return run_segment(segment, first, carried)
        key = (tuple(id(block) for block in segment.blocks), segment.embedding is not None,
               segment.norm is not None, segment.head is not None,
               signature(carried, [first, *entry_tensors(carried)]))
        # Captures and replays go to the current stream of the model's device, not of the current one.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
            graphed = self.segments.get(key)
            if graphed is None:
                graphed = self.segments[key] = GraphedSegment(segment, first, carried, self.capture)
            try:
                return graphed(first, carried, holders, copied=segment.keep_inputs)
            except CaptureFailed as failure:
                self.failed = True
                self.segments.clear()
                warnings.warn(f"compile_decode: capturing a decode step as a CUDA graph failed ({failure}); "
                              "this generate() call decodes eagerly (same numbers, slower)", RuntimeWarning,
                              stacklevel=2)
                return run_segment(segment, first, carried)


def segment_runner(model: nn.Module, capture: Optional[Capture] = None) -> SegmentRunner:
    """How a span runs the decode segments of ``model`` (a :class:`~trellis_lm.TrellisModel`):
    without ``compile_decode`` eagerly; with it, by CUDA graphs on one CUDA device (or by
    ``capture``, replacing :func:`capture_cuda_graph`, on any one device: tests run the same
    bookkeeping on a CPU), compiled on a CPU, else eagerly (a model split across devices, or
    another device type)."""
    if not model.config.compile_decode:
        return run_eagerly
    devices = {p.device for p in model.parameters()}
    device = devices.pop() if len(devices) == 1 else None
    if device is not None and (capture is not None or device.type == "cuda"):
        return DecodeGraphs(capture or capture_cuda_graph, device)
    return CompiledSegments() if device is not None and device.type == "cpu" else run_eagerly


@contextmanager
def inference_span(model: nn.Module, capture: Optional[Capture] = None) -> Iterator[None]:
    """What ``generate()`` sets up for its call, for any loop that steps ``model`` as it does (the
    benchmarks): each layer's projections of one input stacked once
    (:func:`~trellis_lm.projection_stacks.stacked_projections`), and decode steps run by a
    :class:`~trellis_lm.decode_step.DecodePlan` (eagerly; with ``compile_decode`` compiled on a
    CPU, CUDA graphs on a GPU, see :func:`segment_runner`; ``capture`` replaces
    :func:`capture_cuda_graph` on any device, how tests check the graphs' bookkeeping on a CPU).
    The weights must not change within the block; nested spans keep the outer one's stacks and
    plans; a no-op for models that are not Trellis models."""
    with stacked_projections(model), decode_plans(model, lambda module: segment_runner(module, capture)):
        yield
