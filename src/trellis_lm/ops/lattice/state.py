"""The recurrent state the op carries from one call to the next."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import OpState
from .terms import rownorm


@dataclass
class LatticeState(OpState):
    """The slot accumulation, its anchor and the position within the current chunk, for N sequences.

    Attributes:
        memory: ``[N, H, M, D]`` the unnormalised accumulation ``U`` after the last token; the
            state that is read is ``S = rownorm(U)`` (design page, section 1). It is kept
            unnormalised because a chunk's later writes add to ``U``, not to ``S``.
        anchor: ``[N, H, M, D]`` ``S`` as it was at the start of the current chunk (unit rows);
            every write of a chunk takes its terms and its projection there.
        offset: ``[N]`` int64, tokens seen modulo the chunk size. At 0 the next token starts a
            chunk: ``U`` and the anchor are then both replaced by ``rownorm(U)``, so the anchor's
            value does not matter.

    Tensors are float32, or float64 when the op ran in float64.
    """

    memory: torch.Tensor
    anchor: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def at_chunk_start(cls, s: torch.Tensor) -> "LatticeState":
        """A state whose next token starts a chunk, from slots ``s [N, H, M, D]`` (rows are
        normalised here; what a plain tensor ``initial_state`` means)."""
        s = rownorm(s)
        offset = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
        return cls(s, s, offset)
