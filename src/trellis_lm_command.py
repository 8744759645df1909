"""The ``trellis-lm`` command's entry point (``[project.scripts]``).

It lives outside the package so that the package can tell it is imported for the command: its
``__init__`` then leaves the model stack unimported (it registers the model with transformers,
which imports torch and transformers' modeling code: seconds), ``--help`` and a command line that
argparse refuses answer at once, and :func:`trellis_lm.cli.main` registers once a command runs.
"""

from __future__ import annotations

from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``trellis-lm`` (:func:`trellis_lm.cli.main`)."""
    from trellis_lm.cli import main as run

    return run(argv)
