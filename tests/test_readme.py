"""The README's quickstart is run as written, so it cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def quickstart_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    return python_blocks(text.split("## Quickstart", 1)[1].split("\n## ", 1)[0])


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


def test_every_python_block_runs(tmp_path, monkeypatch):
    """Later sections continue the Quickstart session (its model, tokenizer, saved folder)."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) > len(quickstart_blocks())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
