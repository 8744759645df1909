"""The model card (``README.md``) that Trellis checkpoints are saved with.

It says what the model is, how to load it with stock transformers (``trust_remote_code=True``)
or with ``trellis_lm``, and lists the configuration and generation defaults. A card that a
person wrote (one without :data:`MARKER`) is never overwritten.

This file travels with checkpoints as remote code (see :mod:`.remote_code`); what it says of the
layers comes from their mixers' declarations (:data:`~.mixers.MIXERS`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from .mixers import MIXERS

# Identifies cards this module wrote, which it may rewrite.
MARKER = "<!-- trellis-lm model card: save_pretrained rewrites this file; delete this line to keep your edits -->"
CARD_NAME = "README.md"
TAGS = ("trellis", "text-generation", "custom_code")


def is_generated(card_text: Optional[str]) -> bool:
    """True for a card this module wrote (or no card at all)."""
    return card_text is None or MARKER in card_text


def config_fields(config: Any) -> dict[str, Any]:
    """The fields the config class itself declares (not transformers' generic ones), by name."""
    declared = vars(type(config)).get("__annotations__", {})
    return {name: getattr(config, name) for name, kind in declared.items() if "ClassVar" not in str(kind)}


def describe_layers(config: Any) -> str:
    """One paragraph on what the layers keep, in the words of each layer's mixer (its
    ``display_name`` and ``describe_cache``), and whether decoding costs the same at any length."""
    kinds = config.layer_kinds
    layers: dict[str, list[int]] = {}
    for index, kind in enumerate(kinds):
        layers.setdefault(kind, []).append(index)
    if len(layers) == 1:
        [kind] = layers
        text = (f"All {len(kinds)} of its layers are {MIXERS[kind].display_name} layers, which keep "
                f"{MIXERS[kind].describe_cache(config)}")
    else:
        groups = []
        for kind, indices in layers.items():
            one = len(indices) == 1
            where = f"layer {indices[0]}" if one else "layers " + ", ".join(map(str, indices))
            groups.append(f"{len(indices)} {MIXERS[kind].display_name} layer{'' if one else 's'} ({where}) "
                          f"keep{'s' if one else ''} {MIXERS[kind].describe_cache(config)}")
        text = f"Of its {len(kinds)} layers, " + "; ".join(groups)
    if any(MIXERS[kind].grows_with_context for kind in layers):
        return text + "."
    return text + ": generating costs the same time and memory per token at any context length."


def render_model_card(
    config: Any, name: str, num_parameters: int, generation_defaults: Optional[dict[str, Any]] = None,
    tags: tuple[str, ...] = (),
) -> str:
    """Markdown of the card for a model with ``config`` published as ``name`` (a repo id or folder)."""
    all_tags = list(dict.fromkeys(TAGS + tuple(tags)))
    front_matter = "\n".join(["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
                             + [f"- {tag}" for tag in all_tags] + ["---"])
    rows = "\n".join(f"| `{field}` | `{json.dumps(value)}` |" for field, value in config_fields(config).items())
    generation = json.dumps(generation_defaults or {}, indent=2, sort_keys=True)
    return f"""{front_matter}
{MARKER}

# {name}

A **Trellis** language model ({num_parameters / 1e6:.1f}M parameters). {describe_layers(config)}
There is no positional embedding in the memory layers and no architectural context limit.

## Usage

With transformers alone (the model code is in this repository):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)
inputs = tokenizer(["The memory"], return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=20)
print(tokenizer.batch_decode(output, skip_special_tokens=True))
```

With `pip install trellis-lm`, `import trellis_lm` registers the classes, so `trust_remote_code`
is not needed and the fastest kernels of the installed version are used. Batches may be padded
on either side; `generate()` uses a fixed-size `TrellisCache` (greedy, sampling, beam search).
Evaluate with `lm_eval --model hf --model_args pretrained={name},trust_remote_code=True`.

## Configuration

| field | value |
|---|---|
{rows}

## Generation defaults

```json
{generation}
```
"""


def write_model_card(
    save_directory: str | os.PathLike, model: Any, name: Optional[str] = None, tags: tuple[str, ...] = ()
) -> Optional[Path]:
    """Write the card of ``model`` into ``save_directory`` unless a hand-written one is there.

    ``name`` defaults to the folder's name. Returns the path written, or ``None``.
    """
    path = Path(save_directory) / CARD_NAME
    existing = path.read_text(encoding="utf-8") if path.is_file() else None
    if not is_generated(existing):
        return None
    generation_config = getattr(model, "generation_config", None)
    generation_defaults = generation_config.to_diff_dict() if generation_config is not None else None
    if generation_defaults:
        generation_defaults.pop("transformers_version", None)
    card = render_model_card(
        model.config, name or Path(save_directory).resolve().name, model.num_parameters(), generation_defaults, tags
    )
    path.write_text(card, encoding="utf-8")
    return path


def hub_card_text(repo_id: str, token: Any = None) -> Optional[str]:
    """The card of ``repo_id`` on the Hub, or ``None`` when the repository has none."""
    from huggingface_hub import ModelCard
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return ModelCard.load(repo_id, token=token).content
    except LocalEntryNotFoundError:
        raise  # the Hub could not be reached: that says nothing about the card
    except (EntryNotFoundError, RepositoryNotFoundError):
        return None
