"""Which teacher layers a hybrid conversion keeps as softmax attention, chosen by what
converting each one costs.

For a budget of ``k`` kept layers, the layers whose conversion alone changes the teacher's
next-token distribution most stay attention. The cost of converting layer ``i`` is measured on
held-out text as ``KL(teacher || teacher with layer i's attention replaced by the student's
converted mixer)`` (:func:`conversion_costs`): the student is an all-converted model after
stage 1, whose mixers were each fitted to their own layer, so one set of stage-1 mixers prices
every layer. It costs ``L + 1`` teacher forwards (``L`` converted layers) over the held-out
rows, no training.

:func:`keep_as_attention` then builds the hybrid: converted again from the source with those
layers kept, the other layers' stage-1 mixers carried over.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from transformers import PreTrainedModel

from ..mixers.valid_tokens import ValidTokens
from ..modeling_trellis import TrellisForCausalLM
from .data import check_token_ids
from .distill import distillation_kl
from .llama import convert_llama_to_trellis, converted_layers

AUTO_PATTERN = re.compile(r"^auto:(\d+)$")


def parse_auto(keep_attention: Any) -> Optional[int]:
    """``k`` of ``keep_attention="auto:k"`` (the layers to keep chosen by conversion cost), or
    ``None`` for any other value."""
    if not isinstance(keep_attention, str):
        return None
    match = AUTO_PATTERN.match(keep_attention)
    if match is None:
        raise ValueError(f"keep_attention as a string must be 'auto:k' (k layers chosen by cost), got {keep_attention!r}")
    return int(match.group(1))


@contextmanager
def replaced_attention(teacher: PreTrainedModel, layer: int, mixer: nn.Module,
                       valid: Optional[ValidTokens]) -> Iterator[None]:
    """The teacher with layer ``layer``'s attention output replaced by ``mixer`` of the same
    input (the block's normed hidden states), on the real tokens of ``valid``."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        out = mixer(hidden.to(mixer.o_proj.weight.dtype), valid, None).to(hidden.dtype)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    handle = teacher.model.layers[layer].self_attn.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def conversion_costs(
    student: TrellisForCausalLM,
    teacher: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    layers: Optional[Sequence[int]] = None,
) -> dict[int, float]:
    """What converting each layer alone costs: ``{layer: KL}`` on ``input_ids [B, T]``.

    ``KL(teacher || teacher with layer i's attention output replaced by the student's layer-i
    mixer)``, averaged over real tokens (:func:`~.distill.distillation_kl`), for each layer
    ``i`` of ``layers`` (default: every converted layer of ``student``). Student and teacher on
    one device.
    """
    check_token_ids("input_ids", input_ids, student, teacher)
    converted = converted_layers(student)
    layers = converted if layers is None else list(layers)
    strangers = [layer for layer in layers if layer not in converted]
    if strangers:
        raise ValueError(f"layers: layer {strangers[0]!r} is not a converted layer of the student, whose converted "
                         f"layers are {converted} (a kept attention layer or one beyond the model costs nothing to price)")
    batch, length = input_ids.shape
    valid = ValidTokens.from_attention_mask(attention_mask, batch, length)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    reference = teacher(**inputs).logits
    costs = {}
    for layer in layers:
        with replaced_attention(teacher, layer, student.model.layers[layer].self_attn, valid):
            costs[layer] = distillation_kl(teacher(**inputs).logits, reference, attention_mask).item()
    return costs


def choose_attention_layers(costs: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers of ``costs`` whose conversion costs most, in layer order. A cost that is
    not a finite number (a NaN from non-finite activations sorts anywhere) is refused by layer."""
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= len(costs):
        raise ValueError(f"k must be an integer in [0, {len(costs)}] (the layers priced), got {k!r}")
    for layer, cost in costs.items():
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost):
            raise ValueError(f"the cost of layer {layer} is {cost!r}, not a finite number: the layers cannot be ranked "
                             "(non-finite activations in the student or the teacher?)")
    return sorted(sorted(costs, key=lambda layer: -costs[layer])[:k])


def keep_as_attention(
    student: TrellisForCausalLM, src: Union[str, Path], dst: Union[str, Path], layers: Sequence[int], **options: Any,
) -> TrellisForCausalLM:
    """The hybrid of ``student``: converted again from ``src`` into ``dst`` with ``layers``
    kept as the teacher's attention (``options``: the other arguments of
    :func:`~.llama.convert_llama_to_trellis`, as the student was converted), and every other
    layer's mixer taken from ``student`` (its stage-1 fit). Saved to ``dst`` and returned."""
    return carry_converted_mixers(student, convert_llama_to_trellis(src, dst, keep_attention=list(layers), **options),
                                  dst)


def carry_converted_mixers(student: TrellisForCausalLM, hybrid: TrellisForCausalLM,
                           dst: Union[str, Path]) -> TrellisForCausalLM:
    """``hybrid`` (the student's teacher converted again, keeping some layers as attention) with
    every layer it converts taking ``student``'s mixer; saved to ``dst`` and returned."""
    for index in converted_layers(hybrid):
        mine, theirs = hybrid.model.layers[index].self_attn, student.model.layers[index].self_attn
        if type(mine) is not type(theirs):
            raise ValueError(f"layer {index} is a {type(theirs).__name__} in the student and a {type(mine).__name__} "
                             "in the hybrid: convert both with the same mixer")
        mine.load_state_dict(theirs.state_dict())
    hybrid.save_pretrained(dst)
    return hybrid


__all__ = [
    "carry_converted_mixers", "choose_attention_layers", "conversion_costs", "keep_as_attention", "parse_auto",
    "replaced_attention",
]
