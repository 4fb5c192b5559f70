"""The product's import graph has no cycle: no module imports one that (indirectly) imports it. Every import
counts: at module level, inside functions (lazy ones) and under TYPE_CHECKING; only a script's
`if __name__ == "__main__":` block does not (it runs as `__main__`, a module of its own). A layer that needs what a
higher one holds takes it as a Protocol (worker/engine/engine.py's Stage, worker/engine/model_runner.py's Followers)
or is handed it (worker/models/native_decode.py's dense classes).

The worker's subpackages are layers (docs/architecture.md, the map of worker/), and these imports between them are
the whole list (WORKER_LAYERS): a new one fails here until it is written down, and some never may be:
- service/ (the daemon: flags, WorkerCore, the zmq shells) is the top: no other worker package imports it.
- parallel/ (TP groups, pipelines, the node supervisor) builds engines: only service/ imports it; the engine core
  reaches a pipeline's stage 0 and a TP group's command channel only through the protocols it declares.
- engine/ (the engine core) imports neither service/ nor parallel/; it uses speculative/, kv/, loading/, models/
  and distributed/ (and speculative/, kv/ and models/ build on its requests, scheduler, pool and step primitives).
- loading/ (a model's files into our model) imports only models/ and distributed/: no engine module.
- distributed/ (process groups and sharding) is the floor: it imports no other worker package.
- Sockets: of the worker, only service/, parallel/ (the TP command channel) and distributed/ (the EP group's
  wake-ups) import zmq; the engine core, speculative/, kv/, loading/ and models/ do no I/O of their own."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "infer"
# Each product folder and what its modules' names are relative to (src/infer's subpackages are named without the
# `infer.` their imports carry; the deploy scripts by their path in the checkout).
PRODUCT = {PACKAGE / name: PACKAGE for name in ("protocol", "coordinator", "worker", "client", "kernels")} | {
    ROOT / "deploy": ROOT
}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, base in PRODUCT.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`, but those under a `__main__` guard."""
    for node in ast.iter_child_nodes(tree):
        if _is_main_guard(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                elif base.startswith("infer."):
                    base = base[len("infer.") :]
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                target = target.removeprefix("infer.")
                if target in modules and target != name:
                    graph[name].add(target)
                    break
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for child in edges:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_the_graph_sees_the_imports_it_must():
    """The reader works: known edges are found, lazy ones and relative ones included."""
    graph = _graph(_modules())
    assert "protocol.messages" in graph["coordinator.core"]
    assert "worker.parallel.tp_commands" in graph["worker.service.cli"]  # a lazy import, inside a function
    assert "worker.service.daemon" in graph["worker.service.cli"]
    assert "worker.service.cli" not in graph["worker.service.daemon"]  # under its __main__ guard
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_import_cycle():
    cycles = _cycles(_graph(_modules()))
    assert not cycles, (
        f"import cycles: {[sorted(c) for c in cycles]}: a module imports one that (indirectly) imports it"
    )


# package -> the worker packages its modules import (worker/weight_sync.py: the deprecated alias of
# distributed/weight_sync.py the README names)
WORKER_LAYERS = {
    "service": {"parallel", "engine", "kv", "distributed"},
    "parallel": {"engine", "loading", "models", "distributed"},
    "engine": {"speculative", "kv", "loading", "models", "distributed"},
    "speculative": {"engine", "loading", "models", "distributed"},
    "kv": {"engine"},
    "loading": {"models", "distributed"},
    "models": {"engine", "speculative", "distributed"},
    "distributed": set(),
    "weight_sync": {"distributed"},
}
SOCKETS = {"service", "parallel", "distributed"}  # the worker packages that may import zmq


def _worker_package(module: str) -> str:
    """worker.engine.scheduler -> engine; worker.weight_sync -> weight_sync."""
    return module.split(".")[1]


def _layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    layers: dict[str, set[str]] = {}
    for name, targets in graph.items():
        if name.startswith("worker."):
            package = _worker_package(name)
            found = {_worker_package(t) for t in targets if t.startswith("worker.")}
            layers.setdefault(package, set()).update(found - {package})
    return layers


def _zmq_users(modules: dict[str, Path]) -> set[str]:
    users = set()
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "zmq" or n.startswith("zmq.") for n in names):
                users.add(name)
    return users


def test_the_worker_packages_import_each_other_as_documented():
    layers = _layer_graph(_graph(_modules()))
    for package, allowed in WORKER_LAYERS.items():
        extra = layers.get(package, set()) - allowed
        assert not extra, f"worker/{package}/ imports {sorted(extra)}, which its layer may not (WORKER_LAYERS)"
    assert layers == WORKER_LAYERS, "an import between worker packages is gone: update WORKER_LAYERS and the map"


def test_the_layering_rules_hold():
    """The rules of the module docstring, on the table itself (so a table edit that breaks one is caught too)."""
    assert not any("service" in targets for targets in WORKER_LAYERS.values())
    assert {p for p, targets in WORKER_LAYERS.items() if "parallel" in targets} == {"service"}
    assert not WORKER_LAYERS["engine"] & {"service", "parallel"}
    assert WORKER_LAYERS["loading"] <= {"models", "distributed"}
    assert not WORKER_LAYERS["distributed"]


def test_only_the_io_layers_open_sockets():
    modules = _modules()
    users = {_worker_package(name) for name in _zmq_users(modules) if name.startswith("worker.")}
    assert users <= SOCKETS, f"worker packages that import zmq but do no I/O by design: {sorted(users - SOCKETS)}"
    assert "worker.engine.engine" in modules and "worker.service.daemon" in _zmq_users(modules)
