"""The vLLM plugin's slot logic without vLLM: a memory layer run over a server's state slots
(trellis_lm.integrations.vllm.slots) gives the numbers of the model run on each sequence alone.

A small server loop (tests/slot_server.py) plays vLLM's part; here in float64 on the CPU,
with chunks that end mid-chunk of the ops (tests/test_on_cuda.py runs it on a GPU).
"""

from __future__ import annotations

import os
import platform
import re
import sys

import pytest
import torch

from tests.slot_server import CompiledRuns, serve
from tests.tiny_models import random_tokens, tiny_model
from trellis_lm.cache_entries import MemoryEntry
from trellis_lm.integrations.vllm.compiled_rows import advanced_compiled
from trellis_lm.integrations.vllm import slots as slots_module
from trellis_lm.integrations.vllm.slots import SlotLayout, compile_rows, compiles_rows, fresh_entry, run_on_slots
from trellis_lm.mixers import MIXERS, MemoryMixer
from trellis_lm.mixers.valid_tokens import PackedSequences


@pytest.mark.parametrize("schedule, overrides", [
    ("trellis", {}), ("trellis", {"conv_size": 0, "use_forget_gate": False}), ("lattice", {}), ("kvm", {}),
    ("trellis", {"write_gradient": "anchored"}),  # the anchors kept in the slots and read mid-chunk
    ("trellis", {"conv_size": 2}),  # the package's default: tails of one token
])
def test_slots_give_each_sequence_its_own_logits(schedule, overrides):
    model = tiny_model(schedule=schedule, dtype=torch.float64, **overrides)
    prompts = [random_tokens(1, n, seed=n)[0] for n in (1, 7, 13, 5, 22)]
    # Odd sequences take one token per step, even ones 6 (chunks of 4, KVM's of 3: mid-chunk).
    got = serve(model, prompts, slot_of=[5, 2, 7, 0, 3], step_tokens=lambda i, step: 1 if i % 2 else 6)
    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, model(prompt[None]).logits[0], rtol=1e-12, atol=1e-12)


def test_a_finished_sequences_slot_serves_the_next_one_from_its_start():
    """A slot reused by a new sequence (``computed == 0``) starts from the learned state,
    whatever the last sequence left in it."""
    model = tiny_model(schedule="trellis", dtype=torch.float64)
    first, second = random_tokens(1, 9, seed=1)[0], random_tokens(1, 6, seed=2)[0]
    # The second starts once the first is done (a slot serves one sequence at a time).
    got = serve(model, [first, second], slot_of=[4, 4], step_tokens=lambda i, step: 9 if i == 0 else 2 * (step > 0))
    torch.testing.assert_close(got[1], model(second[None]).logits[0], rtol=1e-12, atol=1e-12)


# Rows of a kept token and drafts, (kept, rejected) in turn.
DRAFTS = [(1, 3), (2, 2), (4, 0), (1, 0), (3, 1), (2, 0), (1, 1)]


@pytest.mark.parametrize("schedule, overrides", [
    ("trellis", {}), ("lattice", {}), ("kvm", {}), ("trellis", {"write_gradient": "anchored"}),
])
def test_rejected_drafts_never_enter_a_slots_state(schedule, overrides):
    """Speculative decoding: rows of a kept token and drafts of which the server keeps some,
    none or all (mid-chunk of the ops, chunks of 4, KVM's of 3), mixed with prompt chunks and
    single tokens; a sequence restarted from 0 in another slot (preempted and recomputed).
    Every kept token's logits equal the model's on the sequence alone: each sequence has a row
    of slots, the state after each token of a row of drafts in its own, as vLLM lays them out."""
    model = tiny_model(schedule=schedule, dtype=torch.float64, **overrides)
    prompts = [random_tokens(1, n, seed=n)[0] for n in (23, 9, 17, 30)]
    width = 4  # a kept token and up to three drafts

    def plan(i, step):
        if i == 0 and step < 2:
            return 7  # a prompt chunk longer than a held row
        return DRAFTS[(i + step) % len(DRAFTS)]

    got = serve(model, prompts, slot_of=[6, 1, 3, 0], step_tokens=plan, width=width)
    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, model(prompt[None]).logits[0], rtol=1e-12, atol=1e-12)
    # A preempted sequence starts again from 0 in a slot holding another's state and drafts.
    again = serve(model, prompts[1:2], slot_of=[6], step_tokens=lambda i, step: DRAFTS[step % len(DRAFTS)],
                  width=width)
    torch.testing.assert_close(again[0], model(prompts[1][None]).logits[0], rtol=1e-12, atol=1e-12)


def test_compiled_rows_give_the_numbers_of_eager_ones(recwarn, monkeypatch):
    """``compiled=True`` (the plugin under ``compile_decode``) on a Trellis, a Lattice and a KVM
    layer: the Trellis and Lattice layers' rows of single tokens and rows of drafts run
    through the compiled functions (counted), in batches of one row and of several, with and
    without room for drafts; the KVM layer's eagerly. Every kept token's logits equal the model's
    on the sequence alone. What ``compile_rows`` compiles (about a minute for both kinds on CI's
    cores) serves batches of any size: no step compiles again."""
    torch._dynamo.reset()  # compile here, whatever this process compiled before
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    model = tiny_model(mixer_types=["trellis", "lattice", "kvm"], num_hidden_layers=3, dtype=torch.float64).eval()
    compiled_runs = CompiledRuns(monkeypatch).runs
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = layer.self_attn
            layout = SlotLayout(type(mixer), model.config, torch.float64)
            compile_rows(mixer, layout, model.model.embed_tokens.weight, width=4)
            if mixer.compilable:  # past FEW_ROWS of the projections' stack
                for rows, length in ((3, 1), (70, 1), (3, 4), (17, 4)):
                    advanced_compiled(mixer, torch.zeros(rows, length, model.config.hidden_size, dtype=torch.float64),
                                      fresh_entry(mixer, layout, rows), each=length > 1)
    assert graphs["unique_graphs"] - before == 8  # a kind's rows of one token and held rows, one row and several
    compiled = graphs["unique_graphs"]
    prompts = [random_tokens(1, n, seed=n)[0] for n in (23, 9, 17, 30)]
    # (width, plan, the rows each compilable layer runs compiled: (rows of drafts, several rows))
    plans = [(1, lambda i, step: 6 if step == 0 else 1, {(False, False), (False, True)}),
             (4, lambda i, step: 7 if i == 0 and step < 2 else DRAFTS[(i + step) % len(DRAFTS)],
              {(False, False), (True, False), (True, True)})]  # one single token a step at most
    for width, plan, rows in plans:
        compiled_runs.clear()
        got = serve(model, prompts, slot_of=[6, 1, 3, 0], step_tokens=plan, width=width, compiled=True)
        for prompt, logits in zip(prompts, got):
            torch.testing.assert_close(logits, model(prompt[None]).logits[0], rtol=1e-12, atol=1e-12)
        assert set(compiled_runs) == {(kind, *row) for kind in ("trellis", "lattice") for row in rows}
    assert graphs["unique_graphs"] == compiled
    assert not [w for w in recwarn if "recompile limit" in str(w.message)]


def test_rows_compile_for_trellis_and_lattice_layers_on_a_cpu_only():
    """What the plugin compiles under ``compile_decode``: Trellis and Lattice rows on a CPU;
    KVM's rows never, and on a GPU (any device but a CPU) nothing."""
    model = tiny_model(schedule="kvm-hybrid")
    graphs = torch._dynamo.utils.counters["stats"]
    before = graphs["unique_graphs"]
    for layer in model.model.layers:
        mixer = layer.self_attn
        if not isinstance(mixer, MemoryMixer):
            continue
        assert compiles_rows(mixer, torch.device("cpu")) == (mixer.kind in ("trellis", "lattice")), mixer.kind
        assert not compiles_rows(mixer, torch.device("cuda"))
        layout = SlotLayout(type(mixer), model.config, torch.float32)
        compile_rows(mixer, layout, torch.empty(0, model.config.hidden_size, device="meta"), width=4)
        if not compiles_rows(mixer, torch.device("cpu")):
            compile_rows(mixer, layout, model.model.embed_tokens.weight, width=4)
    assert graphs["unique_graphs"] == before


def test_a_slot_holding_another_state_than_the_sequence_continues_is_an_error():
    """A sequence continues only from a slot that counts as many tokens as it has taken in:
    one the server did not write for it (or read at the wrong column of drafts) is refused."""
    model = tiny_model(schedule="trellis")
    layout = SlotLayout(type(model.model.layers[0].self_attn), model.config, torch.float32)
    tensors = layout.allocate(8)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    mixer = model.model.layers[0].self_attn
    row = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        run_on_slots(mixer, layout, tensors, x[:3], torch.tensor([0, 3]), torch.tensor([0]), row)  # after 1, 2, 3
        before = [t.clone() for t in tensors]
        for accepted, computed, held in ((2, 3, 2), (1, 4, 1)):
            with pytest.raises(RuntimeError, match=f"sequence 0 continues after {computed} tokens, but the slot it reads "
                                                   f"holds the state after {held}"):
                run_on_slots(mixer, layout, tensors, x[3:], torch.tensor([0, 2]), torch.tensor([computed]), row,
                             torch.tensor([accepted]))
        assert all(torch.equal(a, b) for a, b in zip(tensors, before))  # nothing written
        run_on_slots(mixer, layout, tensors, x[3:], torch.tensor([0, 2]), torch.tensor([3]), row, torch.tensor([3]))


def test_slot_layout_follows_the_mixers_declaration():
    config = tiny_model(schedule="kvm-hybrid").config
    for kind, mixer_class in MIXERS.items():
        if not issubclass(mixer_class, MemoryMixer):
            with pytest.raises(TypeError, match="memory mixers"):
                SlotLayout(mixer_class, config, torch.bfloat16)
            continue
        layout = SlotLayout(mixer_class, config, torch.bfloat16)
        unread = mixer_class.unread_state(config)
        assert [f.name for f in layout.fields] == [*(name for name in mixer_class.cache_layout(config)
                                                     if name not in unread), "tokens"]
        assert all(offset % SlotLayout.ALIGN == 0 for offset in layout.offsets)
        pages = torch.zeros(3, layout.nbytes + 40, dtype=torch.uint8)  # a server's padded pages
        views = layout.views(pages)
        for f, view in zip(layout.fields, views):
            assert view.shape == (3, *f.shape)
            # tails in the model's dtype, states in float32, counters in int64
            assert view.dtype == ({"q_tail": torch.bfloat16, "k_tail": torch.bfloat16}.get(f.name)
                                  or (torch.int64 if not view.dtype.is_floating_point else torch.float32))
            view.fill_(1)
        assert int(pages[:, layout.nbytes:].sum()) == 0 and int(pages[:, : layout.nbytes].sum()) > 0
    # KVM's buffers are held at their bounds: the state rows and the window
    kvm = SlotLayout(MIXERS["kvm"], config, torch.float32)
    shapes = {f.name: f.shape for f in kvm.fields}
    assert shapes["keys"] == (config.num_heads, config.kvm_state_size, config.head_dim)
    assert shapes["window_k"] == (config.num_heads, config.kvm_window_chunks * config.kvm_chunk_size, config.head_dim)
    with pytest.raises(ValueError, match="pages must be"):
        kvm.views(torch.zeros(2, kvm.nbytes - 1, dtype=torch.uint8))
    # Nothing reads a Trellis layer's anchors under exact writes: its slots keep the memories alone.
    exact, anchored = (SlotLayout(MIXERS["trellis"], tiny_model(write_gradient=writes).config, torch.float32)
                       for writes in ("exact", "anchored"))
    assert {f.name for f in anchored.fields} - {f.name for f in exact.fields} == {"anchor_k", "anchor_v"}
    assert exact.stand_ins == {"anchor_k": "m_k", "anchor_v": "m_v"} and anchored.stand_ins == {}


@pytest.mark.parametrize("starts, computed, slots, match", [
    # Issue 50: these were accepted without a word.
    ([0, 3, 2, 6], [0, 0, 0], [0, 1, 2], "starts must rise"),  # decreasing: the second sequence skipped, its tokens read by the third
    ([0, 3, 3, 6], [0, 0, 0], [0, 1, 2], "starts must rise"),  # duplicate: a sequence of no tokens
    ([0, 3, 6, 9], [0, 0, 0], [0, 1, 2], "starts must rise"),  # past the tokens
    ([0, 3, 5, 6], [0, -2, 0], [0, 1, 2], "starts must rise"),  # a negative computed count would start it afresh
    # Issue 72: two sequences on one slot were accepted, their states overwriting each other.
    ([0, 3, 5, 6], [0, 0, 0], [2, 0, 2], "sequences 0 and 2 are both given slot 2: each sequence needs a slot of its own"),
    ([0, 3, 5, 6], [0, 0, 0], [1, 1, 3], "sequences 0 and 1 are both given slot 1"),
    ([0, 3, 5, 6], [0, 0, 0], [0, 4, 1], r"slots must lie in \[0, 4\) \(the slots the tensors hold\), got \[0, 4, 1\]"),
    ([0, 3, 5, 6], [0, 0, 0], [0, -1, 1], r"slots must lie in \[0, 4\)"),
    ([0, 3, 5, 6], [0, 0, 0], [0, 1], r"starts must be \[R \+ 1\], computed and accepted \[R\], slots \[R\] or \[R, "
                                      r"W\]; got \[4\], \[3\], \[3\], \[2\]"),
    # Rows of slots (speculative decoding): a row writes the slots of its tokens' columns.
    ([0, 3, 5, 6], [0, 0, 0], [[0, 1, 2], [3, 2, 0], [1, 0, 3]], "sequences 0 and 1 are both given slot 2"),
    ([0, 3, 4, 6], [0, 0, 0], [[0, 1, 2], [2, 0, 1], [3, 0, 1]], "sequences 0 and 1 are both given slot 2"),
    ([0, 3, 5, 6], [0, 0, 0], [[0, 1, 2], [3, 4, 0], [5, 0, 0]], r"slots must lie in \[0, 4\)"),
    ([0, 3, 5, 6], [0, 0, 0], [[0, 1, 2], [3, 1, 0], [1, 0, 3]], "accepted in \\[1, 3\\]"),  # accepted 4 for row 2
])
def test_run_on_slots_refuses_a_batch_it_would_misread(starts, computed, slots, match):
    model = tiny_model(schedule="trellis", dtype=torch.float64)
    mixer = model.model.layers[0].self_attn
    layout = SlotLayout(type(mixer), model.config, torch.float64)
    tensors = layout.allocate(4)
    before = [t.clone() for t in tensors]
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if match == "starts must rise":
        match = r"starts must rise strictly from >= 0 to <= 6 tokens .* computed must be >= 0"
    accepted = torch.tensor([1, 1, 4]) if match.startswith("accepted") else None
    with pytest.raises(ValueError, match=match):
        run_on_slots(mixer, layout, tensors, x, torch.tensor(starts), torch.tensor(computed), torch.tensor(slots),
                     accepted)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_an_entry_bigger_than_its_slot_is_refused_in_words():
    """Issue 72: torch's broadcast error. A slot holds its kind's entry at the bound of every
    dim; a larger one (or one of another rank) is named by field."""
    config = tiny_model(schedule="kvm").config
    layout = SlotLayout(MIXERS["kvm"], config, torch.float32)
    tensors = layout.allocate(3)
    heads, rows, dim = config.num_heads, config.kvm_state_size, config.head_dim
    layout.write(tensors, torch.tensor([1]), {"keys": torch.ones(1, heads, rows - 1, dim)})  # a buffer not yet grown
    assert int(layout.read(tensors, torch.tensor([1]), ["keys"])["keys"].count_nonzero()) == heads * (rows - 1) * dim
    for value, shape in [(torch.ones(1, heads, rows + 1, dim), [heads, rows + 1, dim]),
                         (torch.ones(1, heads, rows, dim + 2), [heads, rows, dim + 2]),
                         (torch.ones(1, rows, dim), [rows, dim])]:
        with pytest.raises(ValueError, match=re.escape(f"keys: an entry of shape {shape} (per sequence) does not fit "
                                                       f"its slot's {[heads, rows, dim]}")):
            layout.write(tensors, torch.tensor([0]), {"keys": value})
        with pytest.raises(ValueError, match="window_k: an entry of shape"):
            layout.write(tensors, 1, {"window_k": torch.ones(1, heads, config.kvm_window_chunks * config.kvm_chunk_size
                                                             + 1, dim)})


@pytest.mark.parametrize("schedule, overrides", [
    ("trellis", {}), ("trellis", {"conv_size": 0, "use_forget_gate": False}), ("lattice", {}), ("kvm", {}),
])
def test_runs_of_slots_and_prompt_chunks_of_unlike_lengths_packed(schedule, overrides, monkeypatch):
    """The fast paths of a step: sequences in consecutive slots, in any order (as a server hands
    them out to sequences started together), are read in place, not copied, and state tensors the mixer
    returns unchanged are not written back; a step's prompt chunks, of unlike lengths (1, 2, 3,
    lengths not a multiple of the op's chunk, some continuing mid-chunk), run packed along one
    row: one mixer call, no padding. Every token's logits equal the model's on the sequence alone."""
    model = tiny_model(schedule=schedule, dtype=torch.float64, **overrides)
    prompts = [random_tokens(1, n, seed=n)[0] for n in (150, 3, 90, 2, 41, 1)]
    runs, packed = [], []
    real_run, real_packed = slots_module.slot_run, slots_module._run_packed
    monkeypatch.setattr(slots_module, "slot_run", lambda slots: runs.append(real_run(slots)) or runs[-1])
    monkeypatch.setattr(slots_module, "_run_packed", lambda *a: packed.append(a[5].lengths.tolist()) or real_packed(*a))
    # 100 tokens for every sequence at first (a prompt chunk beside whole short prompts), then
    # one token (decode steps) twice in three steps, 7 in the third.
    got = serve(model, prompts, slot_of=[4, 2, 1, 6, 3, 5],
                step_tokens=lambda i, step: 100 if step == 0 else (1 if step % 3 else 7))
    for prompt, logits in zip(prompts, got):
        torch.testing.assert_close(logits, model(prompt[None]).logits[0], rtol=1e-12, atol=1e-12)
    assert runs.count(None) < len(runs) and any(start is not None and start > 1 for start in runs)
    # The first step, in each layer: the one-token prompt alone (a decode's batch), every other
    # sequence's chunk in one packed call, in the order of its slots.
    assert packed[0] == [90, 3, 41, 100, 2]


@pytest.mark.parametrize("schedule, overrides", [
    ("trellis", {}), ("trellis", {"conv_size": 0, "use_forget_gate": False}), ("lattice", {}), ("kvm", {}),
    ("trellis", {"write_gradient": "anchored"}),  # the anchors kept in the slots and read mid-chunk
])
@pytest.mark.parametrize("tokens", [1, 3])
def test_advance_each_gives_the_entry_after_every_token(schedule, overrides, tokens):
    """What the slots verify drafts with: the outputs of ``advance`` on the same tokens, and after
    token t the entry ``advance`` leaves after the first t (mid-chunk: 6 tokens before, chunks of 4)."""
    model = tiny_model(schedule=schedule, dtype=torch.float64, **overrides)
    mixer = model.model.layers[0].self_attn
    x = torch.randn(2, 6 + tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens),
                    dtype=torch.float64)
    with torch.no_grad():
        _, before = mixer.advance(x[:, :6], None, MemoryEntry(None, None, None))
        y, entries = mixer.advance_each(x[:, 6:], before)
        torch.testing.assert_close(y, mixer.advance(x[:, 6:], None, before)[0], rtol=1e-12, atol=1e-12)
        assert len(entries) == tokens
        for t, entry in enumerate(entries, start=1):
            expected = mixer.advance(x[:, 6: 6 + t], None, before)[1]
            for got, want in zip(_tensors(entry), _tensors(expected)):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("schedule, overrides", [
    ("trellis", {}), ("trellis", {"conv_size": 0, "use_forget_gate": False}), ("lattice", {}), ("kvm", {}),
    ("trellis", {"write_gradient": "anchored"}),
])
def test_advance_on_packed_sequences_gives_each_sequences_advance(schedule, overrides):
    """What the slots run prompt chunks with: sequences of 2, 1, 5 and 3 tokens (shorter than the
    short conv's tail, and across a chunk of 4) packed along one row, each after its own entry,
    give the outputs and entry after of ``advance`` on each sequence alone."""
    model = tiny_model(schedule=schedule, dtype=torch.float64, **overrides)
    mixer = model.model.layers[0].self_attn
    lengths = torch.tensor([2, 1, 5, 3])
    x = torch.randn(4, 6 + 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        _, before = mixer.advance(x[:, :6], None, MemoryEntry(None, None, None))
        packed = PackedSequences.from_lengths(lengths)
        y, after = mixer.advance(torch.cat([x[n, 6: 6 + int(t)] for n, t in enumerate(lengths)])[None],
                                 packed, before)
        for n, length in enumerate(lengths.tolist()):
            row = MemoryEntry(*(None if t is None else t[n: n + 1] for t in (before.q_tail, before.k_tail)),
                              before.state.map(lambda t: t[n: n + 1]))
            want_y, want = mixer.advance(x[n: n + 1, 6: 6 + length], None, row)
            start = int(packed.cu_seqlens[n])
            torch.testing.assert_close(y[:, start: start + length], want_y, rtol=1e-12, atol=1e-12)
            got = MemoryEntry(*(None if t is None else t[n: n + 1] for t in (after.q_tail, after.k_tail)),
                              after.state.map(lambda t: t[n: n + 1]))
            for g, w in zip(_tensors(got), _tensors(want)):
                torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def _tensors(entry):
    return [t for t in (entry.q_tail, entry.k_tail, *entry.state.tensors().values()) if t is not None]


KEEPS_FREED_BLOCK = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])  # alone: no torch in this process
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
raised = allocator.keep_freed_memory()
before = resident()
block = bytearray(24 << 20)  # zero-filled, so every page is touched
del block
print(raised, resident() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_a_cpu_server_keeps_freed_blocks_unless_the_user_chose_an_allocator(monkeypatch):
    """The plugin raises glibc's thresholds (``allocator.py``): a freed 24 MB block stays the
    process's, where glibc alone returns it; a user's own thresholds or allocator are left alone."""
    import subprocess

    from trellis_lm.integrations.vllm import allocator

    def run(**env: str) -> tuple[str, int]:
        clean = {k: v for k, v in os.environ.items() if k not in allocator.USER_CHOICES and k != "LD_PRELOAD"}
        command = [sys.executable, "-c", KEEPS_FREED_BLOCK, allocator.__file__]
        raised, kept = subprocess.run(command, env={**clean, **env}, check=True, capture_output=True,
                                      text=True).stdout.split()
        return raised, int(kept)

    raised, kept = run()
    assert raised == "True" and kept >= 20 << 20
    raised, kept = run(MALLOC_TRIM_THRESHOLD_="131072")
    assert raised == "False" and kept < 4 << 20
    for env in ({"MALLOC_MMAP_THRESHOLD_": "131072"}, {"LD_PRELOAD": "/opt/lib/libjemalloc.so.2"}):
        for name in (*allocator.USER_CHOICES, "LD_PRELOAD"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert allocator.keep_freed_memory() is False


def test_a_plan_made_once_serves_each_layer_as_its_own_would():
    # A server step's layers share one plan_slots (made by the first): each layer then computes
    # what it computes planning alone, over a step of two continuing decodes and a new prompt;
    # a plan made for another slot count, token count or compiled setting is refused.
    model = tiny_model(schedule="trellis", dtype=torch.float64)
    generator = torch.Generator().manual_seed(3)
    starts, computed, slots = torch.tensor([0, 1, 2, 7]), torch.tensor([4, 9, 0]), torch.tensor([5, 2, 0])
    plan = slots_module.plan_slots(starts, computed, slots, None, count=6, tokens=7, compiled=False)
    for layer in model.model.layers:
        mixer = layer.self_attn
        layout = SlotLayout(type(mixer), model.config, torch.float64)
        alone = layout.allocate(6)
        for t in alone:
            t.copy_(torch.randn(t.shape, generator=generator, dtype=torch.float64) if t.is_floating_point() else 0)
        alone[-1][[5, 2]] = torch.tensor([4, 9])  # the token counts (the last field) the decodes continue
        shared = [t.clone() for t in alone]
        x = torch.randn(7, model.config.hidden_size, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            want = run_on_slots(mixer, layout, alone, x, starts, computed, slots)
            got = run_on_slots(mixer, layout, shared, x, starts, computed, slots, plan=plan)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(shared, alone))
        with pytest.raises(ValueError, match=r"plan was made for \(slots, tokens, compiled\) = \(6, 7, False\)"):
            run_on_slots(mixer, layout, shared, x[:6], starts[:3], computed[:2], slots[:2], plan=plan)


@pytest.mark.parametrize("write_gradient", ["exact", "anchored"])
def test_decodes_in_a_run_of_slots_write_their_state_where_it_lies(write_gradient, monkeypatch):
    """Decodes in consecutive slots give their state up to the op's step (``consume_state``):
    backend ``native`` writes the state after into the slots themselves, and none of it is
    written back; decodes in scattered slots are read by copies, their state written back. Both
    give the numbers of the torch step, which makes new tensors."""
    model = tiny_model(schedule="trellis", dtype=torch.float64, write_gradient=write_gradient)
    mixer = model.model.layers[0].self_attn
    layout = SlotLayout(type(mixer), model.config, torch.float64)
    state_fields = {"m_k", "m_v", "anchor_k", "anchor_v"} & set(layout.entry_names)
    generator = torch.Generator().manual_seed(6)
    writes = []
    real_write = layout.write
    monkeypatch.setattr(layout, "write", lambda tensors, slots, values: writes.append(set(values)) or real_write(
        tensors, slots, values))
    for slots, in_place in ((torch.tensor([3, 1, 2]), True), (torch.tensor([0, 2, 5]), False)):
        held = layout.allocate(6)
        for name, t in zip(layout.entry_names, held):
            t.copy_(torch.randn(t.shape, generator=generator, dtype=t.dtype) if t.is_floating_point()
                    else torch.randint(0, model.config.chunk_size, t.shape, generator=generator))
        held[-1][slots] = 9  # the tokens each slot's state has taken in
        x = torch.randn(3, model.config.hidden_size, generator=generator, dtype=torch.float64)
        ran = {}
        for backend in ("torch", "native"):
            monkeypatch.setattr(mixer.config, "op_backend", backend)
            tensors = [t.clone() for t in held]
            writes.clear()
            with torch.no_grad():
                out = run_on_slots(mixer, layout, tensors, x, torch.arange(4), torch.full((3,), 9), slots)
            ran[backend] = (out, tensors, writes[0])
        torch.testing.assert_close(ran["native"][0], ran["torch"][0], rtol=1e-12, atol=1e-12)
        for got, want in zip(ran["native"][1], ran["torch"][1]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert state_fields <= ran["torch"][2]
        assert not (state_fields & ran["native"][2]) if in_place else state_fields <= ran["native"][2]
