"""The Key-Value Means op (design page ``kvm.md``): one signature, two backends, one function.

:func:`kvm_attention` (:mod:`.dispatch`) is the entry point, :func:`kvm_step` its unchecked decode
step. Beside it: :mod:`.reference` (the per-token loop of the page), :mod:`.chunked` (the chunked
form through ``scaled_dot_product_attention``), :mod:`.step` (one token per row: what the torch
backend runs for decoding), :mod:`.functions` (the budget and the call's options) and
:mod:`.state` (the carried state, whose buffers grow with the tokens up to their caps).
"""

from .dispatch import BACKENDS, kvm_attention, kvm_step
from .functions import BUDGETS
from .state import KVMState

__all__ = ["BACKENDS", "BUDGETS", "KVMState", "kvm_attention", "kvm_step"]
