"""lm-evaluation-harness integration: the ``trellis`` model name and :func:`evaluate`.

Importing this module registers ``trellis`` with lm-eval's model registry, so
``lm_eval.simple_evaluate(model="trellis", model_args="pretrained=DIR", ...)`` works;
``--model hf --model_args pretrained=DIR,trust_remote_code=True`` works without it.

Context length: a Trellis model has no positional limit, so its config carries no
``max_position_embeddings``; lm-eval then takes the tokenizer's ``model_max_length`` (1,000,000
for tokenizers made by :func:`trellis_lm.train_tokenizer`: nothing is truncated in practice).
Set ``tokenizer.model_max_length`` before saving, or pass ``max_length=N`` in ``model_args``,
to cut contexts (left-truncated, as lm-eval does) or to bound ``batch_size=auto``'s probe.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional, Union

# lm-eval fills its registry lazily, on the first lookup of an empty registry: registering a
# model before that would leave only ours and "hf" would vanish. Importing the models first
# fills it.
import lm_eval.models  # noqa: F401  (imported for its side effect)
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import trellis_lm  # noqa: F401  (registers the Auto classes: no trust_remote_code needed)

from . import TASKS_DIR

IncludePath = Union[str, os.PathLike, list[Union[str, os.PathLike]], None]


@register_model("trellis")
class TrellisLM(HFLM):
    """lm-eval's ``hf`` model, for Trellis checkpoints loaded through this package.

    Batched loglikelihood requests run right-padded (the model is causal, so padding after a
    row's tokens changes nothing before them); ``generate_until`` runs left-padded batches
    through ``generate()`` and the fixed-size cache. Accepts every ``HFLM`` argument
    (``batch_size``, ``max_length``, ``device``, ``dtype``, ...).
    """

    def __init__(self, pretrained: Union[str, Any], **kwargs: Any) -> None:
        # transformers' own model lists do not name "trellis"; say what it is instead of
        # letting lm-eval guess (and warn).
        kwargs.setdefault("backend", "causal")
        super().__init__(pretrained=pretrained, **kwargs)


def evaluate(
    pretrained: Union[str, os.PathLike],
    tasks: list[str],
    *,
    model: str = "trellis",
    model_args: Optional[dict[str, Any]] = None,
    include_path: IncludePath = TASKS_DIR,
    batch_size: Union[int, str] = 8,
    limit: Optional[float] = None,
    num_fewshot: Optional[int] = None,
    device: Optional[str] = None,
    **simple_evaluate_kwargs: Any,
) -> dict[str, Any]:
    """Run ``lm_eval.simple_evaluate`` on the checkpoint ``pretrained``.

    Args:
        pretrained: checkpoint folder or Hub id.
        tasks: lm-eval task or group names (e.g. ``["trellis_demo"]``, ``["hellaswag"]``).
        model: ``"trellis"`` or ``"hf"`` (then ``trust_remote_code=True`` is added).
        model_args: more ``HFLM`` arguments, e.g. ``{"max_length": 4096, "dtype": "bfloat16"}``.
        include_path: a folder of extra task YAMLs, or a list of them (default: the bundled demo tasks).
        batch_size, limit, num_fewshot: as in ``simple_evaluate``.
        device: e.g. ``"cuda:0"``; default: the first GPU if there is one, else the CPU.

    Returns:
        ``simple_evaluate``'s results dict (``results["results"][task][metric]``).
    """
    from lm_eval import simple_evaluate

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    arguments = {"pretrained": str(pretrained), **(model_args or {})}
    if model == "hf":
        arguments.setdefault("trust_remote_code", True)
    return simple_evaluate(
        model=model, model_args=arguments, tasks=tasks, task_manager=task_manager(include_path), batch_size=batch_size,
        limit=limit, num_fewshot=num_fewshot, device=device, **simple_evaluate_kwargs,
    )


def task_manager(include_path: IncludePath = TASKS_DIR) -> Any:
    """lm-eval's ``TaskManager`` over its own tasks and those of ``include_path`` (a folder of
    task YAMLs, a list of them, or ``None``), built once per process for the same folders.

    Building one reads every task YAML lm-eval ships (about 26,000 files with lm-eval 0.4.13:
    some 20 s of a CPU core), which each :func:`evaluate` call paid again. The index holds file
    paths, and configs are read when a task loads, so an edited YAML is seen; a YAML added,
    removed or touched in an included folder builds a new index.
    """
    if include_path is None:
        paths: tuple[str, ...] = ()
    else:
        paths = tuple(str(p) for p in (include_path if isinstance(include_path, list) else [include_path]))
    return _task_manager(paths, _yaml_files(paths))


def _yaml_files(paths: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """``(file, mtime_ns)`` of every YAML under the folders (or the files) in ``paths``."""
    found = []
    for path in map(Path, paths):
        files = [path] if path.is_file() else [*path.rglob("*.yaml"), *path.rglob("*.yml")]
        found += [(str(f), f.stat().st_mtime_ns) for f in files]
    return tuple(sorted(found))


@functools.lru_cache(maxsize=4)
def _task_manager(paths: tuple[str, ...], yaml_files: tuple[tuple[str, int], ...]) -> Any:
    # yaml_files is only part of the cache key: a changed folder gets a new index.
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths) or None)


__all__ = ["TASKS_DIR", "TrellisLM", "evaluate", "task_manager"]
