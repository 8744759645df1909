"""Figures of the decode cost against the context length, from a ``bench_decode.py --json`` record.

    PYTHONPATH=src .venv/bin/python benchmarks/plot_decode.py benchmarks/results/decode_cpu_2026-11-25.json
    PYTHONPATH=src .venv/bin/python benchmarks/plot_decode.py RECORD --out docs/figures   # the repository's

Writes into ``--out`` (default ``outputs/figures``):

- ``decode_vs_context.png`` (README.md): one row's cache bytes and the ms per decoded token at
  batch 1, against the context, for all-Trellis (eager and ``compile_decode``), the hybrid and a
  Llama of the same size;
- ``decode_all_models.png`` (BENCHMARKS.md): ms per token against the context for every model,
  at batch 1 and batch 8.

A record without cache sizes (one written before ``bench_decode.py`` kept them) gets them here:
each model of ``bench_decode.py`` reads each context's tokens and its cache is measured (seconds
to a minute per model; no timing), and they are written back into the record.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Line styles: the memory models solid, the hybrid dashed, the Llama black.
STYLES = {
    "trellis": dict(color="tab:blue", label="Trellis"),
    "trellis-compiled": dict(color="tab:blue", linestyle=":", label="Trellis, compile_decode"),
    "lattice": dict(color="tab:purple", label="Lattice"),
    "lattice-compiled": dict(color="tab:purple", linestyle=":", label="Lattice, compile_decode"),
    "kvm": dict(color="tab:olive", label="KVM"),
    "hybrid": dict(color="tab:orange", linestyle="--", label="hybrid (3 Trellis + 1 attention)"),
    "hybrid-compiled": dict(color="tab:orange", linestyle="-.", label="hybrid, compile_decode"),
    "llama": dict(color="black", label="Llama (same size)"),
}


def by_model(record: dict[str, Any]) -> dict[tuple[str, int], dict[int, float]]:
    """``{(model, batch): {context: ms per token}}`` from the record's ``"model|context|batch"`` keys."""
    table: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for key, ms in record["ms"].items():
        name, context, batch = key.split("|")
        table[name, int(batch)][int(context)] = ms
    return table


def measured_cache_bytes(record: dict[str, Any]) -> dict[str, int]:
    """``{"model|context": bytes}`` of one row's cache after each context, for the record's models."""
    sys.path.insert(0, str(HERE))
    import bench_decode
    import torch

    size = record["size"]
    models = bench_decode.build_models(size, compiled=False, quick=False)
    contexts = sorted({int(key.split("|")[1]) for key in record["ms"]})
    measured = {}
    with torch.no_grad():
        for name, model in models.items():
            for context in contexts:
                cache, _ = bench_decode.prefill(model, context, size["vocab"])
                measured[f"{name}|{context}"] = bench_decode.cache_bytes(cache)
                print(f"{name} after {context} tokens: {measured[f'{name}|{context}']:,} bytes", flush=True)
    return measured


def cache_of(record: dict[str, Any], name: str) -> dict[int, int]:
    """One row's cache bytes by context (compiled models hold their eager twin's cache)."""
    base = name.removesuffix("-compiled")
    return {int(key.split("|")[1]): value for key, value in record["cache_bytes"].items() if key.split("|")[0] == base}


def draw_readme(record: dict[str, Any], source: str) -> Any:
    import matplotlib.pyplot as plt

    table = by_model(record)
    figure, (bytes_axes, ms_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in ("trellis", "hybrid", "llama"):
        cache = cache_of(record, name)
        bytes_axes.plot(list(cache), [b / 2**20 for b in cache.values()], marker="o", **STYLES[name])
    bytes_axes.set(xscale="log", yscale="log", xlabel="tokens of context", ylabel="cache of one sequence (MiB)",
                   title="Memory: fixed, against a KV cache that grows")
    for name in ("trellis", "trellis-compiled", "hybrid", "llama"):
        if (name, 1) in table:
            points = table[name, 1]
            ms_axes.plot(list(points), list(points.values()), marker="o", **STYLES[name])
    ms_axes.set(xscale="log", xlabel="tokens of context", ylabel="ms per decoded token (batch 1)",
                title="Time per token: flat, against one that grows")
    ms_axes.set_ylim(bottom=0)
    for axes in (bytes_axes, ms_axes):
        axes.grid(alpha=0.3, which="both")
        axes.legend(fontsize=8)
    figure.suptitle(source, fontsize=8)
    figure.tight_layout()
    return figure


def draw_all(record: dict[str, Any], source: str) -> Any:
    import matplotlib.pyplot as plt

    table = by_model(record)
    batches = sorted({batch for _, batch in table})
    figure, axes_row = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for axes, batch in zip(axes_row[0], batches):
        for name, style in STYLES.items():
            if (name, batch) in table:
                points = table[name, batch]
                axes.plot(list(points), list(points.values()), marker="o", **style)
        axes.set(xscale="log", yscale="log", xlabel="tokens of context", ylabel="ms per decoded token",
                 title=f"batch {batch}")
        axes.grid(alpha=0.3, which="both")
    axes_row[0][0].legend(fontsize=7)
    figure.suptitle(source, fontsize=8)
    figure.tight_layout()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="a bench_decode.py --json file")
    parser.add_argument("--out", type=Path, default=Path("outputs/figures"), help="folder of the PNGs (default %(default)s)")
    args = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(args.record.read_text())
    if "cache_bytes" not in record:
        record["cache_bytes"] = measured_cache_bytes(record)
        args.record.write_text(json.dumps(record, indent=1) + "\n")
    source = record.get("source", f"benchmarks/bench_decode.py, {args.record.name}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in (("decode_vs_context.png", draw_readme), ("decode_all_models.png", draw_all)):
        figure = draw(record, source)
        figure.savefig(args.out / name, dpi=110)
        plt.close(figure)
        print(f"wrote {args.out / name}")


if __name__ == "__main__":
    main()
