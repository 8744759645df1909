"""The memory ops of the model family, one folder each, every one with one public function
(and its unchecked decode step, ``<op>_step``, for callers whose arguments are right by
construction: the mixers).

* :mod:`.trellis`: :func:`trellis_attention`, the two-pass Trellis memory (``trellis.md``).
* :mod:`.lattice`: :func:`lattice_attention`, the unit-slot Lattice memory (``lattice.md``).
* :mod:`.kvm`: :func:`kvm_attention`, Key-Value Means: a window plus merged means (``kvm.md``).

Helpers the ops share live beside them: :mod:`.checks` (argument checks), :mod:`.varlen`
(chunk grids for packed and resumed sequences) and :mod:`.state` (the base of the states). Each
op's backend registry is exported under its op's name (``TRELLIS_BACKENDS``, ...).
"""

from .kvm import BACKENDS as KVM_BACKENDS
from .kvm import KVMState, kvm_attention, kvm_step
from .lattice import BACKENDS as LATTICE_BACKENDS
from .lattice import LATTICE_VARIANTS, LatticeState, lattice_attention, lattice_step
from .state import OpState
from .trellis import BACKENDS as TRELLIS_BACKENDS
from .trellis import COMPRESS_FNS, MIX_FNS, WRITE_GRADIENTS, TrellisState, trellis_attention, trellis_step

__all__ = [
    "COMPRESS_FNS", "KVM_BACKENDS", "KVMState", "LATTICE_BACKENDS", "LATTICE_VARIANTS", "LatticeState", "MIX_FNS", "OpState",
    "TRELLIS_BACKENDS", "TrellisState", "WRITE_GRADIENTS",
    "kvm_attention", "kvm_step", "lattice_attention", "lattice_step", "trellis_attention", "trellis_step",
]
