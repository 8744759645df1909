"""The Lattice and KVM torch paths against an older checkout of themselves (CPU).

    PYTHONPATH=src .venv/bin/python benchmarks/bench_family.py --old /tmp/old-230ef55
    PYTHONPATH=src .venv/bin/python benchmarks/bench_family.py --old /tmp/old-230ef55 --quick

(make the old checkout with ``git worktree add /tmp/old-230ef55 230ef55``; without ``--old`` the
figures of this checkout alone are printed.) ``--parts`` picks a subset of
``lattice,kvm,c1,decode,count``.

Old and new code run in two worker processes, each importing ``trellis_lm`` from its own ``src``;
the driver asks them in turn for one timed repetition at a time (alternating rounds), so a
shared machine whose speed drifts slows both alike. Figures are medians, compared as ratios
taken in the same run. Operator calls are counted with ``torch.profiler``: every ``aten::`` call
(nested ones included), and for decode also the top-level ones (those no other ``aten::`` call
issued), per token.

Measured (float32, one sequence): Lattice (B, T, H, M, D) = (1, 2048, 4, 64, 64), C = 64, dec,
forward and forward+backward; KVM the shapes of ``bench_kvm.py`` (H = 4, D = 64, C = 256, a
window of 2 chunks, 256 state rows): forward at T = 16384, forward+backward at T = 4096; both
ops at C = 1 on the default backend against the per-token ``reference``; eager decode (batch 1)
of a 4-layer, 256-wide LM (4 heads of 64) of all-Lattice and all-KVM mixers after a prefill of
1024 tokens (KVM folds once every 256 steps; a turn of steps is short, so its median is a
plain step).
"""

from __future__ import annotations

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
    from trellis_lm.ops import kvm_attention, lattice_attention

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def unit(*shape):
        return F.normalize(rand(*shape), dim=-1)

    # Lattice: q, k, v unit, gamma = sigmoid(N(0, 1)), S0 with N(0, 1) rows (as the layer feeds it).
    B, H, M, D = 1, 4, 64, 64

    def lattice_inputs(T, grad):
        xs = [unit(B, T, H, M), unit(B, T, H, M), unit(B, T, H, D), torch.sigmoid(rand(B, T, H)), rand(B, H, M, D)]
        return [x.requires_grad_(grad) for x in xs]

    T_lat, T_c1 = (256, 64) if quick else (2048, 512)
    lat = {name: lattice_inputs(T, grad) for name, T, grad in
           (("fb", T_lat, True), ("f", T_lat, False), ("c1", T_c1, True))}

    def lattice(x, C, backend="torch", grad=True):
        with torch.set_grad_enabled(grad):
            o, _ = lattice_attention(*x[:4], initial_state=x[4], chunk_size=C, backend=backend)
            if grad:
                o.sum().backward()

    # KVM: bench_kvm.py's shapes (C = 256, 2 window chunks, 256 state rows, R = D / 2, 1 sink).
    kc, ks = (64, 64) if quick else (256, 256)

    def kvm_inputs(T, grad):
        xs = [F.layer_norm(rand(B, T, H, D), (D,)), F.layer_norm(rand(B, T, H, D), (D,)), rand(B, T, H, D),
              0.5 + torch.rand(B, T, H, generator=gen), torch.ones(H, D), torch.zeros(H, D), torch.ones(H, 2)]
        return [x.requires_grad_(grad) for x in xs]

    T_kf, T_kfb = (1024, 512) if quick else (16384, 4096)
    kvm = {"f": kvm_inputs(T_kf, False), "fb": kvm_inputs(T_kfb, True), "c1": kvm_inputs(T_c1 // 2, True)}

    def kvm_call(x, C, S, backend="torch", grad=True):
        with torch.set_grad_enabled(grad):
            o, _ = kvm_attention(*x[:4], norm_weight=x[4], norm_bias=x[5], temperature=x[6], chunk_size=C,
                                 window_chunks=2, state_size=S, rope_dims=D // 2, sinks=min(1, C - 1),
                                 backend=backend)
            if grad:
                o.sum().backward()

    # Decode: a 4-layer, 256-wide LM of one mixer kind, eager, batch 1.
    hidden, vocab = (64, 256) if quick else (256, 4096)
    heads = 1 if quick else 4
    context = 256 if quick else 1024
    steppers = {}

    def stepper(kind):
        if kind not in steppers:
            from trellis_lm.benchmark import DecodeStepper

            config = TrellisConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=4, mixer_types=[kind] * 4,
                                   intermediate_size=hidden * 8 // 3, num_heads=heads, head_dim=64, num_slots=64,
                                   chunk_size=64, kvm_chunk_size=kc, kvm_state_size=ks, tie_word_embeddings=True)
            torch.manual_seed(0)
            steppers[kind] = DecodeStepper(TrellisForCausalLM(config).eval(), context)
        return steppers[kind]

    tasks = {
        "lat_fb_c64": lambda: lattice(lat["fb"], 64), "lat_f_c64": lambda: lattice(lat["f"], 64, grad=False),
        "lat_fb_c1": lambda: lattice(lat["c1"], 1), "lat_f_c1": lambda: lattice(lat["c1"], 1, grad=False),
        "lat_ref_fb_c1": lambda: lattice(lat["c1"], 1, "reference"),
        "lat_ref_f_c1": lambda: lattice(lat["c1"], 1, "reference", grad=False),
        "kvm_f": lambda: kvm_call(kvm["f"], kc, ks, grad=False), "kvm_fb": lambda: kvm_call(kvm["fb"], kc, ks),
        "kvm_fb_c1": lambda: kvm_call(kvm["c1"], 1, 16), "kvm_f_c1": lambda: kvm_call(kvm["c1"], 1, 16, grad=False),
        "kvm_ref_fb_c1": lambda: kvm_call(kvm["c1"], 1, 16, "reference"),
        "kvm_ref_f_c1": lambda: kvm_call(kvm["c1"], 1, 16, "reference", grad=False),
        "dec_lattice": lambda: stepper("lattice").step(), "dec_kvm": lambda: stepper("kvm").step(),
    }

    serve(tasks)


def run(sources: dict, threads: int, quick: bool, rounds: int, parts: list[str]) -> list[str]:
    workers = {name: Worker(__file__, src, threads, quick) for name, src in sources.items()}
    both = len(workers) == 2
    rows = []

    def compare(title: str, tasks: list, rounds: int, repeat: int = 1, unit: float = 1e3, label: str = "ms"):
        ms = alternate(workers, tasks, rounds, repeat)
        rows.append(title)
        for t in tasks:
            cells = " | ".join(f"{wn} {ms[wn, t] * unit:9.2f} {label}" for wn in workers)
            ratio = f" | new is {ms['old', t] / ms['new', t]:.2f}x faster" if both else ""
            rows.append(f"  {t:14s} {cells}{ratio}")
        return ms

    T = 256 if quick else 2048
    if "lattice" in parts:
        compare(f"Lattice (B,T,H,M,D)=(1,{T},4,64,64), C=64, dec, float32:", ["lat_fb_c64", "lat_f_c64"], rounds)
    if "kvm" in parts:
        compare("KVM H=4 D=64 C=%d window 2 chunks state %d, forward T=%d, fwd+bwd T=%d:"
                % ((64, 64, 1024, 512) if quick else (256, 256, 16384, 4096)), ["kvm_f", "kvm_fb"], rounds)
    if "c1" in parts:
        for op, T1 in (("lat", 64 if quick else 512), ("kvm", 32 if quick else 256)):
            tasks = [f"{op}_fb_c1", f"{op}_ref_fb_c1", f"{op}_f_c1", f"{op}_ref_f_c1"]
            ms = alternate(workers, tasks, max(3, rounds // 2))
            rows.append(f"{op} at C=1, T={T1}: default 'torch' backend vs the per-token 'reference':")
            for kind, a, b in (("fwd+bwd", tasks[0], tasks[1]), ("forward", tasks[2], tasks[3])):
                for wn in workers:
                    rows.append(f"  {kind:8s} {wn}: torch {ms[wn, a] * 1e3:8.1f} ms | reference {ms[wn, b] * 1e3:8.1f}"
                                f" ms | reference/torch {ms[wn, b] / ms[wn, a]:.2f}x")
    if "decode" in parts:
        compare("eager decode, 4 layers x %d wide, batch 1, after %d tokens, ms/token:"
                % ((64, 256) if quick else (256, 1024)), ["dec_lattice", "dec_kvm"], rounds, repeat=8)
    if "count" in parts:
        rows.append("operator calls (torch.profiler, aten::* all / top-level):")
        for t in ("lat_f_c64", "lat_fb_c64", "kvm_f", "kvm_fb", "lat_f_c1", "lat_fb_c1", "dec_lattice", "dec_kvm"):
            counts = {wn: w.ask("count", t) for wn, w in workers.items()}
            rows.append(f"  {t:14s} " + " | ".join(f"{wn} {c[0]:7d} / {c[1]:6d}" for wn, c in counts.items()))
    for w in workers.values():
        w.close()
    return rows


def main() -> None:
    args = start(__doc__, "lattice,kvm,c1,decode,count", threads=1, worker=_worker)
    if args is None:
        return
    sources = {"new": NEW_SRC}
    if args.old:
        sources = {"old": os.path.join(os.path.abspath(args.old), "src"), "new": NEW_SRC}
    print("\n".join(run(sources, args.threads, args.quick, args.rounds, args.parts)))


if __name__ == "__main__":
    main()
