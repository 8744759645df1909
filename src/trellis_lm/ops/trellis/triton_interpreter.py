"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) across triton releases.

The interpreter holds every scalar of a kernel as a one-element numpy array. Triton 3.6 turns
one into a Python int (a loop bound such as ``range(0, n_chunks)``) with ``int(array)``, which
numpy 2.4 refuses for an array with a dimension ("only 0-dimensional arrays can be converted
to Python scalars"), so no kernel of this backend with a loop ran under it. Triton 3.9 squeezes
the array first; :func:`take_one_element_as_index` makes an older interpreter that fails here
take the element as well. Compiled kernels (a GPU) never take this path.
"""

from __future__ import annotations

import operator
import types


def _index_fails(patch_tensor, scope_type) -> bool:
    """Whether the interpreter's ``tensor.__index__`` refuses a one-element scalar."""
    import numpy as np

    class Probe:
        pass

    scope = scope_type()
    patch_tensor(Probe, scope)
    probe = Probe()
    probe.handle = types.SimpleNamespace(data=np.ones(1, dtype=np.int32))
    try:
        operator.index(probe)
    except TypeError:
        return True
    finally:
        scope.restore()
    return False


def take_one_element_as_index() -> None:
    """Make the interpreter's ``tensor.__index__`` take the element of a one-element array (and
    refuse any other, as before), where it fails on one. Idempotent; does nothing on a triton
    whose interpreter has no such hook or already converts."""
    try:  # transformers' import check of a checkpoint's code skips a try block: triton stays optional there
        from triton.runtime import interpreter
    except ImportError:
        return

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_tensor is None or scope_type is None or not _index_fails(patch_tensor, scope_type):
        return

    def patch_tensor_indexing_its_element(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_tensor_indexing_its_element
