"""GPU benchmarks of backend "triton" (issues 3 and 39), run on the device by benchmarks/gpu_run.sh
(correctness there is tests/test_triton.py and tests/test_on_cuda.py under pytest on the GPU).

    python benchmarks/bench_gpu.py                  # op timings, then decode
    python benchmarks/bench_gpu.py --only op        # op timings only (or: decode)
    python benchmarks/bench_gpu.py --only profile   # where the time goes (kernels by device time)
    python benchmarks/bench_gpu.py --quick          # small sizes: checks the script runs on a GPU
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --quick --dry-run   # the same on a CPU
    python benchmarks/bench_gpu.py --compile-check  # no GPU: compile the kernels for sm_90,
                                                    # report shared memory / registers / spills

What it measures (bfloat16 activations, float32 states, chunk 64):
  * op forward and forward+backward at (B, T, H, D, M) = (8, 4096, 16, 64, 64),
    (2, 16384, 16, 64, 64), (1, 32768, 16, 128, 64): Trellis (backend "triton", through the
    public ``trellis_attention``) anchored at chunk 64 and with exact writes (the exact chunk
    kernels), each with tf32x3 and with bf16 products, against fla's ``chunk_gated_delta_rule``
    and ``chunk_gsa`` (M slots, per-slot log gates) when fla is installed, and PyTorch SDPA flash
    attention (causal) at the same B, T, H, D; Lattice and KVM (PyTorch paths) at the first
    shape; then issue 70's goal ratios from the rows of the same run.
  * chunk 1 (the per-token kernels) and the torch exact chunk form (chunk 16) forward+backward
    against anchored chunk 64 at the first shape, and the forward's achieved TFLOP/s and memory
    bandwidth against a bf16 matmul and a device copy measured in the same run.
  * decode milliseconds per token, batch 1 and 64, of a 12-layer, 768-wide Trellis model against a
    LlamaForCausalLM of the same size (sdpa attention) after contexts of 1k, 16k and 128k tokens
    (Llama is not run where its cache would not fit), each eagerly and with CUDA graphs: Trellis
    with ``compile_decode`` (its whole step, embedding to logits, one CUDA graph), the Llama with
    transformers' StaticCache and ``torch.compile(mode="reduce-overhead")`` (each context and
    batch compiles anew, about a minute); then issue 73's goal ratios from those rows. Trellis's
    state does not grow, so its figure should not depend on the context; the attention model's does.
  * ``--only tune``: launch settings and dot precisions at the first shape (time, forward and
    gradient errors), and the key and value chains on two streams against one after the other
    at the second.
  * ``--only profile``: where the time goes, by ``torch.profiler``: the kernels of one op
    forward+backward at the first shape (chunk 64 and chunk 1) and of one decode step after 1k
    tokens (eager and with CUDA graphs), by device time, against the wall time of the call.

Timings are medians from ``triton.testing.do_bench`` (warm-up and repeats inside). The dot
precision of the Trellis kernels is ``TRELLIS_TRITON_DOT_PRECISION`` (default tf32x3); the
run prints it. ``--only op`` also times the Trellis op with bf16 products (the precision of
the peers' kernels) at every shape.
"""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import re
import sys
import time
from datetime import date
from unittest import mock

import torch
import torch.nn.functional as F

OP_SIZES = [(8, 4096, 16, 64, 64), (2, 16384, 16, 64, 64), (1, 32768, 16, 128, 64)]
QUICK_OP_SIZES = [(2, 512, 4, 64, 64)]
# What the op shapes' kernels are compiled for (heads and head dims; fla's autotuning is keyed
# on them too), at few tokens: see warm().
WARM_SIZES = [(1, 256, 16, 64, 64), (1, 256, 16, 128, 64)]
CHUNK = 64
# The decode models: the 12 layers of width 768, and a small one for --quick.
FULL_DECODE = dict(hidden=768, layers=12, heads=12, head_dim=64, slots=64, vocab=32000, chunk=CHUNK)
QUICK_DECODE = dict(hidden=256, layers=2, heads=4, head_dim=64, slots=64, vocab=1024, chunk=CHUNK)
# "cuda"; "cpu" only for ``--quick --dry-run`` under TRITON_INTERPRET=1, which checks that the
# script runs before device time is spent on it (its timings mean nothing).
DEVICE = "cuda"
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on an H100 (227 KB)


# ---------------------------------------------------------------------------------------------
# Helpers.


def bench_ms(fn) -> float:
    import triton.testing

    if DEVICE == "cpu":  # a dry run: one call, to see that it runs
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def free_cached() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if DEVICE == "cuda" else 1 << 34


def guarded(label: str, fn) -> str:
    """Run one measurement; a failure (missing package, out of memory) becomes a line of text."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - report and go on with the other measurements
        free_cached()
        return f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def trellis_inputs(B, T, H, D, M, dtype=torch.bfloat16, grad=False, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    x = [
        F.normalize(rand(B, T, H, D), dim=-1), F.normalize(rand(B, T, H, D), dim=-1),
        F.normalize(rand(B, T, H, D), dim=-1), rand(B, T, H, M),
        F.logsigmoid(rand(B, T, H) + 4.0), torch.sigmoid(rand(B, T, H)),
    ]
    x = [t.to(dtype).requires_grad_(grad) for t in x]
    state = (rand(B, H, M, D), rand(B, H, M, D))  # N(0, 1) memories, as the model initialises them
    return x, state


# ---------------------------------------------------------------------------------------------
# Op timings.


def _kwargs_for(fn, **wanted):
    """Pass only the keyword arguments the installed version of ``fn`` accepts."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in wanted.items() if k in params}


def chunk_form_flops(B: int, T: int, H: int, D: int, M: int, C: int) -> float:
    """Matrix-multiply FLOPs of the forward chunk form (design page, section 2), per call.

    Per chunk of L tokens and head: Q SK^T, K AK^T, the key-state update, V AV^T, H SV and the
    value-state update (6 L M D), Q K^T and (D * H UV^T) V (2 L^2 D), (D * Q K^T) UK and H UV^T
    (2 L^2 M); each product costs 2 FLOPs per multiply-add.
    """
    chunks = -(-T // C)
    return 2.0 * B * H * chunks * C * (6 * M * D + 2 * C * D + 2 * C * M)


def io_bytes(B: int, T: int, H: int, D: int, M: int) -> float:
    """The least memory traffic of one forward call: bf16 q, k, v, alpha, gates read, o written."""
    return 2.0 * B * T * H * (4 * D + M + 2)


def measured_ceilings() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, device-memory copy GB/s) measured on this device, in this run."""
    n = 8192 if DEVICE == "cuda" else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    tflops = 2 * n**3 / bench_ms(lambda: a @ b) / 1e9
    src = torch.empty(1 << (30 if DEVICE == "cuda" else 20), device=DEVICE, dtype=torch.uint8)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6  # read + write
    return tflops, gbps


# fwd+bwd milliseconds of every timed row, by (shape, name): bench_ops' ratios to the goals.
TIMES: dict = {}


def time_trellis(B, T, H, D, M, ceilings=None, first=False, precision=None) -> str:
    """The op forward and forward+backward (bf16 inputs), anchored (chunk 64) and with exact
    writes (the exact chunk kernels, whatever the chunk size), both at the kernels' dot precision
    (``precision``: that one instead, for the span of the call); ``first``: also chunk 1 (the
    per-token kernels) and the torch exact chunk form on the GPU."""
    from trellis_lm.ops import trellis_attention
    from trellis_lm.ops.trellis import triton_chunk as tc

    if precision is not None:
        with mock.patch.object(tc, "DOT_PRECISION", precision):
            return time_trellis(B, T, H, D, M, ceilings, first)
    x, state = trellis_inputs(B, T, H, D, M)
    xg, _ = trellis_inputs(B, T, H, D, M, grad=True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)

    def timed(**how):
        kw = dict(initial_state=state, chunk_size=CHUNK, backend="triton") | how
        with torch.no_grad():
            fwd = bench_ms(lambda: trellis_attention(*x, **kw))
        return fwd, bench_ms(lambda: trellis_attention(*xg, **kw)[0].backward(do))

    shape, rows = (B, T, H, D, M), []
    for name, how in (("anchored", {}), ("exact", dict(write_gradient="exact"))):
        fwd, both = timed(**how)
        TIMES[shape, f"{name} {tc.DOT_PRECISION}"] = both
        rows.append(f"  trellis {name} ({tc.DOT_PRECISION} dots) fwd {fwd:8.2f} ms | fwd+bwd {both:8.2f} ms")
        if ceilings is not None:
            tflops = chunk_form_flops(B, T, H, D, M, CHUNK) / fwd / 1e9
            gbps = io_bytes(B, T, H, D, M) / fwd / 1e6
            rows.append(f"    forward: {tflops:6.1f} TFLOP/s of the chunk form's products ({100 * tflops / ceilings[0]:.1f}%"
                        f" of the measured bf16 matmul ceiling), {gbps:7.1f} GB/s of least traffic"
                        f" ({100 * gbps / ceilings[1]:.1f}% of measured copy bandwidth)")
    anchored = TIMES[shape, f"anchored {tc.DOT_PRECISION}"]
    rows.append(f"    exact fwd+bwd = {TIMES[shape, f'exact {tc.DOT_PRECISION}'] / anchored:.2f}x anchored chunk {CHUNK}")
    if first:
        for label, how in (("chunk 1 (the per-token kernels)", dict(chunk_size=1)),
                           ("exact writes, backend torch, chunk 16", dict(write_gradient="exact", backend="torch",
                                                                          chunk_size=16))):
            both = timed(**how)[1]
            rows.append(f"    {label}: fwd+bwd {both:8.2f} ms = {both / anchored:.2f}x anchored chunk {CHUNK}")
    return "\n".join(rows)


def time_fla_gsa(B, T, H, D, M) -> str:
    from fla.ops.gsa import chunk_gsa

    def inputs(grad):
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
        t = [r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), r(B, T, H, M), F.logsigmoid(r(B, T, H, M) + 4.0)]
        return [a.to(torch.bfloat16).requires_grad_(grad) for a in t]

    extra = _kwargs_for(chunk_gsa, head_first=False)
    x = inputs(False)
    with torch.no_grad():
        fwd = bench_ms(lambda: chunk_gsa(*x, **extra))
    xg = inputs(True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)

    def fwd_bwd():
        o = chunk_gsa(*xg, **extra)[0]
        o.backward(do)

    return f"  fla chunk_gsa (M={M})   fwd {fwd:8.2f} ms | fwd+bwd {bench_ms(fwd_bwd):8.2f} ms"


def time_fla_gdn(B, T, H, D, M) -> str:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def inputs(grad):
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
        t = [F.normalize(r(B, T, H, D), dim=-1), F.normalize(r(B, T, H, D), dim=-1), r(B, T, H, D),
             F.logsigmoid(r(B, T, H) + 4.0), torch.sigmoid(r(B, T, H))]
        return [a.to(torch.bfloat16).requires_grad_(grad) for a in t]

    extra = _kwargs_for(chunk_gated_delta_rule, head_first=False)
    x = inputs(False)
    with torch.no_grad():
        fwd = bench_ms(lambda: chunk_gated_delta_rule(*x, **extra))
    xg = inputs(True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)

    def fwd_bwd():
        o = chunk_gated_delta_rule(*xg, **extra)[0]
        o.backward(do)

    both = TIMES[(B, T, H, D, M), "fla gated delta"] = bench_ms(fwd_bwd)
    return f"  fla chunk_gated_delta   fwd {fwd:8.2f} ms | fwd+bwd {both:8.2f} ms"


def time_sdpa(B, T, H, D, M) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=gen, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
        fwd = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    do = torch.randn_like(q)

    def fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

    both = TIMES[(B, T, H, D, M), "sdpa flash"] = bench_ms(fwd_bwd)
    return f"  sdpa flash (causal)     fwd {fwd:8.2f} ms | fwd+bwd {both:8.2f} ms"


def time_family(B, T, H, D, M) -> list[str]:
    """Lattice (M slots of width D) and KVM (chunk 64, a window of 2 chunks, 256 state rows, 4
    sinks, RoPE on 32 channels) forward and forward+backward through their PyTorch paths."""
    from trellis_lm.ops import kvm_attention
    from trellis_lm.ops.lattice import lattice_attention

    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=DEVICE)

    def timed(name, call, inputs):
        with torch.no_grad():
            fwd = bench_ms(lambda: call(*inputs))
        leaves = [t.detach().requires_grad_() for t in inputs]
        do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
        both = bench_ms(lambda: call(*leaves)[0].backward(do))
        return f"  {name:23s} fwd {fwd:8.2f} ms | fwd+bwd {both:8.2f} ms"

    memory = F.normalize(rand(B, H, M, D), dim=-1)
    lattice = [F.normalize(rand(B, T, H, M), dim=-1).bfloat16(), F.normalize(rand(B, T, H, M), dim=-1).bfloat16(),
               F.normalize(rand(B, T, H, D), dim=-1).bfloat16(), torch.sigmoid(rand(B, T, H)).bfloat16()]
    params = dict(norm_weight=torch.ones(H, D, device=DEVICE), norm_bias=torch.zeros(H, D, device=DEVICE),
                  temperature=torch.ones(H, 2, device=DEVICE))
    kvm = [F.layer_norm(rand(B, T, H, D), (D,)).bfloat16(), F.layer_norm(rand(B, T, H, D), (D,)).bfloat16(),
           rand(B, T, H, D).bfloat16(), (0.5 + torch.rand(B, T, H, generator=gen, device=DEVICE)).bfloat16()]
    return [
        guarded("  lattice", lambda: timed(f"lattice (torch, M={M})", lambda *x: lattice_attention(
            *x, initial_state=memory, chunk_size=CHUNK, backend="torch"), lattice)),
        guarded("  kvm", lambda: timed("kvm (torch, 256 rows)", lambda *x: kvm_attention(
            *x, **params, chunk_size=CHUNK, window_chunks=2, state_size=256, sinks=4, rope_dims=min(32, D // 2),
            backend="torch"), kvm)),
    ]


def bench_ops(sizes) -> list[str]:
    """Every shape's Trellis rows (tf32x3 and bf16 products), SDPA flash and, at the first, Lattice
    and KVM; then every shape's fla rows. fla comes last: its first calls compile and autotune
    for minutes (an H200 run, 2026-11-26, had not finished chunk_gsa's after 150 s), which a run's
    time limit may cut short, and the goals against SDPA are at the second shape."""
    ceilings = measured_ceilings()
    rows = [f"measured ceilings: bf16 matmul {ceilings[0]:.0f} TFLOP/s, device copy {ceilings[1]:.0f} GB/s"]
    print(rows[0], flush=True)

    def shape(B, T, H, D, M, timers, what):
        rows.append(f"op, (B, T, H, D, M) = {(B, T, H, D, M)}, chunk {CHUNK}, bf16 in, fp32 state{what}:")
        print(rows[-1], flush=True)
        for label, fn in timers:
            rows.append(guarded(f"  {label}", fn))
            print(rows[-1], flush=True)
            free_cached()

    for i, (B, T, H, D, M) in enumerate(sizes):
        shape(B, T, H, D, M, (
            ("trellis", lambda: time_trellis(B, T, H, D, M, ceilings, first=i == 0)),
            ("trellis, bf16 dots", lambda: time_trellis(B, T, H, D, M, precision="bf16")),
            ("sdpa flash", lambda: time_sdpa(B, T, H, D, M)),
        ), "")
        if i == 0:
            rows += time_family(B, T, H, D, M)
            print("\n".join(rows[-2:]), flush=True)
    for B, T, H, D, M in sizes:
        shape(B, T, H, D, M, (
            ("fla chunk_gated_delta_rule", lambda: time_fla_gdn(B, T, H, D, M)),
            ("fla chunk_gsa", lambda: time_fla_gsa(B, T, H, D, M)),
        ), ", fla's kernels")
    return rows + goal_rows(sizes)


def goal_rows(sizes) -> list[str]:
    """Issue 70's ratios, fwd+bwd, from the rows timed in this run (``-`` where one is missing):
    exact against anchored (both at each dot precision) and against fla's gated delta rule,
    and SDPA flash's time over exact's (>= 1: exact is at least as fast)."""
    def ratio(shape, a, b):
        return f"{TIMES[shape, a] / TIMES[shape, b]:.2f}" if (shape, a) in TIMES and (shape, b) in TIMES else "-"

    rows = ["goals, fwd+bwd ratios in this run (exact / anchored <= 1.3, exact / fla <= 2, sdpa / exact >= 1 at 4k"
            " and >= 3 at 32k):"]
    for shape in sizes:
        for p in ("tf32x3", "bf16"):
            rows.append(f"  {shape} {p:6s} dots: exact / anchored {ratio(shape, f'exact {p}', f'anchored {p}')}"
                        f" | exact / fla gated delta {ratio(shape, f'exact {p}', 'fla gated delta')}"
                        f" | sdpa / exact {ratio(shape, 'sdpa flash', f'exact {p}')}")
    print("\n".join(rows), flush=True)
    return rows


def warm(what: str, sizes) -> list[str]:
    """Compile what ``--only op`` will run, at few tokens: ``"trellis"`` (both dot precisions)
    or fla's ``"fla_gsa"`` or ``"fla_gdn"``, so that several processes can compile beside the GPU
    tests (Triton compiles on one CPU core per process; fla autotunes over dozens of configs per
    kernel, minutes of compiles). Binaries land in TRITON_CACHE_DIR. fla's autotuner runs every
    config here, but with FLA_CACHE_RESULTS=0 (read when fla is imported) it keeps no choice on
    disk: the timed run still picks its configs at its own shapes, from compiled binaries."""
    os.environ["FLA_CACHE_RESULTS"] = "0"
    timers = {
        "trellis": lambda *shape: [time_trellis(*shape), time_trellis(*shape, precision="bf16")],
        "fla_gsa": lambda *shape: [time_fla_gsa(*shape)],
        "fla_gdn": lambda *shape: [time_fla_gdn(*shape)],
    }[what]
    rows = []
    for shape in sizes:
        start = time.perf_counter()
        rows += [guarded(f"  warm {what} {shape}", lambda: "\n".join(timers(*shape)))]
        rows.append(f"  warm {what} {shape}: {time.perf_counter() - start:.0f} s")
        print("\n".join(rows[-2:]), flush=True)
    return rows


def tune(B, T, H, D, M) -> list[str]:
    """Launch settings and dot precisions of the chunk kernels at one shape: forward+backward
    time, and the forward's and the input gradients' errors (the largest, norm-relative) against
    the float64 PyTorch backend, per variant: the anchored kernels' warps, and the exact
    kernels' warps and chunk (``EXACT_WARPS``, ``EXACT_CHUNK``), each with a dot precision. The
    settings are the modules' own functions and constants, replaced for the span of one variant."""
    from contextlib import ExitStack

    from trellis_lm.ops import trellis_attention
    from trellis_lm.ops.trellis import triton_chunk as tc
    from trellis_lm.ops.trellis import triton_exact as te

    x, state = trellis_inputs(B, T, H, D, M, grad=True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
    x64 = [t.detach().double().requires_grad_() for t in x]
    rows = [f"tuning at {(B, T, H, D, M)}, chunk {CHUNK}: variant -> fwd+bwd ms, errors:"]

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    def variant(write_gradient, precision, patches):
        kw = dict(initial_state=state, chunk_size=CHUNK, write_gradient=write_gradient)
        ref = trellis_attention(*x64, **dict(kw, initial_state=tuple(t.double() for t in state)), backend="torch")[0]
        ref_grads = torch.autograd.grad(ref, x64, do.double())
        with ExitStack() as stack:
            stack.enter_context(mock.patch.object(tc, "DOT_PRECISION", precision))
            for module, name, value in patches:
                stack.enter_context(mock.patch.object(module, name, value))
            both = bench_ms(lambda: trellis_attention(*x, **kw, backend="triton")[0].backward(do))
            o = trellis_attention(*x, **kw, backend="triton")[0]
            grads = torch.autograd.grad(o, x, do)
        grad_err = max(rel(g, e) for g, e in zip(grads, ref_grads))
        return f"fwd+bwd {both:8.2f} ms | forward error {rel(o.detach(), ref.detach()):.1e} | largest gradient error {grad_err:.1e}"

    variants = [(f"anchored warps {w} {p}", "anchored", p, [(tc, "_warps", lambda *args, w=w: w)])
                for w, p in ((8, "bf16"), (8, "tf32x3"), (8, "tf32"), (4, "bf16"))]
    variants += [(f"exact warps {w} chunk {c} {p}", "exact", p, [(te, "EXACT_WARPS", w), (te, "EXACT_CHUNK", c)])
                 for w, c, p in ((8, 64, "tf32x3"), (8, 64, "bf16"), (4, 64, "tf32x3"), (8, 32, "tf32x3"))]
    for label, write_gradient, precision, patches in variants:
        rows.append(guarded(f"  {label}", lambda: f"  {label:32s}: " + variant(write_gradient, precision, patches)))
        print(rows[-1], flush=True)
    return rows


def streams_ab(B, T, H, D, M) -> list[str]:
    """Forward+backward with the key and value chains side by side on two streams (the backend)
    and one after the other (``_side_by_side`` replaced for the span), at a shape with few
    programs per chain (one per sequence and head)."""
    from trellis_lm.ops import trellis_attention
    from trellis_lm.ops.trellis import triton_chunk as tc

    x, state = trellis_inputs(B, T, H, D, M, grad=True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)

    def fwd_bwd():
        trellis_attention(*x, initial_state=state, chunk_size=CHUNK, backend="triton")[0].backward(do)

    side_by_side = guarded("side by side", lambda: f"{bench_ms(fwd_bwd):8.2f} ms")
    with mock.patch.object(tc, "_side_by_side", lambda like, first, second: (*first(), *second())):
        in_turn = guarded("in turn", lambda: f"{bench_ms(fwd_bwd):8.2f} ms")
    rows = [f"key and value chains at {(B, T, H, D, M)}, chunk {CHUNK}, fwd+bwd: side by side (two streams) "
            f"{side_by_side} | one after the other {in_turn}"]
    print(rows[0], flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Decode.


def same_size_models(hidden, layers, heads, head_dim, slots, vocab, chunk):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trellis_lm import TrellisConfig, TrellisForCausalLM

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  intermediate_size=hidden * 8 // 3, tie_word_embeddings=True)
    trellis = TrellisForCausalLM(TrellisConfig(num_heads=heads, head_dim=head_dim, num_slots=slots, chunk_size=chunk,
                                               op_backend="triton", **common))
    llama = LlamaForCausalLM(LlamaConfig(num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                                         max_position_embeddings=1 << 18, attn_implementation="sdpa", **common))
    return [m.to(DEVICE, torch.bfloat16).eval() for m in (trellis, llama)]


def static_cache_stepper(steps: int):
    """A :class:`~trellis_lm.benchmark.DecodeStepper` maker for the Llama in a ``StaticCache``
    of ``context + steps`` positions (a step attends over what a step at this context needs),
    each step through its forward compiled with ``mode="reduce-overhead"`` (CUDA graphs):
    transformers' recipe for fast decoding, the counterpart of Trellis's ``compile_decode``. The
    forward compiles once per cache length (the first, untimed step)."""
    from transformers import StaticCache

    from trellis_lm.benchmark import DecodeStepper
    from trellis_lm.cache_trellis import CACHE_ARG

    class StaticCacheStepper(DecodeStepper):
        def __init__(self, model, context: int, prefill_piece: int, batch: int) -> None:
            cache = StaticCache(config=model.config, max_cache_len=context + steps + 1)
            super().__init__(model, context, prefill_piece, batch, cache=cache)
            self.position = context
            self.compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def forward(self, token):
            position = torch.tensor([self.position], device=token.device)
            self.position += 1
            return self.compiled(input_ids=token, use_cache=True, cache_position=position, **{CACHE_ARG: self.cache})

    return StaticCacheStepper


def bench_decode(contexts, batches, steps, prefill_piece, **size) -> list[str]:
    """ms/token of Trellis eager and with ``compile_decode`` (its step one CUDA graph), and of the
    Llama eager (DynamicCache) and compiled with CUDA graphs (StaticCache,
    :func:`static_cache_stepper`), at every context and batch where its cache fits; then the
    goal ratios of issue 73 (:func:`decode_goal_rows`)."""
    from trellis_lm.benchmark import DecodeStepper, decode_ms_per_token

    trellis, llama = same_size_models(**size)
    n_t = sum(p.numel() for p in trellis.parameters()) / 1e6
    n_l = sum(p.numel() for p in llama.parameters()) / 1e6
    rows = [f"decode, bf16, {size}; Trellis {n_t:.1f}M params (op backend triton): eager | compile_decode "
            f"(one CUDA graph a step); Llama {n_l:.1f}M params (sdpa): eager, DynamicCache | StaticCache + "
            "torch.compile reduce-overhead:"]
    ms = {}
    for batch in batches:
        for c in contexts:
            timed = {}
            kv_bytes = 2 * size["layers"] * batch * c * size["hidden"] * 2  # Llama's bf16 keys and values
            piece = min(prefill_piece, max(512, (1 << 17) // batch))  # bounds a piece's activations
            for graphs in (False, True):
                trellis.config.compile_decode = graphs
                timed["Trellis", graphs] = guarded(
                    "Trellis", lambda: f"{decode_ms_per_token(trellis, c, steps, piece, batch):7.2f}")
                free_cached()
            for graphs, stepper in ((False, DecodeStepper), (True, static_cache_stepper(steps))):
                if kv_bytes > 0.8 * free_bytes():
                    timed["Llama", graphs] = f"not run (its cache would take {kv_bytes / 2**30:.0f} GiB)"
                else:
                    timed["Llama", graphs] = guarded(
                        "Llama", lambda: f"{decode_ms_per_token(llama, c, steps, piece, batch, stepper):7.2f}")
                free_cached()
            ms.update({(name, graphs, batch, c): text for (name, graphs), text in timed.items()})
            rows.append(f"  batch {batch:3d}, context {c:7d}: Trellis {timed['Trellis', False]} | "
                        f"{timed['Trellis', True]} ms/token; Llama {timed['Llama', False]} | {timed['Llama', True]} "
                        "ms/token")
            print(rows[-1], flush=True)
    rows += decode_goal_rows(ms, contexts, batches)
    print("\n".join(rows[-6:]), flush=True)
    return rows


def decode_goal_rows(ms: dict, contexts: list[int], batches: list[int]) -> list[str]:
    """Issue 73's GPU goals from the rows of :func:`bench_decode` (``ms[name, graphs, batch,
    context]``, each a number or why it is missing): at batch 1 the compiled Llama's ms/token over
    the graphed Trellis's at the first and last context (goals >= 1.0x and >= 2.5x) and the graphed
    Trellis at the last context over the first (flat: <= 1.10); at batch 64, the same ratio at the
    middle context (>= 2x)."""
    def number(key):
        try:
            return float(ms[key])
        except (KeyError, ValueError):
            return None

    def ratio(a, b):
        x, y = number(a), number(b)
        return f"{x / y:.2f}" if x and y else "not measured"

    first, middle, last = contexts[0], contexts[len(contexts) // 2], contexts[-1]
    low, high = min(batches), max(batches)
    return ["# goals (issue 73): compiled Llama ms / graphed Trellis ms; graphed Trellis at the last context / the first",
            f"  batch {low}, {first}: {ratio(('Llama', True, low, first), ('Trellis', True, low, first))}x (>= 1.0x)",
            f"  batch {low}, {last}: {ratio(('Llama', True, low, last), ('Trellis', True, low, last))}x (>= 2.5x)",
            f"  batch {low}, {last} / {first}: {ratio(('Trellis', True, low, last), ('Trellis', True, low, first))} (<= 1.10)",
            f"  batch {high}, {middle}: {ratio(('Llama', True, high, middle), ('Trellis', True, high, middle))}x (>= 2x)"]


# ---------------------------------------------------------------------------------------------
# Where the time goes.


def profiled(label: str, fn, top: int = 8) -> list[str]:
    """One call of ``fn`` (after an untimed one) under ``torch.profiler``: the device time of its
    kernels against the host's wall time around the call (a large gap: bound by launches), how
    many kernels it launched, and the ``top`` kernels by device time (on a CPU dry run, the
    operators by CPU time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync()
        wall = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    rows = [f"{label}: wall {wall:.2f} ms, kernels {sum(e.count for e in kernels)} taking {busy:.2f} ms of device time"]
    ranked = sorted(kernels or events, key=lambda e: -(e.self_device_time_total if kernels else e.self_cpu_time_total))
    for e in ranked[:top]:
        ms = (e.self_device_time_total if kernels else e.self_cpu_time_total) / 1e3
        rows.append(f"    {ms:8.3f} ms  x{e.count:<5d} {e.key[:90]}")
    print("\n".join(rows), flush=True)
    return rows


def profiled_rows(label: str, fn) -> list[str]:
    """:func:`profiled`, or the line saying why it failed."""
    result = guarded(label, lambda: profiled(label, fn))
    return [result] if isinstance(result, str) else result


def profile_all(op_size, decode_size, context: int) -> list[str]:
    """Where the time goes: the Trellis op's forward+backward at ``op_size`` (chunk 64 and the
    exact recurrence, chunk 1), and one decode step of the model of ``decode_size`` after
    ``context`` tokens, batch 1, eager and with ``compile_decode`` (CUDA graphs)."""
    from trellis_lm.benchmark import DecodeStepper, as_generate_runs
    from trellis_lm.ops import trellis_attention

    B, T, H, D, M = op_size
    x, state = trellis_inputs(B, T, H, D, M, grad=True)
    do = torch.randn(B, T, H, D, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for chunk in (CHUNK, 1):
        def fwd_bwd():
            trellis_attention(*x, initial_state=state, chunk_size=chunk, backend="triton")[0].backward(do)
        rows += profiled_rows(f"op fwd+bwd {op_size}, chunk {chunk}", fwd_bwd)
        free_cached()
    trellis, _ = same_size_models(**decode_size)
    for graphs in (False, True):
        trellis.config.compile_decode = graphs
        with as_generate_runs([trellis]):
            stepper = DecodeStepper(trellis, context)
            rows += profiled_rows(f"decode step, context {context}, batch 1, "
                                  f"{'compile_decode (CUDA graphs)' if graphs else 'eager'}", stepper.step)
    return rows


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile check (no GPU needed).


def compile_check(head_dims=(64, 128), slots=64, chunk=CHUNK) -> list[str]:
    """Compile every kernel for sm_90 with the launch settings the backend uses; report the
    shared memory each needs (and registers / spill stack when cuobjdump can read the cubin)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("--compile-check needs compiled kernels: unset TRITON_INTERPRET")
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trellis_lm.ops.trellis import triton_chunk as tc
    from trellis_lm.ops.trellis import triton_exact as te

    # The ptxas triton itself runs for sm_90: triton 3.9 emits PTX 9.4, which only its second bundled
    # ptxas ("ptxas-blackwell") reads; triton 3.6 has one ptxas and no per-arch choice.
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except (ImportError, TypeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    int_ptrs = ("seq_start", "seq_len", "off_ptr", "base_ptr", "cseq", "cidx")

    def arg_type(name):
        if name.endswith("_ptr"):
            return "*i64" if any(s in name for s in int_ptrs) else "*fp32"
        return "i32"

    def resources(kernel):
        """ptxas's own report of the PTX: registers, spilled bytes, and whether it had to
        serialize the tensor-core (wgmma) instructions for lack of registers."""
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            with open(ptx, "w") as f:
                f.write(kernel.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                                 capture_output=True, text=True).stderr
        used = re.search(r"Used (\d+) registers", out)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
        if not used or not spills:
            return "ptxas: " + (out.strip().splitlines() or ["no report"])[-1]
        serialized = " | wgmma SERIALIZED" if "serialized" in out else ""
        return f"regs {used[1]}, spills {spills[1]} B stored / {spills[2]} B loaded{serialized}"

    rows = [f"ahead-of-time compile for sm_90, chunk {chunk}, M = {slots}, dot precision {tc.DOT_PRECISION}:"]
    failed = False
    for D in head_dims:
        BT, BM, BD = tc._pow2(chunk), tc._pow2(slots), tc._pow2(D)
        P = tc._kernel_precision()
        kernels = [
            ("state_fwd", tc._state_fwd_kernel, dict(BT=BT, BM=BM, BD=BD, CF=2, PREC=P), tc._stages("state")),
            *((f"{prefix}output_fwd", tc._output_fwd_kernel,
               dict(BT=BT, BM=BM, BDK=BD, BDV=BD, CF=2, MF=0, PREC=P, EXACT=exact), tc._stages("output"))
              for prefix, exact in (("", False), ("exact_", True))),
            *((f"{prefix}value_bwd", tc._value_bwd_kernel,
               dict(BT=BT, BM=BM, BDK=BD, BDV=BD, CF=2, MF=0, PREC=P, EXACT=exact), tc._stages("local"))
              for prefix, exact in (("", False), ("exact_", True))),
            *((f"{prefix}key_bwd", tc._key_bwd_kernel, dict(BT=BT, BM=BM, BDK=BD, CF=2, PREC=P, EXACT=exact),
               tc._stages("local")) for prefix, exact in (("", False), ("exact_", True))),
            ("chain_bwd", tc._chain_bwd_kernel, dict(BT=BT, BM=BM, BD=BD, BDR=BD, CF=2, PREC=P),
             tc._stages("chain", BT, BM, BD, BD)),
            ("gates_bwd", tc._gates_bwd_kernel, dict(BT=BT, BM=BM), 1),
            ("recurrent", tc._recurrent_kernel,
             dict(BM=BM, BDK=BD, BDV=BD, CF=2, MF=0, PACKED=False, SEG=tc.RECURRENT_SEGMENT), 1),
            ("recur_bwd", tc._recurrent_bwd_kernel,
             dict(SEG=tc.RECURRENT_SEGMENT, BM=BM, BDK=BD, BDV=BD, CF=2, MF=0), 1),
            ("exact_state", te._exact_state_kernel, dict(te.exact_tiles(False, BT, slots, D), CF=2), 1),
            ("exact_chain", te._exact_chain_bwd_kernel, dict(te.exact_tiles(True, BT, slots, D, D), CF=2), 1),
        ]
        for name, fn, constexprs, stages in kernels:
            names = fn.arg_names
            signature = {n: ("constexpr" if n in constexprs else arg_type(n)) for n in names}
            src = ASTSource(fn, signature, {(names.index(k),): v for k, v in constexprs.items()})
            start = time.perf_counter()
            warps = te.EXACT_WARPS if name in ("exact_state", "exact_chain") else tc._warps(
                "recurrent" if name.startswith("recur") else "chunk", D, D, slots)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
            shared = kernel.metadata.shared
            ok = shared <= SMEM_LIMIT
            failed |= not ok
            rows.append(f"  D={D:3d} {name:16s} warps {warps:2d} stages {stages}: shared {shared:6d} B "
                        f"{'ok' if ok else 'TOO MUCH'} | {resources(kernel)} | {time.perf_counter() - start:5.1f} s")
            print(rows[-1], flush=True)
    if failed:
        rows.append("  some kernel needs more shared memory than an H100 block may use")
    return rows


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script runs")
    parser.add_argument("--only", choices=["op", "decode", "profile", "tune"],
                        help="run one part (profile and tune: only when asked)")
    parser.add_argument("--compile-check", action="store_true", help="no GPU needed: sm_90 compiles only")
    parser.add_argument("--warm", choices=["trellis", "fla_gsa", "fla_gdn"],
                        help="compile (and autotune, unsaved) the kernels --only op runs, at few tokens")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --quick and TRITON_INTERPRET=1: run the script on the CPU (timings meaningless)")
    args = parser.parse_args()
    if args.compile_check:
        rows = compile_check()
        sys.exit(1 if any("TOO MUCH" in r for r in rows) else 0)
    global DEVICE
    if args.dry_run:
        if not (args.quick and os.environ.get("TRITON_INTERPRET") == "1"):
            raise SystemExit("--dry-run needs --quick and TRITON_INTERPRET=1")
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU (or --compile-check, or --quick --dry-run)")
    from trellis_lm.ops.trellis import triton_chunk

    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run"
    print(f"# {date.today()} | {name} | {platform.machine()} | torch {torch.__version__} "
          f"| dot precision {triton_chunk.DOT_PRECISION}", flush=True)
    rows = []
    if args.warm:
        rows += warm(args.warm, [(1, 40, 2, 16, 16)] if args.dry_run else WARM_SIZES)
    elif args.only in (None, "op"):
        rows += bench_ops([(1, 40, 2, 16, 16)] if args.dry_run else QUICK_OP_SIZES if args.quick else OP_SIZES)
    if args.only == "tune":
        sizes = [(1, 40, 2, 16, 16)] * 2 if args.dry_run else QUICK_OP_SIZES * 2 if args.quick else OP_SIZES
        rows += tune(*sizes[0])
        rows += streams_ab(*sizes[1])
    if args.only == "profile":
        if args.quick:
            rows += profile_all((1, 40, 2, 16, 16) if args.dry_run else QUICK_OP_SIZES[0], QUICK_DECODE, 100)
        else:
            rows += profile_all(OP_SIZES[0], FULL_DECODE, 1024)
    if args.only in (None, "decode") and not args.warm:
        if args.quick:
            contexts = [32, 100] if args.dry_run else [256, 1024]
            rows += bench_decode(contexts, [1, 4], steps=10, prefill_piece=512, **QUICK_DECODE)
        else:
            rows += bench_decode([1024, 16384, 131072], [1, 64], steps=50, prefill_piece=8192, **FULL_DECODE)
    print("\n# summary\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
