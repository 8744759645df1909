"""Fresh venvs with the torch build this environment runs (the Hub-path and install tests).

`make` installs torch from folders of wheels it keeps between runs (``WHEELS`` in the Makefile, a
folder per venv), with pip's constraints file lifted (this project's machines cap torch below the
newest release, which `make test` tests); a venv a test builds takes the same build from the same
place, so that it downloads nothing again.
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

WHEELS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trellis-lm" / "wheels"


def install_running_torch(python: Path) -> None:
    """Install this environment's torch release into the venv of ``python``: from a folder of
    ``WHEELS`` alone where one holds that release's wheel (and so, as `make` downloaded them, its
    dependencies), else from pip's configured index (which holds this machine's CPU build)."""
    release = version("torch").split("+")[0]
    held = sorted(WHEELS.glob(f"*/torch-{release}-*.whl"))
    source = ["--no-index", "--find-links", str(held[0].parent)] if held else []
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", *source, f"torch=={release}"],
                   check=True, timeout=1800, env={**os.environ, "PIP_CONSTRAINT": "/dev/null"})
