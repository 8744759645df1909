"""The one public entry point of the op: argument checks, state set-up and backend choice."""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
from typing import Callable, Optional, Sequence, Union

import torch

from ...defaults import CHUNK_SIZE, COMPRESS_FN, MIX_FN, WRITE_GRADIENT
from ..checks import (
    as_dtype, check_chunk_size, check_cu_seqlens, checked_offsets_state, compute_dtype, expect_dims,
    expect_float_inputs, expect_in_range, expect_nonzero_sizes, expect_per_token_head, expect_qkv, expect_shape,
    in_compute_dtype,
)
from ..registry import Backend, BackendRegistry, OpCall
from .chunked import chunked_forward
from .compress_mix import check_names
from .native import native_forward, native_step, native_unavailable
from .reference import reference_forward
from .state import TrellisState
from .step import step_forward


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here. Tried on first need only (importing triton is slow), inside
    a try block (where transformers' check of a Hub checkpoint's imports does not look)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_forward(*args):
    """Backend ``"triton"``: imported on first use, since importing triton is slow and the
    package is optional (checkpoints loaded as remote code may run without it)."""
    from .triton_backend import triton_forward

    return triton_forward(*args)


def _triton_step(*args, **kwargs):
    """Backend ``"triton"``'s single-token step (:mod:`.triton_step`), imported on first use
    like :func:`_triton_forward`."""
    from .triton_step import triton_step

    return triton_step(*args, **kwargs)


# What inductor compiles its CPU kernels with: $CXX, else the first of these on PATH.
CXX_NAMES = ("g++", "clang++", "c++")


@functools.cache
def cxx_compiler_found() -> bool:
    """Whether a C++ compiler is on PATH (or ``$CXX``). Looked up once: backend ``"compiled"``
    asks on every op call, and the answer is the machine's."""
    return any(shutil.which(name) for name in filter(None, (os.environ.get("CXX"), *CXX_NAMES)))


def _compiled_unavailable(call: OpCall) -> Optional[str]:
    if call.device.type != "cpu":
        return f"it compiles the chunk form's substitution for CPUs, got {call.device} (on CUDA: 'triton')"
    # Inside torch.compile (a compiled decode's draft rows) the compiler is in use already, and a
    # look at the file system would end the graph.
    if not torch.compiler.is_compiling() and not cxx_compiler_found():
        return f"torch.compile needs a C++ compiler on a CPU: set $CXX or install one of {', '.join(CXX_NAMES)}"
    return None


def _triton_unavailable(call: OpCall) -> Optional[str]:
    if not triton_available():
        return "it needs the triton package (pip install triton)"
    if call.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"it runs on CUDA tensors, got {call.device} (on CPU set TRITON_INTERPRET=1 before importing "
                "triton: slow, for tests)")
    return None


def _triton_unsupported(call: OpCall) -> Optional[str]:
    if call.dtype == torch.float64:
        return "its kernels compute in float32, the inputs are float64"
    if call.settings.get("compress_fn") == "identity":
        # identity's residual is taken at the current memory: its chunk form needs a triangular
        # solve per chunk (design page, section 2) that the kernels and their backward lack.
        return "its chunk kernels take each write's residual at the chunk's anchor, compress_fn='identity' at the current memory"
    return None


# Every name is registered whatever is installed, so a config naming a backend loads everywhere;
# whether it can run is asked per call.
BACKENDS = BackendRegistry(
    "trellis_attention",
    Backend("reference", reference_forward, priority=0),
    Backend("torch", chunked_forward, priority=1, step=step_forward),
    # Named only (it compiles on first use, for tens of seconds): a server's or a long job's choice.
    Backend("compiled", functools.partial(chunked_forward, compiled=True), priority=0, step=step_forward,
            unavailable=_compiled_unavailable, auto_devices=()),
    Backend("triton", _triton_forward, priority=2, step=_triton_step, unavailable=_triton_unavailable,
            unsupported=_triton_unsupported, auto_devices=("cuda",)),
    # Built on first use (about a second); training and compiled graphs run "torch" through it.
    Backend("native", native_forward, priority=2, step=native_step, unavailable=native_unavailable,
            auto_devices=("cpu",)),
)

InitialState = Union[None, TrellisState, Sequence[torch.Tensor]]


def _initial_state(
    initial_state: InitialState, rows: int, heads: int, slots: int, dk: int, dv: int,
    chunk_size: int, dtype: torch.dtype, device: torch.device, check_values: bool = True,
) -> TrellisState:
    """Turn ``None``, a pair or a :class:`TrellisState` into a checked state in ``dtype`` (its
    offsets' range read back only with ``check_values``)."""
    k_shape, v_shape = (rows, heads, slots, dk), (rows, heads, slots, dv)
    k_meaning, v_meaning = "[N, H, M, Dk]", "[N, H, M, Dv]"
    if initial_state is None:
        zeros_k = torch.zeros(k_shape, dtype=dtype, device=device)
        zeros_v = torch.zeros(v_shape, dtype=dtype, device=device)
        return TrellisState.at_chunk_start(zeros_k, zeros_v)
    if isinstance(initial_state, TrellisState):
        state = initial_state
    elif isinstance(initial_state, (tuple, list)) and len(initial_state) == 2:
        state = TrellisState.at_chunk_start(*initial_state)
    else:
        raise ValueError(
            "initial_state must be None, a pair (m_k, m_v) or a TrellisState, "
            f"got {type(initial_state).__name__}"
        )
    for name, shape, meaning in (
        ("m_k", k_shape, k_meaning), ("anchor_k", k_shape, k_meaning),
        ("m_v", v_shape, v_meaning), ("anchor_v", v_shape, v_meaning),
    ):
        expect_shape(f"initial_state.{name}", getattr(state, name), shape,
                     lambda meaning=meaning: f"{meaning} with N = {rows} sequences")
    return checked_offsets_state(state, rows, chunk_size, dtype, device, check_values)


def trellis_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    log_beta: torch.Tensor,
    gamma: torch.Tensor,
    *,
    initial_state: InitialState = None,
    chunk_size: int = CHUNK_SIZE,
    compress_fn: str = COMPRESS_FN,
    mix_fn: str = MIX_FN,
    write_gradient: str = WRITE_GRADIENT,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, Optional[TrellisState]]:
    """The Trellis two-pass memory op (design page, sections 1-3).

    Args:
        q, k: ``[B, T, H, Dk]`` queries and keys (the layer L2-normalises them).
        v: ``[B, T, H, Dv]`` values.
        alpha: ``[B, T, H, M]`` compression targets over the M slots.
        log_beta: ``[B, T, H]`` log forget gates in ``[-inf, 0]`` (-inf: a full forget).
        gamma: ``[B, T, H]`` inner learning rates, finite and >= 0.
            Gates out of range (or NaN) raise a ``ValueError``; the check reads two numbers
            back from the device, and is skipped inside ``torch.compile``.
        Non-finite q, k, v or alpha are not checked; how far one reaches (with a chunk form,
        back to the start of its chunk) is stated in the design page, section 3.
        B = 0 (an empty batch) is allowed and gives an empty ``o`` and the empty state; T, H,
        M, Dk and Dv must be at least 1 (a ``ValueError`` names the one that is 0).
        initial_state: ``None`` (zero memories), a pair ``(m_k [N,H,M,Dk], m_v [N,H,M,Dv])`` at a
            chunk boundary, or a :class:`TrellisState` returned by an earlier call.
            ``N = B``, or the number of sequences in ``cu_seqlens``.
        chunk_size: C >= 1. With ``write_gradient="exact"`` it is not part of the function, and
            the backends lay the tokens out in chunks of their own (torch: ``EXACT_LAYOUT_CHUNK``
            of :mod:`.chunked`; Triton: ``EXACT_CHUNK`` of :mod:`.triton_exact`): C only counts
            the offset of the state handed back. With ``"anchored"`` it is part of the function
            (1 is the exact recurrence).
        compress_fn: ``"identity"``, ``"l2norm"`` or ``"layernorm"``.
        mix_fn: ``"ln_silu"``, ``"l2_silu"`` or ``"softmax"``.
        write_gradient: where each write takes its inner gradient (design page, section 1):
            ``"exact"`` (the default, the model's), at the memory just before it (the per-token recurrence at any C; the
            returned state's anchors then equal its memories: nothing reads them), or
            ``"anchored"``, at the memory as it was at its chunk's start (stale inside a chunk;
            every checkpoint saved before ``TrellisConfig.write_gradient`` existed). ``identity``
            computes the same function either way (its residual is taken at the current memory).
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int, with B = 1: N sequences packed along T, each starting
            from its own initial state (zero length allowed: its state passes through).
        backend: a name of :data:`BACKENDS` or ``"auto"``: ``"reference"`` (per-token loop),
            ``"torch"`` (chunk-parallel; with T == 1 and no ``cu_seqlens``, the single-token step
            of :mod:`.step`), ``"triton"`` (GPU kernels: CUDA tensors, or CPU ones under
            ``TRITON_INTERPRET=1``; not float64, not ``compress_fn="identity"``; with T == 1 and
            no ``cu_seqlens``, the single-token step of :mod:`.triton_step`), ``"native"`` (CPU
            tensors where a C compiler is found: the per-token recurrence as a C loop built on
            first use, :mod:`.native`; calls that record gradients, and calls traced by
            ``torch.compile``, run ``"torch"`` through it),
            ``"compiled"``
            (CPU tensors; ``"torch"`` with each forward substitution of ``"exact"`` writes with
            ``layernorm``/``l2norm`` compiled, :mod:`.compiled_substitution`: tens of seconds on
            first use, never picked by ``"auto"``). ``"auto"``
            takes the best backend that can run the call (``"triton"`` for CUDA tensors where it
            imports and supports the call, ``"native"`` for CPU tensors where it builds, else
            ``"torch"``); a named backend that cannot run it
            raises a ``ValueError`` saying why (see :mod:`trellis_lm.ops.registry`).
        check_values: read the gates and ``initial_state.offset`` back to check their ranges (the
            ``ValueError`` above). ``False`` skips that read (a host sync, and a third of a
            decode step's argument checks) for callers whose values are in range by
            construction: the mixers' decode steps, whose gates are sigmoids and log-sigmoids of
            their activations and whose state this op returned. Shapes are checked either way.

    Returns:
        ``o [B, T, H, Dv]`` in q's dtype, and the final :class:`TrellisState` (float32, or
        float64 for float64 inputs) when ``output_final_state`` else ``None``.
    """
    batch, length, heads, dk, dv = expect_qkv(q, k, v)
    expect_dims("alpha", alpha, 4, "[B, T, H, M]")
    slots = alpha.shape[-1]
    expect_shape("alpha", alpha, (batch, length, heads, slots), "[B, T, H, M]")
    expect_per_token_head({"log_beta": log_beta, "gamma": gamma}, batch, length, heads)
    expect_float_inputs({"q": q, "k": k, "v": v, "alpha": alpha, "log_beta": log_beta, "gamma": gamma}, q.device)
    if length == 0:
        raise ValueError("the inputs must hold at least one token (T >= 1)")
    expect_nonzero_sizes(
        {"H": heads, "Dk": dk, "Dv": dv, "M": slots}, "q, k [B, T, H, Dk], v [B, T, H, Dv], alpha [B, T, H, M]"
    )
    # A gate out of range makes the memory grow without bound (NaN within a few hundred tokens).
    if check_values:
        expect_in_range({
            "log_beta": (log_beta, -math.inf, 0.0, "<= 0 (-inf, a full forget, is allowed) and not NaN"),
            "gamma": (gamma, 0.0, sys.float_info.max, "finite and >= 0"),
        })
    check_chunk_size(chunk_size)
    check_names(compress_fn, mix_fn, write_gradient)

    rows = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch, length)
        rows = cu_seqlens.numel() - 1
    dtype = compute_dtype(q)
    call = OpCall(q.device, dtype, length, cu_seqlens is not None,
                  {"compress_fn": compress_fn, "chunk_size": chunk_size, "write_gradient": write_gradient})
    forward = BACKENDS.function(backend, call)
    state = _initial_state(initial_state, rows, heads, slots, dk, dv, chunk_size, dtype, q.device, check_values)
    if rows == 0:  # an empty batch: nothing to compute, and the (empty) state passes through
        return q.new_zeros(v.shape), (state if output_final_state else None)
    inputs = [as_dtype(t, dtype, q.device) for t in (q, k, v, alpha, log_beta, gamma)]
    with in_compute_dtype(q.device):
        o, final = forward(*inputs, state, chunk_size, compress_fn, mix_fn, write_gradient, cu_seqlens)
    return as_dtype(o, q.dtype, q.device), (final if output_final_state else None)


def trellis_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
    gamma: torch.Tensor, *, state: TrellisState, chunk_size: int = CHUNK_SIZE, compress_fn: str = COMPRESS_FN,
    mix_fn: str = MIX_FN, write_gradient: str = WRITE_GRADIENT, backend: str = "auto", consume_state: bool = False,
) -> tuple[torch.Tensor, TrellisState]:
    """:func:`trellis_attention` for one token per row after an earlier call, unchecked: what a
    decode step needs and nothing more.

    For callers whose arguments are right by construction (the mixer's decode step): ``q, k
    [N, 1, H, Dk]``, ``v [N, 1, H, Dv]``, ``alpha [N, 1, H, M]``, ``log_beta, gamma [N, 1, H]``
    with their gates in range, all in the state's dtype (float32 or float64) and on its device,
    ``state`` as an earlier call returned it, the settings those of that call, autocast off.
    Nothing of that is checked (the argument checks of :func:`trellis_attention` cost about as
    much as the step on a CPU). Returns ``o [N, 1, H, Dv]`` and the state after the token: the
    numbers of ``trellis_attention(..., initial_state=state, output_final_state=True)``.

    ``consume_state``: the caller reads ``state``'s tensors no more (a server's slots, which the
    state after replaces): the step may write the state after into them and return them. A
    permission: backend ``"native"`` takes it where the tensors can hold the state in place (each
    row dense, no two overlapping); the others return new tensors. Read the returned state either way.
    """
    step = trellis_step_for(q.device, q.dtype, chunk_size=chunk_size, compress_fn=compress_fn, mix_fn=mix_fn,
                            write_gradient=write_gradient, backend=backend)
    return step(q, k, v, alpha, log_beta, gamma, state, consume_state=consume_state)


def trellis_step_for(
    device: torch.device, dtype: torch.dtype, *, chunk_size: int = CHUNK_SIZE, compress_fn: str = COMPRESS_FN,
    mix_fn: str = MIX_FN, write_gradient: str = WRITE_GRADIENT, backend: str = "auto",
) -> Callable[..., tuple[torch.Tensor, TrellisState]]:
    """:func:`trellis_step` for inputs on ``device`` in ``dtype`` (the state's) with these settings,
    its backend chosen now, not at each call: ``step(q, k, v, alpha, log_beta, gamma, state,
    consume_state=False)``. For a loop that steps many times with one model's settings (a decode span)."""
    step = BACKENDS.single_token(backend, device, dtype, compress_fn=compress_fn, chunk_size=chunk_size,
                                 write_gradient=write_gradient)

    def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, log_beta: torch.Tensor,
              gamma: torch.Tensor, state: TrellisState, consume_state: bool = False,
              ) -> tuple[torch.Tensor, TrellisState]:
        return step(q, k, v, alpha, log_beta, gamma, state, chunk_size, compress_fn, mix_fn, write_gradient, None,
                    consume_state)

    return bound
