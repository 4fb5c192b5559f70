"""The lifecycle table: every state x command has a defined outcome; STOP is final."""

from __future__ import annotations

import itertools

import pytest

from infer.coordinator.lifecycle import TABLE, Action, ClusterState, Refusal, Transition, commands_to_reach, transition
from infer.protocol.messages import LIFECYCLE_COMMANDS

LIVE = [s for s in ClusterState if s is not ClusterState.STOPPED]


def test_the_table_covers_every_live_state_and_command():
    assert set(TABLE) == set(itertools.product(LIVE, LIFECYCLE_COMMANDS))


@pytest.mark.parametrize(
    "state, command, new_state",
    [
        ("running", "pause", "paused"),
        ("paused", "unpause", "running"),
        ("paused", "suspend", "suspended"),
        ("suspended", "resume", "paused"),
        ("running", "unpause", "running"),
        ("paused", "pause", "paused"),
    ],
)
def test_transitions(state, command, new_state):
    step = transition(ClusterState(state), command)
    assert isinstance(step, Transition) and step.state.value == new_state


def test_repeats_are_no_ops_and_real_changes_tell_the_workers():
    assert transition(ClusterState.PAUSED, "pause").actions == ()
    assert Action.TELL_WORKERS in transition(ClusterState.RUNNING, "pause").actions
    assert transition(ClusterState.PAUSED, "unpause").actions == (Action.TELL_WORKERS, Action.RELEASE_HELD)


@pytest.mark.parametrize("state", LIVE)
def test_stop_works_from_every_live_state(state):
    step = transition(state, "stop")
    assert step.state is ClusterState.STOPPED
    assert step.actions == (Action.FAIL_PENDING, Action.TELL_WORKERS, Action.EXIT)


@pytest.mark.parametrize(
    "state, command, reason",
    [
        (ClusterState.RUNNING, "suspend", "pause it first"),
        (ClusterState.SUSPENDED, "unpause", "resume it first"),
        (ClusterState.STOPPED, "unpause", "stopped"),
        (ClusterState.RUNNING, "explode", "unknown lifecycle command"),
    ],
)
def test_refusals_say_why(state, command, reason):
    step = transition(state, command)
    assert isinstance(step, Refusal) and reason in step.reason


def test_a_late_worker_is_brought_to_the_clusters_state():
    state = ClusterState.RUNNING
    for command in commands_to_reach(ClusterState.SUSPENDED):
        state = transition(state, command).state
    assert state is ClusterState.SUSPENDED
