"""How far a non-finite input reaches (design page, section 3): its own output and every later
one, and with a chunk form the earlier outputs of its chunk, never an output before the chunk."""

from __future__ import annotations

import pytest
import torch

from op_inputs import make_inputs, make_state
from trellis_lm.ops import TrellisState, trellis_attention
from trellis_lm.ops.trellis.chunked import EXACT_LAYOUT_CHUNK
from trellis_lm.ops.trellis.dispatch import triton_available

T = 21


def _first_nonfinite(backend, where, name, dtype=torch.float64, device="cpu", **kw):
    """The first position whose output is not finite, with a NaN at position ``where`` of input
    ``name`` (row 0, every head) and row 1 left alone; row 1's outputs must stay finite."""
    q, k, v, alpha, log_beta, gamma = make_inputs(2, T, 2, 3, 4, 5, seed=where, dtype=dtype)
    x = dict(q=q, k=k, v=v, alpha=alpha)
    x[name] = x[name].clone()
    x[name][0, where] = float("nan")
    state = make_state(2, 2, 3, 4, 5, chunk_size=kw.get("chunk_size", 1), dtype=dtype)
    state = TrellisState(*(t for name_, t in state.tensors().items() if name_ != "offset"), torch.zeros(2, dtype=torch.long))
    inputs = [t.to(device) for t in (x["q"], x["k"], x["v"], x["alpha"], log_beta, gamma)]
    o, _ = trellis_attention(*inputs, initial_state=state.map(lambda t: t.to(device)), backend=backend, **kw)
    finite = o.isfinite().flatten(2).all(-1)  # [B, T]
    assert finite[1].all()
    bad = (~finite[0]).nonzero()
    if name == "q":  # read by its own output only
        assert bad.flatten().tolist() == [where]
    else:  # written into the memories: every later output
        assert bad.numel() and bool((~finite[0, int(bad[0]):]).all())
    return int(bad[0])


@pytest.mark.parametrize("name", ["k", "alpha", "v", "q"])
@pytest.mark.parametrize("where", [0, 9, 20])
@pytest.mark.parametrize("write_gradient", ["anchored", "exact"])
def test_a_nan_reaches_back_to_its_chunk_start_and_no_further(name, where, write_gradient):
    """The torch chunk form at C = 8 (exact writes: in its chunks of EXACT_LAYOUT_CHUNK tokens): the
    first non-finite output is the start of the NaN's chunk (a query's NaN stays in its own
    output); anchored C = 1 and the reference: the NaN's own position."""
    kw = dict(write_gradient=write_gradient)
    chunk = 8 if write_gradient == "anchored" else EXACT_LAYOUT_CHUNK  # exact: the path's own layout
    start = where if name == "q" else where // chunk * chunk
    assert _first_nonfinite("torch", where, name, chunk_size=8, **kw) == start
    if write_gradient == "anchored":
        assert _first_nonfinite("torch", where, name, chunk_size=1, **kw) == where
    assert _first_nonfinite("reference", where, name, chunk_size=8, **kw) == where


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("write_gradient,chunk_start", [("anchored", lambda t: t // 8 * 8), ("exact", lambda t: 0)])
def test_a_nan_in_the_triton_kernels_reaches_its_kernel_chunk(write_gradient, chunk_start):
    """The anchored kernels' chunks are C tokens of the stream; the exact kernels' are 64 tokens
    of the call (EXACT_CHUNK), so at T = 21 everything before the NaN too. (Without a GPU the
    kernels run in the interpreter: conftest.py.)"""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    first = _first_nonfinite("triton", 13, "k", dtype=torch.float32, device=device, chunk_size=8,
                             write_gradient=write_gradient)
    assert first == chunk_start(13)
