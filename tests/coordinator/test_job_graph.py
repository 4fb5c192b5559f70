"""The coordinator's jobs are a decomposition, not a file split: none imports core.py or holds the Coordinator,
each is given its collaborators at construction, and the jobs call each other without a cycle (the map in
core.py's module doc and docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
import inspect
from graphlib import CycleError, TopologicalSorter

import pytest

JOBS = ("admission", "reattachment", "relay", "statistics", "commands", "liveness", "loras")
SHARED = ("books", "outbox", "state", "orphans", "models")  # what jobs share: tables and primitives, no job logic
EXPECTED = {  # job -> the jobs it calls
    "admission": set(),
    "reattachment": {"admission"},
    "relay": {"admission"},
    "statistics": {"admission", "loras"},
    "commands": {"admission", "statistics"},
    "liveness": {"admission", "relay"},
    "loras": set(),
}


def _coordinator_imports(name: str) -> set[str]:
    """The infer.coordinator modules `name` imports, TYPE_CHECKING blocks included."""
    source = inspect.getsource(importlib.import_module(f"infer.coordinator.{name}"))
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("infer.coordinator."):
            found.add(node.module.removeprefix("infer.coordinator."))
        elif isinstance(node, ast.Import):
            found.update(
                a.name.removeprefix("infer.coordinator.") for a in node.names if a.name.startswith("infer.coordinator.")
            )
    return found


@pytest.mark.parametrize("job", JOBS + SHARED)
def test_no_job_reaches_back_to_the_coordinator(job):
    assert not _coordinator_imports(job) & {"core", "daemon"}
    assert "self.core" not in inspect.getsource(importlib.import_module(f"infer.coordinator.{job}"))


def test_jobs_call_each_other_without_a_cycle():
    graph = {job: _coordinator_imports(job) & set(JOBS) for job in JOBS}
    assert graph == EXPECTED
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:  # pragma: no cover - the message names the cycle
        pytest.fail(f"the jobs call each other in a cycle: {e.args[1]}")


def test_shared_modules_know_no_job():
    for name in SHARED:
        assert not _coordinator_imports(name) & set(JOBS), name
