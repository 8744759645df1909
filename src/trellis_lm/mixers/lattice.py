"""The Lattice mixer (design page ``lattice.md``, section 5): one memory of unit-norm slots,
each written only orthogonally to itself."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..cache_entries import MemoryLayerCache
from ..cache_layout import TensorSpec
from ..configuration_trellis import TrellisConfig
from ..ops.lattice import BACKENDS, LATTICE_VARIANTS, LatticeState, lattice_attention, lattice_step, lattice_step_for
from .base import MemoryMixer, Projections, chunked_memory_layout
from .fields import CHUNK_SIZE, CONV_SIZE, NUM_SLOTS, choice
from .norms_convs import at_least_float32


class LatticeLayerCache(MemoryLayerCache):
    """A Lattice layer's cache entry: short-conv tails and a :class:`~trellis_lm.ops.LatticeState`."""

    state_class = LatticeState


class LatticeMixer(MemoryMixer):
    """The Lattice mixer: projections, short convs, step size, the op, gated output.

    Parameters: ``q_proj, k_proj: D -> H M`` (slot coefficients), ``v_proj, g_proj: D -> H d``,
    ``gamma_proj: D -> H`` (bias zero at init), ``o_proj: H d -> D``, ``s0 [H, M, d]`` (the
    learned initial memory, used as ``rownorm(s0)``), short convs on q and k, ``o_norm``.
    ``config.op_backend`` is passed to the op as it is (the config refuses ``"triton"`` for a
    model with Lattice layers: the op has no Triton kernels).
    """

    kind = "lattice"
    teacher_parts = {"q_proj": "slots", "k_proj": "slots", "v_proj": "heads", "o_proj": "copy"}
    new_parameters = ("gamma_proj", "g_proj", "q_conv", "k_conv", "o_norm", "s0")
    display_name = "Lattice"
    state_class = LatticeState
    cache_class = LatticeLayerCache
    backends = BACKENDS
    op = staticmethod(lattice_attention)
    config_fields = (NUM_SLOTS, CHUNK_SIZE, choice("lattice_variant", LATTICE_VARIANTS), CONV_SIZE)
    silu_l2_qk = True
    qk_width = "num_slots"
    fusable_projections = ("q_proj", "k_proj", "v_proj", "g_proj", "gamma_proj")
    compilable = True
    step_op = staticmethod(lattice_step)
    step_for = staticmethod(lattice_step_for)

    def __init__(self, config: Optional[TrellisConfig] = None, layer_idx: int = 0, **arguments: Any) -> None:
        super().__init__(config, layer_idx, **arguments)
        config = self.config
        hidden, heads, dim, slots = config.hidden_size, config.num_heads, config.head_dim, config.num_slots
        self._build_qkv()
        self.gamma_proj = nn.Linear(hidden, heads, bias=True)
        self._build_output()
        self._build_convs()
        self.s0 = nn.Parameter(torch.empty(heads, slots, dim))
        self._init_if_standalone()

    @classmethod
    def state_layout(cls, config: TrellisConfig) -> dict[str, TensorSpec]:
        """:class:`~trellis_lm.ops.LatticeState`: ``[B, H, M, d]`` memory and anchor, the offset in ``[0, C)``."""
        return chunked_memory_layout(config, ("memory", "anchor"))

    def op_inputs(self, proj: Projections, q: torch.Tensor, k: torch.Tensor, valid: Any = None,
                  state: Any = None) -> tuple[torch.Tensor, ...]:
        """``(q, k, v, gamma)`` as :func:`~trellis_lm.ops.lattice_attention` takes them;
        ``q``, ``k`` arrive through SiLU and the per-head L2 norm (``silu_l2_qk``), ``[B, T, H, M]``."""
        v = proj.values()
        gamma = torch.sigmoid(at_least_float32(proj["gamma_proj"]))
        return q, k, v, gamma

    def fresh_state(self, rows: int) -> LatticeState:
        return LatticeState.at_chunk_start(self.s0.expand(rows, -1, -1, -1))

    def op_settings(self) -> dict[str, Any]:
        return dict(chunk_size=self.config.chunk_size, variant=self.config.lattice_variant)
    def init_weights(self, init: Any) -> None:
        super().init_weights(init)
        heads, slots, dim = self.s0.shape
        if slots <= dim:
            # Orthonormal slots per head, as the paper starts from: rows of Q^T for a random Q.
            q, _ = torch.linalg.qr(torch.randn(heads, dim, slots, dtype=torch.float64))
            init.copy_(self.s0, q.transpose(1, 2).to(self.s0))
        else:  # more slots than directions: random unit-scale rows (the op normalises them)
            init.normal_(self.s0, mean=0.0, std=1.0)

    @torch.no_grad()
    def init_from_attention(self, input_norm_weight: Optional[torch.Tensor]) -> None:
        """Initialise what a Lattice mixer has beyond the teacher's projections (q/k via
        :func:`~trellis_lm.conversion.llama.project_to_slots`, v/o copied), for the same aims as
        :meth:`TrellisMixer.init_from_attention` (``input_norm_weight`` is not read):

        - ``g_proj = 0``: the mixer outputs exactly 0, so the converted model is the teacher with
          this layer's attention output removed, and stage 1's error starts at 1.0 (same reasons as
          for Trellis: no bias can give a gate of about 1, a random gate is noise).
        - ``q_conv``, ``k_conv`` = identity: the slot coefficients are SiLU of the projected teacher
          q and k, not a random mix of four positions.
        - ``gamma_proj``: weight 0, bias 0, i.e. step size 1/2 for every token, Lattice's own
          starting point (its bias is zero at init too); the weight is trained.
        - ``s0``: Lattice's own initialisation (orthonormal slots per head when ``M <= d``), drawn
          from the conversion's seed. Which basis the slots start in does not matter for the
          q/k correspondence: a key and a query meet through the slot index, not its direction.
        - ``o_norm`` weight 1: the gate alone sets the output scale.
        """
        self._start_silent()
        self.gamma_proj.weight.zero_()
        self.gamma_proj.bias.zero_()
