"""``config.compile_decode`` on CUDA: each run of memory blocks of a decode step replayed from a
CUDA graph.

On a GPU a one-token step of a small model is bound by the host: every block launches dozens of
small kernels, and each launch costs the host more than the kernel costs the GPU (BENCHMARKS.md,
issue 39: 12.5 ms per token for a 12-layer model whose kernels need well under one). A memory
block's decode step has fixed shapes (its state does not grow) and reads nothing back from the
device, so the whole run of blocks that :mod:`.compiled_decode` would compile on a CPU is captured
once as a CUDA graph and replayed each step: one launch for the run.

A graph reads and writes fixed addresses, and the cache's tensors are never written into (a
failed call restores the entries it began with, two caches may take turns on one model). So a
step copies the hidden state and the carried entries into the graph's inputs, replays it, and
hands the cache copies of its outputs, each side one grouped copy (``torch._foreach_copy_``).

Graphs live for one span in which the weights do not change, :func:`decode_graphs`, which
``generate()`` holds (with the stacked projections of :mod:`.mixers.stacking`, which the graphs
read): captured on a span's first step of each shape and freed when it ends.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .compiled_decode import run_blocks
from .ops.state import OpState

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


Entry = tuple[Optional[torch.Tensor], Optional[torch.Tensor], OpState]


def entry_tensors(entries: Sequence[Entry]) -> list[torch.Tensor]:
    """Every tensor of mixers' carried ``(q_tail, k_tail, state)`` entries, in order."""
    flat = []
    for q_tail, k_tail, state in entries:
        flat += [t for t in (q_tail, k_tail) if t is not None]
        flat += list(state.tensors().values())
    return flat


def entries_from(like: Sequence[Entry], tensors: Iterator[torch.Tensor]) -> list[Entry]:
    """Entries shaped as ``like`` holding the next tensors of ``tensors`` (see :func:`entry_tensors`)."""
    return [(None if q_tail is None else next(tensors), None if k_tail is None else next(tensors),
             state.map(lambda _: next(tensors))) for q_tail, k_tail, state in like]


def signature(entries: Sequence[Entry], inputs: Sequence[torch.Tensor]) -> tuple:
    """What a graph is specialised to: the shapes, dtypes and devices of its ``inputs`` (the
    hidden state, then :func:`entry_tensors` of ``entries``), and which tails are absent."""
    absent = tuple((q is None, k is None, type(s)) for q, k, s in entries)
    return absent, tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)


class GraphedRun:
    """A run of memory ``blocks`` (:func:`~.compiled_decode.run_blocks`) captured for ``inputs``
    like these: the hidden state ``[B, 1, D]``, then the tensors of ``carried`` (each mixer's
    ``(q_tail, k_tail, state)``, :func:`entry_tensors`)."""

    def __init__(self, blocks: tuple[nn.Module, ...], carried: Sequence[Entry], inputs: Sequence[torch.Tensor],
                 capture: Capture) -> None:
        self.inputs = [t.clone() for t in inputs]
        static = iter(self.inputs)
        static_hidden, static_carried = next(static), entries_from(carried, static)
        self._after_like: list[Entry] = []

        def step() -> list[torch.Tensor]:
            out, after = run_blocks(blocks, static_hidden, static_carried)
            self._after_like = after
            return [out, *entry_tensors(after)]

        self.graph, self.outputs = capture(step)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[Entry]]:
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
                 carried: Sequence[Entry]) -> tuple[torch.Tensor, list[Entry]]:
        """:func:`~.compiled_decode.run_blocks` of ``blocks`` by the graph captured for this run and
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
