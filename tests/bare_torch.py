"""Fresh venvs with the torch build this environment runs (the Hub-path and install tests).

`make` provisions its venvs with uv, whose cache keeps the files of every release it downloaded;
a venv a test builds takes the same build with the same uv (from the same cache, so nothing is
downloaded again), and falls back to pip outside a venv that `make` made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path


def install_running_torch(python: Path) -> None:
    """Install this environment's torch build (local label included, e.g. ``2.13.0+cpu``) into
    the venv of ``python``; the folders pip is told to find wheels in (``PIP_FIND_LINKS``, where
    this project's machines keep their CPU build) are searched too."""
    spec = f"torch=={version('torch')}"
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.exists() else shutil.which("uv")
    links = [f"--find-links={folder}" for folder in os.environ.get("PIP_FIND_LINKS", "").split()]
    if uv:
        command = [uv, "pip", "install", "-q", "--python", str(python), *links, spec]
    else:  # pip reads PIP_FIND_LINKS itself; its constraints file may cap torch below this build
        command = [str(python), "-m", "pip", "install", "-q", "--no-compile", spec]
    subprocess.run(command, check=True, timeout=1800, env={**os.environ, "PIP_CONSTRAINT": "/dev/null"})
