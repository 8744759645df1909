"""The words a mixer declares its cache entry in.

A mixer states every tensor of its cache entry as a :class:`TensorSpec` (``Mixer.cache_layout``):
sizes fixed by the configuration as ints, sizes that vary per cache as a :class:`Dim`. Files
of entries are checked against these layouts (:mod:`.cache_files`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


@dataclass(frozen=True)
class Dim:
    """A size of a cache tensor that is not fixed by the configuration alone.

    ``name`` ties sizes together: every dim of one name holds one value within a layer entry
    (``"rows"``: within the whole cache); ``"columns"`` must equal the tokens the cache has seen.
    ``most`` bounds it (buffers that grow with the tokens up to a configured size).
    """

    name: str
    most: Optional[int] = None


ROWS = Dim("rows")
COLUMNS = Dim("columns")


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of a layer's cache entry must be, as its mixer declares it
    (``Mixer.cache_layout``).

    Attributes:
        dims: each dim's size: an int (fixed by the configuration) or a :class:`Dim`.
        dtype: ``"float"`` (any floating dtype), ``"int64"`` or ``"bool"``.
        most: for counters, the largest value allowed: an int, or ``COLUMNS`` (the tokens seen).
    """

    dims: tuple[Union[int, Dim], ...]
    dtype: str = "float"
    most: Union[int, Dim, None] = None
