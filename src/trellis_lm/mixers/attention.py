"""Causal softmax attention, for hybrid schedules and converted models that keep attention layers.

Llama's attention as a mixer: ``q_proj: D -> H d``, ``k_proj, v_proj: D -> H_kv d`` (grouped
key/value heads), plain RoPE on all of ``d``, ``o_proj: H d -> D``; the attention itself is
computed by transformers' attention functions (``config._attn_implementation``: ``"sdpa"`` by
default, ``"eager"``, ``"flash_attention_2"``, ...), so a model loaded with
``attn_implementation=...`` uses the kernel asked for.

Padding is skipped as in the memory mixers: a token's RoPE position counts the real tokens
of its document before it, and it sees only real tokens of its own document, so a padded row
equals the same row alone. Packed documents (``position_ids`` restarting at 0) do not see each
other. The cache entry keeps every column's key and value; its size grows with the context,
as attention's must.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from ..cache_entries import AttentionLayerCache
from ..cache_layout import COLUMNS, ROWS, TensorSpec
from ..cache_trellis import CacheCall, TrellisCache
from ..configuration_trellis import TrellisConfig
from ..projection_stacks import LinearStack, stacked
from .base import Mixer
from .fields import ROPE_THETA, ConfigField, flag, is_int
from .valid_tokens import ValidTokens, last_document, token_positions


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [B, T, d]`` of the rotary embedding at ``positions [B, T]``.

    Computed in float64 from the integer positions (cheap: ``d / 2`` frequencies), then cast,
    so every dtype sees the most exact angles and nothing needs a buffer.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    angles = positions.to(torch.float64)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class AttentionMixer(Mixer):
    """Causal softmax attention with RoPE and grouped key/value heads (see the module doc)."""

    kind = "attention"
    display_name = "softmax attention"
    # Conversion keeps a teacher's attention layer as it is.
    teacher_parts = {"q_proj": "copy", "k_proj": "copy", "v_proj": "copy", "o_proj": "copy"}
    grows_with_context = True
    cache_class = AttentionLayerCache
    layer_type = "full_attention"
    config_fields = (
        ConfigField("num_key_value_heads", lambda v, c: v is None or (is_int(v) and v >= 1 and c.num_heads % v == 0),
                    lambda c: f"None or an integer >= 1 that divides num_heads = {c.num_heads}"),
        ROPE_THETA,
        flag("attention_bias"),
    )
    layer_checks = (
        ConfigField("head_dim", lambda v, c: v % 2 == 0,
                    "an even integer when a layer is 'attention' (RoPE turns channel pairs)"),
    )
    is_causal = True  # read by transformers' attention functions
    fusable_projections = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__(config, layer_idx, **arguments)
        config = self.config
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.key_value_heads, config.head_dim
        self.num_key_value_groups = heads // kv_heads  # read by transformers' attention functions
        self.scaling = dim**-0.5
        self.q_proj = nn.Linear(hidden, heads * dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.projection_stack: Optional[LinearStack] = None  # set within `stacked_projections`
        self._init_if_standalone()

    @classmethod
    def standalone_arguments(cls) -> tuple[str, ...]:
        return (*super().standalone_arguments(), "attn_implementation")

    @classmethod
    def standalone_config(cls, attn_implementation: str = "sdpa", **arguments: Any) -> TrellisConfig:
        """As :meth:`Mixer.standalone_config`, with transformers' attention function to use
        (``"sdpa"`` by default; a model sets it on loading)."""
        config = super().standalone_config(**arguments)
        config._attn_implementation = attn_implementation
        return config

    @classmethod
    def describe_cache(cls, config: TrellisConfig) -> str:
        return "a key/value cache that grows with every token"

    @classmethod
    def cache_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """Keys and values ``[B, H_kv, S, d]`` of every column seen (S = the cache's tokens),
        which columns stay visible, and each row's next position."""
        columns = TensorSpec((ROWS, config.key_value_heads, COLUMNS, config.head_dim))
        return {"keys": columns, "values": columns, "visible": TensorSpec((ROWS, COLUMNS), "bool"),
                "positions": TensorSpec((ROWS,), "int64", most=COLUMNS)}

    def forward(self, x: torch.Tensor, valid: Optional[ValidTokens] = None,
                cache: Union[TrellisCache, CacheCall, None] = None) -> torch.Tensor:
        call = self.checked_call(x, cache)
        batch, length, _ = x.shape
        entry: Optional[AttentionLayerCache] = call.before(self.layer_idx) if call is not None else None
        has_past = entry is not None and entry.keys is not None

        past = entry.positions if has_past else torch.zeros(batch, dtype=torch.long, device=x.device)
        positions = token_positions(valid, past.to(x.device), length)
        q, k, v = self.rotated_qkv(x, positions)

        mask = self._mask(valid, entry if has_past else None, batch, length, x.device)
        if has_past:
            k = torch.cat([entry.keys.to(k), k], dim=2)
            v = torch.cat([entry.values.to(v), v], dim=2)
        implementation = self.config._attn_implementation
        if implementation.startswith("flash"):
            # Flash kernels take a 2-D key padding mask and apply causality themselves.
            if valid is not None and valid.has_documents:
                raise ValueError(
                    "packed documents (position_ids restarting at 0) need attn_implementation 'sdpa' or 'eager' "
                    f"in attention layers, got {implementation!r}"
                )
            kernel_mask = self._visible_keys(valid, entry if has_past else None, batch, length, x.device)
        else:
            kernel_mask = torch.zeros(mask.shape, dtype=q.dtype, device=x.device).masked_fill_(
                ~mask, torch.finfo(q.dtype).min
            )
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        out, _ = attend(self, q, k, v, kernel_mask, dropout=0.0, scaling=self.scaling)  # [B, T, H, d]
        if valid is not None:
            out = out * valid.mask[..., None, None].to(out.dtype)  # no contribution at padding
        if call is not None:
            self._update(entry, call.entry(self.layer_idx), k, v, valid, positions, batch, length)
        return self.o_proj(out.reshape(batch, length, -1))

    def rotated_qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries ``[B, H, T, d]``, keys and values ``[B, H_kv, T, d]`` of ``x [B, T, D]``,
        q and k turned by RoPE at ``positions [B, T]`` (what :meth:`forward` attends with; the
        vLLM plugin hands them to vLLM's paged attention)."""
        batch, length, _ = x.shape
        dim = self.config.head_dim
        fused = stacked(self, x)
        q, k, v = fused[1].values() if fused is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(batch, length, -1, dim).transpose(1, 2)
        k = k.view(batch, length, -1, dim).transpose(1, 2)
        v = v.view(batch, length, -1, dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions, dim, self.config.rope_theta, q.dtype)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    @staticmethod
    def _visible_keys(valid: Optional[ValidTokens], entry: Optional[AttentionLayerCache], batch: int, length: int,
                      device: torch.device) -> torch.Tensor:
        """``[B, S + T]`` bool: the past columns later tokens may see, then the current real tokens."""
        current = valid.mask if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
        return current if entry is None else torch.cat([entry.visible.to(device), current], dim=1)

    @staticmethod
    def _mask(valid: Optional[ValidTokens], entry: Optional[AttentionLayerCache], batch: int, length: int,
              device: torch.device) -> torch.Tensor:
        """``[B, 1, T, S + T]`` bool, True where a query may attend.

        A real query sees the visible past columns (in its row's first document only) and the
        real tokens of its own document up to itself. A padding query sees only itself, so no
        row of the softmax is empty (its output is discarded).
        """
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        current = valid.mask if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
        allowed = causal & current[:, None, :]  # [B, T, T]
        in_first_doc = torch.ones(batch, length, dtype=torch.bool, device=device)
        if valid is not None and valid.doc_starts is not None:
            doc = valid.doc_starts.long().cumsum(dim=1)
            allowed = allowed & (doc[:, :, None] == doc[:, None, :])
            in_first_doc = doc == 0
        allowed = allowed & current[:, :, None]
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)  # padding queries: themselves
        if entry is not None:
            past = entry.visible.to(device)[:, None, :] & (in_first_doc & current)[:, :, None]
            allowed = torch.cat([past, allowed], dim=2)
        return allowed[:, None]

    @staticmethod
    def _update(before: AttentionLayerCache, entry: AttentionLayerCache, keys: torch.Tensor, values: torch.Tensor,
                valid: Optional[ValidTokens], positions: torch.Tensor, batch: int, length: int) -> None:
        """Keep every column in ``entry`` (``before``: the entry the call began from); later
        tokens see the real tokens of each row's last document."""
        device = keys.device
        continuing = last_document(valid, length, device).expand(batch, length)
        if before.keys is None:
            visible = continuing
        else:
            # A row that started a new document in this call no longer sees its older columns.
            new_document = valid.doc_starts.any(dim=1) if valid is not None and valid.doc_starts is not None else None
            old = before.visible.to(device)
            if new_document is not None:
                old = old & ~new_document[:, None]
            visible = torch.cat([old, continuing], dim=1)
        real = valid.mask if valid is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
        last_index = (real.long() * torch.arange(1, length + 1, device=device)).argmax(dim=1, keepdim=True)
        last_real = positions.gather(1, last_index)[:, 0] + 1  # the next token's position
        seen = before.positions.to(device) if before.positions is not None else torch.zeros(batch, dtype=torch.long, device=device)
        entry.keys, entry.values, entry.visible = keys, values, visible
        entry.positions = torch.where(real.any(dim=1), last_real, seen)
