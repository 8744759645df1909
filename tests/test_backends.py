"""Backend choice, parametrised over every op's registry: registering a backend adds its rows.

For each op and each registered backend, on a small float64 CPU call (T not a multiple of the
chunk, and a one-token call, which runs the backend's step where it has one): a backend that
says it can run the call gives the reference's outputs and final state; one that says it cannot
is refused by name with its reason; ``auto`` runs the highest-priority backend that can.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from op_inputs import make_inputs, make_kvm_inputs, make_state
from trellis_lm.ops import kvm_attention, lattice_attention, trellis_attention
from trellis_lm.ops.kvm import BACKENDS as KVM_BACKENDS
from trellis_lm.ops.lattice import BACKENDS as LATTICE_BACKENDS
from trellis_lm.ops.lattice import LatticeState
from trellis_lm.ops.registry import Backend, BackendRegistry, OpCall
from trellis_lm.ops.trellis import BACKENDS as TRELLIS_BACKENDS

CPU = torch.device("cpu")


def trellis_case(length: int) -> tuple[Callable, dict[str, Any], dict[str, Any]]:
    x = make_inputs(2, length, 2, 3, 5, 4, seed=length)
    state = make_state(2, 2, 3, 5, 4, chunk_size=3, seed=length + 1)
    return trellis_attention, {"args": x, "initial_state": state, "chunk_size": 3}, {"compress_fn": "layernorm", "chunk_size": 3}


def lattice_case(length: int) -> tuple[Callable, dict[str, Any], dict[str, Any]]:
    gen = torch.Generator().manual_seed(length)
    q, k = (F.normalize(torch.randn(2, length, 2, 4, generator=gen, dtype=torch.float64), dim=-1) for _ in range(2))
    v = F.normalize(torch.randn(2, length, 2, 3, generator=gen, dtype=torch.float64), dim=-1)
    gamma = torch.sigmoid(torch.randn(2, length, 2, generator=gen, dtype=torch.float64))
    memory = F.normalize(torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64), dim=-1)
    return lattice_attention, {"args": (q, k, v, gamma), "initial_state": LatticeState.at_chunk_start(memory),
                               "chunk_size": 3}, {}


def kvm_case(length: int) -> tuple[Callable, dict[str, Any], dict[str, Any]]:
    x, params = make_kvm_inputs(2, length, 2, 4, 3, seed=length)
    settings = dict(chunk_size=2, window_chunks=1, state_size=2, rope_dims=2, sinks=0)
    return kvm_attention, {"args": x, **params, **settings}, {}


OPS = {"trellis_attention": (TRELLIS_BACKENDS, trellis_case), "lattice_attention": (LATTICE_BACKENDS, lattice_case),
       "kvm_attention": (KVM_BACKENDS, kvm_case)}
ROWS = [(op, name, length) for op, (registry, _) in OPS.items() for name in registry for length in (7, 1)]


def call(op: str, backend: str, length: int) -> tuple[torch.Tensor, Any]:
    fn, kwargs, _ = OPS[op][1](length)
    args = kwargs.pop("args")
    return fn(*args, backend=backend, output_final_state=True, **kwargs)


@pytest.mark.parametrize("op,name,length", ROWS)
def test_a_named_backend_computes_the_reference_or_says_why_not(op, name, length):
    registry, case = OPS[op]
    settings = case(length)[2]
    reason = registry[name].refusal(OpCall(CPU, torch.float64, length, False, settings))
    if reason is not None:
        with pytest.raises(ValueError, match=f"backend '{name}' cannot run this {op} call"):
            call(op, name, length)
        return
    o, state = call(op, name, length)
    o_ref, state_ref = call(op, "reference", length)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-9)
    for field, t in state.tensors().items():
        torch.testing.assert_close(t, state_ref.tensors()[field], rtol=1e-9, atol=1e-9, msg=lambda m: f"{field}: {m}")


@pytest.mark.parametrize("op", list(OPS))
def test_auto_runs_the_best_backend_that_can(op):
    registry, case = OPS[op]
    for length in (7, 1):
        request = OpCall(CPU, torch.float64, length, False, case(length)[2])
        able = [b for b in registry.values()
                if b.refusal(request) is None and (b.auto_devices is None or "cpu" in b.auto_devices)]
        best = max(able, key=lambda b: b.priority)
        assert registry.choose("auto", request) is best
        assert registry.function("auto", request) is best.function_for(request)


@pytest.mark.parametrize("op", list(OPS))
def test_an_unknown_backend_is_refused_with_the_names(op):
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        call(op, "cuda", 3)


def test_a_registered_backend_is_chosen_by_priority_and_refuses_what_it_cannot():
    seen = []

    def forward(*args):
        seen.append(args)
        return "ran"

    registry = BackendRegistry("toy", Backend("slow", lambda *a: "slow", priority=0))
    registry.register(Backend("fast", forward, priority=5, unsupported=lambda c: "no float64" if c.dtype == torch.float64 else None))
    with pytest.raises(ValueError, match="exists already"):
        registry.register(Backend("fast", forward, priority=1))
    f32, f64 = OpCall(CPU, torch.float32, 4, False), OpCall(CPU, torch.float64, 4, False)
    assert registry.choose("auto", f32).name == "fast" and registry.choose("auto", f64).name == "slow"
    with pytest.raises(ValueError, match="backend 'fast' cannot run this toy call: no float64"):
        registry.choose("fast", f64)
    registry.unregister("fast")
    assert list(registry) == ["slow"]
