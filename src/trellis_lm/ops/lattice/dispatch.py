"""The one public entry point of the op: argument checks, state set-up and backend choice."""

from __future__ import annotations

import math
import sys
from typing import Callable, Optional, Union

import torch

from ...defaults import CHUNK_SIZE, LATTICE_VARIANT
from ..checks import (
    as_dtype, check_chunk_size, check_cu_seqlens, checked_offsets_state, compute_dtype, expect_float_inputs,
    expect_in_range, expect_per_token_head, expect_qkv, expect_shape, in_compute_dtype,
)
from ..registry import Backend, BackendRegistry, OpCall
from .chunked import chunked_forward
from .reference import reference_forward
from .state import LatticeState
from .step import step_forward
from .terms import check_variant

# No Triton kernels exist for Lattice: the chunk form's few large matmuls per chunk already run
# well through PyTorch on GPUs, so "torch" serves CUDA tensors too.
BACKENDS = BackendRegistry(
    "lattice_attention",
    Backend("reference", reference_forward, priority=0),
    Backend("torch", chunked_forward, priority=1, step=step_forward),
)

InitialState = Union[torch.Tensor, LatticeState]


def _initial_state(
    initial_state: Optional[InitialState], rows: int, heads: int, slots: int, dim: int,
    chunk_size: int, dtype: torch.dtype, device: torch.device, check_values: bool = True,
) -> LatticeState:
    """Turn a memory tensor or a :class:`LatticeState` into a checked state in ``dtype`` (its
    offsets' range read back only with ``check_values``)."""
    shape, meaning = (rows, heads, slots, dim), lambda: f"[N, H, M, D] with N = {rows} sequences"
    if initial_state is None:
        raise ValueError(
            "initial_state is required: a memory tensor [N, H, M, D] (e.g. the layer's learned S0) "
            "or a LatticeState. The slots live on the unit sphere and a zero memory has no "
            "direction to normalise, so there is no default"
        )
    if isinstance(initial_state, torch.Tensor):
        expect_shape("initial_state", initial_state, shape, meaning)
        # Normalised in the compute dtype, so a low-precision S0 is not rounded twice.
        return LatticeState.at_chunk_start(as_dtype(initial_state, dtype, device))
    if not isinstance(initial_state, LatticeState):
        raise ValueError(
            f"initial_state must be a memory tensor [N, H, M, D] or a LatticeState, got {type(initial_state).__name__}"
        )
    state = initial_state
    expect_shape("initial_state.memory", state.memory, shape, meaning)
    expect_shape("initial_state.anchor", state.anchor, shape, meaning)
    return checked_offsets_state(state, rows, chunk_size, dtype, device, check_values)


def lattice_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    *,
    initial_state: Optional[InitialState],
    chunk_size: int = CHUNK_SIZE,
    variant: str = LATTICE_VARIANT,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, Optional[LatticeState]]:
    """The Lattice memory op (design page ``lattice.md``, sections 1-3).

    M slots on the unit sphere; every token moves each slot orthogonally to itself by a step
    from the chunk's anchor, then retracts onto the sphere and reads ``y = S^T q``.

    Args:
        q: ``[B, T, H, M]`` read coefficients over the slots (the layer L2-normalises them).
        k: ``[B, T, H, M]`` write coefficients (the layer L2-normalises them).
        v: ``[B, T, H, D]`` values.
        gamma: ``[B, T, H]`` step sizes, finite and >= 0 (the page's gamma > 0; 0 writes nothing).
        initial_state: required. A memory tensor ``[N, H, M, D]`` (its rows are normalised here;
            it means "at a chunk boundary") or a :class:`LatticeState` returned by an earlier
            call (resumes exactly, also mid-chunk). ``N = B``, or the number of sequences in
            ``cu_seqlens``. ``None`` raises: a zero memory has no direction. So does a memory
            (the tensor, or the state's ``memory``) with a row of zero or non-finite norm: the
            normalised slot, and every output of its head, would be NaN.
            Out-of-range values (gamma, the memory's rows, the state's offset) raise a
            ``ValueError``; the check reads values back from the device (see ``check_values``).
        chunk_size: C >= 1; the model is defined by it (1 is the paper's exact recurrence).
        variant: the inner loss, one of ``LATTICE_VARIANTS``: ``"dec"`` ``|S^T k - v|^2``
            (default), ``"enc"`` ``|S v - k|^2`` or ``"sim"`` ``-(S v) . k``.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int, with B = 1: N sequences packed along T, each starting
            from its own initial state (zero length allowed: its state passes through).
        backend: ``"reference"`` (per-token loop), ``"torch"`` (chunk-parallel) or ``"auto"``
            (``"torch"``, on CUDA too: there are no Lattice Triton kernels). With T == 1 and no
            ``cu_seqlens``, ``"auto"`` and ``"torch"`` run the single-token step of :mod:`.step`.
        check_values: read gamma, the memory's row norms and ``initial_state.offset`` back to
            check them (the ``ValueError`` above; skipped inside ``torch.compile``). ``False``
            skips those reads (host syncs, and a pass over the memory) for callers whose values
            are right by construction: the mixer's decode steps, whose gamma is a sigmoid and
            whose state this op returned. Shapes are checked either way.

    Returns:
        ``o [B, T, H, D]`` in q's dtype, and the final :class:`LatticeState` (float32, or
        float64 for float64 inputs) when ``output_final_state`` else ``None``.
    """
    batch, length, heads, slots, dim = expect_qkv(q, k, v, key_dim="M", value_dim="D")
    expect_per_token_head({"gamma": gamma}, batch, length, heads)
    expect_float_inputs({"q": q, "k": k, "v": v, "gamma": gamma}, q.device)
    if length == 0:
        raise ValueError("the inputs must hold at least one token (T >= 1)")
    check_chunk_size(chunk_size)
    check_variant(variant)
    forward = BACKENDS.function(backend, OpCall(q.device, compute_dtype(q), length, cu_seqlens is not None))

    rows = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch, length)
        rows = cu_seqlens.numel() - 1
    dtype = compute_dtype(q)
    state = _initial_state(initial_state, rows, heads, slots, dim, chunk_size, dtype, q.device, check_values)
    if check_values:
        # A negative or NaN step size makes the slots diverge, as in the Trellis op; a memory row
        # without a direction makes its slot, and every read of it, NaN. A plain tensor is
        # checked before the op normalises it, so a zero row reads as 0, not as NaN.
        name, memory = (
            ("initial_state", as_dtype(initial_state, dtype, q.device)) if isinstance(initial_state, torch.Tensor)
            else ("initial_state.memory", state.memory)
        )
        with torch.no_grad():
            norms = torch.linalg.vector_norm(memory, dim=-1)
        expect_in_range({
            "gamma": (gamma, 0.0, sys.float_info.max, "finite and >= 0"),
            name: (norms, math.nextafter(0.0, 1.0), sys.float_info.max,
                   "a memory of rows with finite, nonzero norms (each row is normalised onto the unit sphere); "
                   "its row norms"),
        })
    inputs = [as_dtype(t, dtype, q.device) for t in (q, k, v, gamma)]
    with in_compute_dtype(q.device):
        o, final = forward(*inputs, state, chunk_size, variant, cu_seqlens)
    return as_dtype(o, q.dtype, q.device), (final if output_final_state else None)


def lattice_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, *, state: LatticeState,
    chunk_size: int = CHUNK_SIZE, variant: str = LATTICE_VARIANT, backend: str = "auto", consume_state: bool = False,
) -> tuple[torch.Tensor, LatticeState]:
    """:func:`lattice_attention` for one token per row after an earlier call, unchecked (see
    :func:`~trellis_lm.ops.trellis.trellis_step`: the same contract): ``q, k [N, 1, H, M]``,
    ``v [N, 1, H, D]``, ``gamma [N, 1, H]`` in the state's dtype. Returns ``o [N, 1, H, D]`` and the
    state after the token. ``consume_state``: a permission (see there) its steps do not take: the
    state after is new tensors."""
    return lattice_step_for(q.device, q.dtype, chunk_size=chunk_size, variant=variant, backend=backend)(
        q, k, v, gamma, state)


def lattice_step_for(device: torch.device, dtype: torch.dtype, *, chunk_size: int = CHUNK_SIZE, variant: str = LATTICE_VARIANT,
                     backend: str = "auto") -> Callable[..., tuple[torch.Tensor, LatticeState]]:
    """:func:`lattice_step` for inputs on ``device`` in ``dtype`` with these settings, its backend
    chosen now (see :func:`~trellis_lm.ops.trellis.trellis_step_for`): ``step(q, k, v, gamma, state)``."""
    step = BACKENDS.single_token(backend, device, dtype)

    def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor,
              state: LatticeState) -> tuple[torch.Tensor, LatticeState]:
        return step(q, k, v, gamma, state, chunk_size, variant, None)

    return bound
