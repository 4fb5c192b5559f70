"""Chaos in CI: tests/soak/chaos.py's scenario, short. Mixed load (streams and generate calls, some aborted
part-way, a pause / unpause) on a coordinator and three --benchmark-mode workers, whose tokens are
deterministic, so every stream is checked token for token: no gap, no repeat, one end.

- a worker kill -9 (and its restart) under load: every request completes or is aborted by us, nothing else;
- the coordinator kill -9 and restart on the same port under load (the "Coordinator restart" feature: workers
  register again with what they run, clients re-attach their requests): the same.
After each: every KV pool back to zero, and after the lifecycle STOP no process of the cluster is left.
The full-length scenario (5 minutes, a kill every 30 s) is `python tests/soak/chaos.py`.
"""

from __future__ import annotations

from soak.chaos import ChaosConfig, run_chaos

# Short requests so the run drains in a second or two; the rate keeps dozens in flight at every kill.
SHORT = dict(duration=12.0, rate=25.0, max_tokens=(64, 512), request_deadline=60.0, recovery_timeout=20.0)


def _assert_clean(result: dict) -> None:
    statuses = result["requests"]["statuses"]
    assert result["checks"] == {k: True for k in result["checks"]}, (
        result["checks"],
        result["problems"],
        result["events"],
    )
    assert statuses["completed"] > 0 and statuses["aborted"] > 0, statuses  # the mix really ran
    assert {k: n for k, n in statuses.items() if k not in ("completed", "aborted") and n} == {}, (
        statuses,
        result["requests"]["errors"],
    )
    assert all(e["in_flight"] > 0 for e in result["events"] if e["kind"].endswith("_kill")), result["events"]


async def test_mixed_load_through_a_worker_kill_9_and_restart_loses_and_repeats_nothing(tmp_path):
    result = await run_chaos(
        ChaosConfig(**SHORT, worker_kills=[4.0], pauses=[8.0], coordinator_kill_at=None, logs=tmp_path)
    )
    assert [e["kind"] for e in result["events"]] == ["worker_kill", "pause"]
    _assert_clean(result)


async def test_mixed_load_through_a_coordinator_kill_9_and_restart_loses_and_repeats_nothing(tmp_path):
    """Needs the "Coordinator restart" feature: without it the requests in flight at the kill are lost."""
    result = await run_chaos(
        ChaosConfig(**SHORT, worker_kills=[3.0], pauses=[9.0], coordinator_kill_at=6.0, logs=tmp_path)
    )
    assert [e["kind"] for e in result["events"]] == ["worker_kill", "coordinator_kill", "pause"]
    _assert_clean(result)
