"""Tiny Trellis models and inputs shared by the model, generation and remote-code tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trellis_lm import TrellisConfig, TrellisForCausalLM
from trellis_lm.mixers.norms_convs import TrellisShortConv

VOCAB = 97
# Real tokens are drawn above the special ids, so a sequence never contains pad/bos/eos.
FIRST_TOKEN = 3


# Layer schedules the model-level tests run over: the three, at the smallest depth.
SCHEDULES = {
    "trellis": ["trellis", "trellis"],
    "lattice": ["lattice", "lattice"],
    "hybrid": ["trellis", "trellis", "attention", "lattice"],
    "kvm": ["kvm", "kvm"],
    "kvm-hybrid": ["kvm", "lattice", "attention", "trellis"],
}


def schedules_ci_sized(*kept: str) -> list[Any]:
    """``SCHEDULES`` as pytest parameters for a test too costly to run on each in CI: ``kept``
    (the hybrid of every kind, and more where named) in every run, the rest with ``-m slow``."""
    kept = ("kvm-hybrid", *kept)
    return [name if name in kept else pytest.param(name, marks=pytest.mark.slow) for name in SCHEDULES]


def tiny_config(schedule: str = "trellis", **overrides: Any) -> TrellisConfig:
    """2 layers (4 for the hybrids), 2 heads of 8, 6 slots (not a power of two), chunks of 4;
    KVM layers fold chunks of 3 into 4 state rows and attend to a window of one chunk, so a
    few tokens cross several folds. ``schedule`` names the layers' mixers (see ``SCHEDULES``)."""
    kinds = SCHEDULES[schedule]
    fields = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=len(kinds), num_heads=2, head_dim=8, num_slots=6,
        chunk_size=4, intermediate_size=48, mixer_types=None if schedule == "trellis" else kinds,
        kvm_chunk_size=3, kvm_window_chunks=1, kvm_state_size=4, kvm_rope_dims=4, kvm_sinks=1,
        # The tests' draws were chosen with convolutions of 4 taps (the default until the defaults
        # study): with the package's 2 some random models emit their EOS token within a few steps.
        # Tests of the default's width name it (conv_size=2).
        conv_size=4,
    )
    fields.update(overrides)
    return TrellisConfig(**fields)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, schedule: str = "trellis", **overrides: Any) -> TrellisForCausalLM:
    """A randomly initialised model in eval mode, with random short-conv taps.

    A fresh model's convs pass one token each (q the current, k the previous one), so a test
    of what the conv carries across calls (decode, resume, padding, packing) would not see the
    other taps; random ones make every tap count.
    """
    torch.manual_seed(seed)
    model = TrellisForCausalLM(tiny_config(schedule, **overrides))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, TrellisShortConv):
                module.weight.normal_(std=0.5)
    return model.to(dtype).eval()


def random_tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN, VOCAB, (batch, length), generator=generator)


def left_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token rows -> (ids [B, T], attention mask [B, T]) padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


def right_pad(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D token rows -> (ids [B, T], attention mask [B, T]) padded on the right."""
    ids, mask = left_pad([r.flip(0) for r in rows], pad_id)
    return ids.flip(1), mask.flip(1)
