"""Trellis language models for transformers (design page, sections 5 and 6).

A Llama-shaped stack of pre-norm blocks whose token mixer is the Trellis two-pass memory op,
with a fixed-size :class:`TrellisCache` for generation. Padding tokens (zeros of the
attention mask) are skipped exactly: they neither change a layer's state nor count as
positions, so each row of a padded batch gets what it gets alone; outputs at padding
positions carry no mixer contribution.

This file travels with checkpoints as remote code (see :mod:`.remote_code`).
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, fields
from functools import cache, partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import logging

from .cache_trellis import TrellisCache
from .configuration_trellis import TrellisConfig
from .model_card_trellis import CARD_NAME, hub_card_text, is_generated, write_model_card
from .ops import TrellisState, trellis_attention

logger = logging.get_logger(__name__)

L2_EPS = 1e-6
# Reach of the short conv in a row's first document: it may see all of the carried tail.
_UNBOUNDED_REACH = 2**62


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision activations are upcast for norms and the op; float64 stays float64."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2_EPS)


def forget_gate_bias(num_heads: int, normalizer: float) -> torch.Tensor:
    """``beta_proj`` bias that spreads beta from 0.9 to 0.999 across heads (0.99 for one head).

    ``1 - beta`` is log-spaced over [1e-3, 1e-1], and while the weight term is small
    ``beta = exp(logsigmoid(b) / normalizer)``, i.e. ``sigmoid(b) = beta ** normalizer``.
    Returns ``[H]`` float64.
    """
    if num_heads == 1:
        exponents = torch.tensor([-2.0], dtype=torch.float64)
    else:
        exponents = torch.linspace(-1.0, -3.0, num_heads, dtype=torch.float64)
    p = (1.0 - 10.0**exponents) ** normalizer
    return torch.log(p) - torch.log1p(-p)


class TrellisRMSNorm(nn.Module):
    """RMSNorm over the last axis, computed in at least float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel, with the weight folded in when the dtypes allow: one operation
        # instead of five or six matters in token-by-token decoding.
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        normed = F.rms_norm(_at_least_float32(x), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


@dataclass
class ValidTokens:
    """The real tokens of a batch, the documents they form, and how to gather them row by row.

    Padding (zeros of the attention mask) is skipped. A row may also hold several documents
    packed one after the other (``position_ids`` restarting at 0, as transformers'
    ``DataCollatorWithFlattening`` makes them): each later document starts from the initial
    memories, and its short conv sees nothing before it. A row's first document continues
    whatever the row held before (the cache, or the initial memories).

    The op runs once on ``x[mask]``: N sequences (documents; every row has at least one,
    possibly empty) packed in row-major order.

    Attributes:
        mask: ``[B, T]`` bool, True at real tokens.
        lengths: ``[B]`` real tokens per row.
        cu_seqlens: ``[N + 1]`` start of each sequence in ``x[mask]`` (the op's packed layout).
        order: ``[B, T]`` a per-row permutation that puts the row's real tokens first, in order.
        seq_rows: ``[N]`` the row of each sequence.
        continues_row: ``[N]`` bool, True for each row's first sequence.
        last_seqs: ``[B]`` index of each row's last sequence (whose final state the row keeps).
        reach: ``[B, T]`` in the compacted order of :meth:`compact`, how many earlier inputs each
            token's short conv may see (its index in its document; unbounded in a row's first
            document), or ``None`` when no row holds a second document.
    """

    mask: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    order: torch.Tensor
    seq_rows: torch.Tensor
    continues_row: torch.Tensor
    last_seqs: torch.Tensor
    reach: Optional[torch.Tensor] = None

    @classmethod
    def from_mask(cls, mask: torch.Tensor, doc_starts: Optional[torch.Tensor] = None) -> "ValidTokens":
        """From ``mask [B, T]`` and, optionally, ``doc_starts [B, T]`` (True at a real token that
        starts a new document; never at a row's first real token)."""
        batch, length = mask.shape
        lengths = mask.sum(dim=1)
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)
        row_offsets = F.pad(lengths.cumsum(0), (1, 0))
        rows = torch.arange(batch, device=mask.device)
        if doc_starts is None:
            return cls(mask, lengths, row_offsets, order, rows, torch.ones_like(mask[:, 0]), rows)
        starts = doc_starts.gather(1, order)  # real tokens come first after compaction
        seq_flags = starts.clone()
        seq_flags[:, 0] = True  # every row opens a sequence, an empty one for an all-padding row
        seq_rows, seq_cols = seq_flags.nonzero(as_tuple=True)  # row-major: sequences in packed order
        cu_seqlens = torch.cat([row_offsets[seq_rows] + seq_cols, row_offsets[-1:]])
        last_seqs = seq_flags.sum(dim=1).cumsum(0) - 1
        positions = torch.arange(length, device=mask.device).expand(batch, -1)
        doc_start = torch.where(starts, positions, 0).cummax(dim=1).values
        in_first_doc = starts.cumsum(dim=1) == 0
        reach = torch.where(in_first_doc, torch.full_like(positions, _UNBOUNDED_REACH), positions - doc_start)
        return cls(mask, lengths, cu_seqlens, order, seq_rows, seq_cols == 0, last_seqs, reach)

    @classmethod
    def from_attention_mask(
        cls, attention_mask: Any, batch: int, length: int, position_ids: Optional[torch.Tensor] = None
    ) -> Optional["ValidTokens"]:
        """Read the current ``length`` tokens' validity and documents; ``None`` when all tokens
        are real and form one document per row.

        ``attention_mask`` is ``None``, a ``[B, past + T]`` tensor (its last T columns are
        the current tokens), or a dict holding such a tensor (``generate`` passes masks as
        ``{"<layer type>": mask}`` for some caches). ``position_ids`` (``[B or 1, past + T]``)
        mark document starts: a real token numbered 0 that is not its row's first real
        token starts a new document.
        """
        if isinstance(attention_mask, dict):
            attention_mask = next((m for m in attention_mask.values() if isinstance(m, torch.Tensor)), None)
        if attention_mask is None and position_ids is None:
            return None
        if attention_mask is not None and (
            attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length
        ):
            raise ValueError(
                f"attention_mask must be a 2-D padding mask [B = {batch}, past + T >= {length}] with 0 at "
                f"padding, got shape {tuple(attention_mask.shape)}"
            )
        if position_ids is not None and (
            position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] < length
        ):
            raise ValueError(
                f"position_ids must be 2-D [B = {batch} or 1, past + T >= {length}], restarting at 0 where a "
                f"packed document starts, got shape {tuple(position_ids.shape)}"
            )
        if attention_mask is None:
            mask = torch.ones(batch, length, dtype=torch.bool, device=position_ids.device)
        else:
            mask = attention_mask[:, -length:].bool()
        doc_starts = None
        if position_ids is not None:
            positions = position_ids[:, -length:].to(mask.device).expand(batch, -1)
            doc_starts = mask & (positions == 0) & (mask.cumsum(dim=1) > 1)
            doc_starts = doc_starts if bool(doc_starts.any()) else None
        if doc_starts is None and bool(mask.all()):
            return None
        return cls.from_mask(mask, doc_starts)

    @property
    def has_documents(self) -> bool:
        """True when some row holds more than one document."""
        return self.reach is not None

    def to(self, device: Union[str, torch.device], non_blocking: bool = False) -> "ValidTokens":
        """A copy on ``device`` (accelerate calls this when blocks sit on several devices)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return ValidTokens(**{
            name: None if t is None else t.to(device, non_blocking=non_blocking) for name, t in moved.items()
        })

    def compact(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> the same with each row's real tokens moved to its front."""
        return x.gather(1, self._index_like(x))

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`compact`."""
        return torch.empty_like(x).scatter_(1, self._index_like(x), x)

    def _index_like(self, x: torch.Tensor) -> torch.Tensor:
        return self.order.view(self.order.shape + (1,) * (x.dim() - 2)).expand_as(x)


class TrellisShortConv(nn.Conv1d):
    """Causal depthwise convolution over time that carries its last inputs across calls."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__(channels, channels, width, groups=channels, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        tail: Optional[torch.Tensor],
        lengths: Optional[torch.Tensor] = None,
        reach: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve ``x [B, T, C]`` after ``tail [B, width - 1, C]`` (zeros when ``None``).

        With ``lengths [B]``, row b holds its tokens in ``x[b, :lengths[b]]`` (the rest is
        ignored) and its new tail ends after them. With ``reach [B, T]``, token t sees only the
        ``reach[b, t]`` inputs before it (the rest count as zeros), so packed documents do not
        leak into each other. Returns ``(y [B, T, C], new tail)``.
        """
        batch, length, channels = x.shape
        width = self.kernel_size[0]
        carried = width - 1
        if tail is None:
            tail = x.new_zeros(batch, carried, channels)
        seq = torch.cat([tail.to(x.dtype), x], dim=1)
        # Windows times taps, summed: three operations whatever T is. For decode-sized inputs
        # F.conv1d spends far longer setting up its kernel than in the arithmetic; this is the
        # same cross-correlation as nn.Conv1d.
        windows = seq.unfold(1, width, 1)  # [B, T, C, width], a view
        taps = self.weight[:, 0].to(x.dtype)  # [C, width]
        if reach is not None:
            # Tap j looks `width - 1 - j` inputs back; what lies before the document counts as zero.
            lookback = torch.arange(width - 1, -1, -1, device=x.device)
            taps = taps * (lookback <= reach[..., None])[..., None, :]  # [B, T, C, width]
        y = (windows * taps).sum(dim=-1)
        if lengths is None:  # every row's tokens fill x: the tail is the sequence's end
            # A copy, not a view: a view would keep the whole prefill's inputs alive in the cache.
            return y, seq[:, length:].contiguous()
        index = lengths[:, None] + torch.arange(carried, device=x.device)
        new_tail = seq.gather(1, index[..., None].expand(-1, -1, channels))
        if reach is not None:
            # Tail entry i lies `carried - 1 - i` = lookback[i + 1] inputs before the row's last token; what lies
            # before that token's document is zero for the next call, as for a fresh conv.
            last_reach = reach.gather(1, (lengths - 1).clamp(min=0)[:, None])
            last_reach = torch.where(lengths[:, None] > 0, last_reach, _UNBOUNDED_REACH)  # no token: tail unchanged
            new_tail = new_tail * (lookback[1:] <= last_reach)[..., None]
        return y, new_tail


class TrellisAttention(nn.Module):
    """The Trellis mixer: projections, short convs, gates, the op, gated output.

    Named ``self_attn`` in its block so Llama LoRA targets and conversions carry over.
    """

    def __init__(self, config: TrellisConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        hidden, heads, dim, slots = config.hidden_size, config.num_heads, config.head_dim, config.num_slots
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.alpha_proj = nn.Linear(hidden, heads * slots, bias=False)
        self.beta_proj = nn.Linear(hidden, heads, bias=True) if config.use_forget_gate else None
        self.gamma_proj = nn.Linear(hidden, heads, bias=True)
        self.g_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        has_conv = config.conv_size > 0
        self.q_conv = TrellisShortConv(heads * dim, config.conv_size) if has_conv else None
        self.k_conv = TrellisShortConv(heads * dim, config.conv_size) if has_conv else None
        self.o_norm = TrellisRMSNorm(dim, config.rms_norm_eps)
        self.mk0 = nn.Parameter(torch.empty(heads, slots, dim))
        self.mv0 = nn.Parameter(torch.empty(heads, slots, dim))

    def forward(
        self,
        x: torch.Tensor,
        valid: Optional[ValidTokens] = None,
        cache: Optional[TrellisCache] = None,
    ) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``; reads and updates this layer's entry of ``cache``."""
        layer_cache = cache.layers[self.layer_idx] if cache is not None else None
        if layer_cache is None:
            return self.mix(x, valid, None, None, None, keep_state=False)[0]
        carried = (layer_cache.q_tail, layer_cache.k_tail, layer_cache.state)
        mix = self.mix
        # Compiled: decode steps without padding (packing padded rows depends on the mask's values)
        # after a prefill, on CPUs (GPUs run the fused Triton step).
        if (self.config.compile_decode and x.shape[1] == 1 and x.device.type == "cpu" and valid is None
                and layer_cache.state is not None):
            mix = partial(_compiled_mix(), self)
        out, q_tail, k_tail, state = mix(x, valid, *carried, keep_state=True)
        if self.q_conv is not None:
            layer_cache.q_tail, layer_cache.k_tail = q_tail, k_tail
        if state is not None:
            layer_cache.state = state
        return out

    def mix(
        self,
        x: torch.Tensor,
        valid: Optional[ValidTokens],
        q_tail: Optional[torch.Tensor],
        k_tail: Optional[torch.Tensor],
        state: Optional[TrellisState],
        keep_state: bool,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[TrellisState]]:
        """The mixer as a function of what a cache carries: ``x [B, T, D]`` after the short-conv
        tails (``[B, conv_size - 1, H * d]``, ``None`` for zeros) and the op ``state`` (``None``:
        the learnt initial memories). Returns ``(y [B, T, D], q_tail, k_tail, final state)``, the
        state ``None`` when not ``keep_state`` or when no row had a real token."""
        batch, length, _ = x.shape
        heads, dim = self.config.num_heads, self.config.head_dim

        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_conv is not None:
            q, q_tail = self._convolve(self.q_conv, q, valid, q_tail)
            k, k_tail = self._convolve(self.k_conv, k, valid, k_tail)
        q = _l2_normalize(F.silu(_at_least_float32(q)).view(batch, length, heads, dim))
        k = _l2_normalize(F.silu(_at_least_float32(k)).view(batch, length, heads, dim))
        v = _l2_normalize(_at_least_float32(self.v_proj(x)).view(batch, length, heads, dim))
        alpha = _at_least_float32(self.alpha_proj(x)).view(batch, length, heads, -1)
        if self.beta_proj is not None:
            log_beta = F.logsigmoid(_at_least_float32(self.beta_proj(x))) / self.config.gate_logit_normalizer
        else:
            log_beta = alpha.new_zeros(batch, length, heads)
        gamma = torch.sigmoid(_at_least_float32(self.gamma_proj(x)))

        initial_state = self._initial_state(state, valid, batch)
        o, state = self._attend((q, k, v, alpha, log_beta, gamma), initial_state, valid, keep_state)
        gate = F.gelu(self.g_proj(x)).view(batch, length, heads, dim)
        y = self.o_proj((self.o_norm(o) * gate).reshape(batch, length, heads * dim).to(x.dtype))
        return y, q_tail, k_tail, state

    @staticmethod
    def _convolve(
        conv: TrellisShortConv, x: torch.Tensor, valid: Optional[ValidTokens], tail: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The short conv over each row's real tokens only, so padding never enters it."""
        if valid is None:
            return conv(x, tail)
        y, new_tail = conv(valid.compact(x), tail, valid.lengths, valid.reach)
        return valid.restore(y), new_tail

    def _initial_state(self, carried: Optional[TrellisState], valid: Optional[ValidTokens], batch: int) -> Any:
        """The op's initial state: one per row, or one per packed document.

        A row continues ``carried`` (its cache entry) or starts from the learnt memories;
        documents after a row's first always start from the learnt memories.
        """
        def fresh(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.mk0.expand(rows, -1, -1, -1), self.mv0.expand(rows, -1, -1, -1)

        if valid is None or not valid.has_documents:
            return carried if carried is not None else fresh(batch)
        if carried is None:
            return fresh(valid.seq_rows.numel())
        per_seq = carried.map(lambda t: t.index_select(0, valid.seq_rows.to(t.device)))
        keep = valid.continues_row.to(per_seq.offset.device)
        restart = {"m_k": self.mk0, "anchor_k": self.mk0, "m_v": self.mv0, "anchor_v": self.mv0, "offset": 0}
        return TrellisState(**{
            name: torch.where(keep.view(-1, *(1,) * (t.dim() - 1)), t, restart[name])
            for name, t in per_seq.tensors().items()
        })

    def _attend(
        self, features: tuple, initial_state: Any, valid: Optional[ValidTokens], keep_state: bool
    ) -> tuple[torch.Tensor, Optional[TrellisState]]:
        """Run the op; with padding, once on the real tokens packed as one sequence per row.

        Returns ``o [B, T, H, d]`` (zeros at padding) and the final state, one per row (a row's
        last document's), ``None`` when not kept or when no row had a token (the state is then
        unchanged).
        """
        op = partial(
            trellis_attention,
            initial_state=initial_state,
            chunk_size=self.config.chunk_size,
            compress_fn=self.config.compress_fn,
            mix_fn=self.config.mix_fn,
            output_final_state=keep_state,
            backend=self.config.op_backend,
        )
        if valid is None:
            return op(*features)
        v = features[2]
        o = v.new_zeros(v.shape)
        if not bool(valid.lengths.any()):
            return o, None
        packed = [f[valid.mask].unsqueeze(0) for f in features]
        o_packed, final_state = op(*packed, cu_seqlens=valid.cu_seqlens)
        o[valid.mask] = o_packed[0]
        if final_state is not None and valid.has_documents:
            final_state = final_state.map(lambda t: t.index_select(0, valid.last_seqs.to(t.device)))
        return o, final_state


@cache
def _compiled_mix() -> Callable:
    """:meth:`TrellisAttention.mix` compiled for single-token steps (``config.compile_decode``).

    One compiled function for every layer of every model in the process: the module is an
    argument, so layers of one shape share the compiled code instead of recompiling each.
    """
    return torch.compile(TrellisAttention.mix, fullgraph=True, dynamic=False)


class TrellisMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: TrellisConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TrellisDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual block: RMSNorm, Trellis mixer, RMSNorm, SwiGLU MLP."""

    def __init__(self, config: TrellisConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = TrellisAttention(config, layer_idx)
        self.post_attention_layernorm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TrellisMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        valid: Optional[ValidTokens] = None,
        past_key_values: Optional[TrellisCache] = None,
    ) -> torch.Tensor:
        # `hidden_states` stays positional and the cache a keyword named `past_key_values`:
        # that is what activation checkpointing expects.
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), valid, past_key_values)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TrellisPreTrainedModel(PreTrainedModel):
    """Shared settings and weight initialisation of the Trellis models."""

    config_class = TrellisConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TrellisDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    # The cache cannot be rolled back, which assisted decoding needs.
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, TrellisShortConv):
            # PyTorch's default for convolutions, which short convs of recurrent layers start from.
            init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        elif isinstance(module, TrellisRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, TrellisAttention):
            # Entries of order 1, so `MK0 k` spreads over the slots for a unit-norm k; a tiny
            # memory would make the l2norm/layernorm compressions divide by about eps.
            init.normal_(module.mk0, mean=0.0, std=1.0)
            init.normal_(module.mv0, mean=0.0, std=1.0)
            # Targets of unit variance per slot, the scale the layernorm compression outputs
            # (the mixer's input has unit RMS at init). The layernorm compression's Jacobian
            # removes the radial part of phi(z) - alpha, so a write is about -J^T alpha: with the
            # generic 0.02 init the targets, hence the writes, would be several times too small
            # to learn from (MQAR then barely moves, docs/results.md). Replaces the nn.Linear
            # branch's init, as conversion does (conversion/llama.py).
            init.normal_(module.alpha_proj.weight, mean=0.0, std=self.config.hidden_size**-0.5)
            if module.beta_proj is not None:
                # Modules are initialised children first, so this replaces the zero bias
                # the nn.Linear branch gave beta_proj.
                bias = forget_gate_bias(self.config.num_heads, self.config.gate_logit_normalizer)
                init.copy_(module.beta_proj.bias, bias.to(module.beta_proj.bias))

    def save_pretrained(
        self,
        save_directory: Union[str, os.PathLike],
        is_main_process: bool = True,
        state_dict: Optional[dict] = None,
        push_to_hub: bool = False,
        **kwargs: Any,
    ) -> None:
        """transformers' ``save_pretrained`` (weights, config with the model code, generation
        config), plus a model card ``README.md`` with usage and the configuration (see
        :mod:`.model_card_trellis`; a hand-written card is kept).

        With ``push_to_hub=True`` the model is then uploaded by :meth:`push_to_hub`, to
        ``repo_id`` (default: the folder's name), with the ``commit_message``, ``private``,
        ``create_pr``, ``revision`` and ``token`` given here.
        """
        hub_keys = ("repo_id", "commit_message", "commit_description", "private", "create_pr", "revision")
        hub_options = {key: kwargs.pop(key) for key in hub_keys if key in kwargs}
        super().save_pretrained(save_directory, is_main_process=is_main_process, state_dict=state_dict, **kwargs)
        if not is_main_process:
            return
        write_model_card(save_directory, self)
        if push_to_hub:
            repo_id = hub_options.pop("repo_id", os.path.basename(os.path.normpath(save_directory)))
            self.push_to_hub(repo_id, token=kwargs.get("token"), **hub_options)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: Optional[str] = None,
        commit_description: Optional[str] = None,
        private: Optional[bool] = None,
        token: Union[bool, str, None] = None,
        revision: Optional[str] = None,
        create_pr: bool = False,
        max_shard_size: Union[int, str, None] = "50GB",
        tags: Optional[list[str]] = None,
    ) -> Any:
        """Upload the weights, config, model code, generation config and model card to ``repo_id``.

        As transformers' ``push_to_hub``, except for the card: transformers would upload a
        generic one, this uploads the model's own (naming ``repo_id`` in its usage example),
        unless the repository already holds a hand-written card, which is left as it is.
        """
        from transformers.utils import hub  # looked up at call time, so tests can stand in for the Hub

        repo_id = hub.hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        keep_remote_card = not is_generated(hub_card_text(repo_id, token))
        with tempfile.TemporaryDirectory() as work_dir:
            self.save_pretrained(work_dir, max_shard_size=max_shard_size)
            if keep_remote_card:
                (Path(work_dir) / CARD_NAME).unlink()
            else:
                write_model_card(work_dir, self, name=repo_id, tags=tuple(tags or ()) + tuple(self.model_tags or ()))
            return self._upload_modified_files(
                work_dir, repo_id, files_timestamps={}, commit_message=commit_message or "Upload model", token=token,
                create_pr=create_pr, revision=revision, commit_description=commit_description,
            )


class TrellisModel(TrellisPreTrainedModel):
    """Embeddings, blocks and the final norm; returns hidden states and the cache."""

    def __init__(self, config: TrellisConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TrellisDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Union[torch.Tensor, dict, None] = None,
        past_key_values: Optional[TrellisCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        position_ids: Optional[torch.LongTensor] = None,
        **kwargs: Any,
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """Run the stack on ``input_ids [B, T]`` or ``inputs_embeds [B, T, D]``.

        Args:
            attention_mask: ``[B, past + T]`` with 0 at padding (left, right or anywhere),
                a dict holding one, or ``None`` (no padding).
            past_key_values: a :class:`TrellisCache` to continue from; it is updated in place.
            use_cache: create a cache when none is given (default: ``config.use_cache``).
            output_hidden_states: also return the embeddings and every block's output (the
                last one after the final norm).
            position_ids: ``[B or 1, past + T]``, only read for packed documents: a real token
                numbered 0 that is not its row's first real token starts a new document, from the
                initial memories and with a fresh short conv (transformers' packing convention, as
                ``DataCollatorWithFlattening`` makes it). Order itself comes from the recurrence.
            kwargs: accepted and ignored (e.g. the ``cu_seq_lens_*`` of flash-attention packing:
                documents are read from ``position_ids``).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if use_cache is None:
            use_cache = self.config.use_cache
        cache = self._checked_cache(past_key_values, use_cache, batch)
        valid = ValidTokens.from_attention_mask(attention_mask, batch, length, position_ids)

        hidden_states = inputs_embeds
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, valid=valid, past_key_values=cache)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        if cache is not None:
            cache.add_seen_tokens(length)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, past_key_values=cache, hidden_states=all_hidden_states
        )
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    def _checked_cache(self, cache: Any, use_cache: bool, batch: int) -> Optional[TrellisCache]:
        """The cache this forward reads and updates, or ``None``."""
        if self.training and any(layer.gradient_checkpointing for layer in self.layers):
            if cache is not None or use_cache:
                logger.warning_once("A TrellisCache is not used under activation checkpointing in training.")
            return None
        if cache is None:
            return TrellisCache(self.config.num_hidden_layers) if use_cache else None
        if not isinstance(cache, TrellisCache):
            raise ValueError(f"past_key_values must be a TrellisCache, got {type(cache).__name__}")
        if len(cache.layers) != self.config.num_hidden_layers:
            raise ValueError(
                f"past_key_values has {len(cache.layers)} layers, the model {self.config.num_hidden_layers}"
            )
        if cache.batch_size not in (None, batch):
            raise ValueError(f"past_key_values holds {cache.batch_size} rows, the input {batch}")
        return cache


class TrellisForCausalLM(TrellisPreTrainedModel, GenerationMixin):
    """:class:`TrellisModel` with a language-modelling head (tied to the embeddings by default)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: TrellisConfig) -> None:
        super().__init__(config)
        self.model = TrellisModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Union[torch.Tensor, dict, None] = None,
        past_key_values: Optional[TrellisCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        token_type_ids: Optional[torch.LongTensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        **kwargs: Any,
    ) -> Union[CausalLMOutputWithPast, tuple]:
        """Logits ``[B, T, V]`` (or of the positions ``logits_to_keep`` selects) and the cache.

        ``labels [B, T]`` (-100 to ignore) give the next-token loss; ``kwargs`` go to
        ``loss_function``, e.g. ``num_items_in_batch`` (the Trainer passes it with gradient
        accumulation). ``token_type_ids`` is accepted and ignored (there are no segments), so
        that ``generate(**tokenizer(...))`` works with tokenizers that return it. Other
        arguments as in :meth:`TrellisModel.forward`.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            position_ids=position_ids,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states
        )
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: Optional[int] = None,
        past_key_values: Optional[TrellisCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        is_first_iteration: Optional[bool] = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Inputs of one ``generate`` step: only the tokens the cache has not taken in.

        ``generate`` says how many those are in ``next_sequence_length`` (the prompt's unseen
        part at prefill, 1 afterwards, ``None`` to feed everything). Prompt embeddings are
        used on the first step only. The 2-D mask is passed whole; ``forward`` reads its tail.
        """
        def unseen(x: torch.Tensor) -> torch.Tensor:
            return x if next_sequence_length is None else x[:, x.shape[1] - next_sequence_length :]

        if inputs_embeds is not None and is_first_iteration:
            model_inputs: dict[str, Any] = {"input_ids": None, "inputs_embeds": unseen(inputs_embeds)}
        else:
            model_inputs = {"input_ids": unseen(input_ids).contiguous()}
        model_inputs["past_key_values"] = past_key_values
        model_inputs["attention_mask"] = attention_mask
        for key, value in kwargs.items():
            if key != "labels":
                model_inputs.setdefault(key, value)
        # generate() may keep its bookkeeping on the host and leaves the move to this method.
        return {
            key: value.to(self.device) if isinstance(value, torch.Tensor) and self.device.type != "meta" else value
            for key, value in model_inputs.items()
        }

    def _prepare_cache_for_generation(
        self, generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int, max_cache_length: int
    ) -> None:
        """Give ``generate`` a :class:`TrellisCache` (the default would build a key-value cache).

        A cache passed by the user is grown to the beams / returned sequences when it still
        holds one row per prompt, so a conversation can continue with ``num_beams`` or
        ``num_return_sequences`` > 1.
        """
        cache = model_kwargs.get("past_key_values")
        if cache is not None:
            if not isinstance(cache, TrellisCache):
                raise ValueError(f"past_key_values must be a TrellisCache, got {type(cache).__name__}")
            cache._is_user_defined = True
            expand = max(generation_config.num_beams, generation_config.num_return_sequences)
            if expand > 1 and cache.batch_size == batch_size:
                cache.batch_repeat_interleave(expand)
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            logger.warning_once(
                f"cache_implementation={generation_config.cache_implementation!r} is ignored: Trellis models "
                "always use their fixed-size TrellisCache."
            )
        model_kwargs["past_key_values"] = TrellisCache(self.config.num_hidden_layers)


__all__ = ["TrellisForCausalLM", "TrellisModel", "TrellisPreTrainedModel"]
