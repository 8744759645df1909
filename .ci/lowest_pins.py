"""Print pip constraints pinning every dependency with a lower bound in pyproject.toml to that
bound, so `make test-lowest` runs against the oldest versions the package says it supports
(torch 2.11 among them: PyPI's CUDA build, which runs on a CPU). An environment marker is kept,
so that a Linux-only pin (triton) is no constraint elsewhere.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path


def lowest_pins(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    requirements = project["dependencies"] + [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    pins = []
    for requirement in requirements:
        match = re.match(r"^([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*([^;]*)(;.*)?$", requirement)
        name, specifiers, marker = match[1], match[2], match[3] or ""
        lower = re.search(r">=\s*([\w.]+)", specifiers)
        if lower:
            pins.append(f"{name}=={lower[1]}{marker}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("pyproject.toml"))))
