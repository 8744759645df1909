"""The Trellis op: one signature, several backends computing the same function.

``trellis_attention`` (in :mod:`.dispatch`) is the public entry point; ``reference`` holds the
per-token loop of the design page, ``chunked`` the chunk-parallel PyTorch form, ``functions``
the compression and mixing functions they share, and ``state`` the carried state.
"""

from .dispatch import BACKENDS, trellis_attention
from .functions import COMPRESS_FNS, MIX_FNS
from .state import TrellisState

__all__ = ["BACKENDS", "COMPRESS_FNS", "MIX_FNS", "TrellisState", "trellis_attention"]
