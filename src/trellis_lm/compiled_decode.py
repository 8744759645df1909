"""``config.compile_decode``: a decode step's runs of Trellis and Lattice blocks, each run one
compiled function.

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

On a GPU the same runs are each replayed from a CUDA graph instead (:mod:`.decode_graphs`), within
the span that ``generate()`` holds.
"""

from __future__ import annotations

import itertools
import warnings
from functools import cache
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from .cache_trellis import CacheCall
from .mixers.stacking import plain_forward_hooks
from .mixers.tokens import ValidTokens
from .ops.state import OpState

# What runs a run of blocks instead of run_blocks: (blocks, hidden, carried) -> (hidden, carried after).
RunOfBlocks = Callable[[tuple[nn.Module, ...], torch.Tensor, list[tuple[Any, Any, Any]]],
                       tuple[torch.Tensor, list[tuple[Any, Any, Any]]]]


def compiles_decode(model: nn.Module, hidden: torch.Tensor, valid: Optional[ValidTokens], call: Optional[CacheCall],
                    output_hidden_states: Optional[bool]) -> bool:
    """Whether ``model`` (a :class:`~trellis_lm.TrellisModel`) runs this call's blocks through
    :func:`decode_blocks`: ``config.compile_decode``, one token per row of ``hidden [B, 1, D]``
    on a CPU, or on a GPU within a span of CUDA graphs (``model.decode_graphs``, see
    :mod:`trellis_lm.decode_graphs`: ``generate()`` holds one; other GPU calls run eagerly),
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
            and mixer.carried(call)[2] is not None)


def decode_blocks(blocks: Sequence[nn.Module], hidden: torch.Tensor, call: CacheCall,
                  graphs: Optional[RunOfBlocks] = None) -> torch.Tensor:
    """The decoder ``blocks`` on ``hidden [B, 1, D]``, continuing ``call``'s cache, each run of
    blocks that :func:`compiles` by one compiled call (:func:`compiled_or_eager`), or by one
    replay of its CUDA graph where ``graphs`` (a :class:`~trellis_lm.decode_graphs.DecodeGraphs`)
    are given, the others as usual. Returns the last block's output ``[B, 1, D]``."""
    for compiled, run in itertools.groupby(blocks, key=lambda block: compiles(block, call)):
        run = tuple(run)
        if not compiled:
            for block in run:
                hidden = block(hidden, None, call)
            continue
        carried = [_contiguous(block.self_attn.carried(call)) for block in run]
        hidden, after = (graphs or compiled_or_eager)(run, hidden, carried)
        for block, before, entry in zip(run, carried, after):
            block.self_attn.keep(call, before, entry, hidden.shape[0])
    return hidden


def run_blocks(blocks: tuple[nn.Module, ...], hidden: torch.Tensor,
               carried: list[tuple[Any, Any, Any]]) -> tuple[torch.Tensor, list[tuple[Any, Any, Any]]]:
    """Memory ``blocks`` in order on ``hidden [B, T, D]`` (every token real), each mixer
    continuing its ``carried`` ``(q_tail, k_tail, state)``. Returns the output ``[B, T, D]`` and
    each mixer's ``(q_tail, k_tail, state)`` after it: what is compiled."""
    after = []
    for block, entry in zip(blocks, carried):
        def mix(x: torch.Tensor, mixer: nn.Module = block.self_attn, entry: tuple = entry) -> torch.Tensor:
            out, *kept = mixer.mix(x, None, *entry, keep_state=True)
            after.append(_contiguous(kept))
            return out

        hidden = block.around(hidden, mix)
    return hidden, after


def _contiguous(entry: Sequence[Any]) -> tuple[Any, ...]:
    """``(q_tail, k_tail, state)`` with every tensor contiguous. A compiled function is
    specialised to its inputs' strides; a prefill leaves its tails with other strides than a
    step does (views of differently sized buffers), which would compile the step twice."""
    def dense(t: Any) -> Any:
        return t if not isinstance(t, torch.Tensor) or t.is_contiguous() else t.contiguous()

    def dense_state(state: OpState) -> OpState:
        return state if all(t.is_contiguous() for t in state.tensors().values()) else state.map(dense)

    return tuple(dense_state(t) if isinstance(t, OpState) else dense(t) for t in entry)


@cache
def compiled_blocks() -> Callable:
    """:func:`run_blocks` compiled, once per process (the blocks are an argument, not constants)."""
    return torch.compile(run_blocks, fullgraph=True, dynamic=False)


def compiled_or_eager(blocks: tuple[nn.Module, ...], hidden: torch.Tensor,
                      carried: list[tuple[Any, Any, Any]]) -> tuple[torch.Tensor, list[tuple[Any, Any, Any]]]:
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
