"""The Lattice op (design page ``lattice.md``): one signature, two backends, one function.

:func:`lattice_attention` (:mod:`.dispatch`) is the entry point, :func:`lattice_step` its unchecked
decode step (:func:`lattice_step_for` with its backend chosen once). Beside it: :mod:`.reference` (the per-token loop of the page), :mod:`.chunked` (the
chunk-parallel PyTorch form), :mod:`.step` (one decode token), :mod:`.terms` (the variants' write
terms and the retraction) and :mod:`.state` (the carried state). There are no Triton kernels:
``"torch"`` runs on GPUs too.
"""

from .dispatch import BACKENDS, lattice_attention, lattice_step, lattice_step_for
from .state import LatticeState
from .terms import LATTICE_VARIANTS

__all__ = ["BACKENDS", "LATTICE_VARIANTS", "LatticeState", "lattice_attention", "lattice_step",
           "lattice_step_for"]
