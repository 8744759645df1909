"""The README's quickstart is run as written, so it cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_readme_starts_with_the_two_commands():
    first_lines = README.read_text(encoding="utf-8").splitlines()[:4]
    assert first_lines[0] == "```"
    assert first_lines[1].startswith("make demo") and first_lines[2].startswith("make test")


def test_quickstart_runs(tmp_path, monkeypatch):
    blocks = quickstart_blocks()
    assert blocks, "the README has no python blocks under ## Quickstart"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:  # one namespace: later blocks build on earlier ones, as a reader's session would
        exec(compile(block, str(README), "exec"), namespace)
