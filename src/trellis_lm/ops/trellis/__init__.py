"""The Trellis op (design page ``trellis.md``): one signature, several backends, one function.

:func:`trellis_attention` (:mod:`.dispatch`) is the entry point, :func:`trellis_step` its unchecked
decode step. Beside it: :mod:`.reference` (the per-token loop of the page), :mod:`.chunked` (the
chunk-parallel PyTorch form),
:mod:`.step` (one decode token), :mod:`.triton_chunk` / :mod:`.triton_decode` (GPU kernels),
:mod:`.functions` (the compression and mixing functions) and :mod:`.state` (the carried state).
"""

from .dispatch import BACKENDS, trellis_attention, trellis_step
from .functions import COMPRESS_FNS, MIX_FNS
from .state import TrellisState

__all__ = ["BACKENDS", "COMPRESS_FNS", "MIX_FNS", "TrellisState", "trellis_attention", "trellis_step"]
