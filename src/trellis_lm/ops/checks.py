"""Argument checks shared by every op's dispatcher, so all ops word their errors alike."""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch


def expect_shape(name: str, tensor: object, shape: tuple, meaning: Union[str, Callable[[], str]]) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``tensor`` is a tensor of exactly ``shape``.

    ``meaning`` (the shape in words) may be a function that writes it, called only for the error:
    words holding a size (``N = {rows}``) would fix that size, in a compiled function, to the one
    it was traced with (formatting a symbolic size makes it a constant)."""
    if not isinstance(tensor, torch.Tensor):
        meaning = meaning() if callable(meaning) else meaning
        raise ValueError(f"{name} must be a torch.Tensor of shape {meaning}, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        meaning = meaning() if callable(meaning) else meaning
        raise ValueError(f"{name} must have shape {meaning} = {tuple(shape)}, got {tuple(tensor.shape)}")


def expect_dims(name: str, tensor: object, dims: int, meaning: str) -> None:
    """Raise a ``ValueError`` naming ``name`` unless ``tensor`` is a ``dims``-D tensor."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a {dims}-D tensor {meaning}, got {got}")


def expect_qkv(q: object, k: object, v: object, key_dim: str = "Dk", value_dim: str = "Dv") -> tuple[int, ...]:
    """``q``, ``k`` of shape ``[B, T, H, key_dim]`` and ``v`` of ``[B, T, H, value_dim]`` (a
    ``ValueError`` names the first that is not); returns ``(B, T, H, Dk, Dv)``."""
    expect_dims("q", q, 4, f"[B, T, H, {key_dim}]")
    batch, length, heads, dk = q.shape
    expect_dims("v", v, 4, f"[B, T, H, {value_dim}]")
    dv = v.shape[-1]
    expect_shape("k", k, (batch, length, heads, dk), f"[B, T, H, {key_dim}] like q")
    expect_shape("v", v, (batch, length, heads, dv), f"[B, T, H, {value_dim}]")
    return batch, length, heads, dk, dv


def expect_per_token_head(tensors: dict[str, object], batch: int, length: int, heads: int) -> None:
    """Each of ``tensors`` (gates and step sizes, by name) of shape ``[B, T, H]``."""
    for name, tensor in tensors.items():
        expect_shape(name, tensor, (batch, length, heads), "[B, T, H]")


def checked_offsets_state(state, rows: int, chunk_size: int, dtype: torch.dtype, device: torch.device,
                          check_values: bool):
    """A chunk-anchored state (its ``offset`` within the chunk, float tensors otherwise) whose
    shapes the caller checked: its offsets' range read back only with ``check_values``, then
    every float tensor in ``dtype`` on ``device``."""
    if check_values:
        check_offsets("initial_state.offset", state.offset, rows, chunk_size)
    return state.map(lambda t: as_dtype(t, torch.long if t is state.offset else dtype, device))


def expect_float_inputs(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Every input floating point and on ``device`` (the first input's)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {device}; put all inputs on one device")


def check_chunk_size(chunk_size: object) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    return chunk_size


def check_cu_seqlens(cu_seqlens: object, batch: int, length: int) -> torch.Tensor:
    """``[N + 1]`` non-decreasing offsets from 0 to T, with a batch of 1; returned as int64."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [N + 1] of sequence start offsets")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
        raise ValueError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 (sequences packed along T), got batch size {batch}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != length or any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        raise ValueError(
            f"cu_seqlens must rise from 0 to T = {length} without decreasing, got {bounds[:8]}"
            + ("..." if len(bounds) > 8 else "")
        )
    return cu_seqlens.to(dtype=torch.long)


def check_offsets(name: str, offset: torch.Tensor, rows: int, chunk_size: int) -> None:
    """A state's per-row position within its chunk: int64-like ``[N]`` in ``[0, chunk_size)``."""
    expect_shape(name, offset, (rows,), lambda: f"[N] with N = {rows} sequences")
    if offset.is_floating_point():
        raise ValueError(f"{name} must hold integers, got {offset.dtype}")
    # Reading values back cannot be compiled; a compiled decode step is fed states this op made.
    if rows and not torch.compiler.is_compiling():
        lowest, highest = (int(x) for x in offset.aminmax())
        if lowest < 0 or highest >= chunk_size:
            raise ValueError(f"{name} must lie in [0, chunk_size = {chunk_size}), got {offset.tolist()}")


def expect_nonzero_sizes(sizes: dict[str, int], meaning: str) -> None:
    """Raise a ``ValueError`` naming the first of ``sizes`` (dim name -> size) that is 0."""
    for name, size in sizes.items():
        if size == 0:
            raise ValueError(f"{name} must be at least 1 ({meaning}), got 0")


def expect_in_range(bounds: dict[str, tuple[torch.Tensor, float, float, str]]) -> None:
    """Every element of each tensor within ``[low, high]`` (NaN is outside), else a ``ValueError``
    naming it. ``bounds``: name -> (tensor, low, high, what the range means in words).

    One min/max reduction per tensor and a single read-back for all of them. Reading values
    back cannot be compiled, so a compiled graph skips the check (like :func:`check_offsets`).
    """
    bounds = {name: b for name, b in bounds.items() if b[0].numel()}
    if not bounds or torch.compiler.is_compiling():
        return
    with torch.no_grad():
        extremes = torch.stack([x for t, *_ in bounds.values() for x in torch.aminmax(t)]).tolist()
    _raise_out_of_range(bounds, extremes)


def expect_in_range_and_read(
    bounds: dict[str, tuple[torch.Tensor, float, float, str]], read: Sequence[torch.Tensor],
) -> Optional[list[list[int]]]:
    """:func:`expect_in_range`, also reading the integer tensors ``read`` (on the checked
    tensors' device) back in the same transfer: a caller that checks values and needs counters
    on the host waits on the device once, not twice.

    Returns the values of each tensor of ``read`` as a flat list of ints (exact below 2**53:
    they travel as float64, like the extremes), or ``None`` inside a compiled graph, which
    reads nothing back and so checks nothing.
    """
    if torch.compiler.is_compiling():
        return None
    bounds = {name: b for name, b in bounds.items() if b[0].numel()}
    with torch.no_grad():
        parts = [x.to(torch.float64).view(1) for t, *_ in bounds.values() for x in torch.aminmax(t)]
        parts += [t.to(torch.float64).flatten() for t in read]
        values = torch.cat(parts).tolist() if parts else []
    _raise_out_of_range(bounds, values[: 2 * len(bounds)])
    out, start = [], 2 * len(bounds)
    for t in read:
        out.append([int(x) for x in values[start : start + t.numel()]])
        start += t.numel()
    return out


def _raise_out_of_range(bounds: dict[str, tuple[torch.Tensor, float, float, str]], extremes: list[float]) -> None:
    """The ``ValueError`` of :func:`expect_in_range` for the first tensor whose ``(min, max)``
    (consecutive in ``extremes``) leaves its range."""
    for (name, (_, low, high, meaning)), lowest, highest in zip(bounds.items(), extremes[0::2], extremes[1::2]):
        if not (low <= lowest and highest <= high):  # also true for NaN
            raise ValueError(f"{name} must be {meaning}, got values in [{lowest}, {highest}]")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """States and op arithmetic: float64 for float64 inputs, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``tensor.to(device, dtype)``, skipping the no-op conversion (measurable when decoding one
    token per call)."""
    return tensor if tensor.dtype == dtype and tensor.device == device else tensor.to(device=device, dtype=dtype)


def in_compute_dtype(device: torch.device) -> torch.autocast:
    """The context an op's backend runs in: autocast off, so an op called inside an autocast
    region (a bf16 Trainer step) computes its products and float32 states in its compute dtype
    (:func:`compute_dtype`) rather than in the region's lower precision."""
    return torch.autocast(device.type, enabled=False)
