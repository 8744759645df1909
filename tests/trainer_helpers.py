"""Deterministic Trainer runs on tiny models, shared by the training and distributed tests."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer, TrainingArguments

from tiny_models import random_tokens, tiny_model

# Rows of unequal lengths, so micro-batches (and ranks) hold unequal numbers of label tokens:
# a mean of per-micro-batch means would differ from the mean over the whole batch.
ROWS = [{"input_ids": random_tokens(1, n, seed=n)[0].tolist()} for n in (9, 3, 7, 4, 5, 2, 8, 6)]


def right_padded(features: list[dict]) -> dict[str, torch.Tensor]:
    """Collate ``{"input_ids": list}`` rows into a right-padded batch with -100 labels at padding."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, feature in enumerate(features):
        ids[i, : len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        mask[i, : len(feature["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def sgd_trainer(
    output_dir: str, rows: list[dict] = ROWS, dtype: torch.dtype = torch.float32, schedule: str = "trellis",
    **training_kwargs: Any,
) -> Trainer:
    """A Trainer whose steps apply minus the gradient (SGD, lr 1, no clipping), taking ``rows``
    in order, on the same freshly initialised tiny model (in ``dtype``, layers of ``schedule``)
    every time."""
    args = TrainingArguments(**{
        "output_dir": output_dir, "optim": "sgd", "learning_rate": 1.0, "lr_scheduler_type": "constant",
        "max_grad_norm": 0.0, "train_sampling_strategy": "sequential", "save_strategy": "no",
        "logging_strategy": "no", "report_to": "none", "disable_tqdm": True, "use_cpu": True, **training_kwargs,
    })
    return Trainer(model=tiny_model(seed=1, schedule=schedule).to(dtype).train(), args=args, train_dataset=rows, data_collator=right_padded)


def trained_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Train and return the (unwrapped) model's parameters."""
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
