"""Backend ``"native"`` (``ops/trellis/native.py``, ``recurrence_c.py``): the per-token recurrence as a C
loop built on first use, against the per-token reference in float64: every compression, mixing
function and write rule, states handed in mid-chunk and out again, packed sequences (one of them
empty, or each of one token), odd sizes, strided inputs, several threads; where it hands a call
to ``"torch"`` (one token per row, gradients, ``torch.compile``), and how it says that it cannot
be built.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from op_inputs import make_inputs, make_state
from trellis_lm.ops import native_build, trellis_attention
from trellis_lm.ops.registry import OpCall
from trellis_lm.ops.trellis import BACKENDS, TrellisState, native, trellis_step
from trellis_lm.ops.trellis.chunked import chunked_forward

TOL = dict(rtol=1e-10, atol=1e-10)
STATE = ["m_k", "m_v", "anchor_k", "anchor_v", "offset"]


def _assert_same_call(inputs, reference_kw, **kw):
    """The op's output and state by ``"native"`` equal the reference's."""
    expected = trellis_attention(*inputs, backend="reference", output_final_state=True, **reference_kw, **kw)
    got = trellis_attention(*inputs, backend="native", output_final_state=True, **kw)
    torch.testing.assert_close(got[0], expected[0], **TOL)
    for name in STATE:
        torch.testing.assert_close(getattr(got[1], name), getattr(expected[1], name), **TOL)
    return got[1], expected[1]


@pytest.mark.parametrize("compress_fn, mix_fn, write_gradient", list(itertools.product(
    ["identity", "l2norm", "layernorm"], ["ln_silu", "l2_silu", "softmax"], ["exact", "anchored"])))
def test_every_setting_matches_the_reference_over_two_calls(compress_fn, mix_fn, write_gradient):
    settings = dict(compress_fn=compress_fn, mix_fn=mix_fn, write_gradient=write_gradient, chunk_size=5)
    # T = 13 is no multiple of C = 5, the state resumes mid-chunk, and no dim is a power of two.
    state = make_state(2, 3, 5, 7, 6, chunk_size=5, seed=1)
    first = make_inputs(2, 13, 3, 5, 7, 6, seed=2)
    got, expected = _assert_same_call(first, {}, initial_state=state, **settings)
    second = make_inputs(2, 4, 3, 5, 7, 6, seed=3)  # continues each call's own state
    native_out = trellis_attention(*second, backend="native", initial_state=got, **settings)[0]
    reference_out = trellis_attention(*second, backend="reference", initial_state=expected, **settings)[0]
    torch.testing.assert_close(native_out, reference_out, **TOL)


@pytest.mark.parametrize("write_gradient", ["exact", "anchored"])
def test_packed_sequences_one_of_them_empty_and_single_tokens(write_gradient):
    settings = dict(write_gradient=write_gradient, chunk_size=4)
    state = make_state(4, 2, 6, 6, 5, chunk_size=4, seed=4)
    cu_seqlens = torch.tensor([0, 7, 7, 8, 19])
    got, _ = _assert_same_call(make_inputs(1, 19, 2, 6, 6, 5, seed=5), {}, initial_state=state,
                               cu_seqlens=cu_seqlens, **settings)
    for name in STATE[:4]:  # the empty sequence's state passes through untouched, anchors included
        assert torch.equal(getattr(got, name)[1], getattr(state, name)[1])
    # one token per sequence, packed: the loop's one-token form
    _assert_same_call(make_inputs(1, 4, 2, 6, 6, 5, seed=6), {}, initial_state=state,
                      cu_seqlens=torch.tensor([0, 1, 2, 3, 4]), **settings)


@pytest.mark.parametrize("compress_fn, mix_fn, write_gradient", list(itertools.product(
    ["identity", "l2norm", "layernorm"], ["ln_silu", "l2_silu", "softmax"], ["exact", "anchored"])))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_step_matches_the_reference_in_place_or_not(compress_fn, mix_fn, write_gradient, dtype):
    """The one-token form (a decode step: trellis_step): rows at a chunk start and mid-chunk, Dk = 67
    (vectors of 8 doubles or 16 floats, then a tail), Dv = 5 (a tail alone); given the state up
    (``consume_state``), it writes the state after into the very tensors it was given."""
    settings = dict(compress_fn=compress_fn, mix_fn=mix_fn, write_gradient=write_gradient, chunk_size=3)
    state = make_state(4, 2, 67, 5, 7, chunk_size=3, dtype=dtype, seed=20)
    state.offset = torch.tensor([0, 1, 2, 0])
    inputs = make_inputs(4, 1, 2, 67, 5, 7, dtype=dtype, seed=21)
    in_float64 = TrellisState(state.m_k.double(), state.m_v.double(), state.anchor_k.double(), state.anchor_v.double(),
                              state.offset)
    expected = trellis_attention(*[x.double() for x in inputs], initial_state=in_float64, backend="reference",
                                 output_final_state=True, **settings)
    tol = TOL if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    kept = state.map(torch.clone)
    given = state.map(torch.clone)
    for consume, held in ((False, state), (True, given)):
        o, after = trellis_step(*inputs, state=held, backend="native", consume_state=consume, **settings)
        torch.testing.assert_close(o.double(), expected[0], **tol)
        for name in STATE:
            torch.testing.assert_close(getattr(after, name).double(), getattr(expected[1], name).double(), **tol)
        written = ("m_k", "m_v", "anchor_k", "anchor_v") if write_gradient == "anchored" else ("m_k", "m_v")
        assert all((getattr(after, name) is getattr(held, name)) == consume for name in written)
    for name in STATE:  # the state not given up is as it was
        assert torch.equal(getattr(state, name), getattr(kept, name))


def test_the_step_writes_in_place_only_where_the_state_can_take_it():
    """``consume_state`` is a permission: the step writes in place into the fields of a server's
    slots (one row stride, fields interleaved), not into an expanded initial memory (one row for
    all: the learned parameter) nor into a state whose anchors are its memories."""
    rows, heads, dk, dv, slots = 3, 2, 4, 4, 5
    pages = torch.zeros(6, 4 * 8 * heads * slots * dk + 24, dtype=torch.uint8)
    size = 8 * heads * slots * dk
    fields = [pages[1:1 + rows, i * size:(i + 1) * size].view(torch.float64).view(rows, heads, slots, dk)
              for i in range(4)]
    assert native._writable(fields) and not native._writable([fields[0], fields[0]])
    overlapping = pages[1:1 + rows, size // 2:size // 2 + size].view(torch.float64).view(rows, heads, slots, dk)
    assert not native._writable([fields[0], overlapping])
    inputs = make_inputs(rows, 1, heads, dk, dv, slots, seed=22)
    initial = make_state(1, heads, dk, dv, slots, chunk_size=4, seed=23)
    learned = (initial.m_k[0].clone(), initial.m_v[0].clone())
    for write_gradient in ("exact", "anchored"):
        expanded = TrellisState.at_chunk_start(*(x.expand(rows, -1, -1, -1) for x in (initial.m_k, initial.m_v)))
        assert not native._writable((expanded.m_k,))
        expected = trellis_attention(*inputs, initial_state=expanded, backend="reference", output_final_state=True,
                                     write_gradient=write_gradient, chunk_size=4)
        o, after = trellis_step(*inputs, state=expanded, backend="native", consume_state=True,
                                write_gradient=write_gradient, chunk_size=4)
        torch.testing.assert_close(o, expected[0], **TOL)
        for name in STATE:
            torch.testing.assert_close(getattr(after, name), getattr(expected[1], name), **TOL)
        assert torch.equal(initial.m_k[0], learned[0]) and torch.equal(initial.m_v[0], learned[1])
        # the anchors are the memories (a state at a chunk start): not in place, right numbers
        own = TrellisState.at_chunk_start(expanded.m_k.clone(), expanded.m_v.clone())
        o, after = trellis_step(*inputs, state=own, backend="native", consume_state=True,
                                write_gradient=write_gradient, chunk_size=4)
        torch.testing.assert_close(o, expected[0], **TOL)
        assert (after.m_k is own.m_k) == (write_gradient == "exact")  # exact writes leave the anchors unread
        for name in STATE:
            torch.testing.assert_close(getattr(after, name), getattr(expected[1], name), **TOL)


@pytest.mark.parametrize("write_gradient", ["exact", "anchored"])
def test_memories_wider_than_a_block_of_columns(write_gradient):
    # M = 70 and Dv = 67: a block of 64 columns in vectors, then the rest one by one.
    state = make_state(1, 2, 66, 67, 70, chunk_size=3, seed=15)
    _assert_same_call(make_inputs(1, 7, 2, 66, 67, 70, seed=16), {}, initial_state=state, chunk_size=3,
                      write_gradient=write_gradient)


def test_strided_inputs_and_half_precision():
    q, k, v, alpha, log_beta, gamma = make_inputs(2, 9, 3, 4, 4, 7, seed=7)
    joined = torch.cat([q, k], dim=-1)  # q and k as views of one projection, as the layer has them
    q, k = joined[..., :4], joined[..., 4:]
    v = v.transpose(2, 3).contiguous().transpose(2, 3)  # a last axis of stride H (copied by the backend)
    alpha = alpha.transpose(1, 2).contiguous().transpose(1, 2)  # heads outermost in memory
    _assert_same_call((q, k, v, alpha, log_beta, gamma), {})
    half = [x.to(torch.bfloat16) for x in (q, k, v, alpha, log_beta, gamma)]
    o = trellis_attention(*half, backend="native")[0]
    expected = trellis_attention(*[x.double() for x in half], backend="reference")[0]
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o.double(), expected, rtol=2e-2, atol=2e-2)


def test_several_threads_give_one_thread_s_numbers(monkeypatch):
    inputs = make_inputs(3, 30, 5, 8, 8, 9, dtype=torch.float32, seed=8)
    alone = trellis_attention(*inputs, backend="native", output_final_state=True)
    library, threads_asked = native._recurrence(), []

    class Counted:
        def trellis_recurrence(self, job, f64, threads):
            threads_asked.append(threads)
            return library.trellis_recurrence(job, f64, threads)

    monkeypatch.setattr(native, "_recurrence", Counted)
    monkeypatch.setattr(native, "PAIR_WORK", 1)  # a thread for any work
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        shared = trellis_attention(*inputs, backend="native", output_final_state=True)
        trellis_step(*make_inputs(3, 1, 5, 8, 8, 9, dtype=torch.float32, seed=24), state=shared[1])
    finally:
        torch.set_num_threads(threads)
    assert threads_asked == [4, 1]  # a decode step stays on the calling thread
    # each (row, head) pair is one thread's, run by the same code: the same bits
    assert torch.equal(alone[0], shared[0])
    assert torch.equal(alone[1].m_k, shared[1].m_k) and torch.equal(alone[1].m_v, shared[1].m_v)


def test_auto_takes_it_on_cpus_and_gradients_take_the_chunk_form(monkeypatch):
    assert BACKENDS.choose("auto", OpCall(torch.device("cpu"), torch.float32, 8, False, {})).name == "native"
    calls = []

    def counted(*args):
        calls.append(1)
        return chunked_forward(*args)

    monkeypatch.setattr(native, "chunked_forward", counted)
    inputs = make_inputs(2, 6, 2, 4, 4, 5, seed=9, requires_grad=True)
    state = make_state(2, 2, 4, 4, 5, chunk_size=16, seed=10, requires_grad=True)
    leaves = [*inputs, state.m_k, state.m_v]
    o = trellis_attention(*inputs, initial_state=state, output_final_state=True)[0]
    grads = torch.autograd.grad(o.square().sum(), leaves)
    assert calls == [1]
    o_ref = trellis_attention(*inputs, initial_state=state, output_final_state=True, backend="reference")[0]
    for got, expected in zip(grads, torch.autograd.grad(o_ref.square().sum(), leaves)):
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-9)
    with torch.no_grad():  # the same tensors without a graph: the C loop
        trellis_attention(*inputs, initial_state=state)
    assert calls == [1]


def test_a_compiled_graph_traces_the_torch_form():
    inputs = make_inputs(3, 1, 2, 4, 4, 5, seed=11)
    state = make_state(3, 2, 4, 4, 5, chunk_size=16, seed=12)
    call = OpCall(torch.device("cpu"), torch.float64, 1, False, {})

    def step(*args):
        assert native.native_unavailable(call) is None  # asked while tracing, without a look at the disk
        return native.native_forward(*args, state, 16, "layernorm", "softmax", "exact", None)[0]

    traced = torch.compile(step, backend="eager", fullgraph=True)  # a library call would break the graph
    torch.testing.assert_close(traced(*inputs), trellis_attention(*inputs, initial_state=state, backend="reference")[0],
                               **TOL)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache folder of the test's own, the build looked up afresh, and forgotten afterwards."""
    monkeypatch.setenv("TRELLIS_LM_CACHE", str(tmp_path))
    native_build.load.cache_clear()
    native._recurrence.cache_clear()
    yield tmp_path
    native_build.load.cache_clear()
    native._recurrence.cache_clear()


def test_it_builds_once_into_the_cache_folder(fresh_build):
    inputs = make_inputs(1, 3, 1, 4, 4, 3, seed=13)
    trellis_attention(*inputs, backend="native")
    built = sorted(p.suffix for p in fresh_build.iterdir())
    assert built == [".c", ".so"]  # the source and its build, no partial files left
    trellis_attention(*inputs, backend="native")
    assert sorted(p.suffix for p in fresh_build.iterdir()) == built


@pytest.mark.parametrize("cc, reason", [("/nonexistent/cc", "no C compiler: set $CC"),
                                        ("false", "could not build trellis_recurrence.c")])
def test_without_a_working_compiler_it_is_refused_in_words(fresh_build, monkeypatch, cc, reason):
    monkeypatch.setenv("CC", cc)
    inputs = make_inputs(1, 3, 1, 4, 4, 3, seed=14)
    with pytest.raises(ValueError, match=f"backend 'native' cannot run .*{re.escape(reason)}"):
        trellis_attention(*inputs, backend="native")
    # auto takes the chunk form instead
    torch.testing.assert_close(trellis_attention(*inputs)[0], trellis_attention(*inputs, backend="reference")[0],
                               **TOL)
