"""The metadata vLLM builds for the plugin's memory layers each step, and how a layer reads it.

vLLM's recurrent-state layers get their step's metadata from a backend named by their
``mamba_type``. Its generic one for state layers (``BaseMambaAttentionMetadata``, which
vLLM's Mamba, short-conv and GDN builders extend) gives each sequence's slots as vLLM lays
them out under speculative decoding: a decode's row of ``1 + num_speculative_tokens`` state
blocks and how many tokens its last row kept (``num_accepted_tokens``), a prefill's one
block. vLLM's model runner hands those counts only to the builders it knows, the short-conv
one among them; :class:`TrellisStateBackend` is that builder without the convolution kernels'
tables (which a Trellis layer does not read), registered under the name :data:`NAME`
(:func:`register_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.short_conv_attn import (
    ShortConvAttentionBackend,
    ShortConvAttentionMetadataBuilder,
)

NAME = "TRELLIS_STATE"


class TrellisStateMetadataBuilder(ShortConvAttentionMetadataBuilder):
    """vLLM's generic state-layer metadata (each sequence's state blocks, accepted tokens),
    without the tables of its causal-convolution kernels."""

    needs_causal_conv1d_metadata = False


class TrellisStateBackend(ShortConvAttentionBackend):
    """The backend of the plugin's memory layers (:class:`TrellisStateMetadataBuilder`)."""

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_builder_cls() -> type[TrellisStateMetadataBuilder]:
        return TrellisStateMetadataBuilder


def register_backend() -> MambaAttentionBackendEnum:
    """The ``mamba_type`` of the plugin's memory layers, registered with vLLM once per process."""
    member = MambaAttentionBackendEnum.__members__.get(NAME)
    if member is None:
        member = MambaAttentionBackendEnum.register(NAME, f"{__name__}.{TrellisStateBackend.__name__}")
    return member


@dataclass
class StepGroup:
    """Sequences of one step that read and write their slots alike: ``starts [R + 1]`` (into the
    step's tokens), ``computed [R]``, ``slots`` (``[R]``, or ``[R, W]`` with ``accepted [R]``)."""

    starts: torch.Tensor
    computed: torch.Tensor
    slots: torch.Tensor
    accepted: Optional[torch.Tensor] = None


def step_groups(metadata: BaseMambaAttentionMetadata) -> list[StepGroup]:
    """The step's decodes (each a row of ``1 + num_speculative_tokens`` blocks, read at its
    accepted tokens: vLLM puts them first) and its prefills (one block each), as
    :func:`~.slots.run_on_slots` takes them."""
    groups = []
    decodes, prefills = metadata.num_decodes, metadata.num_prefills
    seq_lens = metadata.seq_lens
    if decodes:
        slots = metadata.state_indices_tensor_d[:decodes]
        starts = metadata.query_start_loc_d
        if starts is None:  # without speculative decoding a decode is one token
            starts = torch.arange(decodes + 1, device=slots.device)
        starts = starts[: decodes + 1]
        accepted = metadata.num_accepted_tokens
        groups.append(StepGroup(starts, seq_lens[:decodes] - starts.diff(), slots,
                                None if accepted is None else accepted[:decodes]))
    if prefills:
        starts = metadata.query_start_loc_p[: prefills + 1] + metadata.num_decode_tokens
        groups.append(StepGroup(starts, seq_lens[decodes: decodes + prefills] - starts.diff(),
                                metadata.state_indices_tensor_p[:prefills]))
    return groups
