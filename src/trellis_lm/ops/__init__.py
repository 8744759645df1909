"""The memory ops of the model family, one folder each, every one with one public function.

* :mod:`.trellis`: :func:`trellis_attention`, the two-pass Trellis memory (``trellis.md``).
* :mod:`.lattice`: :func:`lattice_attention`, the unit-slot Lattice memory (``lattice.md``).

Helpers the ops share live beside them: :mod:`.checks` (argument checks), :mod:`.varlen`
(chunk grids for packed and resumed sequences) and :mod:`.state` (the base of the states).
"""

from .state import OpState
from .lattice import LATTICE_VARIANTS, LatticeState, lattice_attention
from .trellis import BACKENDS, COMPRESS_FNS, MIX_FNS, TrellisState, trellis_attention

__all__ = [
    "BACKENDS", "COMPRESS_FNS", "LATTICE_VARIANTS", "LatticeState", "MIX_FNS", "OpState", "TrellisState",
    "lattice_attention", "trellis_attention",
]
