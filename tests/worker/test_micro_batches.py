"""Micro-batches in flight (worker/engine/micro_batches.py) around the real scheduler, torch-free: the engine's pipelined
step replayed with a fake model. A request is never in two micro-batches in flight nor preempted while in one;
under block pressure, aborts and random arrivals every request still gets exactly the tokens of the fake model;
decodes split into `depth` micro-batches of equal share."""

from __future__ import annotations

import dataclasses
import random

import pytest
from sched_sim import expected_output, fake_next_token, finish_step, make_request, make_scheduler

from infer.worker.engine.micro_batches import MicroBatches, runs_alone
from infer.worker.engine.request import RequestStatus
from infer.worker.engine.scheduler import Scheduler, SchedulerOutput


def finish_oldest(scheduler: Scheduler, flights: MicroBatches) -> SchedulerOutput:
    """What Engine._finish_oldest does: drop the chunks of requests finished meanwhile, then advance and sample."""
    scheduled = flights.pop_oldest().scheduled
    kept = dataclasses.replace(scheduled, chunks=tuple(c for c in scheduled.chunks if not c.request.is_finished))
    finish_step(scheduler, kept, fake_next_token)
    return kept


def pipelined_step(scheduler: Scheduler, flights: MicroBatches) -> SchedulerOutput:
    """What Engine._step_micro_batches does around the model; returns the launched batch (maybe empty)."""
    while flights.must_finish():
        finish_oldest(scheduler, flights)
    busy = flights.busy
    unfinished = scheduler.num_running + scheduler.num_waiting
    scheduled = scheduler.schedule(busy=busy, max_seqs=flights.seats(unfinished))
    ids = {c.request.request_id for c in scheduled.chunks}
    assert not ids & busy, "a request in flight was scheduled again"
    assert not {r.request_id for r in scheduled.preempted} & busy, "a request in flight was preempted"
    held = [scheduler.get(i) for i in busy]  # (aborted ones are gone)
    assert all(r.status is RequestStatus.RUNNING and r.block_table for r in held if r is not None)
    if scheduled.is_empty:
        if len(flights):
            finish_oldest(scheduler, flights)
    else:
        flights.add(scheduled, launched=None)
    scheduler.check_invariants()
    return scheduled


def test_decodes_split_into_depth_micro_batches_that_alternate():
    scheduler, flights = make_scheduler(max_num_seqs=32, max_num_batched_tokens=512), MicroBatches(2)
    requests = [make_request(i, [i + 1] * 5, 6) for i in range(8)]
    for request in requests:
        scheduler.add(request)
    launched = [pipelined_step(scheduler, flights) for _ in range(6)]
    names = [[c.request.request_id for c in s.chunks] for s in launched]
    assert names[0] == [f"r{i}" for i in range(4)] and names[1] == [f"r{i}" for i in range(4, 8)]
    assert names[2:] == [names[0], names[1]] * 2  # each half again once its previous step finished
    assert all(c.is_decode for s in launched[2:] for c in s.chunks)
    while scheduler.has_unfinished() or len(flights):
        pipelined_step(scheduler, flights)
    assert [r.output_token_ids for r in requests] == [expected_output(r.prompt_token_ids, 6) for r in requests]


def test_only_requests_not_in_flight_are_preempted_and_a_request_waits_for_them():
    scheduler, flights = make_scheduler(block_size=4, num_blocks=8, enable_prefix_caching=False), MicroBatches(2)
    a, b = make_request(0, list(range(10)), 14), make_request(1, list(range(50, 60)), 14)
    scheduler.add(a)
    scheduler.add(b)
    steps = 0
    while scheduler.has_unfinished() or len(flights):
        pipelined_step(scheduler, flights)
        steps += 1
        assert steps < 500, "no progress"
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 14)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 14)
    assert scheduler.num_preemptions >= 1 and scheduler.block_manager.num_free_blocks == 8


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_with_aborts_finish_exactly(seed, depth, policy):
    rng = random.Random(seed)
    scheduler = make_scheduler(
        block_size=4,
        num_blocks=rng.choice([12, 24, 64]),
        max_num_seqs=rng.choice([3, 8]),
        max_num_batched_tokens=rng.choice([16, 64]),
        policy=policy,
        priority_aging_steps=50,
    )
    flights = MicroBatches(depth)
    requests, aborted, arrivals = [], set(), 0
    for _ in range(3000):
        if arrivals < 20 and rng.random() < 0.3:
            request = make_request(
                arrivals, [rng.randrange(1, 900) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 12)
            )
            request.priority = rng.randrange(-2, 3) if policy == "priority" else 0
            scheduler.add(request)
            requests.append(request)
            arrivals += 1
        if requests and rng.random() < 0.05:  # an abort, maybe of a request in flight
            victim = rng.choice(requests)
            if scheduler.abort(victim.request_id) is not None:
                aborted.add(victim.request_id)
        pipelined_step(scheduler, flights)
        if arrivals == 20 and not scheduler.has_unfinished() and not len(flights):
            break
    assert arrivals == 20 and not scheduler.has_unfinished() and not len(flights)
    for request in requests:
        want = expected_output(request.prompt_token_ids, request.max_tokens)
        if request.request_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == want[: request.num_output_tokens]
        else:
            assert request.output_token_ids == want
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_blocks


def test_a_batch_with_prompt_logprobs_runs_alone():
    scheduler, flights = make_scheduler(), MicroBatches(2)
    plain, wants = make_request(0, [1, 2, 3], 3), make_request(1, [4, 5, 6], 3)
    wants.prompt_logprobs = []
    scheduler.add(plain)
    first = pipelined_step(scheduler, flights)
    assert not runs_alone(first) and len(flights) == 1
    scheduler.add(wants)
    second = pipelined_step(scheduler, flights)
    assert runs_alone(second) and flights.must_finish()  # nothing is launched after it before it finishes
    pipelined_step(scheduler, flights)
    assert len(flights) == 1


def test_the_depth_and_the_seats():
    from infer.worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="the depth is at least 1, got 0"):
        MicroBatches(0)
    assert [MicroBatches(2).seats(n) for n in (0, 1, 2, 3, 32)] == [1, 1, 1, 2, 16]
    with pytest.raises(ValueError, match="pp_micro_batches must be a positive integer"):
        EngineConfig(pp_micro_batches=0)


def test_the_micro_batch_flag_reaches_the_engine_config_through_worker_and_serve():
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args
    from infer.worker.service.cli import build_parser, engine_config

    args = build_parser().parse_args(
        ["--coordinator", "tcp://127.0.0.1:1", "--pp-size", "2", "--pp-micro-batches", "1"]
    )
    assert engine_config(args).pp_micro_batches == 1
    assert engine_config(build_parser().parse_args(["--coordinator", "tcp://127.0.0.1:1"])).pp_micro_batches is None
    served = worker_args(serve_parser().parse_args(["--pp-size", "2", "--pp-micro-batches", "3"]), [])
    assert served[served.index("--pp-micro-batches") + 1] == "3"
