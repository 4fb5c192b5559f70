"""The worker's decisions frame by frame, no socket and no subprocess (tests/worker_harness.py): registration and
re-registration, silenced aborts, drain, duplicate and refused dispatches, the lifecycle table, bad frames,
liveness timers. test_daemon.py keeps the same behaviour covered through a real process."""

from __future__ import annotations

import msgpack
import pytest

from infer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Control,
    ControlAck,
    Error,
    Heartbeat,
    Hello,
    Refused,
    StepBatch,
    UpdateWeights,
    WeightsUpdated,
    encode,
)
from infer.worker.service.core import EXIT_FATAL, EXIT_OK, EXIT_REFUSED, WorkerExit
from infer.worker.service.lifecycle import TABLE, Action, WorkerState, transition
from tests.worker_harness import WorkerHarness, deltas, dispatch, heartbeats, of_type


@pytest.fixture
def h() -> WorkerHarness:
    harness = WorkerHarness()
    assert isinstance(harness.out()[0], Hello)  # the first Hello goes out at start
    harness.welcome()
    return harness


def tokens(ds) -> list[int]:
    return [t for d in ds for t in d.token_ids]


# ---- registration -------------------------------------------------------------------------------------


def test_a_worker_under_a_served_name_says_where_its_tokenizer_is(tmp_path):
    """Hello.tokenizer: the model directory, absolute, only when the served name is not the model's path (a front
    reads the model's tokenizer there); a worker named by its path sends no new field."""
    plain = WorkerHarness()
    plain.engine.model_path = tmp_path
    plain.core.take_outgoing()
    plain.core.start(plain.now)  # says hello again, with model_path now set
    (hello,) = of_type(plain.out(), Hello)
    assert hello.tokenizer is None and b"tokenizer" not in encode(hello)
    named = WorkerHarness(served_model_name="qwen-b")
    named.engine.model_path = tmp_path / "." / "m" / ".."
    named.core.take_outgoing()
    named.core.start(named.now)
    (hello,) = of_type(named.out(), Hello)
    assert (hello.model_id, hello.tokenizer) == ("qwen-b", str(tmp_path))


def test_start_says_hello_and_no_welcome_in_time_is_fatal():
    h = WorkerHarness(connect_timeout=5.0)
    (hello,) = h.out()
    assert isinstance(hello, Hello) and hello.peer_id == "w-test" and hello.running == [] and hello.max_waiting == 1024
    assert h.core.poll_timeout(h.now) == 5.0  # nothing to do before the connect deadline
    h.advance(4.9)
    with pytest.raises(WorkerExit) as e:
        h.advance(0.1)
    assert e.value.code == EXIT_FATAL and "no Welcome" in str(e.value)


def test_refused_ends_the_worker_with_exit_3():
    h = WorkerHarness()
    with pytest.raises(WorkerExit) as e:
        h.send(Refused(reason="wrong model"))
    assert e.value.code == EXIT_REFUSED and "wrong model" in str(e.value)


def test_welcome_gives_the_rank_and_a_second_welcome_changes_nothing():
    h = WorkerHarness()
    h.welcome(dp_rank=3)
    assert (h.core.rank, h.core.group_id, h.core.ever_welcomed) == (3, "dp3", True)
    h.welcome(dp_rank=5)  # no Hello was sent since: a stray duplicate
    assert h.core.rank == 3


def test_reregistration_after_a_coordinator_restart_carries_each_stream(h):
    h.send(dispatch("a", [1, 2, 3], max_tokens=6))
    h.send(dispatch("b", [7, 8], max_tokens=6))
    first = deltas(h.step()) + deltas(h.step())
    assert tokens([d for d in first if d.request_id == "a"]) == [3, 4]
    assert h.core._dispatches_seen == 2
    out = h.send(Heartbeat(sent_at=0.0, instance="coord-2"))  # a new coordinator process
    (hello,) = of_type(out, Hello)
    assert hello.running == ["a", "b"] and hello.rank_hint == 0 and hello.dispatches_seen == 2
    snap = {s.request_id: s for s in hello.snapshots}
    assert list(snap["a"].token_ids) == [3, 4] and snap["a"].delta_ends == [1, 2]
    assert list(snap["a"].prompt_token_ids) == [1, 2, 3] and list(snap["b"].token_ids) == [2, 3]
    # running requests keep going while the new coordinator answers
    assert tokens(deltas(h.step())) == [5, 4]
    h.welcome(instance="coord-2")
    assert h.core._dispatches_seen == 0  # counted afresh for the new instance
    assert h.send(Heartbeat(sent_at=0.0, instance="coord-2")) == []  # the same instance again: nothing


def test_coordinator_silence_registers_again_unless_frames_wait(h):
    h.advance(9.0)
    assert not of_type(h.out(), Hello)
    h.core.tick(h.now + 1.0, inbox_empty=False)  # a long step's frames are queued: not silence
    assert not of_type(h.out(), Hello)
    (hello,) = of_type(h.advance(1.0), Hello)
    assert hello.rank_hint == 0


def test_unknown_worker_error_says_hello_once_per_heartbeat_interval(h):
    assert of_type(h.send(Error(message="unknown worker w-test")), Hello)
    assert not of_type(h.send(Error(message="unknown worker w-test")), Hello)  # crossed the restart
    h.advance(1.0)
    assert of_type(h.send(Error(message="unknown worker w-test")), Hello)
    assert not of_type(h.send(Error(message="request x is unknown")), Hello)


def test_heartbeat_each_interval_with_the_load(h):
    h.send(dispatch("a", max_tokens=50))
    assert heartbeats(h.advance(0.5)) == []
    (beat,) = heartbeats(h.advance(0.5))
    assert beat.load.num_waiting + beat.load.num_running == 1 and beat.sent_at == pytest.approx(1e9 + 1.0)
    assert h.core.poll_timeout(h.now) == 0.0  # the engine has work


def test_the_engines_load_goes_out_with_the_step(h):
    h.send(dispatch("a", max_tokens=50))
    (batch,) = of_type(h.step(), StepBatch)
    assert batch.load == h.engine.load() and batch.load.num_running == 1


def test_beat_during_step_reports_the_step_age(h):
    h.core.beat_during_step(h.now + 0.5, step_started=h.now)
    assert h.out() == []  # an interval has not passed since the last frame
    h.core.beat_during_step(h.now + 2.5, step_started=h.now)
    (beat,) = h.out()
    assert isinstance(beat, Heartbeat) and beat.step_age_s == 2.5


# ---- requests -----------------------------------------------------------------------------------------


def test_a_text_prompt_is_echoed_once_and_the_stream_ends_with_length(h):
    h.send(dispatch("a", "abc", max_tokens=3))
    ds = h.run_until_finished()
    assert tokens(ds) == [3, 4, 5] and ds[-1].finish_reason == "length"
    assert list(ds[0].prompt_token_ids) == [97, 98, 99] and all(d.prompt_token_ids is None for d in ds[1:])
    assert h.core.num_requests == 0


def test_a_token_id_prompt_is_never_echoed_its_client_has_it(h):
    h.send(dispatch("a", [1, 2, 3], max_tokens=3))
    h.send(dispatch("b", [1, 2, 3], max_tokens=3, resumed=[3]))  # a re-dispatch: the ids it was given
    ds = h.run_until_finished()
    assert tokens([d for d in ds if d.request_id == "a"]) == [3, 4, 5]
    assert all(d.prompt_token_ids is None for d in ds) and {d.request_id for d in ds} == {"a", "b"}
    assert all(d.num_prompt_tokens == 3 for d in ds)  # usage counts do not need the echo


def test_a_resumed_dispatch_counts_its_resumed_tokens_toward_max_tokens(h):
    h.send(dispatch("a", [1, 2, 3], max_tokens=5, resumed=[3, 4]))
    ds = h.run_until_finished()
    assert tokens(ds) == [5, 6, 7] and ds[-1].finish_reason == "length"
    h.send(dispatch("b", [1, 2, 3], max_tokens=2, resumed=[3, 4]))
    (d,) = deltas(h.step())
    assert d.error_code == "invalid_request" and "the resumed tokens (2) reach max_tokens (2)" in d.error


def test_duplicate_dispatch_is_refused_and_the_first_goes_on(h):
    h.send(dispatch("a", max_tokens=3))
    h.send(dispatch("a", max_tokens=3))
    first = deltas(h.step())
    error = [d for d in first if d.finish_reason == "error"]
    assert len(error) == 1 and error[0].error_code == "internal" and "already running" in error[0].error
    ds = first + h.run_until_finished()
    assert tokens([d for d in ds if d.finish_reason != "error"]) == [3, 4, 5]


def test_dispatch_past_the_waiting_bound_is_overloaded():
    h = WorkerHarness(max_num_seqs=1, max_waiting_requests=1)
    h.welcome()
    for rid in "abc":
        h.send(dispatch(rid, max_tokens=2))
    (refused,) = [d for d in deltas(h.step()) if d.finish_reason == "error"]
    assert refused.request_id == "c" and refused.error_code == "overloaded"


def test_invalid_dispatch_fails_alone(h):
    h.send(dispatch("a", list(range(1, 70))))  # longer than the 64-token context
    (d,) = deltas(h.step())
    assert d.error_code == "invalid_request" and d.finished and d.prompt_token_ids is None


def test_abort_is_silenced_and_frees_the_id_at_once(h):
    h.send(dispatch("a", max_tokens=10))
    h.step()
    out = h.send(Abort(request_ids=["a", "never-seen"]))
    assert out == [] and h.core.num_requests == 0
    (batch,) = of_type(h.step(), StepBatch)  # no final delta, but the freed blocks are told
    assert batch.deltas == [] and batch.load.num_running == 0
    h.send(dispatch("a", [1, 2, 3], max_tokens=2))  # the same id may come back at once
    assert tokens(h.run_until_finished()) == [3, 4]


def test_two_aborts_of_one_id_between_steps_drop_both_deltas_and_keep_the_third_dispatch(h):
    """Abort, dispatch, abort, dispatch of one id queued during a long step (a client re-attaching twice): both
    aborts' deltas are dropped, and the request running now stays tracked and finishes."""
    h.send(dispatch("a", max_tokens=10))
    h.step()
    for _ in range(2):
        h.send(Abort(request_ids=["a"]))
        h.send(dispatch("a", [1, 2, 3], max_tokens=2))
    assert h.core.num_requests == 1
    out = h.run_until_finished()
    assert tokens(out) == [3, 4] and [d.finish_reason for d in out if d.finished] == ["length"]


# ---- drain ---------------------------------------------------------------------------------------------


def test_drain_refuses_new_work_lets_running_finish_then_exits(h):
    h.send(dispatch("a", max_tokens=3))
    h.core.signals += 1
    h.send(dispatch("b", max_tokens=3))  # a signal that came before this frame wins
    assert h.core.state_name() == "draining" and not h.core.drained(h.now)
    ds = h.run_until_finished()
    (refused,) = [d for d in ds if d.request_id == "b"]
    assert refused.error_code == "draining" and refused.error == "worker is draining"
    assert tokens([d for d in ds if d.request_id == "a"]) == [3, 4, 5] and ds[-1].finish_reason == "length"
    assert h.core.drained(h.now)


def test_drain_timeout_and_second_signal_give_the_rest_back(h):
    h.send(dispatch("a", max_tokens=50))
    h.step()
    h.core.signals += 1
    h.advance(1.0)
    assert not h.core.drained(h.now) and h.core.poll_timeout(h.now) == 0.0
    h.core.signals += 1  # the second signal ends the drain now
    h.core.check_signals(h.now)
    assert h.core.drained(h.now)
    (final,) = deltas(h.out())
    assert final.finish_reason == "abort" and final.request_id == "a"


def test_the_coordinators_drain_worker_drains_as_a_signal_does_and_one_for_another_worker_is_refused(h):
    from infer.protocol.messages import DrainWorker, Error

    h.send(dispatch("a", max_tokens=3))
    (refusal,) = [m for m in h.send(DrainWorker(worker_id="w-other")) if isinstance(m, Error)]
    assert refusal.message == "drain_worker names 'w-other'; this is 'w-test'" and not h.core.draining
    h.send(DrainWorker(worker_id="w-test"))
    assert h.core.state_name() == "draining"
    h.send(dispatch("b", max_tokens=3))
    ds = h.run_until_finished()
    (refused,) = [d for d in ds if d.request_id == "b"]
    assert refused.error_code == "draining"
    assert tokens([d for d in ds if d.request_id == "a"]) == [3, 4, 5] and ds[-1].finish_reason == "length"
    assert h.core.drained(h.now)


def test_drain_deadline():
    h = WorkerHarness(drain_timeout=5.0)
    h.welcome()
    h.send(dispatch("a", max_tokens=50))
    h.core.signals += 1
    h.step()
    assert not h.core.drained(h.now + 4.9)
    assert h.core.drained(h.now + 5.0)
    assert deltas(h.out())[-1].finish_reason == "abort"


# ---- lifecycle -----------------------------------------------------------------------------------------


def test_the_lifecycle_table_covers_every_state_and_command():
    live = (WorkerState.RUNNING, WorkerState.PAUSED, WorkerState.SUSPENDED)
    assert set(TABLE) == {(s, c) for s in live for c in ("pause", "unpause", "suspend", "resume", "stop")}
    for state in live:  # a worker obeys the last command, from any state
        assert transition(state, "pause").state is WorkerState.PAUSED
        assert transition(state, "unpause").state is WorkerState.RUNNING
        assert transition(state, "suspend").actions == (Action.SUSPEND_ENGINE,)
        assert transition(state, "resume").state is WorkerState.PAUSED
        assert transition(state, "stop").actions == (Action.ABORT_ALL, Action.EXIT)


def test_pause_holds_steps_and_each_command_is_acked_after_a_heartbeat(h):
    h.send(dispatch("a", max_tokens=3))
    out = h.send(Control(command="pause"))
    assert [type(m) for m in out] == [Heartbeat, ControlAck] and out[1].state == "paused"
    assert not h.core.wants_step() and deltas(h.step()) == []
    (ack,) = of_type(h.send(Control(command="suspend")), ControlAck)
    assert ack.state == "suspended" and ack.bytes_released == 0  # BenchmarkEngine holds no memory
    (ack,) = of_type(h.send(Control(command="resume")), ControlAck)
    assert ack.state == "paused"
    (ack,) = of_type(h.send(Control(command="unpause")), ControlAck)
    assert ack.state == "running"
    assert tokens(h.run_until_finished()) == [3, 4, 5]


def test_stop_gives_everything_back_then_exits_0(h):
    h.send(dispatch("a", max_tokens=50))
    h.step()
    with pytest.raises(WorkerExit) as e:
        h.send(Control(command="stop"))
    assert e.value.code == EXIT_OK and e.value.leave_group == "stopped by the coordinator"
    batch, ack = h.out()
    assert batch.deltas[0].finish_reason == "abort" and ack.state == "stopped"


def test_an_engine_that_cannot_suspend_keeps_its_state(h):
    def broken() -> int:
        raise RuntimeError("no memory")

    h.engine.suspend = broken
    (ack,) = h.send(Control(command="suspend"))
    assert ack.state == "running" and "no memory" in ack.error and h.core.state is WorkerState.RUNNING


def test_refit_on_an_engine_without_weights_is_refused(h):
    (answer,) = h.send(UpdateWeights(version=2, path="/nowhere"))
    assert isinstance(answer, WeightsUpdated) and "no weights" in answer.error


# ---- frames --------------------------------------------------------------------------------------------


def test_bad_frames_get_an_error_and_a_bad_dispatch_fails_its_request(h):
    (error,) = h.raw([b"a", b"b"])
    assert isinstance(error, Error) and "one frame per message" in error.message
    (error,) = h.raw([b"\xc1"])
    assert isinstance(error, Error) and "msgpack" in error.message
    bad = msgpack.packb({"type": "dispatch", "v": PROTOCOL_VERSION, "body": {"request_id": "r1", "sampling": 7}})
    assert h.raw([bad]) == []
    (d,) = deltas(h.step())
    assert d.request_id == "r1" and d.error_code == "invalid_request" and d.error.startswith("bad dispatch")
    (error,) = h.send(Hello(role="client", peer_id="x"))
    assert "does not handle 'hello'" in error.message
