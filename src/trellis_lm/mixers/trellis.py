"""The Trellis mixer (design page ``trellis.md``, section 5): two memories written by one
online-gradient step per token, with a forget gate."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_entries import MemoryLayerCache
from ..cache_layout import TensorSpec
from ..configuration_trellis import TrellisConfig
from ..ops.trellis import (BACKENDS, COMPRESS_FNS, MIX_FNS, WRITE_GRADIENTS, TrellisState, trellis_attention,
                           trellis_step, trellis_step_for)
from ..ops.trellis.compress_mix import reads_current_memory
from .base import MemoryMixer, Projections, chunked_memory_layout
from .fields import CHUNK_SIZE, CONV_SIZE, NUM_SLOTS, ConfigField, choice, flag, positive
from .norms_convs import at_least_float32


def forget_gate_bias(num_heads: int, normalizer: float, span: tuple[float, float] = (1e-3, 1e-1)) -> torch.Tensor:
    """``beta_proj`` bias that spreads ``1 - beta`` log-evenly over ``span`` across heads (the
    default: beta from 0.9 to 0.999; one head takes the span's geometric middle, 0.99).

    While the weight term is small ``beta = exp(logsigmoid(b) / normalizer)``, i.e.
    ``sigmoid(b) = beta ** normalizer``. Returns ``[H]`` float64.
    """
    low, high = span
    if not 0 < low <= high < 1:
        raise ValueError(f"span must hold 0 < low <= high < 1 (values of 1 - beta), got {span}")
    if num_heads == 1:
        exponents = torch.tensor([(math.log10(low) + math.log10(high)) / 2], dtype=torch.float64)
    else:
        exponents = torch.linspace(math.log10(high), math.log10(low), num_heads, dtype=torch.float64)
    p = (1.0 - 10.0**exponents) ** normalizer
    return torch.log(p) - torch.log1p(-p)


class TrellisLayerCache(MemoryLayerCache):
    """A Trellis layer's cache entry: short-conv tails and a :class:`~trellis_lm.ops.TrellisState`."""

    state_class = TrellisState


class TrellisMixer(MemoryMixer):
    """The Trellis mixer: projections, short convs, gates, the op, gated output.

    Named ``self_attn`` in its block so Llama LoRA targets and conversions carry over.
    Parameters: ``q_proj, k_proj, v_proj, g_proj: D -> H d``, ``alpha_proj: D -> H M``,
    ``beta_proj`` (with the forget gate), ``gamma_proj: D -> H``, ``o_proj: H d -> D``,
    ``mk0, mv0 [H, M, d]`` (the learned initial memories), short convs and ``o_norm``.
    """

    kind = "trellis"
    display_name = "Trellis"
    state_class = TrellisState
    cache_class = TrellisLayerCache
    backends = BACKENDS
    op = staticmethod(trellis_attention)
    step_op = staticmethod(trellis_step)
    step_for = staticmethod(trellis_step_for)
    config_fields = (
        NUM_SLOTS, CHUNK_SIZE, choice("compress_fn", COMPRESS_FNS), choice("mix_fn", MIX_FNS), CONV_SIZE,
        flag("use_forget_gate"), positive("gate_logit_normalizer"),
        # Every checkpoint saved before the field existed computes the anchored function.
        choice("write_gradient", WRITE_GRADIENTS),
    )
    # A LayerNorm over one slot is 0 with a zero gradient: mix_fn "ln_silu" then reads 0 for every
    # input and compress_fn "layernorm" writes nothing, a memory that cannot be addressed.
    layer_checks = (
        ConfigField(
            "num_slots", lambda v, c: v >= 2 or (c.compress_fn != "layernorm" and c.mix_fn != "ln_silu"),
            lambda c: f"at least 2 in Trellis layers with compress_fn={c.compress_fn!r} and mix_fn={c.mix_fn!r}: a "
                      "LayerNorm over one slot is 0 (ln_silu reads 0 for every input, layernorm writes nothing)",
        ),
    )
    compilable = True
    teacher_parts = {"q_proj": "copy", "k_proj": "heads", "v_proj": "heads", "o_proj": "copy"}
    new_parameters = ("alpha_proj", "beta_proj", "gamma_proj", "g_proj", "q_conv", "k_conv", "o_norm", "mk0", "mv0")
    silu_l2_qk = True
    qk_width = "head_dim"
    fusable_projections = ("q_proj", "k_proj", "v_proj", "alpha_proj", "g_proj", "beta_proj", "gamma_proj")

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__(config, layer_idx, **arguments)
        config = self.config
        hidden, heads, dim, slots = config.hidden_size, config.num_heads, config.head_dim, config.num_slots
        self._build_qkv()
        self.alpha_proj = nn.Linear(hidden, heads * slots, bias=False)
        self.beta_proj = nn.Linear(hidden, heads, bias=True) if config.use_forget_gate else None
        self.gamma_proj = nn.Linear(hidden, heads, bias=True)
        self._build_output()
        self._build_convs()
        self.mk0 = nn.Parameter(torch.empty(heads, slots, dim))
        self.mv0 = nn.Parameter(torch.empty(heads, slots, dim))
        self._init_if_standalone()

    @classmethod
    def state_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """:class:`~trellis_lm.ops.TrellisState`: four ``[B, H, M, d]`` memories, the offset in ``[0, C)``."""
        return chunked_memory_layout(config, ("m_k", "m_v", "anchor_k", "anchor_v"))

    @classmethod
    def unread_state(cls, config: TrellisConfig) -> dict[str, str]:
        """The anchors, where every residual is taken at the current memory (``"exact"`` writes,
        the default, and ``identity``; design page, section 1): the memories stand in for them."""
        if reads_current_memory(config.compress_fn, config.write_gradient):
            return {"anchor_k": "m_k", "anchor_v": "m_v"}
        return {}

    def op_inputs(self, proj: Projections, q: torch.Tensor, k: torch.Tensor, valid: Any = None,
                  state: Any = None) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, alpha, log_beta, gamma)`` as :func:`~trellis_lm.ops.trellis_attention` takes them;
        ``q``, ``k`` arrive through SiLU and the L2 norm (``silu_l2_qk``), ``[B, T, H, d]``."""
        v = proj.values()
        batch, length, heads = v.shape[:3]
        alpha = at_least_float32(proj["alpha_proj"]).view(batch, length, heads, -1)
        if self.beta_proj is not None:
            log_beta = self.log_forget(at_least_float32(proj["beta_proj"]))
        else:
            log_beta = alpha.new_zeros(batch, length, heads)
        gamma = torch.sigmoid(at_least_float32(proj["gamma_proj"]))
        return q, k, v, alpha, log_beta, gamma

    def log_forget(self, logits: torch.Tensor) -> torch.Tensor:
        """``log beta [..., H]`` of the forget gate from ``beta_proj``'s output ``logits [..., H]``:
        ``logsigmoid(logits) / gate_logit_normalizer``. A write decays by e over ``-1 / log beta``
        tokens, the head's forget horizon (what studies of length read)."""
        # logsigmoid(x) as softplus(x, beta=-1), -log(1 + exp(-x)): the same function up to rounding
        # (torch's softplus keeps x itself below x = -20), a kernel that costs a decode step's few
        # gates about half of logsigmoid's, which also makes a buffer for its backward.
        return F.softplus(logits, beta=-1) / self.config.gate_logit_normalizer

    def forget_logit_cap(self, horizon: float) -> float:
        """The largest ``beta_proj`` output whose gate forgets at least as fast as a horizon of
        ``horizon`` tokens (``log beta <= -1 / horizon``, see :meth:`log_forget`): clamping the
        logits to it caps every head's horizon, an intervention at inference."""
        if not horizon > 0:
            raise ValueError(f"horizon must be a positive number of tokens, got {horizon!r}")
        # logsigmoid(b) / normalizer <= -1 / horizon  <=>  b <= logit(exp(-normalizer / horizon))
        p = math.exp(-self.config.gate_logit_normalizer / horizon)
        return math.log(p) - math.log1p(-p)

    def fresh_state(self, rows: int) -> TrellisState:
        return TrellisState.at_chunk_start(self.mk0.expand(rows, -1, -1, -1), self.mv0.expand(rows, -1, -1, -1))

    def op_settings(self) -> dict[str, Any]:
        config = self.config
        return dict(chunk_size=config.chunk_size, compress_fn=config.compress_fn, mix_fn=config.mix_fn,
                    write_gradient=config.write_gradient)

    def init_weights(self, init: Any) -> None:
        super().init_weights(init)
        # Entries of order 1, so `MK0 k` spreads over the slots for a unit-norm k; a tiny
        # memory would make the l2norm/layernorm compressions divide by about eps.
        init.normal_(self.mk0, mean=0.0, std=1.0)
        init.normal_(self.mv0, mean=0.0, std=1.0)
        # Targets of unit variance per slot, the scale the layernorm compression outputs
        # (the mixer's input has unit RMS at init). The layernorm compression's Jacobian
        # removes the radial part of phi(z) - alpha, so a write is about -J^T alpha: with the
        # generic 0.02 init the targets, hence the writes, would be several times too small
        # to learn from (MQAR then barely moves, docs/results.md). Replaces the nn.Linear
        # branch's init, as conversion does (conversion/llama.py).
        init.normal_(self.alpha_proj.weight, mean=0.0, std=self.config.hidden_size**-0.5)
        if self.beta_proj is not None:
            # Modules are initialised children first, so this replaces the zero bias
            # the nn.Linear branch gave beta_proj.
            bias = forget_gate_bias(self.config.num_heads, self.config.gate_logit_normalizer)
            init.copy_(self.beta_proj.bias, bias.to(self.beta_proj.bias))

    @torch.no_grad()
    def init_from_attention(self, input_norm_weight: torch.Tensor) -> None:
        """Initialise what a Trellis mixer has beyond the teacher's q/k/v/o projections.

        The aim is a converted model that starts as a well-defined function and gives the
        distillation a well-conditioned op to shape:

        - ``g_proj = 0``: the output gate GELU(g_proj x) is exactly 0, so every mixer outputs 0 and
          the converted model *is* the teacher with its attention outputs removed. A gate of about 1,
          which would pass the memory read through unchanged, cannot be had without a bias (GELU of
          a bias-free linear map of an RMS-normalised input has no constant part), and a random gate
          would add context-free noise of the attention's own size to every layer. GELU'(0) = 1/2,
          so the gate still gets gradients at once (as a zero-initialised LoRA ``B`` or residual
          branch does) and the rest of the mixer right after the first step. Layer-wise errors start
          at exactly 1.0 in :func:`trellis_lm.conversion.layerwise_errors`.
        - ``q_conv``, ``k_conv`` = identity (last tap 1, others 0): q and k are then SiLU of the
          teacher's own (pre-rotary) projections; PyTorch's random conv default would mix four
          positions with random weights and scramble the carried projections. Training can still
          learn local mixing from there, which takes over part of what the rotary embedding did.
        - ``beta_proj``: weight 0, bias from :func:`forget_gate_bias`, i.e. the forget gate spread
          over heads from 0.9 to 0.999 (memory horizons of about 10 to 1000 tokens), like the mix
          of local and long-range heads in an attention layer. Independent of the input at first,
          so each head's horizon is known; the weight is trained.
        - ``gamma_proj``: weight 0, bias 0, i.e. the inner learning rate is 1/2 for every token: far
          above the forget rate (1 - beta <= 0.1), so what is written dominates the memory's decay,
          while a chunk of C stale-gradient updates stays moderate against entries of order 1.
        - ``alpha_proj`` ~ N(0, 1 / |w|^2) with ``w`` the block's ``input_layernorm`` weight: the
          mixer input is ``w * x_hat`` with ``x_hat`` of unit RMS, so each target entry has variance
          about 1 — the scale of what the LayerNorm compression outputs. The targets are then
          distinct, random codes per token that the key pass stores and the value pass reads back
          with. Targets near 0 (the generic 0.02 init on a small ``w``) would write almost nothing:
          the LayerNorm compression's gradient towards 0 is radial and its Jacobian removes it.
        - ``mk0``, ``mv0`` ~ N(0, 1), the model's own choice (design page, section 5): ``MK0 k`` then
          spreads with unit variance over the slots for a unit-norm k, so the compressions do not
          divide by about eps.
        - ``o_norm`` weight 1: the output per head has unit RMS before the gate, so the gate alone
          sets the output scale that the distillation learns.

        Args:
            input_norm_weight: ``[D]`` the teacher's ``input_layernorm`` weight of this block (the
                mixer's q/k/v/o projections are the teacher's, set before or after).
        """
        self._start_silent()
        if self.beta_proj is not None:
            self.beta_proj.weight.zero_()
            self.beta_proj.bias.copy_(forget_gate_bias(self.config.num_heads, self.config.gate_logit_normalizer))
        self.gamma_proj.weight.zero_()
        self.gamma_proj.bias.zero_()
        scale = input_norm_weight.float().norm().clamp_min(1e-6)
        self.alpha_proj.weight.normal_(0.0, 1.0).div_(scale)
        self.mk0.normal_(0.0, 1.0)
        self.mv0.normal_(0.0, 1.0)
