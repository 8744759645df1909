"""The Trellis op (design page ``trellis.md``): one signature, several backends, one function.

:func:`trellis_attention` (:mod:`.dispatch`) is the entry point, :func:`trellis_step` its unchecked
decode step (:func:`trellis_step_for` with its backend chosen once). Beside it: :mod:`.reference` (the per-token loop of the page), :mod:`.chunked` (the
chunk-parallel PyTorch form) with :mod:`.chunked_autograd` (its autograd Function and hand-written
backward), :mod:`.step` (one decode token in PyTorch), :mod:`.triton_backend` (backend ``"triton"``: the
kernels of :mod:`.triton_chunk` and, for exact writes, :mod:`.triton_exact`) with :mod:`.triton_step`
(its single-token step), :mod:`.compress_mix` (the compression and mixing functions) and
:mod:`.state` (the carried state). The kernels' math in PyTorch is test code (``tests/kernel_mirror.py``).
"""

from .dispatch import BACKENDS, trellis_attention, trellis_step, trellis_step_for
from .compress_mix import COMPRESS_FNS, MIX_FNS, WRITE_GRADIENTS
from .state import TrellisState

__all__ = ["BACKENDS", "COMPRESS_FNS", "MIX_FNS", "WRITE_GRADIENTS", "TrellisState", "trellis_attention", "trellis_step",
           "trellis_step_for"]
