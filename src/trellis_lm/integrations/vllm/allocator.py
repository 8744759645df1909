"""glibc's ``malloc`` in a CPU serving process: freed blocks kept for the next step.

A prefill step of the memory layers allocates and frees tens of megabytes of temporaries in
blocks of 4 to 16 MB (the chunk form's products over 4,096 tokens). glibc returns a block
above its mmap threshold to the system when it is freed, and trims the top of its heap when
more than its trim threshold lies free there, so the next step faults the same pages in
again: at the served size (4 x 1,024 tokens, 4 heads of 64, 64 slots) that was a quarter of
the op's CPU time (``BENCHMARKS.md``, issue 52). vLLM's CPU backend answers the same cost by
preloading tcmalloc where its wheel bundles it; where it does not, glibc's two thresholds are
raised instead, as ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would raise them.

The price: a server keeps up to :data:`TRIM_THRESHOLD` bytes of freed heap as its own
between steps rather than returning them (its resident memory stays near its busiest step's).
Nothing changes where the user chose an allocator or these thresholds.
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap: glibc's largest mmap threshold on 64-bit systems.
MMAP_THRESHOLD = 32 << 20
# Free bytes at the heap's top that glibc keeps rather than returns.
TRIM_THRESHOLD = 1 << 30
# What says the user chose: these variables, or another allocator preloaded.
USER_CHOICES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (see the module doc).

    Returns whether they were raised: ``False`` off Linux, where the user set one of
    :data:`USER_CHOICES` or preloaded another allocator, or where the C library has no
    ``mallopt`` that takes them (musl's does nothing and says so).
    """
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_CHOICES):
        return False
    if any(name in os.environ.get("LD_PRELOAD", "") for name in OTHER_ALLOCATORS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
