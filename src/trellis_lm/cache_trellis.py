"""The generation cache of Trellis models (design page, section 6).

Per layer it holds the short-conv tails of q and k (the last ``conv_size - 1`` projected
inputs of every row) and the op's :class:`TrellisState`; the cache also counts the tokens
(columns, padding included) it has seen. Its size does not grow with the tokens seen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import Cache

from .ops import TrellisState

FORMAT = "trellis-cache"
FORMAT_VERSION = "1"


@dataclass
class TrellisLayerCache:
    """What one layer carries from one forward call to the next; ``None`` before its first call.

    Attributes:
        q_tail, k_tail: ``[B, conv_size - 1, H * d]`` the last projected q / k inputs of each
            row, in the activation dtype (``None`` also when the model has no short conv).
        state: the op state, with ``N = B`` rows.
    """

    q_tail: Optional[torch.Tensor] = None
    k_tail: Optional[torch.Tensor] = None
    state: Optional[TrellisState] = None

    # What the generic `Cache` methods ask of their layers.
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name (the state's fields under their own names)."""
        held = {"q_tail": self.q_tail, "k_tail": self.k_tail, **(self.state.tensors() if self.state else {})}
        return {name: tensor for name, tensor in held.items() if tensor is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "TrellisLayerCache":
        """Inverse of :meth:`tensors`."""
        state_names = [f.name for f in fields(TrellisState)]
        state = TrellisState(**{n: tensors[n] for n in state_names}) if state_names[0] in tensors else None
        return cls(tensors.get("q_tail"), tensors.get("k_tail"), state)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to every tensor; all of them have the batch on dim 0."""
        self.q_tail = None if self.q_tail is None else fn(self.q_tail)
        self.k_tail = None if self.k_tail is None else fn(self.k_tail)
        self.state = None if self.state is None else self.state.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self.q_tail = self.k_tail = self.state = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a Trellis cache cannot be cropped: its state folds every token in and keeps no per-token history"
        )

    def get_max_length(self) -> int:
        return -1  # no limit on the tokens it can take


class TrellisCache(Cache):
    """Fixed-size cache of a Trellis model: one :class:`TrellisLayerCache` per layer.

    ``generate()`` builds one by itself; pass one as ``past_key_values`` to continue a
    sequence, including one returned by an earlier ``generate(..., return_dict_in_generate=True)``
    or read back with :meth:`load`.

    Args:
        num_layers: the model's ``config.num_hidden_layers``.
    """

    # The op runs Python control flow per call; `generate()` must not try to compile it, and
    # with a compileable cache it would also hand `forward` its masks as dicts.
    is_compileable = False

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[TrellisLayerCache() for _ in range(num_layers)])
        self.seen_tokens = 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self.layers)}, rows={self.batch_size}, "
            f"seen_tokens={self.seen_tokens}, nbytes={self.nbytes()})"
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens (columns of ``input_ids``, padding included) the cache has taken in."""
        return self.seen_tokens

    def add_seen_tokens(self, count: int) -> None:
        """Called by the model once per forward, after every layer has updated."""
        self.seen_tokens += count

    @property
    def batch_size(self) -> Optional[int]:
        """Rows held, or ``None`` before the first forward."""
        held = [layer.state.offset.shape[0] for layer in self.layers if layer.state is not None]
        return held[0] if held else None

    def reset(self) -> None:
        super().reset()
        self.seen_tokens = 0

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors; independent of the number of tokens seen."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors().values())

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the cache to one safetensors file (tensors, token count, layer count)."""
        # safetensors refuses tensors sharing memory (a state's anchor may be its memory).
        tensors = {
            f"layers.{i}.{name}": t.detach().contiguous().clone().cpu()
            for i, layer in enumerate(self.layers)
            for name, t in layer.tensors().items()
        }
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "num_layers": str(len(self.layers)),
            "seen_tokens": str(self.seen_tokens),
        }
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(cls, path: Union[str, os.PathLike], device: Union[str, torch.device, None] = None) -> "TrellisCache":
        """Read a cache written by :meth:`save`, onto ``device`` (default: CPU)."""
        with safe_open(os.fspath(path), framework="pt", device=str(device or "cpu")) as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{path} is not a Trellis cache file (metadata format: {metadata.get('format')!r})")
            if metadata.get("format_version") != FORMAT_VERSION:
                raise ValueError(
                    f"{path} holds cache format version {metadata.get('format_version')!r}, "
                    f"this code reads {FORMAT_VERSION!r}"
                )
            cache = cls(int(metadata["num_layers"]))
            per_layer: list[dict[str, torch.Tensor]] = [{} for _ in cache.layers]
            for key in f.keys():
                _, index, name = key.split(".", 2)
                per_layer[int(index)][name] = f.get_tensor(key)
        cache.layers = [TrellisLayerCache.from_tensors(tensors) for tensors in per_layer]
        cache.seen_tokens = int(metadata["seen_tokens"])
        return cache


__all__ = ["TrellisCache", "TrellisLayerCache"]
