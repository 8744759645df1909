"""The plugin's CPU version of vLLM's align-mode state copies (trellis_lm.integrations.vllm.
align_copies) against the kernels' semantics written out with tensor indexing, on synthetic
block tables and states: whole ("temporal") states, and convolution windows in both layouts.
Needs no vLLM (the module imports it only to register the copies)."""

from __future__ import annotations

import pytest
import torch

from trellis_lm.integrations.vllm.align_copies import postprocess, precopy

BLOCKS, WIDTH, DIM = 16, 4, 3


def states(dim_first: bool):
    """A temporal state and a conv window per block, seeded, and the kernels' metadata of both."""
    generator = torch.Generator().manual_seed(int(dim_first))
    temporal = torch.randn(BLOCKS, 2, 5, generator=generator)
    conv = torch.randn(BLOCKS, *((DIM, WIDTH) if dim_first else (WIDTH, DIM)), generator=generator)
    table = torch.randperm(BLOCKS, generator=generator)[:12].to(torch.int32).view(3, 4)  # 3 requests, 4 columns
    metadata = dict(
        block_table_ptrs=torch.tensor([table.data_ptr()]), block_table_stride_req=table.stride(0),
        state_base_addrs=torch.tensor([temporal.data_ptr(), conv.data_ptr()]),
        state_block_strides=torch.tensor([temporal.stride(0) * 4, conv.stride(0) * 4]),
        state_elem_sizes=torch.tensor([4, 4]),
        state_inner_sizes=torch.tensor([temporal[0].numel(), 1 if dim_first else conv.stride(1)]),
        state_conv_widths=torch.tensor([0, WIDTH]), state_group_indices=torch.tensor([0, 0]),
        state_dim_row_count=torch.tensor([0, DIM if dim_first else 0]),
        state_dim_row_stride=torch.tensor([0, conv.stride(1) * 4 if dim_first else 0]),
    )
    return temporal, conv, table, metadata


def expected_copy(temporal, conv, table, row, src, dst, bias, dim_first):
    """The kernels' copy: the temporal state from column ``src + bias``; the conv window from
    column ``src`` shifted by ``bias`` tokens (its first ``WIDTH - bias`` entries)."""
    temporal[table[row, dst]] = temporal[table[row, src + bias]].clone()
    window = conv[table[row, src]].clone()
    if dim_first:
        conv[table[row, dst], :, : WIDTH - bias] = window[:, bias:]
    else:
        conv[table[row, dst], : WIDTH - bias] = window[bias:]


def arguments(metadata):
    return [metadata[name] for name in (
        "block_table_ptrs", "block_table_stride_req", "state_base_addrs", "state_block_strides", "state_elem_sizes",
        "state_inner_sizes", "state_conv_widths", "state_group_indices", "state_dim_row_count", "state_dim_row_stride")]


@pytest.mark.parametrize("dim_first", [False, True])
def test_precopy_moves_the_last_accepted_state_to_the_block_a_step_runs_in(dim_first):
    temporal, conv, table, metadata = states(dim_first)
    want_temporal, want_conv = temporal.clone(), conv.clone()
    # Request 0 is fresh (-1), request 1 stays in its block, request 2 moves on from column 0
    # with two tokens of its last row accepted (bias 1).
    state_idx, src_col, bias = torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]), torch.tensor([0, 2, 1])
    expected_copy(want_temporal, want_conv, table, 2, 0, 3, 1, dim_first)
    precopy(state_idx, src_col, bias, *arguments(metadata), None, 3, COPY_BLOCK_SIZE=1024,
            CONV_STATE_DIM_FIRST=dim_first, HAS_IDX_MAPPING=False, TEMPORAL_TILES=16)
    assert torch.equal(temporal, want_temporal) and torch.equal(conv, want_conv)


@pytest.mark.parametrize("dim_first", [False, True])
def test_postprocess_keeps_the_state_at_a_boundary_the_accepted_tokens_crossed(dim_first):
    temporal, conv, table, metadata = states(dim_first)
    want_temporal, want_conv = temporal.clone(), conv.clone()
    block = 8
    # Request 0: a row of 4 from token 14 (running block 1 holds the state after 15), 3 kept:
    # computed 17, the boundary at 16 is the running block's second column (bias 1), kept in
    # block 1 (the one ending at 16): its own running block, so its accepted count becomes 1.
    # Request 1: running block 2 holds the state after 17; 2 kept: 18 < 24, nothing.
    # Request 2: a row of 4 from token 22: running block 2 (after 23), 4 kept: computed 26, the
    # boundary 24 is column 2 + 1, kept in block 2 (ends at 24): the running block itself.
    accepted = torch.tensor([3, 2, 4], dtype=torch.int32)
    state_idx = torch.tensor([1, 2, 2])
    scheduled, computed, drafts = torch.tensor([4, 4, 4]), torch.tensor([14, 16, 22]), torch.tensor([3, 3, 3])
    out = accepted.clone()
    expected_copy(want_temporal, want_conv, table, 0, 1, 1, 1, dim_first)
    expected_copy(want_temporal, want_conv, table, 2, 2, 2, 1, dim_first)
    postprocess(accepted, state_idx, scheduled, computed, drafts, *arguments(metadata), out, None, 3, block_size=block,
                COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first, TEMPORAL_TILES=16)
    assert torch.equal(temporal, want_temporal) and torch.equal(conv, want_conv)
    assert out.tolist() == [1, 2, 1]
    # vLLM's other runner (counts given after the step, requests by idx_mapping): running block 2
    # holds the state after 15, 3 kept (computed 17): the state after 16, a column on, goes back to
    # block 1, which ends at 16.
    temporal, conv, table, metadata = states(dim_first)
    want_temporal, want_conv = temporal.clone(), conv.clone()
    expected_copy(want_temporal, want_conv, table, 0, 2, 1, 1, dim_first)
    out = torch.tensor([3, 1, 1], dtype=torch.int32)
    postprocess(torch.tensor([3, 1, 1], dtype=torch.int32), torch.tensor([2, 0, 0]), None, torch.tensor([17, 0, 0]),
                None, *arguments(metadata), out, torch.tensor([0, -1, -1]), 1, block_size=block,
                COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=dim_first, PRECOMPUTED_NEW_COMPUTED=True, TEMPORAL_TILES=16)
    assert torch.equal(temporal, want_temporal) and torch.equal(conv, want_conv)
    assert out.tolist() == [3, 1, 1]
