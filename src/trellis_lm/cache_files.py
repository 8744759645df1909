"""The file of layer entries: what :meth:`TrellisCache.save` writes and
:meth:`StatePassing.save` too, one safetensors file with a checked header.

Tensors: ``layers.<index>.<name>``, each layer's entry tensors under the names its kind's
entry class gives them (:meth:`LayerCache.tensors`), plus a writer's own (state passing's random
generator). Metadata: ``format`` and ``format_version`` (which writer, which layout),
``layer_kinds`` (JSON list), ``signature`` (JSON: the config fields that define the layers'
functions, or null), for caches ``seen_tokens``, plus a writer's own fields.

A file is checked before any tensor is used: the header first, then every layer's tensors
against the layout its mixer declares (``Mixer.cache_layout``: names, shapes, dtypes), then
their counters against their bounds and each other. Errors name the file, the layer and the tensor.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from safetensors.torch import save_file

from .cache_entries import LAYER_CACHES
from .cache_layout import COLUMNS, Dim, TensorSpec
from .configuration_trellis import TrellisConfig
from .layer_kinds import cache_layouts, layer_signature


@dataclass(frozen=True)
class FileKind:
    """What a file of entries holds, as its header says.

    Attributes:
        format: the metadata ``format``; ``version`` its ``format_version``.
        what: the file in words (errors); ``writer``: the method that writes it.
        counts_tokens: whether the header records ``seen_tokens`` (a cache's columns).
    """

    format: str
    version: str
    what: str
    writer: str
    counts_tokens: bool


# Cache format version 1 (one kind of layer, no record of the model) is not read: its layer count
# could not be checked against anything before allocating.
CACHE_FILE = FileKind("trellis-cache", "2", "a Trellis cache file", "TrellisCache.save", counts_tokens=True)
# Version 1 of the carried states had no header (metadata: the signature and the probability only).
STATE_FILE = FileKind("trellis-carried-states", "2", "a file of carried training states", "StatePassing.save",
                      counts_tokens=False)


@dataclass
class Header:
    """A file's checked header: the layer kinds (``None``: a version-1 state file, which did not
    record them), the tokens seen (``None`` where not counted) and the signature."""

    kinds: Optional[list[str]]
    seen: Optional[int]
    signature: Optional[dict]


def write_entries(path: Union[str, os.PathLike], kind: FileKind, kinds: Sequence[str],
                  layers: Mapping[int, Mapping[str, torch.Tensor]], signature: Optional[dict],
                  seen: Optional[int] = None, metadata: Optional[Mapping[str, str]] = None,
                  tensors: Optional[Mapping[str, torch.Tensor]] = None) -> None:
    """Write ``layers`` (layer index -> its entry's tensors by name) of a model with layers of
    ``kinds`` as a ``kind`` file, with the writer's own ``metadata`` and ``tensors``."""
    # safetensors refuses tensors sharing memory (a state's anchor may be its memory).
    held = {f"layers.{index}.{name}": t.detach().contiguous().clone().cpu()
            for index, named in layers.items() for name, t in named.items() if t is not None}
    header = {"format": kind.format, "format_version": kind.version, "layer_kinds": json.dumps(list(kinds)),
              "signature": json.dumps(signature)}
    if kind.counts_tokens:
        header["seen_tokens"] = str(seen)
    save_file({**held, **(tensors or {})}, os.fspath(path), metadata={**(metadata or {}), **header})


def checked_path(path: Union[str, os.PathLike], kind: FileKind) -> str:
    """``path`` as a string; a folder is a ``ValueError`` (a file of ``kind`` was expected)."""
    where = os.fspath(path)
    if os.path.isdir(where):
        noun = "cache" if kind.counts_tokens else "state"
        raise ValueError(f"{where} is a folder: expected a {noun} file written by {kind.writer}")
    return where


def layer_keys(keys: Iterable[str], path: Any, count: Optional[int] = None) -> dict[int, dict[str, str]]:
    """The file's entry tensors: layer index -> name -> key, for every key ``layers.<i>.<name>``
    (``count``: the indices must be below it). Any other key is a ``ValueError``."""
    per_layer: dict[int, dict[str, str]] = {}
    for key in keys:
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or (count is not None and int(parts[1]) >= count):
            bound = "" if count is None else f" < {count}"
            raise ValueError(f"{path}: tensor {key!r} is not 'layers.<index{bound}>.<name>'")
        per_layer.setdefault(int(parts[1]), {})[parts[2]] = key
    return per_layer


def check_signature(recorded: Optional[dict], config: TrellisConfig, made: str) -> None:
    """Raise a ``ValueError`` naming the first field that defines a layer's function where the
    ``recorded`` signature (``None``: none recorded, nothing to check) differs from ``config``'s
    model; ``made`` says who recorded it (e.g. "the cache was made")."""
    if recorded is None:
        return
    recorded = TrellisConfig.completed(recorded)
    for name, value in layer_signature(config).items():
        if recorded.get(name) != value:
            raise ValueError(f"{made} by a model with {name}={recorded.get(name)!r}, this model has {name}={value!r}")


# safetensors' dtype names, by the kinds a TensorSpec names; an op state's floats are float32 or
# float64 (the ops carry them so in every model dtype).
FILE_DTYPES = {"float": {"F16", "BF16", "F32", "F64"}, "int64": {"I64"}, "bool": {"BOOL"}}
STATE_FLOATS = {"F32", "F64"}
_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                torch.int64: "I64", torch.bool: "BOOL"}


def file_dtype(tensor: torch.Tensor) -> str:
    """``tensor``'s dtype as safetensors names it (others by torch's name, which no spec accepts)."""
    return _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))


def config_of(signature: dict, kinds: list[str], path: Any) -> TrellisConfig:
    """The configuration of the model a cache file records (its metadata ``signature``), which
    gives its layers' sizes: built and checked as any config is."""
    if signature.get("mixer_types") != kinds:
        raise ValueError(f"{path}: metadata 'signature' records the layers {signature.get('mixer_types')!r}, "
                         f"'layer_kinds' {kinds}")
    fields = TrellisConfig.completed({name: value for name, value in signature.items() if name != "mixer_types"})
    try:
        return TrellisConfig(num_hidden_layers=len(kinds), mixer_types=kinds, **fields)
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: metadata 'signature' is not a model this code can build: {error}") from None


def check_layers(where: str, kinds: list[str], seen: int, config: Optional[TrellisConfig],
                  headers: list[dict[str, tuple[tuple[int, ...], str]]],
                  read: Callable[[int, str], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Check a cache's entries, one ``name -> (shape, safetensors dtype)`` dict per layer of
    ``kinds``, against the layouts of ``config``'s model (``None``: only what holds whatever the
    sizes), all of them before any tensor is read; then read each (``read(layer, name)``) and
    check its counters and values. Returns the tensors per layer; raises a ``ValueError``
    starting with ``where`` and naming the layer."""
    exact = config is not None
    layouts = cache_layouts(config) if exact else _loose_layouts(kinds)
    sizes: dict[str, Optional[int]] = {"rows": None}
    for index, (kind, layer) in enumerate(zip(kinds, headers)):
        _check_entry(f"{where}: layer {index} ({kind})", kind, layer, seen, layouts[index], sizes, exact)
    read_layers = []
    for index, (kind, layer) in enumerate(zip(kinds, headers)):
        tensors = {name: read(index, name) for name in layer}
        _check_counters(f"{where}: layer {index} ({kind})", tensors, layouts[index], seen, exact)
        problem = LAYER_CACHES[kind].value_problem(tensors, config) if tensors else None
        if problem:
            raise ValueError(f"{where}: layer {index} ({kind}): {problem}")
        read_layers.append(tensors)
    return read_layers


def check_entry_headers(where: str, kind: str, headers: dict[str, tuple[tuple[int, ...], str]], config: TrellisConfig,
                        index: int) -> None:
    """Check the tensors of one memory layer's entry (e.g. a state carried between training
    batches), ``name -> (shape, safetensors dtype)`` as a file's header gives them, against
    layer ``index`` of ``config``'s model, which is of ``kind``: names, shapes, dtypes. What a
    reader checks before it reads a tensor; :func:`check_entry_values` checks the values read.
    Raises a ``ValueError`` starting with ``where``."""
    _check_entry(where, kind, headers, None, cache_layouts(config)[index], {"rows": None}, exact=True)


def check_entry_values(where: str, kind: str, tensors: dict[str, torch.Tensor], config: TrellisConfig, index: int) -> None:
    """Check the counters of one memory layer's entry read after :func:`check_entry_headers`:
    against their bounds (those bounded by the tokens seen, not known here, only from below) and
    each other. Raises a ``ValueError`` starting with ``where``."""
    _check_counters(where, tensors, cache_layouts(config)[index], None)
    problem = LAYER_CACHES[kind].value_problem(tensors, config)
    if problem:
        raise ValueError(f"{where}: {problem}")


def _loose_layouts(kinds: list[str]) -> list[dict[str, TensorSpec]]:
    """The layouts of ``kinds`` in a model of default sizes: their names, ranks, dtypes and named
    dims hold whatever the sizes (a check without the model reads nothing else of them)."""
    return cache_layouts(TrellisConfig(num_hidden_layers=len(kinds), mixer_types=kinds))


def _check_entry(where: str, kind: str, headers: dict[str, tuple[tuple[int, ...], str]], seen: Optional[int],
                 layout: dict[str, TensorSpec], sizes: dict[str, Optional[int]], exact: bool) -> None:
    """Check one layer's tensors (``name -> (shape, safetensors dtype)``) against what its kind
    holds and the ``layout`` its mixer declares (``exact``: for the model's sizes; else only
    names, ranks, dtypes and the dims a name ties together); ``sizes`` carries the batch rows from
    layer to layer; ``seen``: the tokens the entry has seen (``None``: not known, an entry that
    holds tensors has seen some). Raises a ``ValueError`` starting with ``where``."""
    entry = LAYER_CACHES[kind]
    known = layout.keys() if exact else entry.tensor_names()
    unknown = sorted(set(headers) - set(known))
    if unknown:
        raise ValueError(f"{where} holds an unknown tensor {unknown[0]!r}; its entry holds {sorted(known)}")
    if seen is not None and not seen:
        if headers:
            raise ValueError(f"{where} holds tensors {sorted(headers)}, but the cache has seen no tokens (seen_tokens = 0)")
        return
    if not headers:
        raise ValueError(
            f"{where} holds no state, although the cache has seen {seen} tokens (seen_tokens): the layer would "
            "silently restart from its initial memories"
        )
    required = list(layout) if exact else entry.required_names()
    missing = [name for name in required if name not in headers]
    if missing:
        raise ValueError(
            f"{where}: a {kind} layer's state needs tensors {required}, the file holds {sorted(headers)} (missing {missing})"
        )
    state = set(entry.state_names())
    layer_sizes = dict(sizes, columns=seen)
    for name, (shape, dtype) in headers.items():
        spec = layout.get(name)
        if spec is None:  # (a tail, checked against a model without short convs: the model checks it)
            continue
        allowed = STATE_FLOATS if spec.dtype == "float" and name in state else FILE_DTYPES[spec.dtype]
        if dtype not in allowed:
            raise ValueError(f"{where} tensor {name!r} has dtype {dtype}, the model needs one of {sorted(allowed)}")
        fits = len(shape) == len(spec.dims)
        for size, dim in zip(shape, spec.dims) if fits else ():
            if isinstance(dim, int):
                fits = fits and (size == dim or not exact)
            else:
                fits = fits and (dim.most is None or size <= dim.most or not exact)
                fits = fits and layer_sizes.get(dim.name) in (None, size)
                layer_sizes[dim.name] = size
        if not fits:
            raise ValueError(
                f"{where} tensor {name!r} has shape {list(shape)}, the model needs {_describe(spec.dims, exact)} "
                f"(rows = {sizes['rows'] or 'as the other tensors'}"
                + (f", columns = seen_tokens = {seen})" if seen is not None else ")")
            )
    sizes["rows"] = layer_sizes.get("rows", sizes["rows"])


def _describe(dims: tuple[Union[int, Dim], ...], exact: bool = True) -> str:
    def one(dim: Union[int, Dim]) -> str:
        if isinstance(dim, int):
            return str(dim) if exact else "a size of the model"
        return dim.name + (f" <= {dim.most}" if dim.most is not None and exact else "")

    return "[" + ", ".join(map(one, dims)) + "]"


def _check_counters(where: str, tensors: dict[str, torch.Tensor], layout: dict[str, TensorSpec], seen: Optional[int],
                    exact: bool = True) -> None:
    """Counters (``TensorSpec.most``) must lie in ``[0, most]``: a state's offsets and token
    counts index into its buffers (``most`` from the model's sizes is checked when ``exact``;
    ``COLUMNS``, the tokens seen, always)."""
    for name, spec in layout.items():
        if spec.most is None or name not in tensors or tensors[name].numel() == 0:
            continue
        most = seen if spec.most is COLUMNS else spec.most if exact else None  # (seen None: not known)
        low, high = int(tensors[name].min()), int(tensors[name].max())
        if low < 0 or (most is not None and high > most):
            bound = f"seen_tokens = {seen}" if spec.most is COLUMNS else str(most) if exact else "the model's bound"
            raise ValueError(f"{where} tensor {name!r} holds values in [{low}, {high}], allowed: [0, {bound}]")


def read_header(metadata: Mapping[str, str], path: Any, kind: FileKind) -> Header:
    """The checked header of a ``kind`` file from its ``metadata``.

    A state file without ``format`` is one of version 1 (no kinds recorded), and one without
    ``signature`` records no model: both are then checked by their tensors alone, as they were
    read before the header existed (a resumed training run keeps its checkpoints)."""
    if not kind.counts_tokens and "format" not in metadata:
        return Header(None, None, _signature_field(metadata, path, missing_is_none=True))
    if metadata.get("format") != kind.format:
        raise ValueError(f"{path} is not {kind.what} (metadata format: {metadata.get('format')!r})")
    version = metadata.get("format_version")
    if version != kind.version:
        noun = "cache" if kind.counts_tokens else "carried-states"
        raise ValueError(
            f"{path} holds {noun} format version {version!r}, this code reads {kind.version!r} "
            "(re-create it by running the model on the text again)"
        )

    def count(text: str) -> int:
        if not text.isdigit():
            raise ValueError(text)
        return int(text)

    seen = _field(metadata, path, "seen_tokens", count, "a whole number >= 0") if kind.counts_tokens else None

    def kinds_list(text: str) -> list[str]:
        kinds = json.loads(text)
        if not isinstance(kinds, list) or not all(kind in LAYER_CACHES for kind in kinds):
            raise ValueError(text)
        return kinds

    kinds = _field(metadata, path, "layer_kinds", kinds_list, f"a JSON list of layer kinds among {sorted(LAYER_CACHES)}")
    return Header(kinds, seen, _signature_field(metadata, path, missing_is_none=not kind.counts_tokens))


def _field(metadata: Mapping[str, str], path: Any, name: str, parse: Callable[[str], Any], expected: str) -> Any:
    """``parse(metadata[name])``; a missing or unreadable field is a ``ValueError`` saying what was expected."""
    try:
        return parse(metadata[name])
    except (KeyError, ValueError, TypeError) as error:
        raise ValueError(f"{path}: metadata {name!r} must be {expected}, got {metadata.get(name)!r}") from error


def _signature_field(metadata: Mapping[str, str], path: Any, missing_is_none: bool) -> Optional[dict]:
    """The metadata ``signature``: a JSON object, or null (``None``, also when missing and
    ``missing_is_none``)."""
    if missing_is_none and "signature" not in metadata:
        return None

    def signature(text: str) -> Optional[dict]:
        value = json.loads(text)
        if value is not None and not isinstance(value, dict):
            raise ValueError(text)
        return value

    return _field(metadata, path, "signature", signature, "a JSON object or null")
