"""The layer kinds: each mixer class registered by its kind, and what the configuration and the
cache read of the kinds a model has.

A mixer class that sets ``kind`` registers itself in :data:`MIXERS` as it is defined
(``Mixer.__init_subclass__``). This module registers :func:`check_layer_fields` with the
configuration as it is imported, so a config made once the mixers are loaded checks their
fields; the configuration itself imports nothing of the model. A model checks its config here
again when it is built (:func:`check_layer_fields`): its config may be of a checkpoint's own
configuration code, read before the model's code was loaded.
"""

from __future__ import annotations

from typing import Any

from .configuration_trellis import TrellisConfig, check_value, register_layer_checks

# Every mixer kind by name -> its class, in the order the classes were defined. The
# configuration's checks, the cache, the model card and the conversion read the kinds from here.
MIXERS: dict[str, Any] = {}


def field_checks() -> tuple[Any, ...]:
    """Every registered mixer's config-field checks (see mixers/fields.py), each field once,
    in the mixers' order. Read from the registry at each call: a kind registered later (one
    defined outside the package) is checked too."""
    return tuple({f.name: f for mixer in MIXERS.values() for f in mixer.config_fields}.values())


def op_backends() -> tuple[str, ...]:
    """``"auto"`` and every backend of a registered mixer's op."""
    names = {name for mixer in MIXERS.values() if mixer.backends is not None for name in mixer.backends}
    return ("auto",) + tuple(sorted(names))


def check_layer_fields(config: TrellisConfig) -> None:
    """Raise a ``ValueError`` naming the first field of ``config`` that the registered mixers
    refuse (each layer's kind, every kind's fields, ``op_backend`` against the layers' ops), and
    set ``layer_types`` from the mixers."""
    layers = config.num_hidden_layers
    if config.mixer_types is not None:
        if not isinstance(config.mixer_types, (list, tuple)) or len(config.mixer_types) != layers:
            raise ValueError(
                f"TrellisConfig.mixer_types must be None or a list of num_hidden_layers = {layers} entries, "
                f"got {config.mixer_types!r}"
            )
        for index, kind in enumerate(config.mixer_types):
            if kind not in MIXERS:
                raise ValueError(f"TrellisConfig.mixer_types[{index}] must be one of {tuple(MIXERS)}, got {kind!r}")
    # Every mixer's fields, whether or not a layer uses them: a saved config stays loadable
    # when its schedule changes.
    for field in field_checks():
        check_value(config, field.name, lambda v: field.valid(v, config), field.describe(config))
    backends = op_backends()
    check_value(config, "op_backend", lambda v: v in backends, f"one of {backends}")
    for kind in dict.fromkeys(config.layer_kinds):
        for field in MIXERS[kind].layer_checks:
            check_value(config, field.name, lambda v: field.valid(v, config), field.describe(config))
        registry = MIXERS[kind].backends
        if registry is not None and config.op_backend != "auto" and config.op_backend not in registry:
            raise ValueError(
                f"TrellisConfig.op_backend must be 'auto' or a backend of every op the layers run; "
                f"{registry.op} (the {kind!r} layers) has {sorted(registry)}, got {config.op_backend!r}"
            )
    config.layer_types = [MIXERS[kind].layer_type for kind in config.layer_kinds]


def layer_signature(config: TrellisConfig) -> dict[str, Any]:
    """The fields that define the function of ``config``'s layers: those of the kinds in
    ``config.layer_kinds`` (each mixer's ``signature_fields``). A cache remembers them."""
    names = sorted({name for kind in set(config.layer_kinds) for name in MIXERS[kind].signature_fields()})
    return {"mixer_types": config.layer_kinds, **{name: getattr(config, name) for name in names}}


def cache_layouts(config: TrellisConfig) -> list[dict[str, Any]]:
    """Each layer's cache entry as its mixer declares it (``Mixer.cache_layout``): tensor
    names, shapes and dtypes, what ``TrellisCache.load`` checks a file against."""
    return [MIXERS[kind].cache_layout(config) for kind in config.layer_kinds]


register_layer_checks(check_layer_fields)
