"""The model card (``README.md``) that Trellis checkpoints are saved with.

It says what the model is, how to load it with stock transformers (``trust_remote_code=True``)
or with ``trellis_lm``, its intended use, limitations, license, training data and evaluation
(what the training recipes recorded, :class:`TrainingRun`; placeholders otherwise), and lists
the configuration fields its layers use and the generation defaults. A card that a person
wrote (one without :data:`MARKER`) is never overwritten.

This file travels with checkpoints as remote code (see :mod:`.remote_code`); what it says of the
layers comes from their mixers' declarations (:data:`~.mixers.MIXERS`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .configuration_trellis import TrellisConfig
from .layer_kinds import layer_signature
from .mixers import MIXERS

# Identifies cards this module wrote, which it may rewrite.
MARKER = "<!-- trellis-lm model card: save_pretrained rewrites this file; delete this line to keep your edits -->"
CARD_NAME = "README.md"
TAGS = ("trellis", "text-generation", "custom_code")


def is_generated(card_text: Optional[str]) -> bool:
    """True for a card this module wrote (or no card at all)."""
    return card_text is None or MARKER in card_text


@dataclass(frozen=True)
class TrainingRun:
    """What a training run that made the weights knows of itself, for the card.

    Attributes:
        recipe: how the model was trained, e.g. ``"trellis_lm.training.pretrain"``.
        data: the training data in words (files, or the sample a recipe wrote).
        steps: optimizer steps taken.
        settings: the run's main settings as given (batch size, length, learning rate, ...).
        final_loss: the last logged training loss (on training batches, not held-out text).
    """

    recipe: str
    data: str
    steps: int
    settings: dict[str, Any] = field(default_factory=dict)
    final_loss: Optional[float] = None


def config_fields(config: TrellisConfig) -> dict[str, Any]:
    """The fields the config class itself declares (not transformers' generic ones), by name."""
    declared = vars(type(config)).get("__annotations__", {})
    return {name: getattr(config, name) for name, kind in declared.items() if "ClassVar" not in str(kind)}


def used_config_fields(config: TrellisConfig) -> dict[str, Any]:
    """:func:`config_fields` that the model uses: the model-level ones (the config's
    ``model_level_fields``) and those of the layer kinds it has (``layer_signature``), in the
    order the class declares them. Another kind's fields do not change the model."""
    used = set(config.model_level_fields) | set(layer_signature(config))
    return {name: value for name, value in config_fields(config).items() if name in used}


def _training_sections(run: Optional[TrainingRun]) -> str:
    if run is None:
        return """## Training data

Not recorded: these weights were saved outside trellis-lm's training recipes (which fill this
section in). Say here what the model was trained on.

## Evaluation

None recorded. `trellis-lm eval MODEL --tasks trellis_demo` runs two tiny offline tasks through
lm-evaluation-harness (any lm-eval task works the same way, e.g. `--tasks hellaswag` with internet).
"""
    settings = ", ".join(f"{name} {value}" for name, value in run.settings.items())
    loss = ("no training loss was logged" if run.final_loss is None else
            f"the last logged training loss was {run.final_loss:.3f} (perplexity {math.exp(run.final_loss):.1f} "
            "on training batches, which says how well it fits them, not how it reads new text)")
    return f"""## Training data

{run.data}. Trained by `{run.recipe}`: {run.steps} steps{f"; {settings}" if settings else ""}.

## Evaluation

No held-out evaluation was run with the training: {loss}. `trellis-lm eval MODEL --tasks trellis_demo`
runs two tiny offline tasks through lm-evaluation-harness (any lm-eval task works the same way).
"""


def describe_layers(config: TrellisConfig) -> str:
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
    config: TrellisConfig, name: str, num_parameters: int, generation_defaults: Optional[dict[str, Any]] = None,
    tags: tuple[str, ...] = (), training: Optional[TrainingRun] = None,
) -> str:
    """Markdown of the card for a model with ``config`` published as ``name`` (a repo id or
    folder), trained by ``training`` when a recipe says so."""
    all_tags = list(dict.fromkeys(TAGS + tuple(tags)))
    front_matter = "\n".join(["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:"]
                             + [f"- {tag}" for tag in all_tags] + ["---"])
    rows = "\n".join(f"| `{field}` | `{json.dumps(value)}` |" for field, value in used_config_fields(config).items())
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

With the `trellis-lm` package installed, `import trellis_lm` registers the classes, so
`trust_remote_code` is not needed and the fastest kernels of the installed version are used. It is
not on the package index: install it from a clone of its repository (`pip install .` there, or the
wheel that `python -m build` writes to `dist/`) or with `pip install "git+<the repository's clone
URL>"`. Batches may be padded on either side; `generate()` uses a fixed-size `TrellisCache`
(greedy, sampling, beam search). Evaluate with
`lm_eval --model hf --model_args pretrained={name},trust_remote_code=True`.

## Intended use

Research on and experiments with language models whose memory has a fixed size. The model has not
been evaluated for safety, factual accuracy or any application: do not use its text where it
matters without an evaluation of your own.

## Limitations

- Its memory layers keep a fixed number of slots per head, so details far back in a long context
  are kept only as far as those slots hold them; exact recall (a passkey, a name) fades with distance.
- Text far longer than the model's training windows (past about 16x their length) is read well only
  by a model trained with state passing (`trellis_lm.state_passing`, on in trellis-lm's recipes).
- A small model trained briefly writes fluent-looking but unreliable text, and knows only its
  training data's language and domain.

## License

None declared, for these weights or for the trellis-lm code copied beside them: whoever
publishes them should state one (the `license:` field of the front matter).

{_training_sections(training)}
## Configuration

The fields the model's layers use (the config also holds defaults for other layer kinds, which
change nothing here):

| field | value |
|---|---|
{rows}

## Generation defaults

```json
{generation}
```
"""


def write_model_card(
    save_directory: str | os.PathLike, model: Any, name: Optional[str] = None, tags: tuple[str, ...] = (),
    training: Optional[TrainingRun] = None,
) -> Optional[Path]:
    """Write the card of ``model`` (trained by ``training``, when known) into ``save_directory``
    unless a hand-written one is there.

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
        model.config, name or Path(save_directory).resolve().name, model.num_parameters(), generation_defaults, tags,
        training,
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
