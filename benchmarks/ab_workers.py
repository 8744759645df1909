"""Old-against-new timing in two processes: what ``bench_torch_path.py`` and ``bench_family.py`` share.

Each side is a worker process that imports ``trellis_lm`` from its own ``src`` and serves named
tasks over stdin/stdout (:func:`serve`); the driver asks the workers in turn for one repetition at
a time (:func:`alternate`), so a machine whose speed drifts slows both sides alike, and reports
medians and ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from typing import Callable


def count_aten(fn: Callable[[], object]) -> list[int]:
    """``[all, top-level]`` ``aten::`` calls of one ``fn()`` after a warm-up call (torch.profiler;
    top-level: issued by no other ``aten::`` call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = [e for e in prof.events() if e.name.startswith("aten::")]

    def top(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return [len(events), sum(top(e) for e in events)]


def serve(tasks: dict[str, Callable[[], object]]) -> None:
    """The worker's loop: ``time NAME`` answers the seconds of one call, ``count NAME`` its
    :func:`count_aten`, one JSON line each."""
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, name = line.split()
        fn = tasks[name]
        if cmd == "time":
            start = time.perf_counter()
            fn()
            out = time.perf_counter() - start
        else:
            out = count_aten(fn)
        print(json.dumps(out), flush=True)


class Worker:
    """``script --worker SRC --threads N [--quick]`` in a subprocess importing ``trellis_lm`` from ``src``."""

    def __init__(self, script: str, src: str, threads: int, quick: bool) -> None:
        args = [sys.executable, script, "--worker", src, "--threads", str(threads)] + (["--quick"] if quick else [])
        # Passive OpenMP waiting: an idle worker's threads must not spin on the cores the other uses.
        env = dict(os.environ, PYTHONPATH=src, OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"

    def ask(self, cmd: str, name: str):
        self.proc.stdin.write(f"{cmd} {name}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def alternate(workers: dict[str, Worker], tasks: list[str], rounds: int, repeat: int = 1) -> dict:
    """Median seconds of each ``(worker name, task)`` over ``rounds`` turns of ``repeat``
    repetitions, workers and tasks in turn, after one warm-up repetition each."""
    for w in workers.values():
        for t in tasks:
            w.ask("time", t)
    times = {(wn, t): [] for wn in workers for t in tasks}
    for _ in range(rounds):
        for t in tasks:
            for wn, w in workers.items():
                times[wn, t] += [w.ask("time", t) for _ in range(repeat)]
    return {key: statistics.median(v) for key, v in times.items()}


def parse_args(doc: str, parts: str, threads: int) -> argparse.Namespace:
    """The command line both scripts take: ``--old``, ``--quick``, ``--threads``, ``--rounds``
    (default 7, 2 with ``--quick``), ``--parts`` (a comma-separated subset of ``parts``) and the
    hidden ``--worker SRC`` of the worker processes."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="root of an older checkout to compare against (its src/ is imported)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds: checks the benchmark runs")
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, 2 with --quick)")
    parser.add_argument("--parts", default=parts, help=f"comma-separated subset of {parts} (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 7)
    args.parts = args.parts.split(",")
    return args


def header(threads: int) -> str:
    """The first line of a report: date, machine, threads and the load average when it starts."""
    return (f"# {date.today()} | {platform.processor() or platform.machine()} | {threads} threads | "
            f"load {os.getloadavg()[0]:.2f}")


def start(doc: str, parts: str, threads: int, worker: Callable[[str, int, bool], None]) -> argparse.Namespace | None:
    """A script's entry: :func:`parse_args`; in a worker process (``--worker SRC``) run
    ``worker(src, threads, quick)`` and return None, otherwise print :func:`header` and return the
    arguments."""
    args = parse_args(doc, parts, threads)
    if args.worker:
        worker(args.worker, args.threads, args.quick)
        return None
    print(header(args.threads))
    return args
