"""A decode step (one token per row) as one function of the tokens and the carried entries: what
``generate()`` runs after the prompt, eagerly, through ``torch.compile`` (CPU) or as a replayed
CUDA graph (GPU); :mod:`.compiled_decode` runs it the last two ways (``config.compile_decode``).

On a CPU a one-token step of a small model costs mostly per-operation overhead: the operations,
and the Python between them, which the general forward spends on what it must handle (padding,
packed documents, several tokens, hooks, checks) and on module calls and config lookups, each
about what an operation costs (BENCHMARKS.md, issues 40 and 73). Within an inference span
(:func:`decode_plans`, which ``generate()`` and the benchmarks hold) the model's forward hands a
decode step to :meth:`DecodePlan.step` before its general checks, and each memory block runs by
:func:`run_segment`: the block's function for one real token per row, with its weights and
settings taken once per span (:class:`TokenStep`), checked against the general path in float64
(``tests/test_decode_step.py``).

A model's consecutive memory blocks (Trellis, Lattice) form a *run*; the first run takes the
embedding in with it when it starts the model, the last run the final norm and the head when
it ends it, so an all-memory model's step is one function from the tokens to the logits: one
compiled call, or one CUDA graph. Attention and KVM blocks (a growing cache; a fold on a
data-dependent condition), blocks with a hook or an adapter (their projections not stacked),
and a first call without a carried state run through their modules, between runs.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .cache_entries import LayerCache, MemoryEntry, MemoryLayerCache
from .cache_trellis import CacheCall, TrellisCache
from .layer_kinds import layer_signature
from .mixers.base import MemoryMixer, Projections, gated_output
from .mixers.norms_convs import ScaledRMSNorm, conv_step, rms_norm
from .ops.checks import as_dtype, compute_dtype
from .projection_stacks import LinearStack, plain_forward_hooks


class TokenStep(NamedTuple):
    """A memory block's weights and settings as its decode step reads them, taken once per span
    (:meth:`of`): the step then calls no module (a module call and its ``forward``'s own
    attribute lookups cost a CPU about what an operation does) and reads no config field.

    Attributes:
        norms: the block's RMSNorms as functions of their input (:func:`token_norm`): before the
            mixer, before the MLP, and the mixer's per-head norm of its op's output.
        projections: the mixer's stacked projections of its input (its ``projection_stack``).
        qk_split: the widths of q and k, which lead the stack side by side (one slice of the
            stacked product: a memory mixer's q and k projections have no bias); ``qk_width``
            their sum.
        taps: ``[width, q channels + k channels]``, the taps of the mixer's short convs on q and
            k side by side in the activation dtype, as
            :func:`~trellis_lm.mixers.norms_convs.conv_step` takes them (``None``: no convs).
        op: the op's unchecked single-token step with the layer's settings and backend bound
            (the mixer's ``step_for``): ``op(*op_inputs, state) -> (o, state after)``.
        out: ``o_proj``'s weight.
        mlp: the MLP's stacked gate and up projections; ``down``: its down projection's weight.
    """

    norms: tuple[Callable[[torch.Tensor], torch.Tensor], ...]
    projections: LinearStack
    qk_split: list[int]
    qk_width: int
    taps: Optional[torch.Tensor]
    op: Callable[..., tuple[torch.Tensor, Any]]
    out: torch.Tensor
    mlp: LinearStack
    down: torch.Tensor

    @classmethod
    def of(cls, block: nn.Module) -> Optional["TokenStep"]:
        """``block``'s, for activations in its weights' dtype on their device; ``None`` unless its
        mixer is ``compilable``, its and its MLP's projections are stacked (a span's stacks, q and
        k leading the mixer's) and its output and down projections are plain ``nn.Linear`` (an
        adapter such as LoRA's replaces them): such a block decodes through its modules."""
        mixer, mlp = block.self_attn, block.mlp
        if not mixer.compilable:
            return None
        stack = mixer.projection_stack
        if (stack is None or mlp.projection_stack is None or not type(mixer.o_proj) is type(mlp.down_proj) is nn.Linear
                or stack.names[:2] != ("q_proj", "k_proj") or stack.biases[0] is not None or stack.biases[1] is not None):
            return None
        weight = block.input_layernorm.weight
        taps = None
        if mixer.q_conv is not None:
            with torch.no_grad():
                taps = torch.cat([mixer.q_conv.weight, mixer.k_conv.weight])[:, 0].t().to(weight.dtype).contiguous()
        op = type(mixer).step_for(weight.device, compute_dtype(weight), backend=mixer.config.op_backend,
                                  **mixer.op_settings())
        norms = tuple(token_norm(norm) for norm in (block.input_layernorm, block.post_attention_layernorm,
                                                           mixer.o_norm))
        return cls(norms, stack, stack.widths[:2], sum(stack.widths[:2]), taps, op, mixer.o_proj.weight, mlp.projection_stack,
                   mlp.down_proj.weight)


def token_norm(norm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm`` (a :class:`~trellis_lm.mixers.norms_convs.TrellisRMSNorm`) as a decode step runs it:
    on a CPU in float32 or float64 by :class:`~trellis_lm.mixers.norms_convs.ScaledRMSNorm`, its
    constants made now; elsewhere (a GPU's fused kernel, half precision's float32 upcast) by
    :func:`~trellis_lm.mixers.norms_convs.rms_norm`."""
    weight = norm.weight
    if weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.float64):
        return ScaledRMSNorm.of(weight, norm.eps)
    return functools.partial(rms_norm, weight=weight, eps=norm.eps)


def advance_token(mixer: MemoryMixer, x: torch.Tensor, entry: MemoryEntry,
                  step: TokenStep) -> tuple[torch.Tensor, MemoryEntry]:
    """``mixer.advance(x, None, entry)`` for one real token per row, ``x [B, D]`` (the token axis
    dropped), continuing a whole ``entry`` (a state, and tails where the mixer has convs), by
    ``step`` (its block's :class:`TokenStep`): the same operations on the same numbers, without
    what the general path spends on finding out that this is such a call. Returns ``(y [B, D],
    the entry after)``.

    The products' inputs stay two-dimensional: compiled, a ``[1, 1, D]`` product input is
    handed to the matrix product as a row of stride 0, which it copies first (and the gate
    comes as ``[B, H d]``, which compiled keeps ``o_proj``'s input dense: no copy either)."""
    out, parts = step.projections(x, token_axis=True)  # [B, 1, *], as the mixer reads them
    qk = out[..., : step.qk_width]
    q_tail, k_tail = entry.q_tail, entry.k_tail
    if step.taps is not None:
        tail = torch.cat([q_tail, k_tail], dim=-1)
        qk, tail = conv_step(qk, as_dtype(tail, qk.dtype, qk.device), step.taps)
        q_tail, k_tail = tail.split_with_sizes(step.qk_split, dim=-1)
    q, k, v = mixer.activated_qk(qk, step.qk_split, parts.get("v_proj"))
    proj = Projections(mixer, x, parts, values=v)
    o, state = step.op(*mixer.op_inputs(proj, q, k, None, entry.state), entry.state)
    gated = gated_output(parts["g_proj"].view(x.shape[0], -1), step.norms[2](o), x.dtype)
    return F.linear(gated, step.out), MemoryEntry(q_tail, k_tail, state)


class Segment(NamedTuple):
    """A run of memory blocks of a decode step, with what it takes in and gives out besides them.

    Attributes:
        blocks: the decoder blocks, in order (all memory mixers that :func:`advance_token` runs).
        steps: each block's :class:`TokenStep`.
        embedding: the token embedding when the run starts the model (it then takes token ids).
        norm: the final norm when the run ends the model (:func:`token_norm`'s form of it).
        head: the language-model head after the norm, when the step wants logits.
        keep_inputs: also give each mixer's input (what a cache that records its calls keeps).
    """

    blocks: tuple[nn.Module, ...]
    steps: tuple[TokenStep, ...]
    embedding: Optional[nn.Module]
    norm: Optional[Callable[[torch.Tensor], torch.Tensor]]
    head: Optional[nn.Module]
    keep_inputs: bool


def run_segment(segment: Segment, first: torch.Tensor, carried: Sequence[MemoryEntry],
                ) -> tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]:
    """The ``segment``'s blocks, each continuing its ``carried`` entry, from the token ids
    ``first [B, 1]`` (with an embedding) or the hidden state ``first [B, 1, D]``: what is compiled
    or captured as a CUDA graph, the blocks and weights being arguments, not constants.

    Returns the output (logits ``[B, 1, V]`` with a head, the normed hidden state with a norm
    alone, else the hidden state ``[B, 1, D]``), each block's entry after, and each mixer's input
    ``[B, 1, D]`` when ``segment.keep_inputs`` (else none)."""
    rows = first.shape[0]
    hidden = (segment.embedding(first) if segment.embedding is not None else first).view(rows, -1)  # [B, D]
    after, inputs = [], []
    for block, step, entry in zip(segment.blocks, segment.steps, carried):
        # The block's forward (TrellisDecoderLayer.around; its MLP's as TrellisMLP runs it stacked).
        x = step.norms[0](hidden)
        y, kept = advance_token(block.self_attn, x, entry, step)
        hidden = hidden + y
        gate, up = step.mlp(step.norms[1](hidden))[1].values()
        hidden = hidden + F.linear(F.silu(gate, inplace=True).mul_(up), step.down)
        # Compiled, the tails as dense tensors, not views of the conv's window: the next step's
        # inputs then have the strides this one's had (a compiled function guards on them).
        after.append(kept.map(torch.Tensor.contiguous) if torch.compiler.is_compiling() else kept)
        if segment.keep_inputs:
            inputs.append(x.unsqueeze(1))
    if segment.norm is not None:
        hidden = segment.norm(hidden)
    if segment.head is not None:
        hidden = segment.head(hidden)
    return hidden.unsqueeze(1), after, inputs


# What runs a segment: (segment, first, carried, holders) -> run_segment's answer; ``holders`` are
# the cache's layer entries that will hold the entries after (a CUDA graph's buffers may be
# handed to them). Eagerly (run_eagerly), compiled (compiled_decode.CompiledSegments) or
# graphed (compiled_decode.DecodeGraphs).
SegmentRunner = Callable[[Segment, torch.Tensor, Sequence[MemoryEntry], Sequence[MemoryLayerCache]],
                         tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]]


def run_eagerly(segment: Segment, first: torch.Tensor, carried: Sequence[MemoryEntry],
                holders: Sequence[MemoryLayerCache]) -> tuple[torch.Tensor, list[MemoryEntry], list[torch.Tensor]]:
    """:func:`run_segment` as it is (the runner without ``compile_decode``)."""
    return run_segment(segment, first, carried)


def _hook_dicts(module: nn.Module) -> list[dict]:
    """The forward hooks and pre-hooks of ``module`` and its submodules (empty dicts when none)."""
    return [hooks for m in module.modules() for hooks in (m._forward_hooks, m._forward_pre_hooks)]


class DecodePlan:
    """What a span needs to hand a :class:`~trellis_lm.TrellisModel`'s decode steps to
    :func:`run_segment` (see the module doc): the layers, each memory mixer's :class:`TokenStep`, where
    hooks would be registered, and the function that runs a segment (``runner``: eager, compiled
    or graphed). Made within a span whose weights do not change (:func:`decode_plans`)."""

    def __init__(self, model: nn.Module, head: Optional[nn.Module], runner: SegmentRunner) -> None:
        self.model, self.head, self.runner = model, head, runner
        self.layers = tuple(model.layers)
        self.mixers = [layer.self_attn for layer in self.layers]
        # The ops carry their states in float32, or float64 in a float64 model.
        self.state_dtype = compute_dtype(model.embed_tokens.weight)
        self.steps = [TokenStep.of(layer) for layer in self.layers]
        self.final_norm = token_norm(model.norm)
        self.block_hooks = [_hook_dicts(layer) for layer in self.layers]
        self.outer_hooks = _hook_dicts(model.embed_tokens) + _hook_dicts(model.norm) + (
            _hook_dicts(head) if head is not None else []) + [model._forward_hooks, model._forward_pre_hooks]
        self.all_hooks = list(itertools.chain(self.outer_hooks, *self.block_hooks))
        self.signature = layer_signature(model.config)
        self._checked: list[dict] = []  # caches' signatures already checked against the model

    def takes(self, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any) -> bool:
        """Whether a forward of ``input_ids`` on ``cache`` with ``attention_mask`` and
        ``position_ids`` is a decode step :meth:`step` runs: one token per row (ids on the model's
        device), a :class:`TrellisCache` of as many rows that has seen tokens and is bound to a
        model (:meth:`TrellisCache.bind`, which the general path does first), no padding among
        the step's tokens (a mask, when given, as wide as the cache's tokens and this one, 1 in
        its last column), positions (``generate()`` passes them) of a shape the general path
        reads (they only mark packed documents, which a row's one token never starts), autograd
        off, eval mode, autocast off and no hook outside the blocks. Anything else takes the
        general path, which also raises the errors bad inputs deserve."""
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and isinstance(cache, TrellisCache) and cache.seen_tokens > 0 and cache.signature is not None
                and cache.batch_size == input_ids.shape[0] and input_ids.device == self.model.embed_tokens.weight.device):
            return False
        if position_ids is not None and not (isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2
                                             and position_ids.shape[0] in (1, input_ids.shape[0])):
            return False
        if torch.is_grad_enabled() or self.model.training or torch.is_autocast_enabled(input_ids.device.type):
            return False
        if any(self.outer_hooks) or not plain_forward_hooks():
            return False
        if attention_mask is not None:
            if not (isinstance(attention_mask, torch.Tensor) and attention_mask.shape == (input_ids.shape[0], cache.seen_tokens + 1)
                    and bool((attention_mask[:, -1] == 1).all())):
                return False
        return True

    def step(self, input_ids: torch.Tensor, cache: TrellisCache, with_head: bool) -> torch.Tensor:
        """The decode step of ``input_ids [B, 1]`` continuing ``cache`` (:meth:`takes` said yes):
        the logits ``[B, 1, V]`` (``with_head``) or the final hidden state ``[B, 1, D]``. The
        cache takes the step as the general forward would (its records for rollback
        included); a step that fails leaves it as it was."""
        self._bind(cache)
        runs = self._runs(cache)
        if len(runs) == 1 and runs[0][0]:  # one run: the cache changes only once it has succeeded
            out = self._run_memory(runs[0][1], input_ids, cache.layers, cache, with_head, opens_records=True)
            cache.add_seen_tokens(1)
            return out
        with cache.all_or_nothing() as call:  # blocks through their modules change it as they run
            if cache.records_calls:
                cache.begin_step(1)
            before = [call.before(i) for i in range(len(self.layers))]
            hidden = input_ids
            for lean, run in runs:
                hidden = (self._run_memory(run, hidden, before, cache, with_head, opens_records=False) if lean
                          else self._run_modules(run, hidden, call, with_head))
            cache.add_seen_tokens(1)
        return hidden

    def _bind(self, cache: TrellisCache) -> None:
        signature = cache.signature
        if not any(signature is checked for checked in self._checked):
            cache.bind(self.model.config)
            self._checked = [cache.signature, *self._checked[:7]]

    def _runs(self, cache: TrellisCache) -> list[tuple[bool, list[int]]]:
        """The step's layers in order as runs: ``(True, indices)`` for memory blocks that run by
        :func:`run_segment` (a :class:`TokenStep`, a carried state in the model's state dtype, no
        hook in the block), ``(False, indices)`` for the others."""
        hooked = any(self.all_hooks)
        layers = cache.layers

        def lean(index: int) -> bool:
            layer, step = layers[index], self.steps[index]
            return (step is not None and isinstance(layer, MemoryLayerCache) and layer.state is not None
                    and layer.state.lead.dtype == self.state_dtype and (step.taps is None or layer.q_tail is not None)
                    and not (hooked and any(self.block_hooks[index])))

        return [(is_lean, list(run)) for is_lean, run in itertools.groupby(range(len(self.layers)), key=lean)]

    def _run_memory(self, run: list[int], first: torch.Tensor, before: Sequence[LayerCache], cache: TrellisCache,
                    with_head: bool, opens_records: bool) -> torch.Tensor:
        """``run`` (memory blocks' indices) by :func:`run_segment` through the span's runner, from
        the layers' entries ``before`` the step; the cache's live layers take the entries after,
        and a cache that records its calls each mixer's input (after opening the step's records
        when ``opens_records``)."""
        model, last = self.model, run[-1] == len(self.layers) - 1
        recording = cache.records_calls
        segment = Segment(tuple(self.layers[i] for i in run), tuple(self.steps[i] for i in run),
                          model.embed_tokens if run[0] == 0 else None, self.final_norm if last else None,
                          self.head if last and with_head else None, recording)
        carried = [before[i].entry for i in run]
        holders = [cache.layers[i] for i in run]
        out, after, inputs = self.runner(segment, first, carried, holders)
        if recording:
            if opens_records:
                cache.begin_step(1)
            for i, entry, x in zip(run, carried, inputs):
                cache.record_step(i, self.mixers[i].replay, x, None, entry)
        for holder, entry in zip(holders, after):
            holder.hold(entry)
        return out

    def _run_modules(self, run: list[int], hidden: torch.Tensor, call: CacheCall, with_head: bool) -> torch.Tensor:
        if run[0] == 0:
            hidden = self.model.embed_tokens(hidden)
        for i in run:
            hidden = self.layers[i](hidden, None, call)
        if run[-1] == len(self.layers) - 1:
            hidden = self.model.norm(hidden)
            if with_head:
                hidden = self.head(hidden)
        return hidden


@contextmanager
def decode_plans(model: nn.Module, runner: Callable[[nn.Module], SegmentRunner]) -> Iterator[None]:
    """Within the block, decode steps of every :class:`~trellis_lm.TrellisModel` in ``model`` in
    eval mode run by a :class:`DecodePlan` whose segments ``runner(that model)`` runs (with the
    language model's head in the plan when ``model`` holds one). For a span in which the weights
    do not change (the taps are copies); nested blocks keep the outer one's plans."""
    made = []
    try:
        heads = {id(m._modules["model"]): m._modules.get("lm_head") for m in model.modules() if "model" in m._modules}
        for module in model.modules():
            if "decode_plan" not in vars(module) or module.decode_plan is not None or module.training:
                continue
            module.decode_plan = DecodePlan(module, heads.get(id(module)), runner(module))
            made.append(module)
        yield
    finally:
        for module in made:
            module.decode_plan = None
