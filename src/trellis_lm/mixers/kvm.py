"""The Key-Value Means mixer (design page ``kvm.md``, section 5): attention over a window of
recent chunks plus a bounded state of merged key/value means."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..cache_entries import MemoryLayerCache
from ..cache_layout import COLUMNS, ROWS, Dim, TensorSpec
from ..configuration_trellis import TrellisConfig
from ..ops.kvm import BACKENDS, BUDGETS, KVMState, kvm_attention, kvm_step
from ..ops.kvm.dispatch import check_counters, kvm_config
from .base import MemoryMixer, Projections
from .fields import ROPE_THETA, ConfigField, choice, integer, is_int, positive
from .valid_tokens import ValidTokens, token_positions

LN_EPS = 1e-5  # every LayerNorm of the design page


def kvm_rotary(x: torch.Tensor, positions: torch.Tensor, rope_dims: int, theta: float) -> torch.Tensor:
    """The page's partial RoPE on ``x [..., B, T, H, Dk]`` at ``positions [B, T]``.

    Channel pairs ``(2i, 2i + 1)`` for ``i < R / 2`` turn by ``p theta^(-i / (R/2 - 1))``:
    ``out[2i] = x[2i] cos + x[2i+1] sin``, ``out[2i+1] = x[2i+1] cos - x[2i] sin`` (the official
    code's convention, not Llama's); the other channels pass through. Angles in float64.
    """
    if rope_dims == 0:
        return x
    half = rope_dims // 2
    exponent = torch.arange(half, dtype=torch.float64, device=x.device) / max(half - 1, 1)
    angles = positions.to(torch.float64)[..., None, None] * theta ** (-exponent)  # [B, T, 1, R/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., :rope_dims:2], x[..., 1:rope_dims:2]
    turned = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1).flatten(-2)
    return torch.cat((turned, x[..., rope_dims:]), dim=-1)


class KVMLayerCache(MemoryLayerCache):
    """A KVM layer's cache entry: its :class:`~trellis_lm.ops.KVMState` holds the window and the
    merged means (no short-conv tails)."""

    state_class = KVMState

    @classmethod
    def value_problem(cls, tensors: dict[str, torch.Tensor], config: Optional[TrellisConfig]) -> Optional[str]:
        """The counters against each other and the buffers, as the op checks a state it is given
        (``seen`` and ``covered`` agree with the chunking, ``used`` and the window fit their
        buffers): a state that breaks them would index past its buffers."""
        if config is None:
            return None
        settings = kvm_config(
            config.kvm_chunk_size, config.kvm_window_chunks, config.kvm_rotary_dims, config.kvm_sinks,
            config.kvm_state_size, config.kvm_budget, config.kvm_budget_scale, config.kvm_budget_exponent,
            config.kvm_budget_saturation, 1, config.kvm_budget_min,
        )
        room = (tensors["keys"].shape[2], tensors["window_k"].shape[2])
        try:
            check_counters(*(tensors[name].tolist() for name in ("seen", "covered", "used")), room, settings)
        except ValueError as error:
            return f"its counters do not hold together: {error}"
        return None


class KVMMixer(MemoryMixer):
    """The KVM mixer: projections, per-head q/k LayerNorm (affine shared by the heads), partial
    RoPE, merge gate ``1 + elu(merge_proj(x))``, the op, ``o_proj`` (no output norm or gate: it
    is attention).

    Parameters: ``q_proj, k_proj, v_proj: D -> H d``, ``q_norm, k_norm`` (LayerNorm over d),
    ``merge_proj: D -> H`` (the merge gate's logits; no bias, zero at init: plain sums at the
    start; not named ``gate_proj``, the MLP's name, so LoRA recipes that target the MLP leave
    it alone), the state LayerNorm
    ``state_norm_weight, state_norm_bias [H, d]``, ``temperature [H, 2]`` (t_s, t_w; 1 at init),
    ``o_proj: H d -> D``. Settings: ``config.kvm_*`` and ``rope_theta``. ``config.op_backend``
    is passed to the op as it is (the config refuses ``"triton"``: KVM has no custom kernels).
    """

    kind = "kvm"
    display_name = "Key-Value Means"
    state_class = KVMState
    cache_class = KVMLayerCache
    backends = BACKENDS
    op = staticmethod(kvm_attention)
    step_op = staticmethod(kvm_step)
    fusable_projections = ("q_proj", "k_proj", "v_proj", "merge_proj")
    config_fields = (
        ROPE_THETA,
        integer("kvm_chunk_size", 1, 2**16),
        integer("kvm_window_chunks", 1, 2**10),
        ConfigField(
            "kvm_rope_dims", lambda v, c: v is None or (is_int(v) and 0 <= v < c.head_dim and v % 2 == 0),
            lambda c: f"None or an even integer in [0, head_dim = {c.head_dim}): with every channel rotated, the "
                      "state keys (rotated channels zeroed) would all be one vector, unable to tell tokens apart",
        ),
        ConfigField("kvm_sinks", lambda v, c: is_int(v) and 0 <= v < c.kvm_chunk_size,
                    lambda c: f"an integer in [0, kvm_chunk_size = {c.kvm_chunk_size})"),
        ConfigField("kvm_state_size", lambda v, c: is_int(v) and c.kvm_chunk_size <= v <= 2**16,
                    lambda c: f"an integer in [kvm_chunk_size = {c.kvm_chunk_size}, {2**16}]"),
        choice("kvm_budget", BUDGETS),
        positive("kvm_budget_scale"),
        positive("kvm_budget_exponent"),
        positive("kvm_budget_saturation"),
        ConfigField("kvm_budget_min", lambda v, c: v is None or (is_int(v) and 0 <= v <= c.kvm_state_size),
                    lambda c: f"None (kvm_chunk_size) or an integer in [0, kvm_state_size = {c.kvm_state_size}]"),
    )

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__(config, layer_idx, **arguments)
        config = self.config
        hidden, heads, dim = config.hidden_size, config.num_heads, config.head_dim
        self._build_qkv()
        self.merge_proj = nn.Linear(hidden, heads, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.q_norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.k_norm = nn.LayerNorm(dim, eps=LN_EPS)
        self.state_norm_weight = nn.Parameter(torch.ones(heads, dim))
        self.state_norm_bias = nn.Parameter(torch.zeros(heads, dim))
        self.temperature = nn.Parameter(torch.ones(heads, 2))
        self._init_if_standalone()

    @classmethod
    def describe_cache(cls, config: TrellisConfig) -> str:
        window = config.kvm_window_chunks * config.kvm_chunk_size
        return (f"a window of the last {window} tokens' keys and values and at most {config.kvm_state_size} merged "
                f"key/value means per head ({config.num_heads} heads)")

    @classmethod
    def state_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """:class:`~trellis_lm.ops.KVMState`: buffers of ``R <= kvm_state_size`` state rows and
        ``W' <= kvm_window_chunks * kvm_chunk_size`` window slots (grown with the tokens), and
        the counters (tokens seen and folded at most the cache's tokens, rows used at most R)."""
        heads, dim = config.num_heads, config.head_dim
        rows, slots = Dim("state rows", config.kvm_state_size), Dim("window slots", config.kvm_window_chunks * config.kvm_chunk_size)
        counter = TensorSpec((ROWS,), "int64", most=COLUMNS)
        return {
            "keys": TensorSpec((ROWS, heads, rows, dim)), "values": TensorSpec((ROWS, heads, rows, dim)),
            "radii": TensorSpec((ROWS, heads, rows)), "used": TensorSpec((ROWS,), "int64", most=config.kvm_state_size),
            "window_k": TensorSpec((ROWS, heads, slots, dim)), "window_v": TensorSpec((ROWS, heads, slots, dim)),
            "window_g": TensorSpec((ROWS, heads, slots)), "seen": counter, "covered": counter,
        }

    def op_inputs(self, proj: Projections, q: torch.Tensor, k: torch.Tensor, valid: Optional[ValidTokens] = None,
                  state: Optional[KVMState] = None) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, gate)`` as :func:`~trellis_lm.ops.kvm_attention` takes them; RoPE positions
        count each row's real tokens, continuing the carried state's."""
        x = proj.x
        batch, length, _ = x.shape
        heads, dim = self.config.num_heads, self.config.head_dim
        past = state.seen.to(x.device) if state is not None else torch.zeros(batch, dtype=torch.long, device=x.device)
        positions = token_positions(valid, past, length)
        rope = self.config.kvm_rotary_dims
        # q and k turn by the same angles: one rotation of both, split by one unbind.
        qk = torch.stack([self.q_norm(q.view(batch, length, heads, dim)),
                          self.k_norm(k.view(batch, length, heads, dim))])
        q, k = kvm_rotary(qk, positions, rope, self.config.rope_theta).unbind(0)
        v = proj["v_proj"].view(batch, length, heads, dim)
        # 1 + elu(z), computed as z + 1 for z > 0 and exp(z) below: exp's small values survive
        # bf16 (1 + elu rounds to 0 there from z <= -7, exp only below -87); z is clamped at 0
        # for exp, so the branch not taken cannot overflow into a NaN gradient.
        logits = proj["merge_proj"]
        gate = torch.where(logits > 0, logits + 1.0, logits.clamp(max=0.0).exp())
        return q, k, v, gate

    def fresh_state(self, rows: int) -> KVMState:
        config = self.config
        dtype = torch.float64 if self.o_proj.weight.dtype == torch.float64 else torch.float32
        # Empty buffers: the op grows them with the tokens, up to kvm_state_size rows and the
        # window, so a short input never pays for the configured sizes.
        return KVMState.empty(
            rows, config.num_heads, 0, 0, config.head_dim, config.head_dim, dtype=dtype, device=self.o_proj.weight.device,
        )

    def op_settings(self) -> dict[str, Any]:
        config = self.config
        return dict(
            norm_weight=self.state_norm_weight, norm_bias=self.state_norm_bias, temperature=self.temperature,
            chunk_size=config.kvm_chunk_size, window_chunks=config.kvm_window_chunks, rope_dims=config.kvm_rotary_dims,
            sinks=config.kvm_sinks, state_size=config.kvm_state_size, budget=config.kvm_budget,
            budget_scale=config.kvm_budget_scale, budget_exponent=config.kvm_budget_exponent,
            budget_saturation=config.kvm_budget_saturation,
            budget_min=config.kvm_budget_min,  # None: one chunk, in the op as in the config
        )

    def read_out(self, proj: Projections, o: torch.Tensor) -> torch.Tensor:
        batch, length, _ = proj.x.shape
        return self.o_proj(o.reshape(batch, length, -1).to(proj.x.dtype))

    def init_weights(self, init: Any) -> None:
        super().init_weights(init)
        init.zeros_(self.merge_proj.weight)  # plain sums at the start (the page; upstream: Kaiming)
        init.ones_(self.state_norm_weight)
        init.zeros_(self.state_norm_bias)
        init.ones_(self.temperature)
        for norm in (self.q_norm, self.k_norm):
            init.ones_(norm.weight)
            init.zeros_(norm.bias)
