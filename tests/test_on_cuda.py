"""On a CUDA GPU: Lattice and KVM at real sizes, the model's ``generate`` against the CPU's, the
vLLM plugin's slots, and bf16 Trainer steps (issue 39, item 1).

These need a GPU, which CI does not have: they are skipped there and run by the device check
(``benchmarks/gpu_run.sh``). Trellis's kernels at real sizes are in ``test_triton.py`` (which
runs every one of its tests on the GPU when there is one). References are the PyTorch backends in
float64 on the CPU, themselves checked against the per-token references in ``test_*_ops.py``;
errors are norm-wise relative, ``|got - ref| / |ref|``, bf16 within 1e-2 and float32 within 1e-4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from op_inputs import make_kvm_inputs
from slot_server import serve
from tiny_models import random_tokens, tiny_model
from trellis_lm.ops import kvm_attention
from trellis_lm.ops.lattice import lattice_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PRECISIONS = [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.detach().double().cpu()
    return ((got.detach().double().cpu() - ref).norm() / ref.norm()).item()


def check_call(op, inputs64: list[torch.Tensor], dtype: torch.dtype, tol: float, **kw) -> None:
    """``op`` on CUDA in ``dtype`` (from the same rounded inputs) against ``op`` in float64 on the
    CPU: outputs, every final state tensor and the gradients of a random projection of both."""
    x = [t.to("cuda", dtype).requires_grad_() for t in inputs64]
    x_ref = [t.detach().double().cpu().requires_grad_() for t in x]
    o, s = op(*x, **kw)
    o_ref, s_ref = op(*x_ref, **kw)
    assert o.is_cuda and o.dtype == dtype
    assert o.isfinite().all()
    assert rel(o, o_ref) < tol
    for name, t in s.tensors().items():
        expected = s_ref.tensors()[name]
        if t.is_floating_point():
            assert t.dtype == torch.float32, name  # states stay float32 under low-precision inputs
            assert rel(t, expected) < tol, name
        else:
            assert torch.equal(t.cpu(), expected), name
    weight = torch.randn(o_ref.shape, dtype=torch.float64)
    got = torch.autograd.grad((o.float() * weight.to("cuda", torch.float32)).sum(), x)
    expected = torch.autograd.grad((o_ref * weight).sum(), x_ref)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.isfinite().all(), f"grad {i}"
        assert rel(g, e) < tol, f"grad {i}: {rel(g, e):.2e}"


@pytest.mark.parametrize("dtype,tol", PRECISIONS)
@pytest.mark.parametrize("C", [16, 64])
def test_lattice_at_real_sizes(dtype, tol, C):
    torch.manual_seed(C)
    B, T, H, M, D = 2, 1000, 4, 64, 64  # T is not a multiple of C
    inputs = [F.normalize(torch.randn(B, T, H, M, dtype=torch.float64), dim=-1),
              F.normalize(torch.randn(B, T, H, M, dtype=torch.float64), dim=-1),
              F.normalize(torch.randn(B, T, H, D, dtype=torch.float64), dim=-1),
              torch.sigmoid(torch.randn(B, T, H, dtype=torch.float64))]
    memory = F.normalize(torch.randn(B, H, M, D), dim=-1)

    def op(q, k, v, gamma, **kw):
        return lattice_attention(q, k, v, gamma, initial_state=memory.to(q.device), chunk_size=C,
                                 backend="torch", output_final_state=True)

    check_call(op, inputs, dtype, tol)


@pytest.mark.parametrize("dtype,tol", PRECISIONS)
def test_kvm_at_real_sizes(dtype, tol):
    (q, k, v, gate), params = make_kvm_inputs(2, 1000, 4, 64, 64, seed=3)
    settings = dict(chunk_size=64, window_chunks=2, state_size=128, sinks=4, rope_dims=32)

    def op(q, k, v, gate):
        on = {name: t.to(q.device, torch.float32 if q.dtype != torch.float64 else q.dtype) for name, t in params.items()}
        return kvm_attention(q, k, v, gate, **on, **settings, backend="torch", output_final_state=True)

    check_call(op, [q, k, v, gate], dtype, tol)


def test_generate_on_cuda_gives_the_cpu_tokens():
    """Greedy float32 tokens of a hybrid with every mixer kind (Trellis on the Triton kernels and
    their decode step, Lattice, KVM and attention on PyTorch), prompts crossing chunk and KVM
    fold boundaries, are the CPU's tokens."""
    model = tiny_model(seed=4, schedule="kvm-hybrid", hidden_size=128, head_dim=64, num_slots=64, chunk_size=16,
                       intermediate_size=256, kvm_chunk_size=16, kvm_window_chunks=2, kvm_state_size=32,
                       kvm_rope_dims=16)
    prompt = random_tokens(3, 77, seed=5)
    settings = dict(max_new_tokens=40, do_sample=False, min_new_tokens=40)
    on_cpu = model.generate(prompt, **settings)
    on_gpu = model.to("cuda").generate(prompt.cuda(), **settings)
    assert on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.parametrize("schedule", ["trellis", "lattice", "kvm"])
def test_vllm_slots_on_cuda_give_each_sequence_its_logits(schedule):
    """The vLLM plugin's slot logic on the GPU (vLLM itself is not on the device): prompt
    chunks that end mid-chunk of the ops, single tokens and rows of n-gram drafts of which some
    are rejected, the slots' state tensors on the GPU, Trellis on its Triton kernels and decode
    step. Every kept token's float32 logits are the model's on the sequence alone, within 1e-4."""
    model = tiny_model(seed=3, schedule=schedule, hidden_size=128, head_dim=64, num_slots=64, chunk_size=16,
                       intermediate_size=256, kvm_chunk_size=16, kvm_window_chunks=2, kvm_state_size=32,
                       kvm_rope_dims=16).to("cuda")
    prompts = [random_tokens(1, n, seed=n)[0].cuda() for n in (61, 9, 40, 3)]
    drafts = [(1, 3), (2, 2), (4, 0), (1, 0), (3, 1)]  # (kept, rejected) in turn

    def plan(i, step):
        return 21 if i == 0 and step < 2 else drafts[(i + step) % len(drafts)]

    got = serve(model, prompts, slot_of=[5, 0, 3, 1], step_tokens=plan, width=4)
    with torch.no_grad():
        for prompt, logits in zip(prompts, got):
            assert logits.is_cuda
            assert rel(logits, model(prompt[None]).logits[0]) < 1e-4


def test_bf16_trainer_steps_are_finite(tmp_path):
    """A few Trainer steps in bf16 autocast on the GPU, a hybrid with every mixer kind: every
    logged loss and every parameter finite, and the parameters moved."""
    from transformers import Trainer, TrainingArguments

    from trainer_helpers import right_padded

    model = tiny_model(seed=6, schedule="kvm-hybrid", hidden_size=128, head_dim=64, num_slots=64, chunk_size=16,
                       intermediate_size=256, kvm_chunk_size=16, kvm_state_size=32).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = [{"input_ids": random_tokens(1, n, seed=n)[0].tolist()} for n in (200, 130, 97, 64, 150, 33, 180, 120)]
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, max_steps=6, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=right_padded)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    moved = 0
    for name, p in trainer.model.named_parameters():
        assert p.isfinite().all(), name
        moved += not torch.equal(p.detach().cpu(), before[name].cpu())
    assert moved > len(before) // 2


@pytest.fixture
def deterministic():
    """PyTorch's deterministic kernels for the span of a test (conftest sets cuBLAS's workspace
    for them): with the default ones, two eager prefills of one prompt differ (by ~4e-7 on an
    H100, 2026-11-27: atomics), and so do the caches built on them."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])


class CountedGraphs:
    """``capture_cuda_graph`` with its captures and the replays of the graphs it made counted."""

    def __init__(self, monkeypatch) -> None:
        import trellis_lm.compiled_decode as compiled_decode

        self.captures, self.replays = 0, 0
        real = compiled_decode.capture_cuda_graph
        counter = self

        class Counted:
            def __init__(self, graph) -> None:
                self.graph = graph

            def replay(self) -> None:
                counter.replays += 1
                self.graph.replay()

        def capture(fn):
            self.captures += 1
            graph, outputs = real(fn)
            return Counted(graph), outputs

        monkeypatch.setattr(compiled_decode, "capture_cuda_graph", capture)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_generate_with_cuda_graphs_gives_the_eager_tokens(dtype, monkeypatch, deterministic):
    """``compile_decode`` on CUDA: generate() replays each run of memory blocks (here Lattice, and
    Trellis on its Triton step with the final norm and the head, between KVM and attention blocks
    through their modules) from CUDA graphs, with the eager steps' greedy tokens and final
    cache, bit for bit."""
    graphs = CountedGraphs(monkeypatch)
    model = tiny_model(seed=4, schedule="kvm-hybrid", hidden_size=128, head_dim=64, num_slots=64, chunk_size=16,
                       intermediate_size=256, kvm_chunk_size=16, kvm_window_chunks=2, kvm_state_size=32,
                       kvm_rope_dims=16).to("cuda", dtype)
    prompt = random_tokens(3, 77, seed=5).cuda()
    settings = dict(max_new_tokens=40, do_sample=False, min_new_tokens=40, return_dict_in_generate=True)
    eager = model.generate(prompt, **settings)
    model.config.compile_decode = True
    graphed = model.generate(prompt, **settings)
    # Two runs, each with a graph per set of buffers it reads; each replayed once a step.
    assert graphs.captures == 2 * 2 and graphs.replays == 2 * 39 and model.model.decode_plan is None
    assert torch.equal(graphed.sequences, eager.sequences)
    for mine, theirs in zip(graphed.past_key_values.layers, eager.past_key_values.layers):
        for name, tensor in mine.tensors().items():
            torch.testing.assert_close(tensor, theirs.tensors()[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_all_trellis_step_is_one_cuda_graph_in_every_decoding_mode(dtype, monkeypatch, deterministic):
    """An all-Trellis model's decode step is one replay (embedding, every block, the norm and the
    head), and greedy, beam search, prompt lookup (a recording cache: copies) and sampling give
    the eager steps' tokens."""
    graphs = CountedGraphs(monkeypatch)
    model = tiny_model(seed=9, hidden_size=128, head_dim=64, num_slots=64, chunk_size=16, num_hidden_layers=3,
                       intermediate_size=256).to("cuda", dtype)
    ids, one = random_tokens(2, 21, seed=6).cuda(), random_tokens(1, 7, seed=7).repeat(1, 3).cuda()

    def every_mode():
        outputs = [model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False),
                   model.generate(ids[:1], max_new_tokens=8, min_new_tokens=8, num_beams=2, do_sample=False),
                   model.generate(one, max_new_tokens=8, min_new_tokens=8, prompt_lookup_num_tokens=2, do_sample=False)]
        torch.manual_seed(12)
        return outputs + [model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=True, top_k=0)]

    eager = every_mode()
    model.config.compile_decode = True
    greedy = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert graphs.captures == 2 and graphs.replays == 11  # one replay a step after the prompt's
    for mode, got, want in zip(("greedy", "beam", "prompt lookup", "sampling"), [greedy, *every_mode()[1:]], eager):
        assert torch.equal(got, want), mode
