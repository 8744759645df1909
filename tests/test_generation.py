"""Generation: prefill/decode equivalences, padding, generate() modes, continuing from a cache."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch._dynamo.utils import counters
from transformers import PreTrainedTokenizerFast

from tiny_models import left_pad, random_tokens, tiny_model
from transformers_names import cache_of
import trellis_lm.compiled_decode as compiled_decode
from trellis_lm import TrellisCache, TrellisForCausalLM
from trellis_lm.compiled_decode import inference_span
from trellis_lm.ops import COMPRESS_FNS, MIX_FNS

TOL = dict(rtol=1e-4, atol=1e-4)


def logits_in_pieces(model: TrellisForCausalLM, ids: torch.Tensor, sizes: list[int], mask=None) -> torch.Tensor:
    """Feed ``ids`` in consecutive pieces through one cache; the logits of all pieces."""
    cache, logits, start = TrellisCache(model.config), [], 0
    for size in sizes:
        piece_mask = None if mask is None else mask[:, : start + size]
        logits.append(model(ids[:, start : start + size], attention_mask=piece_mask, past_key_values=cache).logits)
        start += size
    assert start == ids.shape[1] and cache.get_seq_length() == start
    return torch.cat(logits, dim=1)


# ----------------------------------------------------------------------------- equivalences


@pytest.mark.parametrize("chunk_size, length", [(4, 12), (4, 11), (5, 13), (1, 6)])
def test_prefill_then_decode_equals_full_forward(chunk_size, length):
    model = tiny_model(seed=chunk_size, chunk_size=chunk_size)
    ids = random_tokens(2, length, seed=length)
    full = model(ids).logits
    for prefix in sorted({1, 2, chunk_size, chunk_size + 1, length - 1}):
        pieces = [prefix] + [1] * (length - prefix)
        torch.testing.assert_close(logits_in_pieces(model, ids, pieces), full, **TOL, msg=f"prefix {prefix}")


@pytest.mark.parametrize("sizes", [[3, 1, 5, 4], [1, 7, 2, 3], [6, 7]])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"chunk_size": 5}, {"conv_size": 0}, {"conv_size": 1}, {"conv_size": 2}, {"use_forget_gate": False},
     {"compress_fn": "l2norm", "mix_fn": "softmax"}, {"compress_fn": "identity", "mix_fn": "l2_silu"}],
)
def test_prefill_in_uneven_pieces_equals_full_forward(sizes, overrides):
    model = tiny_model(seed=3, **overrides)
    ids = random_tokens(2, sum(sizes), seed=1)
    torch.testing.assert_close(logits_in_pieces(model, ids, sizes), model(ids).logits, **TOL)


def test_padded_pieces_equal_each_row_alone():
    # The first piece holds nothing but padding for the short rows: their state must pass through.
    model = tiny_model(seed=4, chunk_size=3)
    rows = [random_tokens(1, n, seed=n)[0] for n in (11, 4, 6)]
    ids, mask = left_pad(rows)
    logits = logits_in_pieces(model, ids, [5, 1, 2, 3], mask)
    for i, row in enumerate(rows):
        torch.testing.assert_close(logits[i][mask[i].bool()], model(row[None]).logits[0], **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("compress_fn", COMPRESS_FNS)
@pytest.mark.parametrize("mix_fn", MIX_FNS)
def test_sweep_of_padded_pieces(compress_fn, mix_fn):
    """The CI-sized checks above at a larger size: every function pair, several chunk sizes,
    random prompt lengths, left padding and random piece sizes."""
    generator = torch.Generator().manual_seed(len(compress_fn) * 10 + len(mix_fn))
    for chunk_size in (1, 2, 7, 16):
        model = tiny_model(
            seed=chunk_size, hidden_size=64, num_hidden_layers=3, num_heads=4, head_dim=16, num_slots=12,
            intermediate_size=96, chunk_size=chunk_size, compress_fn=compress_fn, mix_fn=mix_fn,
        )
        lengths = torch.randint(1, 41, (4,), generator=generator).tolist()
        rows = [random_tokens(1, n, seed=n + chunk_size)[0] for n in lengths]
        ids, mask = left_pad(rows)
        sizes, left = [], ids.shape[1]
        while left:
            sizes.append(min(left, int(torch.randint(1, 12, (1,), generator=generator))))
            left -= sizes[-1]
        logits = logits_in_pieces(model, ids, sizes, mask)
        for i, row in enumerate(rows):
            torch.testing.assert_close(logits[i][mask[i].bool()], model(row[None]).logits[0], **TOL)


# ----------------------------------------------------------------------------- compiled decode

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("clang++") is None,
    reason="torch.compile on CPU needs a C++ compiler",
)


@pytest.fixture
def fresh_compiler():
    """No compiled decode step from earlier tests: each test's compilations count from zero
    against torch.compile's recompile limit (the models share one compiled function per process),
    and in :func:`graphs_compiled`."""
    import torch._dynamo

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def compiled_runs(monkeypatch):
    """Each compiled call of a run of blocks, in order, as ``(blocks, with the embedding, with the
    head, keeping the mixers' inputs)``; a call answered eagerly (past the recompile limit) fails."""
    runs = []
    compiled = compiled_decode.compiled_segment()

    def counted(segment, first, carried):
        runs.append((len(segment.blocks), segment.embedding is not None, segment.head is not None,
                     segment.keep_inputs))
        return compiled(segment, first, carried)

    monkeypatch.setattr(compiled_decode, "compiled_segment", lambda: counted)
    monkeypatch.setattr(compiled_decode, "warn_recompile_limit", lambda: pytest.fail("fell back to eager"))
    return runs


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process (each compilation of the decode step's function)."""
    return counters["stats"]["unique_graphs"]


# Schedules of memory blocks with (schedule, overrides, the runs of a decode step: (blocks, with the
# embedding, with the head, keeping inputs)).
WHOLE_STEP = [(2, True, True, False)]
DECODE_RUNS = [
    ("trellis", {}, WHOLE_STEP),
    ("trellis", {"conv_size": 2}, WHOLE_STEP),  # the package's default: tails of one token
    ("trellis", {"compress_fn": "l2norm", "mix_fn": "softmax", "use_forget_gate": False, "conv_size": 0}, WHOLE_STEP),
    ("lattice", {}, WHOLE_STEP),
    # trellis, trellis | attention (eager) | lattice; kvm (eager) | lattice | attention | trellis
    ("hybrid", {"head_dim": 6}, [(2, True, False, False), (1, False, True, False)]),  # attention turns channel pairs
    ("kvm-hybrid", {"head_dim": 6}, [(1, False, False, False), (1, False, True, False)]),
]


def eager_and_compiling(schedule: str, overrides: dict) -> tuple[TrellisForCausalLM, TrellisForCausalLM, torch.Tensor]:
    """A float64 model of odd sizes, the same with ``compile_decode``, and tokens whose
    single-token steps after a 4-token prefill cross chunk starts (every 3rd token), where
    anchors move: feed them in ``DECODE_PIECES``."""
    sizes = dict(chunk_size=3, num_heads=3, head_dim=5, num_slots=7) | overrides
    eager = tiny_model(seed=5, dtype=torch.float64, schedule=schedule, **sizes)
    compiling = copy.deepcopy(eager)
    compiling.config.compile_decode = True
    return eager, compiling, random_tokens(2, 12, seed=2)


DECODE_PIECES = [4] + [1] * 8


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize(("schedule", "overrides", "runs"), DECODE_RUNS)
def test_compiled_decode_step_equals_eager(schedule, overrides, runs, compiled_runs):
    eager, compiled, ids = eager_and_compiling(schedule, overrides)
    with torch.no_grad(), inference_span(compiled):  # generate's span; a step recording gradients runs eagerly
        fused = logits_in_pieces(compiled, ids, DECODE_PIECES)
    # Every single-token step ran each run of memory blocks as one compiled call (an all-memory
    # model's whole step: embedding, blocks, norm and head), each compiled once; the prefill
    # ran eagerly.
    assert compiled_runs == runs * 8 and graphs_compiled() == len(runs)
    torch.testing.assert_close(fused, logits_in_pieces(eager, ids, DECODE_PIECES), rtol=1e-12, atol=1e-12)


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_generate_with_compiled_decode(compiled_runs):
    model = tiny_model(seed=8)
    ids = random_tokens(2, 6, seed=3)
    eager = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert compiled_runs == []
    model.config.compile_decode = True
    torch.testing.assert_close(model.generate(ids, max_new_tokens=10, do_sample=False), eager, rtol=0, atol=0)
    # The prompt eagerly, then each of the 9 single-token steps as one compiled call of the
    # whole step (with the projections stacked by generate), compiled once: the step after
    # the prefill included.
    assert compiled_runs == WHOLE_STEP * 9 and graphs_compiled() == 1
    # Another call at another context, and another model of the same shapes, reuse the compiled
    # code (the blocks and generate's stacked weights are inputs, not constants; a prefill's
    # conv tails, views of a buffer its length sizes, are made dense first).
    other = tiny_model(seed=9)
    other.config.compile_decode = True
    for m, prompt in ((model, random_tokens(2, 3, seed=4)), (other, random_tokens(2, 17, seed=5))):
        m.generate(prompt, max_new_tokens=4, do_sample=False)
    assert graphs_compiled() == 1 and len(compiled_runs) == 9 + 2 * 3


DECODING_MODES = ("greedy", "beam", "prompt lookup", "assisted", "sampling")


def tokens_in_every_mode(model: torch.nn.Module, drafter: torch.nn.Module) -> list[torch.Tensor]:
    """``model``'s tokens in each of :data:`DECODING_MODES` (``drafter``: the assistant model): two
    rows of random prompts (one for beam search), and for prompt lookup and assisted decoding a
    prompt that repeats."""
    ids, one = random_tokens(2, 5, seed=6), random_tokens(1, 4, seed=7).repeat(1, 3)
    length = dict(max_new_tokens=6, min_new_tokens=6)
    outputs = [model.generate(ids, **length, do_sample=False),
               model.generate(ids[:1], **length, num_beams=2, do_sample=False),
               model.generate(one, **length, prompt_lookup_num_tokens=2, do_sample=False),
               model.generate(one, **length, assistant_model=drafter, do_sample=False)]
    torch.manual_seed(12)
    return outputs + [model.generate(ids, **length, do_sample=True, top_k=0)]


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_decode_in_every_decoding_mode(compiled_runs):
    # Greedy, sampling and beam search (two rows each: one compilation), prompt lookup and another
    # model's drafts (one row, a cache that records its calls: one more, which the draft model, of
    # the same shapes, shares): the eager steps' tokens in float64.
    model = tiny_model(seed=10, dtype=torch.float64)
    drafter = tiny_model(seed=11, dtype=torch.float64)
    eager = tokens_in_every_mode(model, drafter)
    assert compiled_runs == []
    for m in (model, drafter):
        m.config.compile_decode = True
    for mode, got, want in zip(DECODING_MODES, tokens_in_every_mode(model, drafter), eager):
        assert torch.equal(got, want), mode
    recorded = [run for run in compiled_runs if run[3]]
    assert recorded and len(recorded) < len(compiled_runs) and graphs_compiled() == 2


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_a_hooked_block_decodes_eagerly_among_compiled_ones(compiled_runs):
    # A forward hook on one mixer must see every call: that block runs through its modules, the
    # others (trellis | attention | lattice after it) still compile, and the numbers do not change.
    model = tiny_model(seed=6, schedule="hybrid", head_dim=6)
    ids = random_tokens(2, 8, seed=4)
    eager = logits_in_pieces(model, ids, [4, 1, 1, 1, 1])
    compiled = copy.deepcopy(model)
    compiled.config.compile_decode = True
    seen = []
    compiled.model.layers[0].self_attn.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad(), inference_span(compiled):
        torch.testing.assert_close(logits_in_pieces(compiled, ids, [4, 1, 1, 1, 1]), eager, rtol=1e-5, atol=1e-5)
    assert seen == [4, 1, 1, 1, 1] and compiled_runs == [(1, False, False, False), (1, False, True, False)] * 4


# Where a hook is added after the first compilation (issue 50, item 5): on a block's projection,
# its MLP, a norm's pre-hook. (module path in layer 0 of a trellis model, hook kind)
LATE_HOOKS = [("self_attn.q_proj", "forward"), ("mlp", "forward"), ("post_attention_layernorm", "pre"),
              ("self_attn.o_norm", "forward")]


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("second_model", [False, True], ids=["same-model", "second-model"])
def test_a_hook_added_after_compiling_is_called_every_step(compiled_runs, second_model):
    # The compiled run is shared by every model of these shapes: a hook added to any module of a
    # block once it compiled (on this model or another instance) must be called at every step
    # and change the tokens as it does eagerly; the hooked block runs through its modules.
    ids = random_tokens(1, 5, seed=7)
    model = tiny_model(seed=8)
    model.config.compile_decode = True
    model.generate(ids, max_new_tokens=4, do_sample=False)  # compiles the whole step
    assert compiled_runs == WHOLE_STEP * 3
    for path, kind in LATE_HOOKS:
        target = tiny_model(seed=8) if second_model else model
        target.config.compile_decode = True
        eager = copy.deepcopy(target)
        eager.config.compile_decode = False
        calls = {"compiled": [], "eager": []}

        def decode(m):  # the tokens and every step's logits
            out = m.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
            return out.sequences, torch.stack(out.logits)

        _, unhooked = decode(eager)

        # Features moved and scaled (a norm undoes a scale alone): every hook changes the logits.
        def hook_on(m, name):
            module = m.model.layers[0].get_submodule(path)
            if kind == "pre":
                return module.register_forward_pre_hook(
                    lambda mod, args: (calls[name].append(1), (args[0].roll(1, -1) * 2,))[1])
            return module.register_forward_hook(lambda mod, args, out: (calls[name].append(1), out.roll(1, -1) * 2)[1])

        handles = [hook_on(target, "compiled"), hook_on(eager, "eager")]
        del compiled_runs[:]
        # The logits, not the tokens, show each hook's effect: a tiny model's greedy tokens may not move.
        want, want_logits = decode(eager)
        assert not torch.allclose(want_logits, unhooked, rtol=1e-3, atol=1e-3), path
        got, got_logits = decode(target)
        assert torch.equal(got, want) and torch.allclose(got_logits, want_logits, rtol=1e-4, atol=1e-5), path
        assert len(calls["compiled"]) == len(calls["eager"]) == 6, path  # the prefill and every step
        assert compiled_runs == [(1, False, True, False)] * 5, path  # layer 1 compiles, layer 0 runs eagerly
        for handle in handles:
            handle.remove()


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_a_step_recording_gradients_decodes_eagerly(compiled_runs):
    # The compiled step is traced for inference; a step under autograd (gradients through a
    # cached decode step) once crashed the process (heap corruption) or failed on the state's
    # integer offsets. It runs through the general path: same logits and gradients, nothing compiled.
    def step_and_grads(model):
        ids = random_tokens(2, 5, seed=1)
        cache = TrellisCache(model.config)
        with inference_span(model):
            with torch.no_grad():
                model(ids[:, :4], past_key_values=cache)
            logits = model(ids[:, 4:], past_key_values=cache).logits
        logits.square().sum().backward()
        return logits.detach(), model.model.embed_tokens.weight.grad

    eager = tiny_model(seed=3, schedule="hybrid", head_dim=6)
    compiled = copy.deepcopy(eager)
    compiled.config.compile_decode = True
    for got, want in zip(step_and_grads(compiled), step_and_grads(eager)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert compiled_runs == []


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_decode_of_a_padded_batch(compiled_runs):
    # Left-padded prompts: each step's own tokens are real in every row, so the steps compile.
    model = tiny_model(seed=4, schedule="hybrid", head_dim=6)
    ids, mask = left_pad([random_tokens(1, n, seed=n)[0] for n in (5, 2, 7)])
    eager = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    model.config.compile_decode = True
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False), eager)
    assert compiled_runs == [(2, True, False, False), (1, False, True, False)] * 5


@needs_compiler
@pytest.mark.usefixtures("fresh_compiler")
def test_compiled_decode_past_the_recompile_limit_decodes_eagerly(monkeypatch):
    # A process that decodes many different models meets torch.compile's recompile limit: the
    # steps after it run eagerly (same numbers) with a warning, instead of failing.
    import torch._dynamo

    warned = []
    monkeypatch.setattr(compiled_decode, "warn_recompile_limit", lambda: warned.append(True))
    ids = random_tokens(2, 6, seed=3)
    # torch's own patch: a monkeypatch of a config module would delete (hide) the entry when undone.
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed, dtype in ((1, torch.float32), (2, torch.float64)):  # the second needs a recompilation
            model = tiny_model(seed=seed, dtype=dtype)
            eager = model.generate(ids, max_new_tokens=4, do_sample=False)
            model.config.compile_decode = True
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), eager)
    assert warned


# ----------------------------------------------------------------------------- generate()


def prompts(seed: int = 0) -> list[torch.Tensor]:
    return [random_tokens(1, n, seed=seed + n)[0] for n in (7, 3, 5)]


def test_greedy_left_padded_batch_equals_each_row_alone():
    model = tiny_model(seed=5)
    ids, mask = left_pad(prompts())
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for i, row in enumerate(prompts()):
        alone = model.generate(row[None], max_new_tokens=8, do_sample=False)
        assert torch.equal(batch[i, ids.shape[1] :], alone[0, len(row) :])


def test_greedy_with_and_without_cache_agree():
    model = tiny_model(seed=6)
    ids, mask = left_pad(prompts())
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)


def reference_beam_search(model: TrellisForCausalLM, prompt: torch.Tensor, beams: int, steps: int) -> torch.Tensor:
    """Beam search without EOS, one full forward per step and no cache: ranks by summed log-prob."""
    sequences, scores = prompt[None], torch.zeros(1)
    for _ in range(steps):
        log_probs = torch.log_softmax(model(sequences, use_cache=False).logits[:, -1].double(), dim=-1)
        totals = (scores[:, None] + log_probs).flatten()
        best = totals.topk(beams).indices
        vocab = log_probs.shape[-1]
        sequences = torch.cat([sequences[best // vocab], (best % vocab)[:, None]], dim=1)
        scores = totals[best]
    return sequences[0]


def test_beam_search_matches_an_independent_beam_search():
    model = tiny_model(seed=7, eos_token_id=None)
    ids, mask = left_pad(prompts())
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False)
    for i, row in enumerate(prompts()):
        expected = reference_beam_search(model, row, beams=3, steps=5)
        assert torch.equal(batch[i, ids.shape[1] :], expected[len(row) :])
        alone = model.generate(row[None], max_new_tokens=5, num_beams=3, do_sample=False)
        assert torch.equal(alone[0], expected)


def test_sampling_with_a_seed():
    model = tiny_model(seed=8)
    ids, mask = left_pad(prompts())

    def sample(**kwargs):
        torch.manual_seed(1234)
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, **kwargs)

    first = sample()
    assert torch.equal(first, sample())
    assert torch.equal(first, sample(use_cache=False))  # same draws from the same distributions
    many = sample(num_return_sequences=3)
    assert many.shape == (9, ids.shape[1] + 6)
    assert torch.equal(many, sample(num_return_sequences=3, use_cache=False))
    assert torch.equal(many[::3, : ids.shape[1]], ids)


def test_inputs_embeds_prompt():
    model = tiny_model(seed=9)
    ids, mask = left_pad(prompts())
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=5, do_sample=False)
    from_ids = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(from_embeds, from_ids[:, ids.shape[1] :])


def test_generate_returns_and_continues_from_its_cache():
    model = tiny_model(seed=10)
    ids, mask = left_pad(prompts())
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = cache_of(first)
    assert isinstance(cache, TrellisCache)
    assert cache.get_seq_length() == first.sequences.shape[1] - 1  # the last token is not fed yet
    mask_so_far = torch.cat([mask, torch.ones(3, 4, dtype=torch.long)], dim=1)
    resumed = model.generate(
        first.sequences, attention_mask=mask_so_far, past_key_values=cache, max_new_tokens=5, do_sample=False
    )
    straight = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False)
    assert torch.equal(resumed, straight)


def test_continuing_a_conversation_with_new_user_tokens():
    model = tiny_model(seed=11)
    ids, mask = left_pad(prompts())
    first = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    follow_up = torch.cat([first.sequences, random_tokens(3, 4, seed=99)], dim=1)
    follow_mask = torch.cat([mask, torch.ones(3, 7, dtype=torch.long)], dim=1)
    resumed = model.generate(
        follow_up, attention_mask=follow_mask, past_key_values=cache_of(first), max_new_tokens=4, do_sample=False
    )
    assert torch.equal(resumed, model.generate(follow_up, attention_mask=follow_mask, max_new_tokens=4, do_sample=False))


def test_a_returned_cache_feeds_several_return_sequences():
    model = tiny_model(seed=12)
    ids, mask = left_pad(prompts())
    first = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    mask_so_far = torch.cat([mask, torch.ones(3, 2, dtype=torch.long)], dim=1)

    def sample(**kwargs):
        torch.manual_seed(7)
        return model.generate(
            first.sequences, attention_mask=mask_so_far, max_new_tokens=4, do_sample=True, num_return_sequences=2, **kwargs
        )

    assert torch.equal(sample(past_key_values=cache_of(first)), sample(use_cache=False))


def test_a_returned_cache_feeds_beam_search():
    model = tiny_model(seed=13, eos_token_id=None)
    row = prompts()[0]
    first = model.generate(row[None], max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    resumed = model.generate(first.sequences, past_key_values=cache_of(first), max_new_tokens=4, num_beams=3)
    assert torch.equal(resumed[0], reference_beam_search(model, first.sequences[0], beams=3, steps=4))


def test_generate_refuses_a_foreign_cache():
    from transformers import DynamicCache

    model = tiny_model()
    with pytest.raises(ValueError, match="TrellisCache"):
        model.generate(random_tokens(1, 3), past_key_values=DynamicCache(), max_new_tokens=2)


def test_any_transformers_tokenizer_works():
    # A word-level tokenizer that also returns token_type_ids (BERT style), padding on the left.
    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(90)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", padding_side="left",
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
    )
    model = tiny_model(seed=14)
    texts = ["w5 w6 w7 w8 w9", "w10 w11"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    assert "token_type_ids" in batch
    out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    alone = model.generate(**tokenizer(texts[1:], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert torch.equal(out[1, -4:], alone[0, -4:])
    assert len(tokenizer.batch_decode(out, skip_special_tokens=True)) == 2
    loss = model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss
    assert torch.isfinite(loss)
