"""``python -m trellis_lm``: the ``trellis-lm`` command."""

from .cli import main

raise SystemExit(main())
