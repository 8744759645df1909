"""The recurrent state the op carries from one call to the next."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..state import OpState


@dataclass
class TrellisState(OpState):
    """Memories, their anchors and the position within the current chunk, for N sequences.

    Attributes:
        m_k: ``[N, H, M, Dk]`` key memory ``MK`` after the last token.
        m_v: ``[N, H, M, Dv]`` value memory ``MV``.
        anchor_k: ``[N, H, M, Dk]`` ``MK`` as it was at the start of the current chunk; the
            gradient of every write in a chunk is taken there (design page, section 1).
        anchor_v: ``[N, H, M, Dv]`` likewise for ``MV``.
        offset: ``[N]`` int64, tokens seen modulo the chunk size. At 0 the next token starts a
            chunk, so the anchors are about to be replaced and their value does not matter.

    Memories are float32, or float64 when the op ran in float64.
    """

    m_k: torch.Tensor
    m_v: torch.Tensor
    anchor_k: torch.Tensor
    anchor_v: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def at_chunk_start(cls, m_k: torch.Tensor, m_v: torch.Tensor) -> "TrellisState":
        """A state whose next token starts a chunk (what a pair ``(m_k, m_v)`` means)."""
        offset = torch.zeros(m_k.shape[0], dtype=torch.long, device=m_k.device)
        return cls(m_k, m_v, m_k, m_v, offset)
