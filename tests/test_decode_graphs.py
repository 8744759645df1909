"""``compile_decode`` on a GPU: a decode step's runs of memory blocks (an all-memory model's whole
step, embedding to logits) replayed from CUDA graphs (trellis_lm.compiled_decode).

A CUDA graph needs a GPU (``tests/test_on_cuda.py`` runs the real one). Here the capture is
replaced by one that records the step and replays it by running it again and writing its
results where the captured outputs are, as a graph's replay does: everything else (the static
buffers for the tokens and the entries, the two sets a replay reads and writes in turn, the
copies in and the copies a cache is given, which runs are captured and when, what the cache is
handed) is the code a GPU runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_generation import DECODE_PIECES, DECODE_RUNS, eager_and_compiling, logits_in_pieces
from tiny_models import random_tokens, tiny_model
from trellis_lm import TrellisCache
from trellis_lm.compiled_decode import CompiledSegments, DecodeGraphs, entry_tensors, inference_span


class ReplayingCapture:
    """A stand-in for ``capture_cuda_graph``: counts captures and replays; a replay reruns the
    step (whose own writes into the other set of buffers are a graph's) and writes its results
    where the capture's outputs are (a graph's fixed addresses)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def __call__(self, fn):
        self.captures += 1
        outputs = fn()
        capture = self

        class Graph:
            def replay(self) -> None:
                capture.replays += 1
                for into, new in zip(outputs, fn()):
                    into.copy_(new)

        return Graph(), outputs


def graphs_of(model) -> DecodeGraphs:
    return model.model.decode_plan.runner


def held(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.tensors().values()]


@pytest.mark.parametrize(("schedule", "overrides", "runs"), DECODE_RUNS)
def test_replayed_steps_equal_eager(schedule, overrides, runs):
    eager, graphed, ids = eager_and_compiling(schedule, overrides)
    capture = ReplayingCapture()
    with torch.no_grad(), inference_span(graphed, capture=capture):
        replayed = logits_in_pieces(graphed, ids, DECODE_PIECES)
        assert len(graphs_of(graphed).segments) == len(runs)
    # One graph per run of memory blocks and set of buffers it reads, captured on the first two
    # steps, replayed on every step; the prefill ran eagerly; the graphs are gone with the span.
    assert capture.captures == 2 * len(runs) and capture.replays == len(runs) * 8
    assert graphed.model.decode_plan is None
    torch.testing.assert_close(replayed, logits_in_pieces(eager, ids, DECODE_PIECES), rtol=1e-12, atol=1e-12)


def test_generate_replays_and_leaves_the_cache_of_eager_steps():
    model = tiny_model(seed=8, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 6, seed=3)
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    eager = model.generate(ids, **settings)
    model.config.compile_decode = True
    capture = ReplayingCapture()
    with inference_span(model, capture=capture):  # generate's own span keeps this one
        out = model.generate(ids, **settings)
    assert torch.equal(out.sequences, eager.sequences)
    assert capture.captures == 2 * 2 and capture.replays == 2 * 9
    for mine, theirs in zip(out.past_key_values.layers, eager.past_key_values.layers):
        for name, tensor in mine.tensors().items():
            torch.testing.assert_close(tensor, theirs.tensors()[name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_decoding_mode_replays_the_eager_tokens():
    # Greedy, beam search, prompt lookup and another model's drafts (caches that record their calls:
    # steps are handed copies, and a crop replays them), sampling: float64, so every choice is the
    # eager one.
    model, drafter = tiny_model(seed=10, dtype=torch.float64), tiny_model(seed=11, dtype=torch.float64)
    ids, one = random_tokens(2, 5, seed=6), random_tokens(1, 4, seed=7).repeat(1, 3)

    def every_mode():
        outputs = [model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False),
                   model.generate(ids[:1], max_new_tokens=6, min_new_tokens=6, num_beams=2, do_sample=False),
                   model.generate(one, max_new_tokens=6, min_new_tokens=6, prompt_lookup_num_tokens=2, do_sample=False),
                   model.generate(one, max_new_tokens=6, min_new_tokens=6, assistant_model=drafter, do_sample=False)]
        torch.manual_seed(12)
        return outputs + [model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0)]

    eager = every_mode()
    for m in (model, drafter):
        m.config.compile_decode = True
    capture = ReplayingCapture()
    with inference_span(model, capture=capture), inference_span(drafter, capture=capture):
        graphed = every_mode()
        # Prompt lookup's steps without a draft: a recording cache, handed copies.
        recording = [s for s in graphs_of(model).segments.values() if (0, True) in s.graphs]
    for mode, got, want in zip(("greedy", "beam", "prompt lookup", "assisted", "sampling"), graphed, eager):
        assert torch.equal(got, want), mode
    assert recording


def test_a_cache_holds_a_set_of_buffers_alone():
    # Steps of one cache read one set of buffers and hand the cache the other, no copy. Another
    # cache's step gives the first one copies before a set it holds is written: its entries keep
    # their values, and each cache continues as it would alone.
    model = tiny_model(seed=3, dtype=torch.float64)
    eager = copy.deepcopy(model)
    model.config.compile_decode = True
    a, b = random_tokens(2, 7, seed=1), random_tokens(2, 7, seed=2)
    capture = ReplayingCapture()

    def sets_held(graphed, cache):
        tensors = {id(t) for t in held(cache)}
        return [all(id(t) in tensors for t in buffers) for buffers in graphed.sets]

    with torch.no_grad(), inference_span(model, capture=capture):
        first, second = TrellisCache(model.config), TrellisCache(model.config)
        model(a[:, :4], past_key_values=first)
        model(a[:, 4:5], past_key_values=first)
        (graphed,) = graphs_of(model).segments.values()
        assert sets_held(graphed, first) == [False, True]
        model(a[:, 5:6], past_key_values=first)  # reads the set it holds, writes the other
        assert sets_held(graphed, first) == [True, False]
        kept = [t.clone() for t in held(first)]
        model(b[:, :4], past_key_values=second)
        model(b[:, 4:5], past_key_values=second)  # copied into the first set: `first` gets a copy first
        assert sets_held(graphed, first) == [False, False] and sets_held(graphed, second) == [False, True]
        for before, now in zip(kept, held(first)):
            assert torch.equal(before, now)
        steps = [model(a[:, 6:7], past_key_values=first).logits, model(b[:, 5:6], past_key_values=second).logits]
    want = [logits_in_pieces(eager, a, [4, 1, 1, 1])[:, -1:], logits_in_pieces(eager, b[:, :6], [4, 1, 1])[:, -1:]]
    for got, expected in zip(steps, want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_two_caches_taking_turns_and_a_reordered_cache():
    model = tiny_model(seed=6, dtype=torch.float64, schedule="hybrid", head_dim=6)
    graphed = copy.deepcopy(model)
    graphed.config.compile_decode = True
    a, b = random_tokens(3, 9, seed=4), random_tokens(3, 7, seed=5)

    def turns(m):
        caches, logits = [TrellisCache(m.config), TrellisCache(m.config)], []
        for cache, ids in zip(caches, (a, b)):
            m(ids[:, :4], past_key_values=cache)
        for step in range(3):
            for cache, ids in zip(caches, (a, b)):
                logits.append(m(ids[:, 4 + step : 5 + step], past_key_values=cache).logits)
        caches[0].reorder_cache(torch.tensor([2, 0, 1]))  # beam search's reordering: new tensors
        logits.append(m(a[:, 7:8], past_key_values=caches[0]).logits)
        return torch.cat(logits, dim=1)

    capture = ReplayingCapture()
    with torch.no_grad(), inference_span(graphed, capture=capture):
        replayed = turns(graphed)
    # Caches taking turns are copied into the first set each step: one graph per run.
    assert capture.captures == 2 and capture.replays == 2 * 7
    torch.testing.assert_close(replayed, turns(model), rtol=1e-12, atol=1e-12)


def test_a_step_failing_after_a_replay_leaves_the_cache_as_it_was(monkeypatch):
    # The hybrid's attention block fails after its first run was replayed: that run wrote the set
    # of buffers the cache does not hold, so the cache keeps its entries before, and its next
    # step gives what a step that never failed gives.
    model = tiny_model(seed=5, dtype=torch.float64, schedule="hybrid", head_dim=6)
    eager = copy.deepcopy(model)
    model.config.compile_decode = True
    ids = random_tokens(2, 7, seed=8)
    attention = type(model.model.layers[2].self_attn)
    forward = attention.forward
    with torch.no_grad(), inference_span(model, capture=ReplayingCapture()):
        cache = TrellisCache(model.config)
        model(ids[:, :4], past_key_values=cache)
        model(ids[:, 4:5], past_key_values=cache)
        kept = [t.clone() for t in held(cache)]
        monkeypatch.setattr(attention, "forward", lambda *args: (_ for _ in ()).throw(RuntimeError("out of memory")))
        with pytest.raises(RuntimeError, match="out of memory"):
            model(ids[:, 5:6], past_key_values=cache)
        monkeypatch.setattr(attention, "forward", forward)
        assert cache.get_seq_length() == 5 and all(torch.equal(x, y) for x, y in zip(kept, held(cache)))
        got = model(ids[:, 5:6], past_key_values=cache).logits
    torch.testing.assert_close(got, logits_in_pieces(eager, ids[:, :6], [4, 1, 1])[:, -1:], rtol=1e-12, atol=1e-12)


def test_a_failed_capture_decodes_eagerly_with_a_warning():
    # An operation a CUDA graph cannot hold (or no memory for one) must not fail generate().
    model = tiny_model(seed=7, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 5, seed=6)
    eager = model.generate(ids, max_new_tokens=6, do_sample=False)
    model.config.compile_decode = True
    attempts = []

    def failing(fn):
        attempts.append(fn)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(RuntimeWarning, match="operation not permitted.*decodes eagerly"):
        with inference_span(model, capture=failing):
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), eager)
    assert len(attempts) == 1  # the first failure ends the span's captures


def test_no_graphs_with_autograd_or_for_a_model_off_the_gpu():
    model = tiny_model(seed=2)
    model.config.compile_decode = True
    ids = random_tokens(1, 4, seed=2)
    capture = ReplayingCapture()
    with inference_span(model, capture=capture):
        cache = TrellisCache(model.config)
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache).logits.sum().backward()  # autograd records: the general path
    assert capture.captures == 0 and model.model.embed_tokens.weight.grad is not None
    with inference_span(model):  # no capture given: a CPU model's steps compile
        assert isinstance(graphs_of(model), CompiledSegments)


def test_entry_tensors_round_trip():
    from trellis_lm.compiled_decode import entries_from

    model = tiny_model(seed=1, schedule="hybrid", head_dim=6)
    cache = TrellisCache(model.config)
    with torch.no_grad():
        model(random_tokens(2, 5), past_key_values=cache)
    entries = [(layer.q_tail, layer.k_tail, layer.state) for layer in cache.layers if hasattr(layer, "q_tail")]
    flat = entry_tensors(entries)
    again = entries_from(entries, iter(flat))
    assert [t is u for t, u in zip(entry_tensors(again), flat)] == [True] * len(flat)
