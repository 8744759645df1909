"""``compile_decode`` on a GPU: runs of memory blocks replayed from CUDA graphs (trellis_lm.compiled_decode).

A CUDA graph needs a GPU (``tests/test_on_cuda.py`` runs the real one). Here the capture is
replaced by one that records the step and replays it by running it again and writing its
results into the captured outputs, as a graph's replay does: everything else (the copies in
and out, which runs are captured and when, the signature, what the cache is handed) is the
code a GPU runs.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_generation import DECODE_PIECES, DECODE_RUNS, eager_and_compiling, logits_in_pieces
from tiny_models import random_tokens, tiny_model
from trellis_lm import TrellisCache
from trellis_lm.compiled_decode import decode_graphs, entry_tensors


class ReplayingCapture:
    """A stand-in for ``capture_cuda_graph``: counts captures and replays; a replay reruns the
    step and writes its results where the capture's outputs are (a graph's fixed addresses)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        self.outputs: list[list[torch.Tensor]] = []

    def __call__(self, fn):
        self.captures += 1
        outputs = fn()
        self.outputs.append(outputs)
        capture = self

        class Graph:
            def replay(self) -> None:
                capture.replays += 1
                for into, new in zip(outputs, fn()):
                    into.copy_(new)

        return Graph(), outputs


def graphs_of(model):
    return model.model.decode_graphs


@pytest.mark.parametrize(("schedule", "overrides", "runs"), DECODE_RUNS)
def test_replayed_steps_equal_eager(schedule, overrides, runs):
    eager, graphed, ids = eager_and_compiling(schedule, overrides)
    capture = ReplayingCapture()
    with torch.no_grad(), decode_graphs(graphed, capture=capture):
        replayed = logits_in_pieces(graphed, ids, DECODE_PIECES)
        assert len(graphs_of(graphed).runs) == len(runs)
    # Captured on the first step (one graph per run of memory blocks), replayed on every step;
    # the prefill ran eagerly; the graphs are gone with the span.
    assert capture.captures == len(runs) and capture.replays == len(runs) * 8
    assert graphs_of(graphed) is None
    torch.testing.assert_close(replayed, logits_in_pieces(eager, ids, DECODE_PIECES), rtol=1e-12, atol=1e-12)


def test_generate_replays_and_leaves_the_cache_of_eager_steps():
    model = tiny_model(seed=8, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 6, seed=3)
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    eager = model.generate(ids, **settings)
    model.config.compile_decode = True
    capture = ReplayingCapture()
    with decode_graphs(model, capture=capture):  # generate's own span keeps this one
        out = model.generate(ids, **settings)
    assert torch.equal(out.sequences, eager.sequences)
    assert capture.captures == 2 and capture.replays == 2 * 9
    for mine, theirs in zip(out.past_key_values.layers, eager.past_key_values.layers):
        for name, tensor in mine.tensors().items():
            torch.testing.assert_close(tensor, theirs.tensors()[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_cache_never_holds_a_graphs_buffers():
    # The cache is handed copies: a later replay (another cache's step) cannot change it, and a
    # failed call restores entries nobody wrote into.
    model = tiny_model(seed=3, dtype=torch.float64)
    model.config.compile_decode = True
    ids = random_tokens(2, 5, seed=1)
    capture = ReplayingCapture()
    with torch.no_grad(), decode_graphs(model, capture=capture):
        cache = TrellisCache(model.config)
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache)
        (run,) = graphs_of(model).runs.values()
        buffers = {t.untyped_storage().data_ptr() for t in run.inputs + run.outputs}
        held = [t for layer in cache.layers for t in layer.tensors().values()]
        assert not buffers & {t.untyped_storage().data_ptr() for t in held}
        kept = [t.clone() for t in held]
        other = TrellisCache(model.config)
        model(ids.flip(0), past_key_values=other)
        model(ids[:, 1:2], past_key_values=other)  # replays the same graph with other's entries
        assert capture.replays == 2
        for before, now in zip(kept, held):
            assert torch.equal(before, now)


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
    with torch.no_grad(), decode_graphs(graphed, capture=capture):
        replayed = turns(graphed)
    assert capture.captures == 2 and capture.replays == 2 * 7
    torch.testing.assert_close(replayed, turns(model), rtol=1e-12, atol=1e-12)


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
        with decode_graphs(model, capture=failing):
            assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), eager)
    assert len(attempts) == 1  # the first failure ends the span's captures


def test_no_graphs_with_autograd_or_for_a_model_off_the_gpu():
    model = tiny_model(seed=2)
    model.config.compile_decode = True
    ids = random_tokens(1, 4, seed=2)
    capture = ReplayingCapture()
    with decode_graphs(model, capture=capture):
        cache = TrellisCache(model.config)
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache).logits.sum().backward()  # autograd records: eager
    assert capture.captures == 0 and model.model.embed_tokens.weight.grad is not None
    with decode_graphs(model):  # no capture given: a CPU model's steps compile as before
        assert graphs_of(model) is None


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
