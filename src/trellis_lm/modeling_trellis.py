"""Trellis language models for transformers (design pages, sections 5 and 6).

A Llama-shaped stack of pre-norm blocks (RMSNorm, token mixer, RMSNorm, SwiGLU MLP) whose
token mixer is chosen per layer (``config.mixer_types``, see :mod:`.mixers`): the Trellis
memory, the Lattice memory, or softmax attention. One :class:`TrellisCache` serves every
schedule. Padding tokens (zeros of the attention mask) are skipped exactly: they neither
change a layer's state nor count as positions, so each row of a padded batch gets what it
gets alone; outputs at padding positions carry no mixer contribution.

This file travels with checkpoints as remote code (see :mod:`.remote_code`).
"""

from __future__ import annotations

import os
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.utils import logging

from .cache_trellis import CACHE_ARG, CACHE_NAMES, CacheCall, TrellisCache, one_cache
from .compiled_decode import inference_span
from .configuration_trellis import TrellisConfig
from .decode_step import DecodePlan
from .model_card_trellis import CARD_NAME, hub_card_text, is_generated, write_model_card
from .mixers import build_mixer
from .mixers.base import init_module
from .mixers.norms_convs import TrellisRMSNorm
from .mixers.valid_tokens import ValidTokens, document_starts, real_tokens
from .projection_stacks import LinearStack, stacked

logger = logging.get_logger(__name__)


class TrellisMLP(nn.Module):
    """SwiGLU feed-forward."""

    fusable_projections = ("gate_proj", "up_proj")

    def __init__(self, config: TrellisConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.projection_stack: Optional[LinearStack] = None  # set within `stacked_projections`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = stacked(self, x)
        if fused is not None:  # inference, in generate: gate and up by one matmul, the product in place
            gate, up = fused[1].values()
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        gate = F.silu(self.gate_proj(x))
        # Without autograd, into `gate` (this method's own tensor): one [B, T, I] allocation less.
        return self.down_proj(gate.mul_(self.up_proj(x)) if not torch.is_grad_enabled() else gate * self.up_proj(x))


class TrellisDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual block: RMSNorm, the layer's mixer (``config.mixer_types``), RMSNorm,
    SwiGLU MLP. The mixer is named ``self_attn`` whatever its kind, as Llama's."""

    def __init__(self, config: TrellisConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = build_mixer(config, layer_idx)
        self.post_attention_layernorm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TrellisMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        valid: Optional[ValidTokens] = None,
        cache: Optional[CacheCall] = None,
    ) -> torch.Tensor:
        # `hidden_states` stays positional (activation checkpointing expects it). The cache
        # comes as one call's view (CacheCall): a block recomputed by activation checkpointing
        # reads the entry it read the first time.
        return self.around(hidden_states, lambda x: self.self_attn(x, valid, cache))

    def around(self, hidden_states: torch.Tensor, mix: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block with ``mix`` (``[B, T, D]`` -> ``[B, T, D]``) as its token mixer: what
        :meth:`forward` runs with the layer's mixer, and a compiled decode step with the
        mixer's function of its carried state (:mod:`.compiled_decode`)."""
        hidden_states = hidden_states + mix(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class TrellisPreTrainedModel(PreTrainedModel):
    """Shared settings and weight initialisation of the Trellis models."""

    config_class = TrellisConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TrellisDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_NAMES)
    # Attention layers compute through transformers' attention functions.
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        init_module(module, self.config.initializer_range, init)

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
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        keep_remote_card = not is_generated(hub_card_text(repo_id, token))
        with tempfile.TemporaryDirectory() as work_dir:
            self.save_pretrained(work_dir, max_shard_size=max_shard_size)
            if keep_remote_card:
                (Path(work_dir) / CARD_NAME).unlink()
            else:
                write_model_card(work_dir, self, name=repo_id, tags=tuple(tags or ()) + tuple(self.model_tags or ()))
            return api.upload_folder(
                repo_id=repo_id, folder_path=work_dir, commit_message=commit_message or "Upload model",
                commit_description=commit_description, revision=revision, create_pr=create_pr,
            )


# Keyword arguments that transformers, the Trainer and data collators pass besides the named
# ones, each with what `forward` does with it; any other name is a TypeError, not dropped.
# Flash-attention packing (DataCollatorWithFlattening): read as document boundaries.
PACKING_ARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Requests the model can only answer one way: accepted with that answer (or None), else a ValueError.
FIXED_ANSWERS = {"output_attentions": False, "output_router_logits": False, "is_causal": True}
# Read by the loss (the Trainer passes it with gradient accumulation).
LOSS_ARGS = ("num_items_in_batch",)


def _check_extra_kwargs(owner: str, kwargs: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse the keyword arguments ``forward`` would otherwise drop without a word."""
    unknown = sorted(set(kwargs) - set(allowed) - set(FIXED_ANSWERS))
    if unknown:
        raise TypeError(
            f"{owner}.forward() got unexpected keyword arguments {unknown}; besides its named arguments it "
            f"takes {sorted(set(allowed) | set(FIXED_ANSWERS))}"
        )
    for name, answer in FIXED_ANSWERS.items():
        if kwargs.get(name) not in (None, answer):
            raise ValueError(f"{name}={kwargs[name]!r} is not available: a Trellis model has {name}={answer}")


def keep_positions(hidden_states: torch.Tensor, logits_to_keep: Union[int, torch.Tensor]) -> torch.Tensor:
    """The positions of ``hidden_states [B, T, D]`` whose logits are wanted.

    ``logits_to_keep`` is an int (the last that many positions; 0 keeps all), a 1-D tensor of
    positions (the same for every row, ``[B, P, D]`` out), a 2-D integer tensor ``[B, P]`` of
    positions per row (``[B, P, D]`` out) or a 2-D bool mask ``[B, T]`` (``[kept, D]`` out), as
    transformers' own models read it.
    """
    if isinstance(logits_to_keep, torch.Tensor):
        if logits_to_keep.dim() == 2 and logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        if logits_to_keep.dim() == 2:
            return hidden_states.gather(1, logits_to_keep[..., None].expand(-1, -1, hidden_states.shape[-1]))
        if logits_to_keep.dim() == 1:
            return hidden_states[:, logits_to_keep]
    elif isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep >= 0:
        return hidden_states[:, -logits_to_keep:] if logits_to_keep else hidden_states
    raise ValueError(
        "logits_to_keep must be an int >= 0, a 1-D tensor of positions, a 2-D tensor of positions per row or a "
        f"2-D bool mask, got {logits_to_keep!r}"
    )


class TrellisModel(TrellisPreTrainedModel):
    """Embeddings, blocks and the final norm; returns hidden states and the cache."""

    def __init__(self, config: TrellisConfig) -> None:
        config.check_fields()  # fields may have been changed since the config was made
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TrellisDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = TrellisRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.decode_plan: Optional[DecodePlan] = None  # set within `inference_span` (a generate call)
        self.post_init()

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Union[torch.Tensor, dict, None] = None,
        cache: Optional[TrellisCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[TrellisCache] = None,
        **kwargs: Any,
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """Run the stack on ``input_ids [B, T]`` or ``inputs_embeds [B, T, D]``.

        Args:
            attention_mask: ``[B, past + T]`` with 0 at padding (left, right or anywhere),
                a dict holding one, or ``None`` (no padding). ``past`` is the number of
                tokens the cache has taken in (0 without one); another length is a ``ValueError``.
            cache: a :class:`TrellisCache` to continue from; it is updated in place.
            past_key_values: the same argument under the name transformers used before 5.24
                (either name, not both). Outputs carry the cache under the running transformers'
                name (``cache`` from 5.24 on, ``past_key_values`` before).
            use_cache: create a cache when none is given (default: ``config.use_cache``).
            output_hidden_states: also return the embeddings and every block's output (the
                last one after the final norm).
            position_ids: ``[B or 1, past + T]`` or ``[B or 1, T]``, only read for packed
                documents: a real token numbered 0 that is not its row's first real token starts
                a new document, from the initial memories and with a fresh short conv
                (transformers' packing convention, as ``DataCollatorWithFlattening`` makes it).
                Order itself comes from the recurrence.
            kwargs: only what transformers passes: the flash-attention packing arguments
                (``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``,
                ``seq_idx``), read as document boundaries like ``position_ids`` (all that are
                given must agree); ``output_attentions``, ``output_router_logits`` (False or
                None: there are none) and ``is_causal`` (True or None). Any other name is a
                ``TypeError``.
        """
        cache = one_cache(cache, past_key_values)
        if self._takes_decode_step(input_ids, attention_mask, cache, inputs_embeds, use_cache, output_hidden_states,
                                   position_ids, kwargs):
            hidden = self.decode_plan.step(input_ids, cache, with_head=False)
            output = BaseModelOutputWithPast(last_hidden_state=hidden, **{CACHE_ARG: cache})
            return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()
        _check_extra_kwargs(type(self).__name__, kwargs, PACKING_ARGS)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, tokens], got shape {tuple(input_ids.shape)}")
        if inputs_embeds is not None and (inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size):
            raise ValueError(
                f"inputs_embeds must be 3-D [batch, tokens, hidden_size = {self.config.hidden_size}], "
                f"got shape {tuple(inputs_embeds.shape)}"
            )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if length == 0:
            raise ValueError(
                "the input holds no tokens (input_ids / inputs_embeds with T = 0 columns): a forward needs at least "
                "one token per row"
            )
        if use_cache is None:
            use_cache = self.config.use_cache
        past = cache.get_seq_length() if isinstance(cache, TrellisCache) else 0
        cache = self._checked_cache(cache, use_cache, batch)
        run = partial(self._run, inputs_embeds, attention_mask, past, position_ids, output_hidden_states,
                      return_dict, kwargs)
        if cache is None:
            return run(None)
        # All or nothing: a failure (or Ctrl-C) in any layer leaves the cache as it was, not
        # with the layers before it advanced.
        with cache.all_or_nothing() as call:
            cache.bind(self.config)
            if cache.records_calls:
                if length > cache.rollback_window:
                    return self._forward_in_two(
                        inputs_embeds, attention_mask, cache, position_ids, output_hidden_states, return_dict, kwargs
                    )
                cache.begin_step(length)
            return run(call)

    def _takes_decode_step(self, input_ids: Any, attention_mask: Any, cache: Any, inputs_embeds: Any, use_cache: Any,
                           output_hidden_states: Any, position_ids: Any, kwargs: dict[str, Any]) -> bool:
        """Whether this forward is a decode step that the span's plan runs (see
        :mod:`trellis_lm.decode_step`): within an inference span, token ids without embeddings,
        other keyword arguments or per-block hidden states, a cache used, and what
        :meth:`DecodePlan.takes` asks of the tokens, mask, positions and cache."""
        plan = self.decode_plan
        return (plan is not None and inputs_embeds is None and not kwargs and not output_hidden_states
                and use_cache is not False and plan.takes(input_ids, attention_mask, position_ids, cache))

    def _run(
        self, inputs_embeds: torch.Tensor, attention_mask: Any, past: int, position_ids: Optional[torch.Tensor],
        output_hidden_states: Optional[bool], return_dict: Optional[bool], kwargs: dict[str, Any],
        call: Optional[CacheCall],
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """The layers on ``inputs_embeds [B, T, D]``, continuing the cache of ``call`` (``past``
        columns seen)."""
        batch, length = inputs_embeds.shape[:2]
        real = real_tokens(attention_mask, batch, length, past)
        starts = document_starts(batch, length, position_ids, **{name: kwargs.get(name) for name in PACKING_ARGS},
                                 real=real)
        valid = ValidTokens.from_real(real, starts)

        hidden_states = inputs_embeds
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        for layer in self.layers:
            # Positional: transformers' checkpointing wrapper drops a keyword `cache` (it assumes a
            # recomputed layer would write its cache twice; a CacheCall makes that harmless).
            hidden_states = layer(hidden_states, valid, call)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        cache = None if call is None else call.cache
        if call is not None:
            cache.add_seen_tokens(length)

        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **{CACHE_ARG: cache}
        )
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    def _forward_in_two(
        self, inputs_embeds: torch.Tensor, attention_mask: Any, cache: TrellisCache, position_ids: Any,
        output_hidden_states: Optional[bool], return_dict: Optional[bool], kwargs: dict[str, Any],
    ) -> Union[BaseModelOutputWithPast, tuple]:
        """A call longer than the cache's ``rollback_window``, run as two (the same function):
        the last ``rollback_window`` tokens on their own, so that what the cache keeps to roll
        back stays bounded by the window, not by the call."""
        if any(kwargs.get(name) is not None for name in PACKING_ARGS):
            raise ValueError(
                "packed documents (cu_seq_lens_*, max_length_*, seq_idx) cannot be read with a cache that keeps a "
                "rollback window; give them one call without a cache"
            )
        if isinstance(attention_mask, dict):
            attention_mask = next((m for m in attention_mask.values() if isinstance(m, torch.Tensor)), None)
        tail = cache.rollback_window
        cut = inputs_embeds.shape[1] - tail

        def before_tail(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            # Masks and positions end with the current tokens: drop the tail's columns.
            return None if x is None else x[:, : x.shape[1] - tail]

        # The head is never taken back: it runs whole and unrecorded.
        with cache.unrecorded():
            head = self(inputs_embeds=inputs_embeds[:, :cut], attention_mask=before_tail(attention_mask), cache=cache,
                        use_cache=True, output_hidden_states=output_hidden_states, return_dict=True,
                        position_ids=before_tail(position_ids))
        parts = [head, self(inputs_embeds=inputs_embeds[:, cut:], attention_mask=attention_mask, cache=cache,
                            use_cache=True, output_hidden_states=output_hidden_states, return_dict=True,
                            position_ids=position_ids)]
        hidden = None
        if output_hidden_states:
            hidden = tuple(torch.cat(pair, dim=1) for pair in zip(*(part.hidden_states for part in parts)))
        output = BaseModelOutputWithPast(
            last_hidden_state=torch.cat([part.last_hidden_state for part in parts], dim=1), hidden_states=hidden,
            **{CACHE_ARG: cache},
        )
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    def _checked_cache(self, cache: Any, use_cache: bool, batch: int) -> Optional[TrellisCache]:
        """The cache this forward reads and updates, or ``None``.

        Under activation checkpointing in training no cache is made by default (it would only
        hold states no one reads); a cache given explicitly (e.g. by state passing,
        :mod:`trellis_lm.state_passing`) is continued, exactly as without checkpointing."""
        if cache is None and self.training and any(layer.gradient_checkpointing for layer in self.layers):
            return None
        if cache is None:
            return TrellisCache(self.config) if use_cache else None
        if not isinstance(cache, TrellisCache):
            raise ValueError(f"the cache (cache / past_key_values) must be a TrellisCache, got {type(cache).__name__}")
        # Whether its layers are this model's is checked by `cache.bind`, in the forward.
        if cache.batch_size not in (None, batch):
            raise ValueError(f"the cache holds {cache.batch_size} rows, the input {batch}")
        return cache


# The most draft tokens assisted / prompt-lookup decoding may ask for per verification: the
# cache keeps that many tokens' layer inputs to roll back, which must not grow with a number
# (10**6 would keep a whole prompt's).
MAX_DRAFT_TOKENS = 256


class RefuseNonFiniteLogits(LogitsProcessor):
    """Stops ``generate`` with a ``ValueError`` at the first NaN or +inf logit (-inf is what
    filtering processors write, so it passes)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if bool((torch.isnan(scores) | torch.isposinf(scores)).any()):
            raise ValueError(
                f"generate() met non-finite logits (NaN or +inf) after {input_ids.shape[1]} tokens: the model's "
                "weights or inputs hold non-finite values (forward lets them through, as transformers' models do)"
            )
        return scores


class TrellisForCausalLM(TrellisPreTrainedModel, GenerationMixin):
    """:class:`TrellisModel` with a language-modelling head (untied by default; ``tie_word_embeddings=True`` shares the embedding)."""

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
        cache: Optional[TrellisCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        output_hidden_states: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        token_type_ids: Optional[torch.LongTensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[TrellisCache] = None,
        **kwargs: Any,
    ) -> Union[CausalLMOutputWithPast, tuple]:
        """Logits ``[B, T, V]`` (or of the positions ``logits_to_keep`` selects, see
        :func:`keep_positions`) and the cache.

        ``labels [B, T]`` (-100 to ignore) give the next-token loss; ``num_items_in_batch``
        (the Trainer passes it with gradient accumulation) goes to ``loss_function``.
        ``token_type_ids`` is accepted only as all zeros (there are no segments), so that
        ``generate(**tokenizer(...))`` works with tokenizers that return it. Other arguments,
        ``kwargs`` included, as in :meth:`TrellisModel.forward`; an unknown name is a ``TypeError``.
        """
        cache = one_cache(cache, past_key_values)
        # One token per row: its logits are the last position's, whatever logits_to_keep asks.
        keeps_all = type(logits_to_keep) is int and logits_to_keep in (0, 1)
        if (labels is None and token_type_ids is None and keeps_all
                and self.model._takes_decode_step(input_ids, attention_mask, cache, inputs_embeds, use_cache,
                                                  output_hidden_states, position_ids, kwargs)):
            logits = self.model.decode_plan.step(input_ids, cache, with_head=True)
            output = CausalLMOutputWithPast(logits=logits, **{CACHE_ARG: cache})
            return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()
        _check_extra_kwargs(type(self).__name__, kwargs, PACKING_ARGS + LOSS_ARGS)
        if token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError("token_type_ids must be all zeros or None: Trellis models have no segment embeddings")
        loss_kwargs = {name: kwargs.pop(name) for name in LOSS_ARGS if name in kwargs}
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            position_ids=position_ids,
            **kwargs,
        )
        logits = self.lm_head(keep_positions(outputs.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kwargs)
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, **{CACHE_ARG: getattr(outputs, CACHE_ARG)}
        )
        return output if (return_dict if return_dict is not None else self.config.return_dict) else output.to_tuple()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' ``generate``, taking the cache as ``cache`` or ``past_key_values`` with any
        transformers version. Assisted (``assistant_model=``) and prompt-lookup
        (``prompt_lookup_num_tokens=``, at most ``MAX_DRAFT_TOKENS``) decoding work too: the cache
        rolls back the rejected draft tokens (see ``TrellisCache.rollback_window``).

        Non-finite logits (NaN or +inf, e.g. from NaN weights) stop it with a ``ValueError`` at
        the first step that meets them; ``forward`` itself lets them through, as transformers'
        models do, on every path. A step that fails leaves a given cache after the last step
        that completed.

        The weights are read when the call begins (each layer's projections of one input
        stacked into one matrix, see :func:`~trellis_lm.projection_stacks.stacked_projections`):
        a weight changed during the call, e.g. from a streamer, is not seen before it ends; nor
        by the CUDA graphs that ``config.compile_decode`` captures on a GPU for the call
        (:func:`trellis_lm.compiled_decode.decode_graphs`)."""
        cache = one_cache(kwargs.pop("cache", None), kwargs.pop("past_key_values", None))
        if cache is not None:
            kwargs[CACHE_ARG] = cache
            self._check_speculative_continuation(args[0] if args else kwargs.get("inputs", kwargs.get("input_ids")),
                                                 cache, kwargs)
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        kwargs["logits_processor"] = LogitsProcessorList([RefuseNonFiniteLogits(), *processors])
        # The weights do not change during the call: each layer's projections of one input are
        # stacked once, so a decode step runs them as one matmul (projection_stacks).
        with inference_span(self):
            return super().generate(*args, **kwargs)

    @staticmethod
    def _check_speculative_continuation(inputs: Any, cache: Any, kwargs: dict[str, Any]) -> None:
        """Assisted and prompt-lookup decoding continue a cache from the whole sequence, whose
        first verification feeds the tokens the cache has not seen with the drafts: at least one
        must be unseen, or the first draft would have no logits to be checked against (plain
        decoding refuses such an input in :meth:`prepare_inputs_for_generation`)."""
        config = kwargs.get("generation_config")
        speculative = kwargs.get("assistant_model") is not None or kwargs.get(
            "prompt_lookup_num_tokens", getattr(config, "prompt_lookup_num_tokens", None)) is not None
        seen = cache.get_seq_length() if isinstance(cache, TrellisCache) else 0
        if speculative and seen and isinstance(inputs, torch.Tensor) and seen >= inputs.shape[-1]:
            raise ValueError(
                f"the cache has already taken in {seen} tokens, but input_ids holds {inputs.shape[-1]}: assisted and "
                "prompt-lookup decoding continue a cache from the whole sequence, the tokens the cache has seen "
                "followed by at least one new one (e.g. torch.cat([output.sequences, new_ids], dim=1))"
            )

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: Optional[int] = None,
        cache: Optional[TrellisCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        is_first_iteration: Optional[bool] = False,
        past_key_values: Optional[TrellisCache] = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Inputs of one ``generate`` step: only the tokens the cache has not taken in.

        ``generate`` says how many those are in ``next_sequence_length`` (the prompt's unseen
        part at prefill, 1 afterwards, ``None`` to feed everything). Prompt embeddings are
        used on the first step only. The 2-D mask is passed whole; ``forward`` reads its tail.
        The cache comes under either name and goes on under the running transformers' name.

        The first verification of assisted and prompt-lookup decoding says ``None`` whatever the
        cache holds: transformers then feeds the whole sequence and its drafts, a cache that has
        seen all but the last token would take them in twice (a Llama's ``DynamicCache`` does the
        same). Where the inputs hold the whole sequence (a mask and positions, when given, as long
        as them), only the tokens the cache has not seen are fed, so the tokens are greedy's.
        """
        cache = one_cache(cache, past_key_values)
        seen = cache.get_seq_length() if isinstance(cache, TrellisCache) else 0
        if isinstance(cache, TrellisCache) and cache.rollback_window and next_sequence_length and not is_first_iteration:
            # A verification of assisted decoding feeds its drafts at once and takes the rejected
            # ones back: the window follows the drafts when their number grows (its schedule).
            cache.widen_rollback(next_sequence_length)
        if is_first_iteration and seen and seen >= input_ids.shape[1]:
            raise ValueError(
                f"the cache has already taken in {seen} tokens, but input_ids holds {input_ids.shape[1]}: "
                "generate() continues a cache from the whole sequence, the tokens the cache has seen followed by "
                "the new ones (e.g. torch.cat([output.sequences, new_ids], dim=1)); a cache that generate() "
                "already extended cannot be reused for a shorter input"
            )

        length = (inputs_embeds if inputs_embeds is not None and is_first_iteration else input_ids).shape[1]
        positions = kwargs.get("position_ids")
        whole = ((attention_mask is None or attention_mask.shape[-1] == length)
                 and (positions is None or positions.shape[-1] == length))
        if next_sequence_length is None and is_first_iteration and seen and whole:
            next_sequence_length = length - seen

        def unseen(x: torch.Tensor) -> torch.Tensor:
            return x if next_sequence_length is None else x[:, x.shape[1] - next_sequence_length :]

        if inputs_embeds is not None and is_first_iteration:
            model_inputs: dict[str, Any] = {"input_ids": None, "inputs_embeds": unseen(inputs_embeds)}
        else:
            model_inputs = {"input_ids": unseen(input_ids).contiguous()}
        model_inputs[CACHE_ARG] = cache
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
        """Give ``generate`` a :class:`TrellisCache` (the default would build a key-value cache),
        under the running transformers' name for it.

        A cache passed by the user is grown to the beams / returned sequences when it still
        holds one row per prompt, so a conversation can continue with ``num_beams`` or
        ``num_return_sequences`` > 1. For assisted and prompt-lookup decoding (and for the draft
        model's own ``generate``) the cache keeps a rollback window of the drafts asked for and
        two tokens, which follows the drafts' schedule when it grows: each verification feeds the
        drafts and takes the rejected ones back, and keeps no more than one verification's layer
        inputs and entries.
        """
        cache = one_cache(*(model_kwargs.pop(name, None) for name in CACHE_NAMES))
        if cache is not None and generation_config.use_cache is False:
            raise ValueError(
                "generate() got a cache together with use_cache=False: without a cache it feeds the whole sequence "
                "at every step, which a given cache would take in again; drop use_cache=False to continue the cache, "
                "or the cache to generate without one"
            )
        window = 0
        # The main model of assisted decoding, and its draft model (generate() with is_assistant):
        # the candidate generator crops the draft's cache back to the accepted tokens too.
        if (getattr(generation_mode, "value", generation_mode) == "assisted_generation"
                or getattr(generation_config, "is_assistant", False)):
            lookup = generation_config.prompt_lookup_num_tokens
            name = "prompt_lookup_num_tokens" if lookup is not None else "num_assistant_tokens"
            drafts = lookup if lookup is not None else generation_config.num_assistant_tokens
            if getattr(generation_config, "is_assistant", False):  # the draft model's own call: its drafts are 0
                drafts = drafts or 0
            elif isinstance(drafts, bool) or not isinstance(drafts, int) or not 1 <= drafts <= MAX_DRAFT_TOKENS:
                raise ValueError(
                    f"{name} must be an integer in [1, {MAX_DRAFT_TOKENS}] for a Trellis model, got {drafts!r}: the "
                    "draft tokens per verification, whose layer inputs the cache keeps to take rejected ones back"
                )
            # A verification feeds the drafts and one token and takes back at most the drafts;
            # a draft model's crops reach over as many one-token calls.
            window = drafts + 2
        if cache is not None:
            if not isinstance(cache, TrellisCache):
                raise ValueError(f"the cache (cache / past_key_values) must be a TrellisCache, got {type(cache).__name__}")
            cache.widen_rollback(window)
            # What transformers' own version of this hook marks on a user's cache: generate() then
            # never runs a step past the stop (its deferred stop check on MPS) into a cache that
            # cannot be cropped. Private; tests/test_transformers_compat.py fails when
            # transformers stops reading it.
            cache._is_user_defined = True
            expand = max(generation_config.num_beams, generation_config.num_return_sequences)
            if expand > 1 and cache.batch_size == batch_size:
                cache.batch_repeat_interleave(expand)
            model_kwargs[CACHE_ARG] = cache
            return
        if generation_config.use_cache is False:
            return
        if generation_config.cache_implementation not in (None, "dynamic"):
            logger.warning_once(
                f"cache_implementation={generation_config.cache_implementation!r} is ignored: Trellis models "
                "always use their fixed-size TrellisCache."
            )
        model_kwargs[CACHE_ARG] = TrellisCache(self.config, rollback_window=window)


__all__ = ["TrellisForCausalLM", "TrellisModel", "TrellisPreTrainedModel"]
