"""The package's layering: no import cycle among its modules, counting imports made inside
functions (a cycle hidden in a function still ties two modules into one unit to change); the
configuration imports nothing of the model, the mixers nothing of the model above them."""

from __future__ import annotations

import ast
from pathlib import Path

import trellis_lm

PACKAGE = Path(trellis_lm.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """The package modules ``path`` imports anywhere in its code (relative imports), each as a
    dotted name inside the package (a package stands for its ``__init__``)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.add(target if node.module else ".".join(base))
    return {t for t in found if t != name}


def import_graph() -> dict[str, set[str]]:
    graph = {module_name(p): imports_of(p) for p in PACKAGE.rglob("*.py")}
    # `from .pkg import module` names a module of the package, not a name of its __init__.
    return {m: {t for t in targets if t in graph or t.rpartition(".")[0] in graph} for m, targets in graph.items()}


def test_no_module_takes_part_in_an_import_cycle():
    graph = import_graph()
    # The parse sees relative imports at every level (a graph without edges has no cycle).
    assert "mixers.base" in graph["mixers"] and "cache_trellis" in graph["modeling_trellis"]
    assert "training" in graph["cli"]  # (imported inside a function)
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def closure(graph: dict[str, set[str]], module: str) -> set[str]:
    """The package modules ``module`` imports, directly or through others."""
    seen, pending = set(), [module]
    while pending:
        for target in graph.get(pending.pop(), ()):
            if target not in seen:
                seen.add(target)
                pending.append(target)
    return seen


# The model: the modules that make up a model and what sits above them (what a layer kind's
# code, the cache and the model are; the configuration and the entry layouts are below them).
MODEL = ("layer_kinds", "mixers", "ops", "cache_trellis", "cache_entries", "cache_files", "modeling_trellis", "projection_stacks",
         "compiled_decode", "decode_step", "state_passing", "training", "conversion", "integrations", "eval")


def of_the_model(module: str) -> bool:
    return any(module == top or module.startswith(f"{top}.") for top in MODEL)


def test_the_configuration_imports_nothing_of_the_model():
    """A config is read before its model (a checkpoint's, as remote code): the mixers register
    what it checks, it imports none of them (nor anything they import), not even inside a function."""
    graph = import_graph()
    assert "remote_code" in graph["configuration_trellis"]  # (the graph sees the config's imports)
    assert not {m for m in closure(graph, "configuration_trellis") if of_the_model(m)}


def test_the_mixers_import_nothing_of_the_model_above_them():
    """A mixer imports its op, the cache and the configuration, never the model built of mixers
    (nor anything above it)."""
    graph = import_graph()
    above = {"modeling_trellis", "compiled_decode", "decode_step", "state_passing", "training", "conversion",
             "integrations", "eval", "cli", "benchmark", "model_card_trellis"}
    for mixer in [m for m in graph if m == "mixers" or m.startswith("mixers.")]:
        reached = closure(graph, mixer)
        assert not {m for m in reached if m.split(".")[0] in above}, mixer
