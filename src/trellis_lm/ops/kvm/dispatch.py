"""The one public entry point of the op: argument checks, state set-up and backend choice."""

from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from ...defaults import (KVM_BUDGET, KVM_BUDGET_EXPONENT, KVM_BUDGET_SATURATION, KVM_BUDGET_SCALE, KVM_CHUNK_SIZE,
                         KVM_SINKS, KVM_STATE_SIZE, KVM_WINDOW_CHUNKS)
from ..checks import (
    as_dtype, check_chunk_size, check_cu_seqlens, compute_dtype, expect_dims, expect_float_inputs, expect_per_token_head, expect_qkv,
    expect_in_range_and_read, expect_shape, in_compute_dtype,
)
from ..registry import Backend, BackendRegistry, OpCall
from .chunked import chunked_forward
from .functions import BUDGETS, KVMConfig
from .reference import reference_forward
from .state import KVMState, covered_after
from .step import step_forward

BACKENDS = BackendRegistry(
    "kvm_attention",
    Backend("reference", reference_forward, priority=0),
    Backend("torch", chunked_forward, priority=1, step=step_forward),
)



def _expect_int(name: str, value: object, low: int, high: Optional[int] = None, why: str = "") -> int:
    """An int (not a bool) in ``[low, high]``, or a ``ValueError`` naming ``name``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high)
    if not ok:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {bound}{why}, got {value!r}")
    return value


def _expect_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    return float(value)


def _initial_state(initial_state: Optional[KVMState], rows: int, heads: int, dk: int, dv: int,
                   config: KVMConfig, dtype: torch.dtype, device: torch.device) -> KVMState:
    """``None`` or a :class:`KVMState`, its shapes checked against the call (values are checked
    by :func:`check_counters`), converted to ``dtype``."""
    if initial_state is None:  # empty buffers: the backends grow them as the tokens need
        return KVMState.empty(rows, heads, 0, 0, dk, dv, dtype=dtype, device=device)
    if not isinstance(initial_state, KVMState):
        raise ValueError(f"initial_state must be None or a KVMState, got {type(initial_state).__name__}")
    expect_dims("initial_state.keys", initial_state.keys, 4, "[N, H, R, Dk]")
    expect_dims("initial_state.window_k", initial_state.window_k, 4, "[N, H, W', Dk]")
    # Buffers of any size up to (S, W) hold a state (KVMState); keys and window_k give theirs.
    size = min(initial_state.keys.shape[2], config.state_size)
    window = min(initial_state.window_k.shape[2], config.window)
    n = f"N = {rows} sequences"
    rows_like, slots_like = f"R = {size} like initial_state.keys", f"W' = {window} like initial_state.window_k"
    for name, shape, meaning in (
        ("keys", (rows, heads, size, dk), f"[N, H, R, Dk] with {n}, R <= state_size = {config.state_size}"),
        ("values", (rows, heads, size, dv), f"[N, H, R, Dv] with {n}, {rows_like}"),
        ("radii", (rows, heads, size), f"[N, H, R] with {n}, {rows_like}"),
        ("window_k", (rows, heads, window, dk),
         f"[N, H, W', Dk] with {n}, W' <= window_chunks * chunk_size = {config.window}"),
        ("window_v", (rows, heads, window, dv), f"[N, H, W', Dv] with {n}, {slots_like}"),
        ("window_g", (rows, heads, window), f"[N, H, W'] with {n}, {slots_like}"),
        ("used", (rows,), f"[N] with {n}"), ("seen", (rows,), f"[N] with {n}"), ("covered", (rows,), f"[N] with {n}"),
    ):
        expect_shape(f"initial_state.{name}", getattr(initial_state, name), shape, meaning)
    counters = ("used", "seen", "covered")
    for name in counters:
        if getattr(initial_state, name).is_floating_point():
            raise ValueError(f"initial_state.{name} must hold integers, got {getattr(initial_state, name).dtype}")
    return KVMState(**{
        name: as_dtype(tensor, torch.long if name in counters else dtype, device)
        for name, tensor in initial_state.tensors().items()
    })


def check_counters(seen: list[int], covered: list[int], used: list[int], room: tuple[int, int],
                    config: KVMConfig) -> None:
    """The initial state's counters, read back, against each other, the call's sizes and the
    state's buffers ``room = (R, W')``."""
    # The window starts at `covered`: nothing has left it before chunk B started.
    if any(s < 0 for s in seen) or covered != [covered_after(s, config) for s in seen]:
        raise ValueError(
            "initial_state.seen and initial_state.covered disagree with chunk_size and window_chunks: "
            f"seen {seen}, covered {covered}"
        )
    size, window = room
    if any(u > size or (u < config.chunk_size if c > 0 else u != 0) for u, c in zip(used, covered)):
        raise ValueError(
            "initial_state.used must be 0 before the first fold and in [chunk_size, R] after it "
            f"(R = {size}, the rows of initial_state.keys), got {used}"
        )
    if any(s - c > window for s, c in zip(seen, covered)):
        raise ValueError(
            f"initial_state.window_k must hold the window's seen - covered tokens, got {window} slots "
            f"for {[s - c for s, c in zip(seen, covered)]} tokens"
        )


def kvm_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gate: torch.Tensor,
    *,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    temperature: torch.Tensor,
    initial_state: Optional[KVMState] = None,
    chunk_size: int = KVM_CHUNK_SIZE,
    window_chunks: int = KVM_WINDOW_CHUNKS,
    rope_dims: int = 64,
    sinks: int = KVM_SINKS,
    state_size: int = KVM_STATE_SIZE,
    budget: str = KVM_BUDGET,
    budget_scale: float = KVM_BUDGET_SCALE,
    budget_exponent: float = KVM_BUDGET_EXPONENT,
    budget_saturation: float = KVM_BUDGET_SATURATION,
    budget_round: int = 1,
    budget_min: Optional[int] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    check_values: bool = True,
) -> tuple[torch.Tensor, Optional[KVMState]]:
    """Key-Value Means attention (design page ``kvm.md``, sections 1-3).

    Each query attends, in one softmax, to a compressed state (temperature ``t_s``) and a block
    sliding window of the last ``window_chunks`` chunks, its own causally (temperature ``t_w``).
    When a chunk leaves the window it is folded into the state: the least familiar tokens are
    appended as new rows, as the budget allows, and the others are merged, winner take all,
    into their most similar non-sink row.

    Work and memory follow the tokens present and carried, not the sizes asked for: the
    state's buffers grow with the tokens up to ``state_size`` rows and ``W`` window slots
    (:class:`KVMState`), so a short call costs the same at ``chunk_size``, ``window_chunks`` or
    ``state_size`` = 10**9 as at sizes that just hold it.

    Args:
        q, k: ``[B, T, H, Dk]`` as the layer prepared them: LayerNormed, RoPE on the first
            ``rope_dims`` channels.
        v: ``[B, T, H, Dv]``.
        gate: ``[B, T, H]`` merge gates, finite and >= 0 (the page's ``g`` is > 0; 0 is what a
            very negative logit underflows to, in bf16 or float32, and only leaves a row empty).
        norm_weight, norm_bias: ``[H, Dk]`` the affine of ``LN_s``, the state's LayerNorm.
        temperature: ``[H, 2]`` per-head ``(t_s, t_w)``, multiplying state and window keys;
            finite (the page sets no sign: they are learned from 1).
            A gate or temperature out of range (NaN included) raises a ``ValueError``; the
            check reads values back from the device (see ``check_values``).
        initial_state: ``None`` (no tokens seen) or the :class:`KVMState` of an earlier call,
            with ``N = B`` rows, or one per sequence of ``cu_seqlens``. Its counters must agree
            with each other, with ``chunk_size`` and ``window_chunks``, and with its buffers
            (a ``ValueError`` otherwise), buffers of at most ``state_size`` rows and ``W`` slots.
        chunk_size: C >= 1. window_chunks: B >= 1, the window holds W = B C tokens at most.
        rope_dims: R, the rotated channels, zeroed in state keys: even (RoPE turns channel
            pairs) and in ``[0, Dk)``. ``R = Dk`` is refused: every state key would be LN_s of
            a zero vector, the same for every row, and nothing could be found by content.
        sinks: the first ``sinks`` state rows never take merges; ``0 <= sinks < chunk_size``.
        state_size: S >= chunk_size, the most state rows: the budget M of ``"fixed"``, the cap
            of the growable budgets.
        budget: ``"fixed"``; or ``"power_law"`` (``floor(budget_scale * t ** budget_exponent)``
            rows at position t) or ``"saturation"`` (``floor(budget_saturation * t /
            (budget_saturation + t))``), rounded down to a multiple of ``budget_round``, at least
            ``budget_min``; every budget is capped by the tokens covered and by ``state_size``.
            ``budget_scale``, ``budget_exponent``, ``budget_saturation`` > 0; ``budget_round``
            >= 1; ``budget_min`` >= 0, and at most ``state_size`` for the growable budgets (the
            fixed one ignores it); ``None`` means ``chunk_size``, what the first fold seeds
            (upstream: 256 with chunks of 256), as ``TrellisConfig.kvm_budget_min`` does.
        output_final_state: also return the state after the last token.
        cu_seqlens: ``[N + 1]`` int, with B = 1: N sequences packed along T, each from its own
            initial state (a zero-length sequence hands its state back).
        backend: ``"reference"`` (per-token loop), ``"torch"`` (chunked; one token per
            row without ``cu_seqlens`` runs the single-token step of :mod:`.step`, the same
            function) or ``"auto"`` (torch).
        check_values: read the gates, the temperatures and ``initial_state``'s counters back
            (one transfer) to check them (the ``ValueError`` above; skipped inside
            ``torch.compile``). ``False`` skips that read for callers whose values are right by
            construction: the mixer's decode steps, whose gates are ``1 + elu`` of activations
            and whose state this op returned. Shapes are checked either way.

    Returns:
        ``o [B, T, H, Dv]`` in q's dtype, and the final :class:`KVMState` (float32, or float64
        for float64 inputs) when ``output_final_state`` else ``None``.
    """
    batch, length, heads, dk, dv = expect_qkv(q, k, v)
    expect_per_token_head({"gate": gate}, batch, length, heads)
    expect_shape("norm_weight", norm_weight, (heads, dk), "[H, Dk]")
    expect_shape("norm_bias", norm_bias, (heads, dk), "[H, Dk]")
    expect_shape("temperature", temperature, (heads, 2), "[H, 2] (t_s, t_w)")
    expect_float_inputs(
        {"q": q, "k": k, "v": v, "gate": gate, "norm_weight": norm_weight, "norm_bias": norm_bias,
         "temperature": temperature}, q.device,
    )
    if length == 0:
        raise ValueError("the inputs must hold at least one token (T >= 1)")
    check_chunk_size(chunk_size)
    _expect_int("window_chunks", window_chunks, 1)
    _expect_int("rope_dims", rope_dims, 0, dk, " (at most Dk)")
    if rope_dims == dk:
        raise ValueError(
            f"rope_dims must be less than Dk = {dk}: state keys are LN_s of the key with its rotated channels "
            "zeroed, so with every channel rotated every state key is the same vector and nothing can be "
            f"found by content; got {rope_dims}"
        )
    if rope_dims % 2:
        raise ValueError(f"rope_dims must be even (RoPE turns channel pairs (2i, 2i + 1)), got {rope_dims}")
    _expect_int("sinks", sinks, 0, chunk_size - 1, " (fewer than chunk_size)")
    _expect_int("state_size", state_size, chunk_size, why=" (at least chunk_size)")
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    _expect_positive("budget_scale", budget_scale)
    _expect_positive("budget_exponent", budget_exponent)
    _expect_positive("budget_saturation", budget_saturation)
    _expect_int("budget_round", budget_round, 1)
    # A growable budget's floor above its cap would make it the fixed budget in disguise.
    growable = budget != "fixed"
    budget_min = chunk_size if budget_min is None else budget_min
    _expect_int("budget_min", budget_min, 0, state_size if growable else None,
                " (at most state_size, the cap of the growable budgets)" if growable else "")
    forward = BACKENDS.function(backend, OpCall(q.device, compute_dtype(q), length, cu_seqlens is not None))
    config = kvm_config(chunk_size, window_chunks, rope_dims, sinks, state_size, budget, budget_scale, budget_exponent,
                        budget_saturation, budget_round, budget_min)

    rows = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, batch, length)
        rows = cu_seqlens.numel() - 1
    dtype = compute_dtype(q)
    state = _initial_state(initial_state, rows, heads, dk, dv, config, dtype, q.device)
    if check_values:
        # Out-of-range gates or temperatures make the state or the softmax NaN; one read-back
        # checks them and the carried counters together.
        counters = expect_in_range_and_read({
            "gate": (gate, 0.0, sys.float_info.max, "finite and >= 0"),
            "temperature": (temperature, -sys.float_info.max, sys.float_info.max, "finite"),
        }, (state.seen, state.covered, state.used) if initial_state is not None else ())
        if counters:
            check_counters(*counters, state.room, config)
    inputs = [as_dtype(t, dtype, q.device) for t in (q, k, v, gate, norm_weight, norm_bias, temperature)]
    with in_compute_dtype(q.device):
        o, final = forward(*inputs, state, config, cu_seqlens)
    return as_dtype(o, q.dtype, q.device), (final if output_final_state else None)


@functools.lru_cache(maxsize=64)
def kvm_config(chunk_size: int, window_chunks: int, rope_dims: int, sinks: int, state_size: int, budget: str,
               budget_scale: float, budget_exponent: float, budget_saturation: float, budget_round: int,
               budget_min: Optional[int]) -> KVMConfig:
    """The :class:`KVMConfig` of a call's settings (``budget_min`` ``None``: ``chunk_size``),
    remembered: a decode step asks once per layer and token."""
    return KVMConfig(chunk_size, window_chunks, rope_dims, sinks, state_size, budget, float(budget_scale),
                     float(budget_exponent), float(budget_saturation), budget_round,
                     chunk_size if budget_min is None else budget_min)


def kvm_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor, *, state: KVMState,
    norm_weight: torch.Tensor, norm_bias: torch.Tensor, temperature: torch.Tensor, chunk_size: int = KVM_CHUNK_SIZE,
    window_chunks: int = 2, rope_dims: int = 64, sinks: int = 1, state_size: int = 256, budget: str = "fixed",
    budget_scale: float = 16.0, budget_exponent: float = 0.5, budget_saturation: float = 1024.0,
    budget_round: int = 1, budget_min: Optional[int] = None, backend: str = "auto", consume_state: bool = False,
) -> tuple[torch.Tensor, KVMState]:
    """:func:`kvm_attention` for one token per row after an earlier call, unchecked (see
    :func:`~trellis_lm.ops.trellis.trellis_step`: the same contract): ``q, k [N, 1, H, Dk]``,
    ``v [N, 1, H, Dv]``, ``gate [N, 1, H]``, the parameters ``norm_weight, norm_bias [H, Dk]``
    and ``temperature [H, 2]``, all in the state's dtype. Returns ``o [N, 1, H, Dv]`` and the
    state after the token. ``consume_state``: a permission (see there) its step does not take: the
    state after is new tensors."""
    config = kvm_config(chunk_size, window_chunks, rope_dims, sinks, state_size, budget, budget_scale, budget_exponent,
                        budget_saturation, budget_round, budget_min)
    step = BACKENDS.single_token(backend, q.device, q.dtype)
    return step(q, k, v, gate, norm_weight, norm_bias, temperature, state, config, None)
