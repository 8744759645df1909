"""Loads the bundled demo data for the task YAMLs in this folder (lm-eval imports this file by path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def load_bundled(data_files: dict[str, str], **_metadata: Any) -> datasets.DatasetDict:
    """``load_dataset("json", data_files=...)`` with relative paths taken from this folder
    (absolute ones are used as they are); lm-eval also passes the task's metadata, ignored."""
    return datasets.load_dataset("json", data_files={split: str(HERE / path) for split, path in data_files.items()})
