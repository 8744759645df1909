"""Backend ``"compiled"`` (``ops/trellis/compiled_substitution.py``): the chunk form with each
full-width chunk's forward substitution compiled, against the per-token reference in float64.

Each case compiles once (about 40 s on a 2-core CPU), so the cases are few and each checks
much: exact writes, chunks of the full layout width and inputs whose chunks are all shorter
(eager), T not a multiple of the layout chunk, dims that are not powers of two, mid-chunk
offsets, packed documents, gradients (the forward compiled, the backward the chunk form's own),
and that the compiled kernel ran and did not compile again for another number of (row, head)
pairs, nor for inputs that require no grad after inputs that do.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from op_inputs import make_inputs, make_state
from trellis_lm.ops import trellis_attention
from trellis_lm.ops.registry import OpCall
from trellis_lm.ops.trellis import BACKENDS, chunked, chunked_autograd, dispatch

TOL = dict(rtol=1e-9, atol=1e-9)
GRAD_TOL = dict(rtol=1e-8, atol=1e-9)
STATE = ["m_k", "m_v", "anchor_k", "anchor_v"]


@pytest.fixture
def compiled_calls(monkeypatch) -> list:
    """The (pass, row-head pairs, width) of every compiled substitution the op runs."""
    calls, real = [], chunked_autograd.compiled_substitute

    def counted(name, z, lower, alpha, u, block):
        calls.append(tuple(z.shape[:3]))
        return real(name, z, lower, alpha, u, block)

    monkeypatch.setattr(chunked_autograd, "compiled_substitute", counted)
    return calls


def _outputs(backend, x, state, cf, cu_seqlens=None):
    o, final = trellis_attention(*x, initial_state=state, chunk_size=5, compress_fn=cf, mix_fn="ln_silu",
                                 write_gradient="exact", cu_seqlens=cu_seqlens, output_final_state=True, backend=backend)
    return o, final


def _loss_grads(backend, x, state, cf):
    o, final = _outputs(backend, x, state, cf)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    for name in ("m_k", "m_v"):
        t = getattr(final, name)
        loss = loss + (t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum()
    return torch.autograd.grad(loss, list(x) + [state.m_k, state.m_v])


def test_stacked_chain_forward_and_gradients_match_the_reference(compiled_calls):
    """Dk == Dv (the passes stacked, P = 2), layernorm; T = 75: layout chunks of 32, 32 and 11 (the
    grid's width is its longest chunk's, so the last runs compiled too, with free cells)."""
    x = make_inputs(2, 75, 3, 6, 6, 7, seed=11, requires_grad=True)
    state = make_state(2, 3, 6, 6, 7, chunk_size=5, seed=12, requires_grad=True)
    width = chunked.EXACT_LAYOUT_CHUNK
    assert 75 % width and 75 > 2 * width
    o, final = _outputs("compiled", x, state, "layernorm")
    o_ref, final_ref = _outputs("reference", x, state, "layernorm")
    torch.testing.assert_close(o, o_ref, **TOL)
    for name in STATE:
        torch.testing.assert_close(getattr(final, name), getattr(final_ref, name), **TOL, msg=lambda m: f"{name}: {m}")
    assert compiled_calls == [(2, 6, width)] * 3

    got, expected = _loss_grads("compiled", x, state, "layernorm"), _loss_grads("reference", x, state, "layernorm")
    for i, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, **GRAD_TOL, msg=lambda m: f"gradient {i}: {m}")
    assert len(compiled_calls) == 6
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # inputs that require no grad: the same kernel
        torch.testing.assert_close(_outputs("compiled", x, state, "layernorm")[0], o, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == before

    short = make_inputs(2, 20, 3, 6, 6, 7, seed=13)  # every chunk shorter than the layout's: eager
    torch.testing.assert_close(_outputs("compiled", short, state, "layernorm")[0],
                               _outputs("reference", short, state, "layernorm")[0], **TOL)
    assert len(compiled_calls) == 9  # 6, and the 3 chunks of the call without grad


def test_packed_documents_of_two_chains_match_the_reference_and_compile_once(compiled_calls):
    """Dk != Dv (two chains, P = 1), l2norm, packed documents (one empty, one of a single token,
    two over a layout chunk), then another batch with more documents: no second compilation."""
    def case(lengths, seed):
        x = make_inputs(1, sum(lengths), 2, 5, 3, 6, seed=seed)
        state = make_state(len(lengths), 2, 5, 3, 6, chunk_size=5, seed=seed + 1)
        return x, state, torch.tensor([0] + lengths).cumsum(0)

    torch._dynamo.reset()  # this test's first call compiles: whatever ran before cannot have made NH dynamic
    for lengths, seed in (([40, 0, 1, 33], 21), ([35, 3, 34, 36, 2, 50], 23)):
        x, state, cu = case(lengths, seed)
        before = counters["stats"]["unique_graphs"]
        o, final = _outputs("compiled", x, state, "l2norm", cu)
        if seed == 23:
            assert counters["stats"]["unique_graphs"] == before  # 6 documents reuse the 4 documents' kernel
        o_ref, final_ref = _outputs("reference", x, state, "l2norm", cu)
        torch.testing.assert_close(o, o_ref, **TOL)
        for name in STATE:
            torch.testing.assert_close(getattr(final, name), getattr(final_ref, name), **TOL)
    # Per call: two layout chunks (the longest document's), each through both chains.
    assert compiled_calls == [(1, 8, 32)] * 4 + [(1, 12, 32)] * 4


def test_the_compiled_backend_is_named_only_and_runs_on_cpus():
    call = OpCall(torch.device("cpu"), torch.float32, 64, False, {"compress_fn": "layernorm"})
    assert BACKENDS.choose("auto", call).name != "compiled"
    assert BACKENDS["compiled"].refusal(call) is None
    reason = BACKENDS["compiled"].refusal(OpCall(torch.device("cuda"), torch.float32, 64, False, {}))
    assert "CPUs" in reason and "triton" in reason


@pytest.fixture
def compiler_asked_afresh():
    """The compiler lookup is remembered per process: forgotten before the test and after it."""
    dispatch.cxx_compiler_found.cache_clear()
    yield
    dispatch.cxx_compiler_found.cache_clear()


def test_the_compiled_backend_refuses_in_words_where_no_cxx_compiler_is(monkeypatch, compiler_asked_afresh):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="backend 'compiled' cannot run.*needs a C[+][+] compiler"):
        trellis_attention(*make_inputs(1, 40, 2, 4, 4, 3, seed=5), backend="compiled")
