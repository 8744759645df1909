"""The teacher's side of stage 1: its attention inputs and outputs, captured, and kept.

:func:`teacher_attention` captures, by forward hooks, each layer's attention input (after
``input_layernorm``) and output for a batch. Stage 1 fits each converted mixer to the teacher's attention output from the teacher's own
attention input; neither depends on the student. :class:`TeacherActivations` runs the teacher
once over the training blocks and keeps, per block, those inputs and outputs of the converted
layers (in memory up to a byte budget, the rest as safetensors files in a folder, which a
resumed run reuses): every later epoch of stage 1 costs the student's mixers only.

"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import Dataset
from transformers import PreTrainedModel

from .data import pad_batch

INPUTS, TARGETS = "teacher_inputs", "teacher_targets"


@contextmanager
def captured_attention(
    teacher: PreTrainedModel, layers: Optional[Sequence[int]] = None
) -> Iterator[list[Optional[tuple[torch.Tensor, torch.Tensor]]]]:
    """While open, each teacher forward fills the yielded list, one entry per layer:
    ``(attention input [B, T, D] after input_layernorm, attention output [B, T, D] after o_proj)``;
    only ``layers`` (default all) are captured, the others stay ``None``."""
    all_layers = teacher.model.layers
    pairs: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * len(all_layers)
    wanted = range(len(all_layers)) if layers is None else layers

    def hook(index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        pairs[index] = (hidden.detach(), (output[0] if isinstance(output, tuple) else output).detach())

    handles = [
        all_layers[i].self_attn.register_forward_hook(lambda *a, i=i: hook(i, *a), with_kwargs=True)
        for i in wanted
    ]
    try:
        yield pairs
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def teacher_attention(
    teacher: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    layers: Optional[Sequence[int]] = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The attention inputs and outputs ``[B, T, D]`` of ``layers`` (default all, in that order)
    for ``input_ids [B, T]`` (the teacher's body only: its LM head is not needed)."""
    with captured_attention(teacher, layers) as pairs:
        teacher.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    wanted = range(len(pairs)) if layers is None else layers
    return [pairs[i][0] for i in wanted], [pairs[i][1] for i in wanted]


def fingerprint(teacher: PreTrainedModel, layers: Sequence[int], blocks: Dataset) -> str:
    """What cached activations depend on: the teacher's weights (a sample of them), the layers
    and the blocks' tokens; files of another fingerprint are computed again."""
    digest = hashlib.sha256(json.dumps(list(layers)).encode())
    tensors = list(teacher.state_dict().items())
    for name, tensor in tensors[:: max(1, len(tensors) // 16)]:
        digest.update(name.encode())
        digest.update(tensor.detach().float().flatten()[:4096].cpu().numpy().tobytes())
    for index in range(len(blocks)):
        digest.update(torch.as_tensor(blocks[index]["input_ids"]).numpy().tobytes())
    return digest.hexdigest()[:16]


class TeacherActivations(Dataset):
    """Training blocks with the teacher's attention inputs and outputs of ``layers``.

    Item ``i`` is block ``i`` (``input_ids [T]``, ``attention_mask [T]``) plus ``teacher_inputs``
    and ``teacher_targets`` ``[L, T, D]`` (the converted layers, in order, in the teacher's dtype).

    Args:
        teacher: the teacher (on the device it runs on once, here).
        blocks: a dataset of ``{"input_ids"}`` items (e.g. :class:`~.distill.TokenBlocks`).
        layers: the converted layers' indices.
        folder: where blocks beyond the memory budget are kept (reused when a run resumes:
            files of the same fingerprint are not computed again); ``None`` keeps every block
            in memory, whatever the budget.
        memory_bytes: the most bytes of activations held in memory (default 1 GiB).
        batch_size: blocks per teacher forward.
    """

    def __init__(self, teacher: PreTrainedModel, blocks: Dataset, layers: Sequence[int],
                 folder: Union[str, Path, None] = None, memory_bytes: int = 2**30, batch_size: int = 8) -> None:
        for name, value, least in (("memory_bytes", memory_bytes, 0), ("batch_size", batch_size, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.blocks, self.layers = blocks, list(layers)
        self.width = teacher.config.hidden_size
        self.folder = None if folder is None else Path(folder)
        self.memory: dict[int, dict[str, torch.Tensor]] = {}
        self.computed = 0  # blocks the teacher ran on (not found on disk)
        key = self.key = fingerprint(teacher, self.layers, blocks)
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            manifest = self.folder / "manifest.json"
            if not manifest.is_file() or json.loads(manifest.read_text()).get("fingerprint") != key:
                for stale in self.folder.glob("block-*.safetensors"):
                    stale.unlink()
                manifest.write_text(json.dumps({"fingerprint": key, "layers": self.layers, "blocks": len(blocks)}))
        held = 0
        for start in range(0, len(blocks), batch_size):
            indices = range(start, min(start + batch_size, len(blocks)))
            if self.folder is not None and all(self._stored(i) for i in indices):
                continue
            batch = pad_batch([blocks[i] for i in indices])
            device = next(teacher.parameters()).device
            mask = batch["attention_mask"].to(device)
            inputs, targets = teacher_attention(teacher, batch["input_ids"].to(device), mask, self.layers)
            inputs, targets = torch.stack(inputs, 1).cpu(), torch.stack(targets, 1).cpu()  # [B, L, T, D]
            for row, index in enumerate(indices):
                length = int(batch["attention_mask"][row].sum())
                pair = {INPUTS: inputs[row, :, :length].contiguous(), TARGETS: targets[row, :, :length].contiguous()}
                size = sum(t.numel() * t.element_size() for t in pair.values())
                if self.folder is None or held + size <= memory_bytes:
                    self.memory[index], held = pair, held + size
                else:
                    save_file(pair, str(self._path(index)), metadata=self._stamp(index))
                self.computed += 1

    def _path(self, index: int) -> Path:
        return self.folder / f"block-{index}.safetensors"

    def _stamp(self, index: int) -> dict[str, str]:
        """What a block's file must record to be reused: the run's fingerprint, the block's index
        and a digest of its tokens (a file of another block, or of another run, is not this one)."""
        ids = torch.as_tensor(self.blocks[index]["input_ids"]).numpy().tobytes()
        return {"fingerprint": self.key, "block": str(index), "tokens": hashlib.sha256(ids).hexdigest()[:16]}

    def _stored(self, index: int) -> bool:
        """Whether block ``index``'s file holds its activations whole: a file safetensors reads
        (a truncated or empty one is not), stamped for this block of this run, of the shapes its
        tokens give. Any other is computed again."""
        path = self._path(index)
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), framework="pt") as f:
                stamp = f.metadata() or {}
                shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        except (SafetensorError, OSError):
            return False
        length = len(self.blocks[index]["input_ids"])
        expected = [len(self.layers), length, self.width]
        return stamp == self._stamp(index) and shapes == {INPUTS: expected, TARGETS: expected}

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        pair = self.memory.get(index)
        if pair is None:
            path = self._path(index)
            try:
                pair = load_file(str(path))
            except (SafetensorError, OSError) as error:  # changed since the run began
                raise ValueError(f"{path}: the teacher activations of block {index} cannot be read ({error}); delete "
                                 "the file and run again to compute them") from None
        ids = torch.as_tensor(self.blocks[index]["input_ids"])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pair}


def pad_activations(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """:func:`~.distill.pad_batch`, plus the activations right-padded with zeros: ``[B, L, T, D]``."""
    batch = pad_batch(features)
    length = batch["input_ids"].shape[1]
    for name in (INPUTS, TARGETS):
        batch[name] = torch.stack([
            nn.functional.pad(f[name], (0, 0, 0, length - f[name].shape[1])) for f in features
        ])
    return batch


__all__ = ["INPUTS", "TARGETS", "TeacherActivations", "captured_attention", "fingerprint", "pad_activations", "teacher_attention"]
