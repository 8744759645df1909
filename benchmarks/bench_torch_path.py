"""The PyTorch (CPU) path against an older checkout of itself, and eager decode against Llama.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_torch_path.py --old /tmp/old-af93191
    PYTHONPATH=src .venv/bin/python benchmarks/bench_torch_path.py --old /tmp/old-af93191 --quick

(make the old checkout with ``git worktree add /tmp/old-af93191 af93191``; without ``--old``
only the decode comparison and the operator counts of this checkout run.)

Old and new code run in two worker processes, each importing ``trellis_lm`` from its own
``src``; the driver asks them in turn for one timed repetition at a time (alternating rounds),
so a shared machine whose speed drifts slows both sides alike. Every figure reported is a
median and a ratio taken in the same run. Operator calls are counted with ``torch.profiler``
(every ``aten::`` call, nested ones included, as the profiler lists them).

Measured: the op's forward+backward and forward (B, T, H, D, M) = (1, 2048, 4, 64, 64), C = 64,
float32, anchored writes, and at C = 1 against the per-token ``reference`` backend; a 4-layer, 256-wide LM
(4 heads of 64, 64 slots, vocabulary 4096, T = 2048) forward and forward+backward; eager decode
ms/token of that LM against a same-size ``LlamaForCausalLM`` (sdpa, ``DynamicCache``) after
256, 8192 and 32768 tokens of context; the single-token decode steps of the Trellis op (exact
writes) and the Lattice op (``"enc"``) for 1 and 16 rows of 4 heads (part ``step``).
"""

from __future__ import annotations

import inspect
import os
import sys

from ab_workers import Worker, alternate, serve, start

HERE = os.path.dirname(os.path.abspath(__file__))
NEW_SRC = os.path.join(os.path.dirname(HERE), "src")


# ----------------------------------------------------------------------------- worker side
def _worker(src: str, threads: int, quick: bool) -> None:
    sys.path.insert(0, src)
    import torch
    import torch.nn.functional as F

    from trellis_lm import TrellisConfig, TrellisForCausalLM
    from trellis_lm.ops import lattice_attention, lattice_step, trellis_attention, trellis_step

    torch.set_num_threads(threads)
    T = 256 if quick else 2048
    B, H, D, M = 1, 4, 64, 64
    hidden, layers, vocab = (64, 2, 256) if quick else (256, 4, 4096)
    heads, head_dim, slots = (1, 64, 16) if quick else (4, 64, 64)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def op_inputs(T, requires_grad):
        xs = [F.normalize(rand(B, T, H, D), dim=-1), F.normalize(rand(B, T, H, D), dim=-1),
              F.normalize(rand(B, T, H, D), dim=-1), rand(B, T, H, M),
              F.logsigmoid(rand(B, T, H) + 3), torch.sigmoid(rand(B, T, H))]
        state = [rand(B, H, M, D), rand(B, H, M, D)]
        return [t.requires_grad_(requires_grad) for t in xs], [t.requires_grad_(requires_grad) for t in state]

    x_g, s_g = op_inputs(T, True)
    x_n, s_n = op_inputs(T, False)
    T1 = 64 if quick else 512
    x_1, s_1 = op_inputs(T1, True)

    # The op's rows time anchored writes, the function every checkout computes by these arguments
    # (the op's default became "exact" after af93191, which has no write_gradient).
    anchored = {"write_gradient": "anchored"} if "write_gradient" in inspect.signature(trellis_attention).parameters else {}

    def op_fb(C, backend="torch", x=x_g, s=s_g):
        o, _ = trellis_attention(*x, initial_state=s, chunk_size=C, backend=backend, **anchored)
        o.sum().backward()

    def op_f(C, backend="torch", x=x_n, s=s_n):
        with torch.no_grad():
            trellis_attention(*x, initial_state=s, chunk_size=C, backend=backend, **anchored)

    config = TrellisConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=hidden * 8 // 3, num_heads=heads, head_dim=head_dim,
                           num_slots=slots, chunk_size=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = TrellisForCausalLM(config)
    ids = torch.randint(0, vocab, (1, T), generator=gen)

    def lm_fb():
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def lm_f():
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)

    def step_inputs(rows):
        """One token per row and the state after 8 (exact writes), for the Trellis and the Lattice
        decode steps (``"enc"``: its write reads the memory times the value)."""
        x = [F.normalize(rand(rows, 9, H, D), dim=-1) for _ in range(3)]
        gates = [rand(rows, 9, H, M), F.logsigmoid(rand(rows, 9, H) + 3), torch.sigmoid(rand(rows, 9, H))]
        prefix = [t[:, :8] for t in x + gates]
        _, t_state = trellis_attention(*prefix, output_final_state=True, write_gradient="exact")
        _, l_state = lattice_attention(x[0][:, :8], x[1][:, :8], x[2][:, :8], gates[2][:, :8],
                                       initial_state=F.normalize(rand(rows, H, M, D), dim=-1),
                                       output_final_state=True, variant="enc")
        token = [t[:, 8:] for t in x + gates]
        return token, t_state, l_state

    def step_tasks(rows):
        token, t_state, l_state = step_inputs(rows)
        q, k, v, _, _, gamma = token

        def trellis():
            trellis_step(*token, state=t_state, write_gradient="exact")

        def lattice():
            lattice_step(q, k, v, gamma, state=l_state, variant="enc")

        return {f"trellis_step_r{rows}": trellis, f"lattice_step_r{rows}": lattice}

    tasks = {
        **step_tasks(1), **step_tasks(16),
        "op_fb_c64": lambda: op_fb(64), "op_f_c64": lambda: op_f(64),
        "op_fb_c1": lambda: op_fb(1, x=x_1, s=s_1), "op_f_c1": lambda: op_f(1, x=x_1, s=s_1),
        "ref_fb_c1": lambda: op_fb(1, "reference", x=x_1, s=s_1),
        "ref_f_c1": lambda: op_f(1, "reference", x=x_1, s=s_1),
        "lm_fb": lm_fb, "lm_f": lm_f,
    }

    serve(tasks)


def compare_old_new(old_src: str, threads: int, quick: bool, rounds: int, parts: str) -> list[str]:
    workers = {"old": Worker(__file__, old_src, threads, quick), "new": Worker(__file__, NEW_SRC, threads, quick)}
    rows = []
    groups = [
        ("op (B,T,H,D,M)=(1,%d,4,64,64), C=64, float32" % (256 if quick else 2048), ["op_fb_c64", "op_f_c64"]),
        ("LM 4x256 (4 heads of 64, 64 slots, vocab 4096), T=%d" % (256 if quick else 2048), ["lm_fb", "lm_f"]),
        ("step of decoding, one token (4 heads of 64, 64 slots; Trellis exact writes, Lattice 'enc'), "
         "1 and 16 rows, float32", ["trellis_step_r1", "trellis_step_r16", "lattice_step_r1", "lattice_step_r16"]),
    ]
    for title, tasks in groups:
        if title.split()[0] not in parts:
            continue
        ms = alternate(workers, tasks, rounds)
        rows.append(title + ":")
        for t in tasks:
            rows.append(f"  {t:16s} old {ms['old', t] * 1e3:9.3f} ms | new {ms['new', t] * 1e3:9.3f} ms | "
                        f"new is {ms['old', t] / ms['new', t]:.2f}x faster")
    # C = 1: the default backend against the per-token reference (new code; old for comparison).
    tasks = ["op_fb_c1", "ref_fb_c1", "op_f_c1", "ref_f_c1"]
    if "c1" not in parts:
        tasks = []
    ms = alternate(workers, tasks, max(3, rounds // 2))
    rows.append("op at C=1, T=%d (default 'torch' backend vs the per-token 'reference'):" % (64 if quick else 512))
    for kind, a, b in (("fwd+bwd", "op_fb_c1", "ref_fb_c1"), ("forward", "op_f_c1", "ref_f_c1")) if tasks else ():
        for side in ("old", "new"):
            rows.append(f"  {kind:8s} {side}: torch {ms[side, a] * 1e3:8.1f} ms | reference {ms[side, b] * 1e3:8.1f} ms"
                        f" | reference/torch {ms[side, b] / ms[side, a]:.2f}x")
    rows.append("operator calls (torch.profiler, aten::*):")
    for t in ("op_f_c64", "op_fb_c64", "lm_f", "lm_fb") if "count" in parts else ():
        counts = {wn: w.ask("count", t) for wn, w in workers.items()}
        rows.append(f"  {t:10s} old {counts['old'][0]:7d} | new {counts['new'][0]:7d}")
    for w in workers.values():
        w.close()
    return rows


def bench_decode(threads: int, quick: bool, rounds: int) -> list[str]:
    import torch

    sys.path.insert(0, NEW_SRC)
    from trellis_lm.benchmark import interleaved_decode_ms, same_size_models

    torch.set_num_threads(threads)
    size = (dict(hidden=64, layers=2, heads=1, head_dim=64, slots=16, vocab=256) if quick
            else dict(hidden=256, layers=4, heads=4, head_dim=64, slots=64, vocab=4096))
    contexts = [64, 512] if quick else [256, 8192, 32768]
    trellis, _, llama = same_size_models(**size)
    ms = interleaved_decode_ms({(n, c): (m, c) for c in contexts for n, m in (("Trellis", trellis), ("Llama", llama))},
                               rounds)
    rows = [f"eager decode, batch 1, float32, {size}, chunk 64; {rounds} turns of 8 steps:"]
    for c in contexts:
        rows.append(f"  context {c:6d}: Trellis {ms['Trellis', c]:7.2f} | Llama {ms['Llama', c]:7.2f} ms/token | "
                    f"Llama/Trellis {ms['Llama', c] / ms['Trellis', c]:.2f}x")
    lo, hi = contexts[0], contexts[-1]
    rows.append(f"  ms/token at {hi} / at {lo}: Trellis {ms['Trellis', hi] / ms['Trellis', lo]:.3f} "
                f"(Llama {ms['Llama', hi] / ms['Llama', lo]:.3f})")
    return rows


def main() -> None:
    args = start(__doc__, "op,LM,step,c1,count,decode", threads=2, worker=_worker)
    if args is None:
        return
    rows = []
    if args.old:
        rows += compare_old_new(os.path.join(os.path.abspath(args.old), "src"), args.threads, args.quick, args.rounds,
                                args.parts)
    if "decode" in args.parts:
        rows += bench_decode(args.threads, args.quick, args.rounds)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
