"""Evaluation with lm-evaluation-harness.

- ``TASKS_DIR``: bundled offline demo tasks (``trellis_demo_choice``: loglikelihood,
  ``trellis_demo_gen``: generate_until, group ``trellis_demo``); pass it as lm-eval's
  ``--include_path`` / ``TaskManager(include_path=...)``.
- :mod:`trellis_lm.eval.harness` (imported on demand, it imports lm-eval): the ``trellis``
  model name for lm-eval and :func:`~trellis_lm.eval.harness.evaluate`.
- Synthetic recall (imported on demand): :mod:`.mqar` (multi-query associative recall data),
  :mod:`.niah` (single-needle retrieval prompts and scoring), :mod:`.synthetic` (trains tiny
  Trellis variants and a Llama baseline on MQAR with ``transformers.Trainer``; driven by
  ``examples/synthetic_recall.py``).
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["TASKS_DIR"]
