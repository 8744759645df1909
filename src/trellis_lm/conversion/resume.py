"""What a distillation's work folder records of the run that made its checkpoints, so that a
resumed run continues that run and no other (:func:`~.pipeline.convert_and_distill`).

The record (``run.json``) holds the source and every option that decides what the stages make:
the conversion's (its config fields among them) and the distillation's, but for how long each
stage runs and its bookkeeping (:data:`MAY_CHANGE`): a run resumed for more steps, or on a
machine of its own, is the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..arguments import argument, named

RECORD = "run.json"
# What a resumed run may set otherwise: how long the stages run, where they read and write, and
# their bookkeeping.
MAY_CHANGE = frozenset({
    "data", "work_dir", "resume", "stage1_steps", "stage2_steps", "save_steps", "eval_every", "stage1_patience",
    "stage1_cache_gib", "cpu",
})
# What a run writes in its work folder, and a fresh start replaces (the teacher's activations,
# found by a fingerprint of the teacher and the blocks, are reused).
STAGE_OUTPUTS = ("layerwise", "logits", "layer_choice.json")


def run_record(source: Path, conversion: Any, distill: Any) -> dict[str, Any]:
    """What a run records: ``{name: value}``, each name as errors mention it (``src``,
    ``ConversionOptions.num_slots``, ``TrellisConfig.write_gradient`` for a further config field,
    ``DistillOptions.stage1_lr``), each value as JSON reads it back."""
    record: dict[str, Any] = {"src": str(source)}
    for options in (conversion, distill):
        owner = type(options).__name__
        for field in dataclasses.fields(options):
            if field.name not in MAY_CHANGE and field.name != "overrides":
                record[f"{owner}.{field.name}"] = getattr(options, field.name)
    record.update({f"TrellisConfig.{name}": value for name, value in sorted(conversion.overrides.items())})
    return json.loads(json.dumps(record, default=str))


def check_resumable(work: Path, record: dict[str, Any]) -> None:
    """Refuse to resume the run in ``work`` where it was made with options other than ``record``
    (naming each that differs), or where it holds checkpoints but no record; a folder without
    checkpoints has nothing to resume (the run starts afresh)."""
    path = work / RECORD
    if not path.is_file():
        if any((work / name).exists() for name in STAGE_OUTPUTS):
            raise ValueError(f"{argument('DistillOptions.resume')}: {work} holds checkpoints but no record of the options "
                             f"that made them ({RECORD}: a run from before runs recorded them), so they cannot be "
                             "continued as this run's: start afresh without resuming (they are then replaced)")
        return
    recorded = json.loads(path.read_text(encoding="utf-8"))
    differing = [name for name in dict.fromkeys([*recorded, *record]) if recorded.get(name) != record.get(name)]
    if differing:
        changes = ", ".join(f"{_label(name)} {record.get(name)!r} (the run's: {recorded.get(name)!r})"
                            for name in differing)
        raise ValueError(f"{argument('DistillOptions.resume')}: {work} holds a run made with other options: {changes}; "
                         "resume it with its own, or start afresh without resuming (its checkpoints are then replaced)")


def begin_run(work: Path, record: dict[str, Any], resume: bool) -> None:
    """Record the run in ``work``; a run that does not resume first removes what an earlier run
    left there (:data:`STAGE_OUTPUTS`), which a later resume would otherwise continue."""
    work.mkdir(parents=True, exist_ok=True)
    if not resume:
        for name in STAGE_OUTPUTS:
            path = work / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    temporary = work / f".{RECORD}.partial"
    temporary.write_text(json.dumps(record, indent=1), encoding="utf-8")
    os.replace(temporary, work / RECORD)


def _label(name: str) -> str:
    """A recorded option as an error names it: the argument (the command's option in its words);
    a further config field as the field."""
    return name if name.startswith("TrellisConfig.") else named(name)


__all__ = ["MAY_CHANGE", "RECORD", "begin_run", "check_resumable", "run_record"]
