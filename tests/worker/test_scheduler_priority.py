"""Scheduler, policy "priority": better ranked requests are admitted first and preempt worse ranked ones
when seats or blocks are short, never the reverse; the aging rule serves a low priority request under a flood
of high priority ones; with long_prefill_token_threshold, short prompts are prefilled beside a better ranked long
one. Steps are counted, never timed."""

from __future__ import annotations

import functools
import random

import pytest
import sched_sim
from sched_sim import expected_output, fake_next_token, finish_step

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import Scheduler, SchedulerOutput

make_scheduler = functools.partial(sched_sim.make_scheduler, policy="priority")


def make_request(i: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [(i * 31 + j) % 1000 for j in range(prompt_len)]
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens),
        arrival_order=i,
        max_tokens=max_tokens,
        priority=priority,
    )


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    assert len(output.chunks) <= scheduler.config.max_num_seqs
    finish_step(scheduler, output, fake_next_token)
    return output


def first_token_steps(scheduler: Scheduler, max_steps: int = 10_000) -> dict[str, int]:
    """Run to completion; the step at which each request got its first output token."""
    first: dict[str, int] = {}
    for n in range(max_steps):
        if not scheduler.has_unfinished():
            return first
        for chunk in step(scheduler).chunks:
            if chunk.samples:
                first.setdefault(chunk.request.request_id, n)
    raise AssertionError("no progress")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(policy="lifo"), "policy must be one of fcfs, priority"),
        (dict(priority_aging_steps=0), "priority_aging_steps must be a positive integer"),
    ],
)
def test_config_is_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(**overrides)


@pytest.mark.parametrize("priority", [True, 1.5, 2**63])
def test_a_priority_that_is_not_a_64_bit_integer_is_refused(priority):
    with pytest.raises(ValueError, match="priority must (be an integer|fit in 64 bits)"):
        make_scheduler().add(make_request(0, 4, 2, priority=priority))


def test_with_the_engine_full_a_high_priority_request_goes_before_earlier_low_priority_ones():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):  # r0, r1 run; r2, r3 wait (all priority 5)
        scheduler.add(make_request(i, 4, 20, priority=5))
    step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"r0", "r1"}
    scheduler.add(make_request(4, 4, 20, priority=0))
    output = step(scheduler)
    # it takes the seat of the worst ranked running request (r1: same priority, later arrival), at once
    assert [c.request.request_id for c in output.chunks if c.samples] == ["r0", "r4"]
    assert [r.request_id for r in output.preempted] == ["r1"]
    first = first_token_steps(scheduler)
    assert first["r2"] > 0 and first["r3"] > 0


def test_when_blocks_are_short_the_lowest_priority_running_request_is_preempted():
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=64)  # 32 token slots
    scheduler.add(make_request(0, 12, 4, priority=1))  # 3 + 1 blocks
    scheduler.add(make_request(1, 12, 4, priority=9))  # the lowest priority
    scheduler.add(make_request(2, 2, 2, priority=3))  # 1 block for good
    step(scheduler)
    assert scheduler.num_running == 3
    scheduler.add(make_request(3, 12, 4, priority=0))  # needs 3 blocks: only 1 is free
    output = step(scheduler)
    assert [r.request_id for r in output.preempted] == ["r1"]
    assert any(c.request.request_id == "r3" and c.samples for c in output.chunks)
    scheduler.check_invariants()


def test_a_worse_ranked_request_never_preempts_a_better_one():
    scheduler = make_scheduler(max_num_seqs=2, num_blocks=16)
    scheduler.add(make_request(0, 12, 8, priority=0))
    scheduler.add(make_request(1, 12, 8, priority=0))
    step(scheduler)
    scheduler.add(make_request(2, 12, 8, priority=1))
    for _ in range(6):
        output = step(scheduler)
        assert not output.preempted
        assert all(c.request.request_id != "r2" for c in output.chunks)


def test_fcfs_ignores_priorities():
    scheduler = make_scheduler(max_num_seqs=1, policy="fcfs")
    for i, priority in enumerate([9, 5, 0]):
        scheduler.add(make_request(i, 4, 2, priority=priority))
    first = first_token_steps(scheduler)
    assert sorted(first, key=first.get) == ["r0", "r1", "r2"]


def flood(aging_steps: int, num_steps: int) -> int | None:
    """One seat; a low priority request among a steady flood of high priority ones (a new one every step,
    each needing 2 steps). The step at which the low one first gets a token, None if never."""
    scheduler = make_scheduler(max_num_seqs=1, priority_aging_steps=aging_steps)
    scheduler.add(make_request(0, 4, 2, priority=0))
    scheduler.add(make_request(1, 4, 3, priority=10))  # the low one
    for n in range(num_steps):
        scheduler.add(make_request(n + 2, 4, 2, priority=0))
        for chunk in step(scheduler).chunks:
            if chunk.request.request_id == "r1" and chunk.samples:
                return n
    return None


def test_aging_lets_a_low_priority_request_through_a_flood_of_high_priority_ones():
    assert flood(aging_steps=10**9, num_steps=300) is None  # without aging it would starve
    served = flood(aging_steps=50, num_steps=300)
    assert served is not None and 49 <= served <= 51  # its 50th step (0-based 49), or the holder's last


def test_an_aged_request_is_not_preempted_by_a_better_priority():
    scheduler = make_scheduler(max_num_seqs=1, priority_aging_steps=3)
    scheduler.add(make_request(0, 4, 10, priority=10))
    for _ in range(3):
        step(scheduler)
    scheduler.add(make_request(1, 4, 2, priority=-100))
    for _ in range(7):
        output = step(scheduler)
        assert not output.preempted and [c.request.request_id for c in output.chunks] == ["r0"]
    first = first_token_steps(scheduler)
    assert "r1" in first


def test_with_the_threshold_short_prompts_are_prefilled_beside_a_better_ranked_long_one():
    """Chunks capped at 16 tokens of a 64-token step: the best ranked request, a long prompt, gets its 16 tokens in
    every step until it is prefilled; worse ranked short prompts behind it take the rest of the budget at once; a
    better ranked one arriving later is served ahead of it and samples in its first step too."""
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=16)
    long = make_request(0, 150, 2, priority=0)
    scheduler.add(long)
    step(scheduler)
    scheduler.add(make_request(1, 8, 4, priority=5))
    scheduler.add(make_request(2, 8, 4, priority=5))
    output = step(scheduler)
    assert {c.request.request_id: (c.num_new_tokens, c.samples) for c in output.chunks} == {
        "r0": (16, False),
        "r1": (8, True),
        "r2": (8, True),
    }
    scheduler.add(make_request(3, 10, 4, priority=-1))
    output = step(scheduler)
    assert {c.request.request_id: (c.num_new_tokens, c.samples) for c in output.chunks} == {
        "r3": (10, True),
        "r0": (16, False),
        "r1": (1, True),
        "r2": (1, True),
    }
    while long.num_computed_tokens < 150:
        output = step(scheduler)
        assert any(c.request is long for c in output.chunks)  # never starved by the better ranked r3
    first_token_steps(scheduler)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("chunked", "threshold"), [(True, 0), (True, 8), (False, 0)])
def test_random_workloads_with_priorities_complete_with_exact_outputs(seed, chunked, threshold):
    rng = random.Random(seed)
    scheduler = make_scheduler(
        max_num_seqs=rng.choice([2, 4, 8]),
        num_blocks=rng.choice([24, 48]),
        max_num_batched_tokens=64 if chunked else 2048,
        max_model_len=64,
        enable_chunked_prefill=chunked,
        priority_aging_steps=rng.choice([5, 40, 1000]),
        long_prefill_token_threshold=threshold,
    )
    requests = [
        make_request(i, rng.randrange(1, 40), rng.randrange(1, 20), priority=rng.randrange(-3, 4)) for i in range(30)
    ]
    pending = list(requests)
    steps = 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                scheduler.add(pending.pop(0))
        if scheduler.has_unfinished():
            step(scheduler)
        steps += 1
        assert steps < 10_000, "no progress"
    for r in requests:
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
