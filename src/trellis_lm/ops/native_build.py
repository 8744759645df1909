"""C sources of the ops built on the user's machine, once, and loaded with ``ctypes``.

A source (the text of a C file, kept in a Python module so that flat remote code carries it) is
written to the cache folder and compiled by the C compiler found as ``$CC``, else the first of :data:`CC_NAMES` on
PATH, for this machine's processor (``-march=native``, tried without it where the compiler
refuses it), into a cache folder: ``$TRELLIS_LM_CACHE``, else ``$XDG_CACHE_HOME/trellis_lm``,
else ``~/.cache/trellis_lm``. The file is named by a hash of the source, the compiler, its
flags and the processor's features, so an edited source, another compiler or a home folder
shared with another kind of machine gets a build of its own; a source and its build are
written under temporary names and renamed, so processes building at once (tests in parallel, a server's
ranks) never load half a file. About a second of compiling on first use, nothing after.

Where no compiler is found, or it fails, :func:`load` raises :class:`NativeUnavailable` with
the reason (the compiler's last lines included), and the op's dispatch takes another backend.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# What compiles the sources where $CC is unset: the first of these on PATH.
CC_NAMES = ("cc", "gcc", "clang")
# -fassociative-math (with the two flags it needs) lets sums be vectorised in any order, as a
# chunk form's products sum them; no flag drops NaN or infinity semantics (no -ffast-math).
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math")
NATIVE_FLAG = "-march=native"
# How long a compile may take before it counts as failed.
COMPILE_SECONDS = 120


class NativeUnavailable(RuntimeError):
    """No C compiler, or the build failed; the message says which and why."""


def compiler() -> str | None:
    """The C compiler's path: ``$CC`` (its first word), else the first of :data:`CC_NAMES` on PATH."""
    chosen = os.environ.get("CC", "").split()
    return shutil.which(chosen[0]) if chosen else next(filter(None, map(shutil.which, CC_NAMES)), None)


def cache_folder() -> Path:
    """Where builds are kept (see the module doc)."""
    if os.environ.get("TRELLIS_LM_CACHE"):
        return Path(os.environ["TRELLIS_LM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trellis_lm"


def _processor() -> str:
    """The processor's features as the build depends on them (``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as info:  # Linux: the flags line names every instruction set
            return next((line for line in info if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _write(path: Path, text: str) -> None:
    """``path`` holding ``text``, written whole or not at all."""
    handle, partial = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
    with os.fdopen(handle, "w") as file:
        file.write(text)
    os.replace(partial, path)


def _compile(cc: str, source: Path, target: Path, name: str) -> None:
    """Build ``source`` into ``target`` (written whole or not at all)."""
    errors = []
    for extra in ((NATIVE_FLAG,), ()):
        handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(handle)
        try:
            done = subprocess.run([cc, *FLAGS, *extra, str(source), "-o", partial, "-lm"], capture_output=True,
                                  text=True, timeout=COMPILE_SECONDS)
            if done.returncode == 0:
                os.replace(partial, target)
                return
            errors.append(done.stderr.strip().splitlines()[-5:])
        except (OSError, subprocess.TimeoutExpired) as error:
            errors.append([str(error)])
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    raise NativeUnavailable(f"{cc} could not build {name}.c: " + " | ".join("; ".join(e) for e in errors))


@functools.cache
def load(name: str, source: str) -> ctypes.CDLL:
    """The library built from the C code ``source`` (compiled on first use as ``<name>-<hash>.c``,
    see the module doc). Raises :class:`NativeUnavailable` where it cannot be built."""
    cc = compiler()
    if cc is None:
        raise NativeUnavailable(f"no C compiler: set $CC or install one of {', '.join(CC_NAMES)}")
    key = hashlib.sha256("\0".join([source, cc, *FLAGS, _processor(), sys.platform]).encode()).hexdigest()[:16]
    folder = cache_folder()
    target = folder / f"{name}-{key}.so"
    if not target.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            code = folder / f"{name}-{key}.c"
            _write(code, source)
        except OSError as error:
            raise NativeUnavailable(f"the cache folder {folder} is not writable ({error}): set $TRELLIS_LM_CACHE") from error
        _compile(cc, code, target, name)
    try:
        return ctypes.CDLL(str(target))
    except OSError as error:
        raise NativeUnavailable(f"{target} does not load: {error}") from error
