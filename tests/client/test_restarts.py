"""The launchers' restart policy: exponential backoff, the crash-loop limit within a window, and a window that
forgets old restarts (pure logic, time passed in)."""

from __future__ import annotations

import pytest

from infer.client.restarts import CrashLoop, GiveUp, Restart, RestartPolicy, how_it_ended

POLICY = RestartPolicy(max_restarts=3, restart_window=60.0, restart_backoff=1.0, restart_backoff_max=3.0)


def test_backoff_doubles_up_to_its_cap_then_the_limit_gives_up_with_the_reason():
    loop = CrashLoop(POLICY)
    assert loop.on_exit(0.0, 1) == Restart(1.0, 1)
    assert loop.on_exit(2.0, -9) == Restart(2.0, 2)
    assert loop.on_exit(5.0, 1) == Restart(3.0, 3)  # 4 s, capped at 3
    verdict = loop.on_exit(9.0, 3)
    assert isinstance(verdict, GiveUp)
    assert "exited with code 3 after 3 restarts within 60 s" in verdict.reason and "--max-restarts 3" in verdict.reason


def test_refused_options_exit_code_2_are_given_up_at_once():
    verdict = CrashLoop(POLICY).on_exit(0.0, 2)
    assert isinstance(verdict, GiveUp) and "exited with code 2: its options or model were refused" in verdict.reason


def test_restarts_older_than_the_window_are_forgotten():
    loop = CrashLoop(POLICY)
    for t in (0.0, 2.0, 5.0):
        assert isinstance(loop.on_exit(t, 1), Restart)
    assert loop.on_exit(100.0, 1) == Restart(1.0, 1)  # all three restarts left the window
    assert loop.on_exit(102.0, 1) == Restart(2.0, 2)


def test_no_restarts_at_all():
    verdict = CrashLoop(RestartPolicy(max_restarts=0)).on_exit(0.0, -9)
    assert isinstance(verdict, GiveUp) and "--max-restarts 0" in verdict.reason


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_restarts=-1),
        dict(restart_backoff=-1.0),
        dict(restart_window=float("nan")),
        dict(restart_backoff=5.0, restart_backoff_max=1.0),
    ],
)
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


def test_return_codes_in_words():
    assert how_it_ended(2) == "exited with code 2"
    assert how_it_ended(-9) == "was killed by SIGKILL"
