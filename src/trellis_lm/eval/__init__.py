"""Measures a user calls (each module imported on demand).

- :mod:`.perplexity`: perplexity at a window length, and by position along long files read in
  one pass; :mod:`.passkey`: passkey retrieval in held-out text; :mod:`.decode_cost`: ms per
  token and cache bytes after a long context.
- Synthetic recall: :mod:`.mqar` (multi-query associative recall data and scoring), :mod:`.niah`
  (single-needle retrieval prompts and scoring).
- lm-evaluation-harness: ``TASKS_DIR``, bundled offline demo tasks (``trellis_demo_choice``:
  loglikelihood, ``trellis_demo_gen``: generate_until, group ``trellis_demo``; pass it as lm-eval's
  ``--include_path`` / ``TaskManager(include_path=...)``), and :mod:`.harness` (it imports
  lm-eval): the ``trellis`` model name for lm-eval and :func:`~trellis_lm.eval.harness.evaluate`.

The studies that train models and write the result pages (``studies/`` in the repository) are
not part of the package.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"

__all__ = ["TASKS_DIR"]
