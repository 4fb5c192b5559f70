"""The coordinator's logic, driven by hand: frames in, decoded messages out, a clock the test moves.

Handshake and refusals, routing a burst, relaying deltas, failover with resumed tokens (no gap, no
repeat), retries running out, re-registration, client death, client abort, the lifecycle, stats that
wait for workers, malformed frames. Every message the core emits goes through the codec.
"""

from __future__ import annotations

import msgpack
import msgspec
import pytest
from core_harness import MODEL, Harness, client_deltas, delta, dispatches, worker_hello

from infer.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    ClusterStats,
    Control,
    ControlAck,
    Delta,
    Error,
    Heartbeat,
    Load,
    Message,
    Refused,
    RequestSpec,
    StatsRequest,
    StepBatch,
    TokenIds,
    Welcome,
    encode,
)
from infer.protocol.sampling import SamplingParams


def of_type(out: list[tuple[bytes, Message]], kind: type, to: bytes | None = None) -> list[Message]:
    return [m for identity, m in out if isinstance(m, kind) and (to is None or identity == to)]


C1, C2 = b"client-1", b"client-2"
W0, W1 = b"w0", b"w1"


def two_workers(**options) -> Harness:
    h = Harness(**options)
    h.worker("w0", 0)
    h.worker("w1", 1)
    return h


# ---- handshake -------------------------------------------------------------------------------------


def test_worker_is_welcomed_and_the_first_model_id_is_the_clusters():
    h = Harness()
    out = h.worker("w0", 0)
    (welcome,) = of_type(out, Welcome, W0)
    assert welcome.model_id == MODEL and welcome.state == "running"
    # a worker of another model joins too (tests/coordinator/test_models.py); Welcome still names the first's
    (welcome,) = of_type(h.worker("w1", 1, model="other"), Welcome, W1)
    assert welcome.model_id == MODEL and welcome.dp_rank == 1


def test_model_id_flag_wins_over_the_first_worker():
    h = Harness(model_id="wanted")
    (refused,) = of_type(h.worker("w0", 0), Refused, W0)
    assert "from --model-id" in refused.reason and "'wanted'" in refused.reason


def test_protocol_version_and_duplicate_rank_are_refused_with_what_differs():
    h = Harness()
    h.worker("w0", 0)
    other = PROTOCOL_VERSION + 1
    (refused,) = of_type(h.send(b"x", worker_hello("x", 3, protocol_version=other)), Refused)
    assert "protocol version differs" in refused.reason and f"speaks {PROTOCOL_VERSION}" in refused.reason
    assert f"speaks {other}" in refused.reason
    (refused,) = of_type(h.worker("w9", 0), Refused)
    assert "duplicate dp_rank 0" in refused.reason and "'w0'" in refused.reason
    # a hello with a schema version the coordinator cannot read is refused too (not just an error)
    frame = msgpack.packb({"type": "hello", "v": 9, "body": {}})
    (refused,) = of_type(h.raw(b"y", [frame]), Refused)
    assert "schema version 9" in refused.reason
    # a worker of the previous protocol (3: before the msgspec Structs) hears which version this side speaks
    old = msgpack.packb(
        {
            "type": "hello",
            "v": 3,
            "body": {
                "role": "worker",
                "peer_id": "old",
                "model_id": MODEL,
                "num_kv_blocks": 10,
                "block_size": 16,
                "max_num_seqs": 4,
                "max_model_len": 64,
            },
        }
    )
    (refused,) = of_type(h.raw(b"old", [old]), Refused)
    assert f"schema version 3 of 'hello' is not supported (this side speaks {PROTOCOL_VERSION})" in refused.reason
    assert PROTOCOL_VERSION == 5


def test_a_dead_ranks_replacement_is_accepted():
    h = two_workers()
    h.core.peer_gone(W0, h.now)
    h.out()
    assert of_type(h.worker("w0-new", 0), Welcome)
    assert [w.worker_id for w in h.core.workers] == ["w1", "w0-new"]  # the dead record is superseded
    # the old one comes back to life: it is told to register again (and will find its rank taken)
    (err,) = of_type(h.send(W0, Heartbeat(sent_at=0.0)), Error, W0)
    assert err.message.startswith("unknown worker")
    assert "duplicate dp_rank 0" in of_type(h.worker("w0", 0), Refused)[0].reason


def _assigned(out: list[tuple[bytes, Message]], to: bytes) -> tuple[int | None, str | None]:
    (welcome,) = of_type(out, Welcome, to)
    return welcome.dp_rank, welcome.group_id


def test_workers_without_a_rank_get_the_lowest_free_one():
    h = Harness()
    assert _assigned(h.worker("a", None), b"a") == (0, "dp0")
    assert _assigned(h.worker("b", None), b"b") == (1, "dp1")
    assert _assigned(h.worker("c", 3), b"c") == (3, "dp3")  # an explicit rank is honoured
    assert _assigned(h.worker("d", None), b"d") == (2, "dp2")  # the gap below it is filled
    assert _assigned(h.worker("e", None), b"e") == (4, "dp4")
    assert sorted(w.dp_rank for w in h.core.workers) == [0, 1, 2, 3, 4]
    assert "duplicate dp_rank 1" in of_type(h.worker("f", 1), Refused)[0].reason  # explicit duplicates: refused


def test_an_assigned_worker_keeps_its_rank_when_it_registers_again():
    h = Harness()
    h.worker("a", None)
    h.worker("b", None)
    assert _assigned(h.worker("b", None), b"b") == (1, "dp1")  # again while live (coordinator silent)
    h.core.peer_gone(b"b", h.now)
    h.out()
    assert _assigned(h.worker("b", None), b"b") == (1, "dp1")  # back after a partition
    h.core.peer_gone(b"a", h.now)
    h.out()
    assert _assigned(h.worker("new", None), b"new") == (0, "dp0")  # a dead rank's replacement takes it
    assert [w.worker_id for w in h.core.workers] == ["b", "new"]  # and supersedes the dead record


def test_a_restarted_coordinator_gives_workers_back_their_ranks_when_free():
    h = Harness()  # a new coordinator process
    assert _assigned(h.send(b"b", worker_hello("b", None, rank_hint=1)), b"b") == (1, "dp1")
    assert _assigned(h.send(b"x", worker_hello("x", None)), b"x") == (0, "dp0")
    assert _assigned(h.send(b"a", worker_hello("a", None, rank_hint=0)), b"a") == (2, "dp2")  # taken meanwhile


def test_ep_members_without_ranks_get_distinct_ranks_in_their_group():
    h = Harness()
    assert _assigned(h.worker("m0", None, group="ep-h:1"), b"m0") == (0, "ep-h:1")
    assert _assigned(h.worker("m1", None, group="ep-h:1"), b"m1") == (1, "ep-h:1")
    assert {w.group_id for w in h.core.workers} == {"ep-h:1"}


# ---- routing and relaying --------------------------------------------------------------------------


def test_a_burst_spreads_before_any_load_report():
    h = two_workers()
    out = []
    for i in range(100):
        out += h.submit(C1, f"r{i}")
    counts = {w: len(d) for w, d in dispatches(out).items()}
    assert counts == {W0: 50, W1: 50}


def test_least_loaded_follows_the_reports():
    h = two_workers()
    h.submit(C1, "a")
    h.submit(C1, "b")
    h.step("w0", delta("a", 5, prompt=[1, 2, 3]), free=10)  # w0 reports a nearly full pool
    h.step("w1", delta("b", 5, prompt=[1, 2, 3]), free=99)
    out = []
    for i in range(4):
        out += h.submit(C1, f"n{i}")
    assert set(dispatches(out)) == {W1}


def test_deltas_are_relayed_and_the_request_is_forgotten_when_finished():
    h = two_workers()
    (d,) = dispatches(h.submit(C1, "r", prompt="hello world", max_tokens=3))[W0]
    assert d.spec.prompt == "hello world" and d.spec.sampling.max_tokens == 3 and not d.resumed_token_ids
    out = h.step("w0", delta("r", 7, prompt=[11, 12]), free=90)
    (first,) = client_deltas(out, C1)
    assert first.token_ids == [7] and first.prompt_token_ids == [11, 12]
    out = h.step("w0", delta("r", 8), delta("r", 9, finish="length"))
    assert [x.token_ids for x in client_deltas(out, C1)] == [[8], [9]]
    assert h.core.requests.get("r") is None and h.core.stats(h.now).requests_completed == 1


def test_pinned_request_goes_to_its_rank_or_fails_clearly():
    h = two_workers()
    assert set(dispatches(h.submit(C1, "p", pin_rank=1))) == {W1}
    (final,) = client_deltas(h.submit(C1, "q", pin_rank=7), C1)
    assert final.finish_reason == "error" and "pinned to dp_rank 7" in final.error and "0, 1" in final.error


def test_duplicate_request_id_is_an_error_for_that_request():
    h = two_workers()
    h.submit(C1, "r")
    (err,) = of_type(h.submit(C1, "r"), Error, C1)
    assert err.request_id == "r" and "already in flight" in err.message


def test_no_worker_yet_means_the_request_waits_then_runs():
    h = Harness()
    assert not dispatches(h.submit(C1, "early"))
    assert set(dispatches(h.worker("w0", 0))) == {W0}


def test_queue_timeout_fails_a_request_nobody_can_run():
    h = Harness(queue_timeout=0.5)
    h.submit(C1, "lonely")
    out = h.advance(0.3) + h.advance(0.3)
    (final,) = client_deltas(out, C1)
    assert final.finish_reason == "error" and "queue timeout" in final.error


# ---- failover --------------------------------------------------------------------------------------


def _run_until_three_tokens(h: Harness) -> None:
    h.submit(C1, "r", prompt="some prompt", max_tokens=10, min_tokens=5)
    h.step("w0", delta("r", 7, prompt=[11, 12]))
    h.step("w0", delta("r", 8))
    h.step("w0", delta("r", 9))


def test_worker_death_resumes_the_stream_with_no_gap_and_no_repeat():
    h = two_workers()
    _run_until_three_tokens(h)
    h.core.peer_gone(W0, h.now)  # a send found w0's connection gone (kill -9)
    (d,) = dispatches(h.out())[W1]
    assert d.spec.prompt is None and d.spec.prompt_token_ids == [11, 12] and d.resumed_token_ids == [7, 8, 9]
    # the request's own SamplingParams: the engine counts the 3 resumed tokens toward max_tokens / min_tokens
    assert d.spec.sampling == SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5)
    # the new worker echoes prompt ids in its first delta: the client must not see them twice
    out = h.step("w1", delta("r", 10, prompt=[11, 12, 7, 8, 9]))
    (cont,) = client_deltas(out, C1)
    assert cont.token_ids == [10] and cont.prompt_token_ids is None and cont.num_prompt_tokens == 2
    # the dead worker's late frames are refused and its copy aborted
    out = h.step("w0", delta("r", 99))
    assert "unknown worker" in of_type(out, Error, W0)[0].message
    assert of_type(out, Abort, W0)[0].request_ids == ["r"]
    assert not client_deltas(out, C1)
    assert h.core.requests.get("r").journal.token_ids == [7, 8, 9, 10]


def test_a_continued_stream_reports_the_weight_version_that_computed_it():
    """The first delta from the new worker (it echoes the prompt, so the coordinator rewrites it) keeps its
    weight version: it was dropped there, so a stream that ended in that delta reported version 0."""
    h = two_workers()
    _run_until_three_tokens(h)
    h.core.peer_gone(W0, h.now)
    h.out()
    out = h.step(
        "w1",
        Delta(
            request_id="r",
            token_ids=TokenIds([10]),
            text="<10>",
            finished=True,
            finish_reason="length",
            prompt_token_ids=TokenIds([11, 12, 7, 8, 9]),
            weight_version=3,
        ),
    )
    (cont,) = client_deltas(out, C1)
    assert cont.weight_version == 3 and cont.prompt_token_ids is None and cont.finish_reason == "length"


def test_a_redispatch_carries_the_params_unchanged_and_routing_charges_only_what_is_left():
    h = two_workers()
    _run_until_three_tokens(h)  # max_tokens 10, min_tokens 5, 3 tokens delivered
    h.core.peer_gone(W0, h.now)
    (d,) = dispatches(h.out())[W1]
    assert (
        d.spec.sampling
        == h.core.requests.get("r").sampling
        == SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5)
    )
    assert h.core.workers.by_id["w1"].cost_in_flight == (2 + 3) + (10 - 3)  # prompt + resumed, then what is left
    # every token out, only the final delta lost with its worker: the request ends, nothing is dispatched
    h.submit(C1, "done", max_tokens=2, pin_rank=1)
    h.step("w1", delta("done", 4, prompt=[1, 2, 3]), delta("done", 5))
    h.core.peer_gone(W1, h.now)
    out = h.out() + h.worker("w2", 2)
    assert [x.finish_reason for x in client_deltas(out, C1) if x.request_id == "done"] == ["length"]
    assert all(x.request_id != "done" for ds in dispatches(out).values() for x in ds)


def test_an_unseeded_sampled_request_gets_a_seed_that_the_client_hears_and_the_redispatch_keeps():
    h = two_workers()
    out = h.submit(C1, "r", prompt="some prompt", temperature=1.0, max_tokens=10, stop=["xy"])
    (d0,) = dispatches(out)[W0]
    seed = d0.spec.sampling.seed
    assert isinstance(seed, int) and 0 <= seed < 2**63
    # the worker's first delta reports the seed it runs with; the client hears it once
    out = h.step(
        "w0", Delta(request_id="r", token_ids=TokenIds([7]), text="a", prompt_token_ids=TokenIds([11, 12]), seed=seed)
    )
    (d,) = client_deltas(out, C1)
    assert d.seed == seed and d.prompt_token_ids == [11, 12]
    h.step("w0", Delta(request_id="r", token_ids=TokenIds([8]), text=""))  # a character still incomplete
    h.step("w0", Delta(request_id="r", token_ids=TokenIds([9]), text="\u00e9"))  # its "x" held back: stop "xy"?
    h.core.peer_gone(W0, h.now)
    (d1,) = dispatches(h.out())[W1]
    assert d1.spec.sampling.seed == seed and d1.resumed_token_ids == [7, 8, 9]
    assert d1.resumed_text_len == len("a\u00e9") and d1.spec.sampling == d0.spec.sampling
    out = h.step(
        "w1", Delta(request_id="r", token_ids=TokenIds([10]), text="xz", prompt_token_ids=TokenIds([11, 12]), seed=seed)
    )
    (cont,) = client_deltas(out, C1)
    assert cont.seed is None and cont.prompt_token_ids is None and cont.token_ids == [10]


def test_seeds_are_kept_given_distinct_and_left_out_of_greedy_requests():
    h = two_workers()
    out = h.submit(C1, "s", temperature=0.7, seed=5)
    out += h.submit(C1, "g", temperature=0.0)
    out += h.submit(C1, "u1", temperature=1.0)
    out += h.submit(C1, "u2", temperature=1.0)
    sent = {d.request_id: d.spec.sampling for ds in dispatches(out).values() for d in ds}
    assert sent["s"].seed == 5 and sent["g"].seed is None
    assert sent["u1"].seed != sent["u2"].seed


def test_a_silent_worker_is_declared_dead_and_its_requests_move():
    h = two_workers()
    _run_until_three_tokens(h)
    out = []
    for _ in range(8):  # w1 keeps talking, w0 is hung
        h.send(W1, Heartbeat(sent_at=0.0))
        out += h.advance(0.15)
    assert [d.resumed_token_ids for d in dispatches(out)[W1]] == [[7, 8, 9]]
    assert not h.core.workers.by_id["w0"].healthy


def test_death_before_the_first_delta_resends_the_original_prompt():
    h = two_workers()
    h.submit(C1, "r", prompt="text")
    h.core.peer_gone(W0, h.now)
    (d,) = dispatches(h.out())[W1]
    assert d.spec.prompt == "text" and not d.resumed_token_ids


def test_a_request_whose_tokens_were_all_delivered_is_finished_not_resent():
    h = two_workers()
    h.submit(C1, "r", max_tokens=2)
    h.step("w0", delta("r", 4, prompt=[1, 2, 3]))
    h.step("w0", delta("r", 5))  # the last token, without its finish (not what workers do)
    h.core.peer_gone(W0, h.now)
    out = h.out()
    assert not dispatches(out)
    assert client_deltas(out, C1)[-1].finish_reason == "length"


def test_exhausted_retries_fail_the_request_with_a_clear_error():
    h = Harness(max_retries=1)
    for i in range(3):
        h.worker(f"w{i}", i)
    h.submit(C1, "r")
    h.core.peer_gone(W0, h.now)
    h.out()
    h.core.peer_gone(W1, h.now)
    final = [d for d in client_deltas(h.out(), C1) if d.finished]
    assert final[0].finish_reason == "error"
    assert "re-dispatched 1 time(s), the limit (--max-retries)" in final[0].error


def test_worker_that_gave_up_a_request_is_routed_around():
    h = two_workers()
    h.submit(C1, "r")
    h.step("w0", delta("r", 4, prompt=[1, 2, 3]))
    out = h.step("w0", Delta(request_id="r", token_ids=TokenIds([5]), text="x", finished=True, finish_reason="abort"))
    assert [x.token_ids for x in client_deltas(out, C1)] == [[5]]  # its last token still counts
    assert dispatches(out)[W1][0].resumed_token_ids == [4, 5]
    # a draining worker refuses new dispatches: they move, and it gets nothing new
    h.submit(C1, "s", pin_rank=0)
    out = h.step("w0", delta("s", finish="error", error="worker is draining", code="draining"))
    assert set(dispatches(out)) == {W1} and not client_deltas(out, C1)
    assert set(dispatches(h.submit(C1, "t"))) == {W1}


def test_reregistration_aborts_what_moved_and_keeps_what_it_still_owns():
    h = two_workers(worker_timeout=0.5)
    h.submit(C1, "a")  # -> w0
    h.submit(C1, "b")  # -> w1
    for _ in range(5):
        h.send(W1, Heartbeat(sent_at=0.0))
        h.advance(0.15)  # w0 silent: declared dead, "a" moves to w1
    assert h.core.requests.get("a").worker_id == "w1"
    out = h.worker("w0", 0, running=["a"])
    assert of_type(out, Abort, W0)[0].request_ids == ["a"] and of_type(out, Welcome, W0)
    # a live worker re-registering (it lost contact) keeps what it still runs; what it lost moves
    h.submit(C1, "c", pin_rank=1)
    out = h.worker("w1", 1, running=["a"])
    assert not of_type(out, Abort, W1)
    assert h.core.requests.get("a").worker_id == "w1"
    moved = [d for ds in dispatches(out).values() for d in ds]
    assert sorted(d.request_id for d in moved) == ["b", "c"] and not any(d.resumed_token_ids for d in moved)
    assert {w.worker_id: w.cost_in_flight for w in h.core.workers} == {
        w.worker_id: sum(h.core.requests.get(rid).charged for rid in w.requests) for w in h.core.workers
    }


def test_a_dead_group_member_takes_its_group_out_of_routing():
    h = Harness()
    h.worker("e0", 0, group="ep")
    h.worker("e1", 1, group="ep")
    h.worker("solo", 2)
    h.submit(C1, "r", pin_rank=1)
    h.core.peer_gone(b"e0", h.now)
    out = h.out()
    assert of_type(out, Abort, b"e1")[0].request_ids == ["r"]
    assert set(dispatches(out)) == {b"solo"}
    assert [w.healthy for w in h.core.stats(h.now).workers] == [False, False, True]


# ---- clients ---------------------------------------------------------------------------------------


def test_client_abort_ends_the_stream_and_frees_the_worker():
    h = two_workers()
    h.submit(C1, "r")
    out = h.send(C1, Abort(request_ids=["r", "unknown"]))
    (final,) = client_deltas(out, C1)
    assert final.finish_reason == "abort"
    assert of_type(out, Abort, W0)[0].request_ids == ["r"]
    assert not client_deltas(h.step("w0", delta("r", 1, prompt=[1])), C1)  # late deltas are dropped


def test_a_client_cannot_abort_another_clients_request():
    h = two_workers()
    h.submit(C1, "r")
    assert not h.send(C2, Abort(request_ids=["r"]))
    assert h.core.requests.get("r") is not None


def test_a_silent_client_loses_its_requests():
    h = two_workers()
    h.submit(C1, "a")
    h.submit(C1, "b")
    h.submit(C2, "c")
    out = []
    for _ in range(8):
        h.send(C2, Heartbeat(sent_at=0.0))
        h.send(W0, Heartbeat(sent_at=0.0))
        h.send(W1, Heartbeat(sent_at=0.0))
        out += h.advance(0.15)
    aborted = sorted(rid for m in of_type(out, Abort) for rid in m.request_ids)
    assert aborted == ["a", "b"] and h.core.requests.get("c") is not None
    assert h.core.stats(h.now).requests_aborted == 2


def test_an_unroutable_client_loses_its_requests_at_once():
    h = two_workers()
    h.submit(C1, "a")
    h.core.peer_gone(C1, h.now)
    assert of_type(h.out(), Abort, W0)[0].request_ids == ["a"]


def test_client_heartbeat_is_answered():
    h = Harness()
    assert of_type(h.send(C1, Heartbeat(sent_at=1.0)), Heartbeat, C1)


# ---- lifecycle -------------------------------------------------------------------------------------


def test_paused_requests_wait_then_run_on_unpause():
    h = two_workers()
    out = h.send(C1, Control(command="pause"))
    assert of_type(out, ControlAck, C1)[0].state == "paused"
    assert {m.command for m in of_type(out, Control)} == {"pause"} and len(of_type(out, Control)) == 2
    assert not dispatches(h.submit(C1, "r1") + h.submit(C1, "r2"))
    assert h.core.stats(h.now).num_held == 2
    out = []
    for _ in range(60):  # a pause, however long, does not time requests out
        for peer in (C1, W0, W1):
            h.send(peer, Heartbeat(sent_at=0.0))
        out += h.advance(0.15)
    assert not client_deltas(out, C1) and h.core.stats(h.now).num_held == 2
    out = h.send(C1, Control(command="unpause"))
    assert sum(len(d) for d in dispatches(out).values()) == 2


def test_refused_commands_say_why():
    h = two_workers()
    (err,) = of_type(h.send(C1, Control(command="suspend")), Error, C1)
    assert "pause it first" in err.message
    h.send(C1, Control(command="pause"))
    assert not of_type(h.send(C1, Control(command="suspend")), ControlAck, C1)  # answered once the workers did
    h.send(W0, ControlAck(command="suspend", state="suspended", bytes_released=100))
    (ack,) = of_type(h.send(W1, ControlAck(command="suspend", state="suspended", bytes_released=20)), ControlAck, C1)
    assert ack.state == "suspended" and ack.bytes_released == 120
    (err,) = of_type(h.send(C1, Control(command="unpause")), Error, C1)
    assert "resume it first" in err.message
    h.send(C1, Control(command="resume"))
    h.send(W0, ControlAck(command="resume", state="paused", bytes_restored=100))
    assert of_type(h.send(W1, ControlAck(command="resume", state="paused")), ControlAck, C1)[0].state == "paused"


def test_a_suspend_answers_when_a_worker_fails_or_stays_silent():
    h = two_workers()
    h.send(C1, Control(command="pause"))
    h.send(C1, Control(command="suspend"))
    h.send(W0, ControlAck(command="suspend", state="paused", error="RuntimeError: no"))
    (ack,) = of_type(h.advance(301.0), ControlAck, C1)
    assert "worker w0: RuntimeError: no" in ack.error and "w1" in ack.error


def test_a_worker_joining_a_paused_cluster_is_paused_too():
    h = Harness()
    h.send(C1, Control(command="pause"))
    h.send(C1, Control(command="suspend"))
    out = h.worker("w0", 0)
    assert of_type(out, Welcome)[0].state == "suspended"
    assert [m.command for m in of_type(out, Control, W0)] == ["pause", "suspend"]


def test_stop_fails_pending_requests_tells_workers_and_finishes():
    h = two_workers()
    h.submit(C1, "running")
    h.send(C1, Control(command="pause"))
    h.submit(C2, "held")
    out = h.send(C2, Control(command="stop"))
    finals = client_deltas(out, C1) + client_deltas(out, C2)
    assert {d.request_id for d in finals} == {"running", "held"}
    assert all(d.finish_reason == "error" and "the cluster was stopped" in d.error for d in finals)
    assert len([m for m in of_type(out, Control) if m.command == "stop"]) == 2
    assert of_type(out, ControlAck, C2)[0].state == "stopped"
    (err,) = of_type(h.submit(C1, "late"), Error, C1)
    assert "stopping" in err.message
    assert not h.core.done(h.now)
    h.send(W0, ControlAck(command="stop", state="stopped"))
    h.send(W1, ControlAck(command="stop", state="stopped"))
    assert h.core.done(h.now)


def test_stop_does_not_wait_forever_for_acks():
    h = two_workers(stop_timeout=0.5)
    h.core.shutdown("signal SIGTERM", h.now)
    assert not h.core.done(h.now)
    h.now += 0.6
    assert h.core.done(h.now)


def test_signal_with_a_drain_timeout_lets_accepted_requests_finish_then_stops():
    h = two_workers(drain_timeout=5.0)
    out = h.submit(C1, "a") + h.submit(C1, "b")
    worker_of = {d.request_id: identity for identity, ds in dispatches(out).items() for d in ds}
    h.core.on_signal("signal SIGTERM", h.now)
    (err,) = of_type(h.submit(C2, "late"), Error, C2)
    assert err.code == "unavailable" and "draining to stop" in err.message
    out = h.step(worker_of["a"].decode(), delta("a", 7, prompt=[1, 2, 3], finish="length"))
    assert [d.finish_reason for d in client_deltas(out, C1)] == ["length"]
    assert not of_type(out, Control)  # "b" still runs: no STOP yet
    out = h.step(worker_of["b"].decode(), delta("b", 8, prompt=[1, 2, 3], finish="length"))
    assert [d.finish_reason for d in client_deltas(out, C1)] == ["length"]
    assert len([m for m in of_type(out, Control) if m.command == "stop"]) == 2  # drained: STOP at once


def test_drain_timeout_expires_into_stop_and_a_second_signal_stops_at_once():
    h = two_workers(drain_timeout=2.0, worker_timeout=10.0, client_timeout=10.0)
    h.submit(C1, "slow")
    h.core.on_signal("signal SIGTERM", h.now)
    assert not of_type(h.advance(1.0), Control)
    out = h.advance(1.1)
    (final,) = client_deltas(out, C1)
    assert final.finish_reason == "error" and "the cluster was stopped" in final.error
    assert len([m for m in of_type(out, Control) if m.command == "stop"]) == 2
    h2 = two_workers(drain_timeout=30.0)
    h2.submit(C1, "r")
    h2.core.on_signal("signal SIGTERM", h2.now)
    h2.core.on_signal("signal SIGINT", h2.now)
    assert len([m for m in of_type(h2.out(), Control) if m.command == "stop"]) == 2


def test_drain_timeout_must_not_be_negative():
    with pytest.raises(ValueError, match="drain_timeout must be a number of seconds >= 0"):
        Harness(drain_timeout=-1)


# ---- stats -----------------------------------------------------------------------------------------


def test_stats_report_workers_and_counts():
    h = two_workers()
    h.submit(C1, "r")
    h.step("w0", delta("r", 1, prompt=[1]), free=80)
    (stats,) = of_type(h.send(C1, StatsRequest()), ClusterStats, C1)
    w0 = stats.workers[0]
    assert (w0.worker_id, w0.dp_rank, w0.healthy, w0.requests_routed, w0.num_in_flight) == ("w0", 0, True, 1, 1)
    assert w0.load.num_free_blocks == 80 and stats.workers[1].load is None
    assert stats.num_in_flight == 1 and stats.requests_submitted == 1 and stats.state == "running"


def test_stats_can_wait_for_workers():
    h = Harness()
    assert not h.send(C1, StatsRequest(min_healthy_workers=2, timeout_s=5.0))
    assert not of_type(h.worker("w0", 0), ClusterStats)
    (stats,) = of_type(h.worker("w1", 1), ClusterStats, C1)
    assert stats.num_healthy_workers == 2
    h.send(C1, StatsRequest(min_healthy_workers=3, timeout_s=0.2))
    h.send(W0, Heartbeat(sent_at=0.0))
    (late,) = of_type(h.advance(0.3), ClusterStats, C1)
    assert late.num_healthy_workers == 2


# ---- malformed input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, text",
    [
        ([b"\xc1"], "not valid msgpack"),
        ([encode(Heartbeat(sent_at=0.0)), b"x"], "exactly one frame"),
        (
            [msgpack.packb({"type": "submit", "v": PROTOCOL_VERSION, "body": {"request_id": 5}})],
            "field 'request_id': Expected `str`, got `int`",
        ),
        ([encode(Welcome(coordinator_id="x", state="running"))], "does not accept 'welcome'"),
        (
            [
                encode(
                    StepBatch(
                        deltas=[],
                        load=Load(
                            num_waiting=0, num_running=0, num_free_blocks=0, num_total_blocks=0, num_queued_tokens=0
                        ),
                    )
                )
            ],
            "unknown worker",
        ),
    ],
)
def test_malformed_frames_get_an_error_and_change_nothing(frames, text):
    h = two_workers()
    (err,) = of_type(h.raw(C1, frames), Error, C1)
    assert text in err.message
    assert h.core.stats(h.now).frames_rejected >= (0 if "unknown worker" in text else 1)
    assert set(dispatches(h.submit(C1, "ok"))) <= {W0, W1}


def _submit_frame(rid, sampling) -> bytes:
    return msgpack.packb(
        {
            "type": "submit",
            "v": PROTOCOL_VERSION,
            "body": {"request_id": rid, "spec": {"prompt": "x", "sampling": sampling}},
        }
    )


@pytest.mark.parametrize(
    "sampling, text",
    [
        ({"temperature": 0.0, "top_p": 1.5}, "field 'spec.sampling.top_p': top_p must be in (0, 1]"),
        ({"max_tokens": 2**64 - 1}, "field 'spec.sampling.max_tokens': max_tokens must fit in 64 bits"),
        ({"stop": {"a": 1}}, "field 'spec.sampling.stop': Expected `array`, got `object`"),
        (
            {"structured_outputs": {"choice": "ab"}},
            "field 'spec.sampling.structured_outputs.choice': Expected `array | null`",
        ),
        ({"logit_bias": [[1, 2, 3]]}, "field 'spec.sampling.logit_bias[0]': Expected `array` of length 2"),
        ({"temperature": 0.0, "teperature": 1}, "field 'spec.sampling': Object contains unknown field `teperature`"),
        ("hot", "field 'spec.sampling': Expected `object`, got `str`"),
    ],
)
def test_a_submit_with_bad_sampling_fails_that_request_alone_naming_the_field(sampling, text):
    h = two_workers()
    ((worker, (running,)),) = dispatches(h.submit(C1, "ok")).items()
    (err,) = of_type(h.raw(C1, [_submit_frame("bad", sampling)]), Error, C1)
    assert err.request_id == "bad" and err.code == "invalid_request" and text in err.message
    assert h.core.requests.get("bad") is None and h.core.stats(h.now).frames_rejected == 1
    out = h.step(worker.decode(), delta("ok", 5, finish="length"))  # the client's other request goes on
    assert [d.finish_reason for d in client_deltas(out, C1)] == ["length"]


def test_a_worker_may_not_act_as_a_client():
    h = two_workers()
    (err,) = of_type(h.submit(W0, "r"), Error, W0)
    assert "registered as a worker" in err.message


def test_load_score_counts_unreported_requests_once():
    h = two_workers()
    h.submit(C1, "a", max_tokens=20)
    h.submit(C1, "b", max_tokens=20)  # least-loaded: one each
    h.submit(C1, "c", max_tokens=20)  # -> w0 again
    w0 = h.core.workers.by_id["w0"]
    before = w0.score
    assert before == pytest.approx(2 * (3 + 20) / 1600)  # prompt tokens + max_tokens, each; 100 x 16 capacity
    # a report that already counts both requests replaces the estimate instead of adding to it
    h.send(
        W0,
        StepBatch(
            deltas=[],
            load=Load(num_waiting=0, num_running=2, num_free_blocks=100, num_total_blocks=100, num_queued_tokens=40),
        ),
    )
    assert w0.score == pytest.approx(40 / 1600)
    h.submit(C1, "d", max_tokens=20, pin_rank=0)  # dispatched after that report: estimated on top
    assert w0.score == pytest.approx((40 + 23) / 1600)


def test_a_failover_replays_an_encoder_decoder_request_with_both_prompts():
    """An encoder-decoder request (T5, BART): its text prompt is the encoder's input, which the first worker tokenized
    and echoed; its decoder prompt rides beside it. The replay after its worker died carries the encoder's ids, the
    decoder prompt and the tokens delivered."""
    from infer.protocol.messages import Submit

    h = two_workers()
    submit = Submit(
        request_id="r",
        spec=RequestSpec(
            prompt="translate this",
            sampling=SamplingParams(temperature=0.0, max_tokens=10),
            decoder_prompt_token_ids=TokenIds([8, 9]),
        ),
    )
    ((ran, (first,)),) = dispatches(h.send(C1, submit)).items()
    assert first.spec.prompt == "translate this" and first.spec.decoder_prompt_token_ids == [8, 9]
    h.step(ran.decode(), delta("r", 4, prompt=[21, 22, 23]))
    h.step(ran.decode(), delta("r", 5))
    h.core.peer_gone(ran, h.now)
    (replay,) = dispatches(h.out())[W1 if ran == W0 else W0]
    assert replay.spec.prompt is None and replay.spec.prompt_token_ids == [21, 22, 23]
    assert replay.spec.decoder_prompt_token_ids == [8, 9] and replay.resumed_token_ids == [4, 5]


def test_a_dispatch_nests_the_spec_its_submit_carried_replaced_only_by_the_seed_and_the_prompt_ids():
    """What a request asks is one RequestSpec from the client to the engine: the coordinator's record keeps the
    Submit's, every Dispatch nests it, and the coordinator changes it in two ways only, each a new spec: a sampled
    request without a seed is given one, and a text prompt's ids, once a worker tokenized them, replace the text."""
    from infer.protocol.messages import Submit

    h = two_workers()
    greedy = RequestSpec(
        prompt_token_ids=TokenIds([5, 6, 7]),
        sampling=SamplingParams(temperature=0.0, max_tokens=4, stop=["x"]),
        priority=-3,
        decoder_prompt="ignored by a decoder-only worker, carried all the same",
    )
    ((_, (d,)),) = dispatches(h.send(C1, Submit(request_id="g", spec=greedy))).items()
    assert d.spec == greedy == h.core.requests.get("g").spec  # (the harness sends frames through the codec)
    assert d.spec.engine_args() == {
        "prompt": [5, 6, 7],
        "params": greedy.sampling,
        "priority": -3,
        "images": [],
        "decoder_prompt": "ignored by a decoder-only worker, carried all the same",
        "audio": None,
    }

    sampled = RequestSpec(prompt="hello", sampling=SamplingParams(temperature=0.8, max_tokens=4))
    ((ran, (d,)),) = dispatches(h.send(C1, Submit(request_id="s", spec=sampled))).items()
    seed = d.spec.sampling.seed
    assert seed is not None and d.spec == msgspec.structs.replace(sampled, sampling=sampled.sampling.with_seed(seed))
    h.step(ran.decode(), delta("s", 9, prompt=[31, 32]))
    h.core.peer_gone(ran, h.now)
    (replay,) = dispatches(h.out())[W1 if ran == W0 else W0]
    assert replay.spec == RequestSpec(prompt_token_ids=TokenIds([31, 32]), sampling=sampled.sampling.with_seed(seed))
    assert replay.resumed_token_ids == [9]
