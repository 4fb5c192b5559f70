"""Scheduler: budgets, chunked prefill mixed with decodes, short prefills beside a long one
(long_prefill_token_threshold), preemption by recompute, FCFS admission, aborts, requests that can never fit, and
simulated engine loops over random workloads run to completion."""

from __future__ import annotations

import itertools
import random

import pytest
from sched_sim import expected_output, fake_next_token, finish_step, make_request, make_scheduler

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Limits and ordering every step must satisfy."""
    config = scheduler.config
    assert output.num_batched_tokens == sum(c.num_new_tokens for c in output.chunks)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.chunks) <= config.max_num_seqs and scheduler.num_running <= config.max_num_seqs
    assert len({c.request.request_id for c in output.chunks}) == len(output.chunks)
    kinds = [not c.is_decode for c in output.chunks]
    assert kinds == sorted(kinds), "decodes must come before prefill chunks"
    for group in (True, False):
        orders = [c.request.arrival_order for c in output.chunks if c.is_decode is group]
        assert orders == sorted(orders)
    for chunk in output.chunks:
        request = chunk.request
        assert chunk.start == request.num_computed_tokens and chunk.num_new_tokens >= 1
        assert chunk.end <= request.num_tokens and request.status is RequestStatus.RUNNING
        assert len(request.block_table) * config.block_size >= chunk.end
    if not config.enable_chunked_prefill:
        assert all(c.samples for c in output.chunks), "without chunking every prefill is whole"
    threshold = config.long_prefill_token_threshold
    if threshold and not config.whole_images:
        assert all(c.is_decode or c.num_new_tokens <= threshold for c in output.chunks)


def engine_step(scheduler: Scheduler) -> SchedulerOutput:
    """What the engine does around the model: schedule, 'run', update, append sampled tokens, finish."""
    output = scheduler.schedule()
    check_step(scheduler, output)
    finish_step(scheduler, output, fake_next_token)
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished():
        assert len(outputs) < max_steps, "no progress"
        outputs.append(engine_step(scheduler))
    return outputs


# ---- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
        (dict(max_num_batched_tokens=-1), "max_num_batched_tokens must be a positive integer"),
        (dict(block_size=True), "block_size must be a positive integer"),
        (dict(num_blocks=2.0), "num_blocks must be a positive integer"),
        (dict(enable_prefix_caching=1), "enable_prefix_caching must be a bool"),
        (
            dict(enable_chunked_prefill=False),
            r"without chunked prefill, max_num_batched_tokens \(64\) must be >= max_model_len \(2048\)",
        ),
        (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an integer >= 0 \(0: off\)"),
        (
            dict(long_prefill_token_threshold=8.0),
            r"long_prefill_token_threshold must be an integer >= 0 \(0: off\), got 8.0",
        ),
        (
            dict(long_prefill_token_threshold=True),
            r"long_prefill_token_threshold must be an integer >= 0 \(0: off\), got True",
        ),
        (
            dict(enable_chunked_prefill=False, max_num_batched_tokens=2048, long_prefill_token_threshold=16),
            r"long_prefill_token_threshold \(16\) needs chunked prefill",
        ),
    ],
)
def test_config_is_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(**overrides)


# ---- budgets -----------------------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=50)
    rng = random.Random(1)
    for i in range(10):
        scheduler.add(make_request(i, [rng.randrange(1000) for _ in range(rng.randrange(1, 40))], 5))
    outputs = run_to_completion(scheduler)
    assert max(o.num_batched_tokens for o in outputs) == 50
    assert max(len(o.chunks) for o in outputs) == 3


def test_chunked_prefill_of_a_long_prompt_runs_alongside_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=64, block_size=16, num_blocks=100)
    shorts = [make_request(i, [i + 1] * 5, max_tokens=8) for i in range(3)]
    for request in shorts:
        scheduler.add(request)
    engine_step(scheduler)  # the three short prompts prefill together and sample their first token
    long = make_request(3, [(7 * j) % 1000 for j in range(1000)], max_tokens=2)
    scheduler.add(long)
    chunks: list[ScheduledChunk] = []
    mixed_steps = 0
    while long.num_computed_tokens < 1000:
        output = engine_step(scheduler)
        mine = [c for c in output.chunks if c.request is long]
        decodes = [c for c in output.chunks if c.request is not long]
        assert len(mine) == 1 and all(c.is_decode for c in decodes)
        assert mine[0].num_new_tokens == min(64 - len(decodes), 1000 - mine[0].start)
        assert output.chunks[-1].request is long  # decodes first
        mixed_steps += bool(decodes)
        chunks.append(mine[0])
    assert mixed_steps == 7  # the short requests decode (7 more tokens each) during the long prefill
    assert all(prev.end == nxt.start for prev, nxt in itertools.pairwise(chunks)) and chunks[0].start == 0
    assert [c.num_new_tokens for c in chunks[7:-1]] == [64] * (len(chunks) - 8)
    assert [c.samples for c in chunks] == [False] * (len(chunks) - 1) + [True]
    run_to_completion(scheduler)
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 8) for r in shorts)


def test_any_number_of_requests_may_be_mid_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=64, num_blocks=200)
    requests = [make_request(i, list(range(i, i + 100)), 2) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    output = engine_step(scheduler)
    assert [c.num_new_tokens for c in output.chunks] == [64]
    output = engine_step(scheduler)
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [("r0", 36), ("r1", 28)]
    output = engine_step(scheduler)
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [("r0", 1), ("r1", 63)]
    run_to_completion(scheduler)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, 2) for r in requests)


def first_token_steps(scheduler: Scheduler, requests: list[Request], arrive_at: int = 1) -> dict[str, int]:
    """Step (0-based) at which each request samples its first token; `requests` are added before step `arrive_at`
    (the scheduler holds whatever was added before the call)."""
    first: dict[str, int] = {}
    step = 0
    while scheduler.has_unfinished() or step < arrive_at:
        if step == arrive_at:
            for request in requests:
                scheduler.add(request)
        for chunk in engine_step(scheduler).chunks:
            if chunk.samples:
                first.setdefault(chunk.request.request_id, step)
        step += 1
        assert step < 10_000, "no progress"
    return first


@pytest.mark.parametrize("threshold", [0, 16])
def test_short_prompts_behind_a_long_one_are_prefilled_beside_it_with_the_threshold(threshold):
    """A 200-token prompt, then three short ones (5, 10 and 16 tokens) a step later, at 64 tokens a step. With a
    threshold of 16 the long prompt takes 16 tokens a step and the short ones are admitted beside it at once: they
    sample their first token in the next step, while the long one still has 168 tokens to prefill. Without it the
    long prompt takes the whole budget until its last chunk, and the short ones wait for that step."""
    scheduler = make_scheduler(max_num_batched_tokens=64, num_blocks=128, long_prefill_token_threshold=threshold)
    long = make_request(0, [(7 * j) % 1000 for j in range(200)], max_tokens=3)
    shorts = [make_request(i, [i + 1] * n, max_tokens=3) for i, n in ((1, 5), (2, 10), (3, 16))]
    scheduler.add(long)
    first = first_token_steps(scheduler, shorts)
    if threshold:
        assert [first[s.request_id] for s in shorts] == [1, 1, 1]
        assert first["r0"] == 12  # 12 chunks of 16 tokens, then one of 8 that samples
    else:
        assert [first[s.request_id] for s in shorts] == [3, 3, 3]  # beside the long one's last chunk (8 tokens)
        assert first["r0"] == 3
    for request in (long, *shorts):
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 3)


def test_the_threshold_cuts_prefill_chunks_not_decodes_and_shares_what_a_long_prompt_leaves():
    """Two long prompts (FCFS: the older first) and decodes: every prefill chunk is at most the threshold, each
    decode is one token, and the budget is filled in arrival order."""
    scheduler = make_scheduler(max_num_batched_tokens=40, num_blocks=256, long_prefill_token_threshold=12)
    decoders = [make_request(i, [i + 1] * 3, max_tokens=30) for i in range(3)]
    for request in decoders:
        scheduler.add(request)
    engine_step(scheduler)
    a, b = make_request(3, list(range(100)), 2), make_request(4, list(range(300, 400)), 2)
    scheduler.add(a)
    scheduler.add(b)
    output = engine_step(scheduler)
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 1),
        ("r3", 12),
        ("r4", 12),
    ]
    run_to_completion(scheduler)
    assert all(r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens) for r in (a, b, *decoders))


def test_with_the_threshold_the_rest_of_a_prompt_after_a_cache_hit_is_what_is_capped():
    scheduler = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=512, long_prefill_token_threshold=8)
    prefix = [(3 * j) % 1000 for j in range(64)]
    scheduler.add(make_request(0, prefix + [1, 2, 3], 2))
    run_to_completion(scheduler)
    second = make_request(1, prefix + list(range(20)), 2)
    scheduler.add(second)
    output = engine_step(scheduler)
    assert [(c.start, c.num_new_tokens) for c in output.chunks] == [(64, 8)]


def test_chunk_samples_only_when_it_reaches_the_last_token():
    request = make_request(0, list(range(10)))
    request.num_computed_tokens = 4
    assert not ScheduledChunk.of(request, 5).samples
    chunk = ScheduledChunk.of(request, 6)
    assert chunk.samples and chunk.end == 10
    request.append_token(3)  # the engine appends after the step: the plan does not change
    assert chunk.samples


# ---- preemption --------------------------------------------------------------------------------------


def test_preemption_by_recompute_when_blocks_run_out_keeps_the_output():
    scheduler = make_scheduler(block_size=4, num_blocks=8, enable_prefix_caching=False)
    a, b = make_request(0, list(range(10)), 14), make_request(1, list(range(50, 60)), 14)
    scheduler.add(a)
    scheduler.add(b)
    output_lengths = []
    while scheduler.has_unfinished():
        output = engine_step(scheduler)
        if output.preempted:
            assert output.preempted == (b,)  # the newest running request is the victim
            assert b.status is RequestStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
            assert b.num_output_tokens > 0 and b not in [c.request for c in output.chunks]
        output_lengths.append(b.num_output_tokens)
    assert b.num_preemptions >= 1, "the pool is too small for both: b must have been preempted"
    assert scheduler.stats.num_preemptions == a.num_preemptions + b.num_preemptions == b.num_preemptions
    assert output_lengths == sorted(output_lengths)  # outputs are kept across preemption, never regenerated
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 14)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 14)
    assert scheduler.block_manager.num_free_blocks == 8


def test_a_preempted_request_recomputes_prompt_and_outputs_and_hits_the_cache():
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    a, b = make_request(0, list(range(10)), 14), make_request(1, list(range(50, 60)), 14)
    scheduler.add(a)
    scheduler.add(b)
    while not b.num_preemptions:
        engine_step(scheduler)
    num_tokens_then = b.num_tokens
    assert num_tokens_then > b.num_prompt_tokens  # it had produced output
    first_back = None
    while first_back is None:
        output = engine_step(scheduler)
        first_back = next((c for c in output.chunks if c.request is b), None)
    assert first_back.start == b.num_cached_tokens > 0  # its full blocks survived in the prefix cache
    assert first_back.end == num_tokens_then and first_back.samples  # prompt + outputs, then sample
    run_to_completion(scheduler)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 14)


def test_a_request_that_outgrows_the_pool_alone_is_preempted_by_itself_and_waits():
    """Preempting itself (nothing newer to evict) stops the step; it resumes once blocks come back."""
    scheduler = make_scheduler(block_size=4, num_blocks=6, enable_prefix_caching=False)
    a, b = make_request(0, list(range(12)), 12), make_request(1, list(range(40, 48)), 4)
    scheduler.add(a)
    scheduler.add(b)
    run_to_completion(scheduler)
    assert a.output_token_ids == expected_output(a.prompt_token_ids, 12)
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 4)


def test_no_new_admissions_in_a_step_that_preempted():
    scheduler = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=8, enable_prefix_caching=False)
    a, b = make_request(0, list(range(10)), 14), make_request(1, list(range(50, 60)), 14)
    scheduler.add(a)
    scheduler.add(b)
    while not b.num_preemptions:
        output = engine_step(scheduler)
    assert [c.request for c in output.chunks] == [a] and b.status is RequestStatus.WAITING
    # A 7-token chunk of b would fit in what its preemption freed, but re-admitting now would only thrash.
    assert scheduler.block_manager.num_blocks_to_allocate(b, 7) <= scheduler.block_manager.num_free_blocks


# ---- admission order ---------------------------------------------------------------------------------


def test_waiting_requests_are_admitted_first_come_first_served():
    scheduler = make_scheduler(block_size=4, num_blocks=10, enable_prefix_caching=False)
    big0, big1 = make_request(0, list(range(24)), 4), make_request(1, list(range(24)), 4)
    small = make_request(2, [5, 6], 2)
    for request in (big0, big1, small):
        scheduler.add(request)
    first_scheduled: list[str] = []
    while scheduler.has_unfinished():
        output = engine_step(scheduler)
        for chunk in output.chunks:
            if chunk.request.request_id not in first_scheduled:
                first_scheduled.append(chunk.request.request_id)
        if "r1" not in first_scheduled:
            assert "r2" not in first_scheduled  # small fits but must not jump ahead of r1
    assert first_scheduled == ["r0", "r1", "r2"]


def test_preempted_requests_go_back_ahead_of_newer_arrivals():
    scheduler = make_scheduler(block_size=4, num_blocks=8, enable_prefix_caching=False)
    a, b = make_request(0, list(range(10)), 14), make_request(1, list(range(50, 60)), 14)
    scheduler.add(a)
    scheduler.add(b)
    engine_step(scheduler)
    late = make_request(2, list(range(12)), 2)
    scheduler.add(late)  # waits: 3 blocks do not fit next to a and b
    while not b.num_preemptions:
        engine_step(scheduler)
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2"]  # b goes back ahead of late
    while scheduler.has_unfinished():
        engine_step(scheduler)
        assert b.status is not RequestStatus.WAITING or late.status is RequestStatus.WAITING


# ---- abort, finish, bad requests ---------------------------------------------------------------------


def test_abort_of_waiting_and_running_requests_frees_their_blocks():
    scheduler = make_scheduler(max_num_seqs=2, block_size=4, num_blocks=16)
    requests = [make_request(i, list(range(i, i + 10)), 20) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    engine_step(scheduler)
    running, waiting = requests[0], requests[2]
    assert running.status is RequestStatus.RUNNING and waiting.status is RequestStatus.WAITING
    free_before = scheduler.block_manager.num_free_blocks
    held = len(running.block_table)
    assert scheduler.abort("r0") is running
    assert running.status is RequestStatus.FINISHED_ABORTED and running.block_table == []
    assert scheduler.block_manager.num_free_blocks == free_before + held
    assert scheduler.abort("r2") is waiting and waiting.status is RequestStatus.FINISHED_ABORTED
    assert scheduler.abort("r2") is None and scheduler.abort("nobody") is None
    assert scheduler.get("r1") is requests[1] and scheduler.get("r0") is None
    scheduler.check_invariants()
    run_to_completion(scheduler)
    assert requests[1].output_token_ids == expected_output(requests[1].prompt_token_ids, 20)
    assert scheduler.block_manager.num_free_blocks == 16


def test_abort_between_schedule_and_update_is_safe():
    scheduler = make_scheduler()
    request = make_request(0, list(range(20)), 3)
    scheduler.add(request)
    output = scheduler.schedule()
    scheduler.abort("r0")
    scheduler.update_after_step(output)  # the aborted chunk is skipped
    assert request.num_computed_tokens == 0 and not scheduler.has_unfinished()
    scheduler.check_invariants()


def test_update_twice_with_the_same_output_raises():
    scheduler = make_scheduler()
    scheduler.add(make_request(0, list(range(20)), 3))
    output = scheduler.schedule()
    scheduler.update_after_step(output)
    with pytest.raises(ValueError, match="chunk starts at 0 but 20 tokens are computed"):
        scheduler.update_after_step(output)


def test_finish_sets_status_and_error_and_rejects_misuse():
    scheduler = make_scheduler()
    request = make_request(0, [1, 2, 3], 3)
    scheduler.add(request)
    with pytest.raises(ValueError, match="needs a finished status"):
        scheduler.finish(request, RequestStatus.RUNNING)
    scheduler.finish(request, RequestStatus.FINISHED_ERROR, "boom")
    assert request.status is RequestStatus.FINISHED_ERROR and request.error == "boom"
    with pytest.raises(ValueError, match="is not in the scheduler"):
        scheduler.finish(request, RequestStatus.FINISHED_STOPPED)


def test_a_request_that_can_never_fit_is_rejected_with_the_sizes():
    scheduler = make_scheduler(block_size=16, num_blocks=8, max_model_len=1024)
    with pytest.raises(
        ValueError,
        match=r"304 tokens need 19 KV blocks of 16 tokens, "
        r"but the pool has only 8 blocks \(128 tokens\)",
    ):
        scheduler.add(make_request(0, list(range(300)), 4))
    scheduler.add(make_request(1, list(range(100)), 28))  # 128 tokens: exactly the pool
    assert scheduler.num_waiting == 1


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: make_request(0, list(range(65)), 1), r"prompt of 65 tokens is longer than max_model_len \(64\)"),
        (lambda: make_request(0, [], 1), "the prompt is empty"),
        (lambda: Request("r0", [1], SamplingParams(), max_tokens=0), "max_tokens must be >= 1"),
    ],
)
def test_malformed_requests_are_rejected(build, message):
    scheduler = make_scheduler(max_model_len=64)
    with pytest.raises(ValueError, match=message):
        scheduler.add(build())
    assert not scheduler.has_unfinished()


def test_duplicate_request_id_is_rejected():
    scheduler = make_scheduler()
    scheduler.add(make_request(0, [1]))
    with pytest.raises(ValueError, match="request id 'r0' is already in the scheduler"):
        scheduler.add(make_request(0, [2]))


# ---- prefix caching through the scheduler ------------------------------------------------------------


def test_a_shared_prefix_is_computed_once():
    scheduler = make_scheduler(block_size=16, num_blocks=64, max_num_batched_tokens=512)
    prefix = [(3 * j) % 1000 for j in range(256)]
    first = make_request(0, prefix + [1, 2, 3], 2)
    scheduler.add(first)
    run_to_completion(scheduler)
    second = make_request(1, prefix + [4, 5, 6, 7], 2)
    scheduler.add(second)
    output = engine_step(scheduler)
    assert [(c.start, c.num_new_tokens) for c in output.chunks] == [(256, 4)]
    assert second.num_cached_tokens == 256
    stats = scheduler.stats
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens) == (259 + 260, 256)
    run_to_completion(scheduler)
    assert second.output_token_ids == expected_output(second.prompt_token_ids, 2)


# ---- without chunked prefill -------------------------------------------------------------------------


def test_without_chunking_a_budget_sized_prompt_is_not_starved_by_decodes():
    scheduler = make_scheduler(
        max_num_batched_tokens=100, max_model_len=100, enable_chunked_prefill=False, block_size=4, num_blocks=200
    )
    decoders = [make_request(i, [i + 1] * 3, 30) for i in range(6)]
    for request in decoders:
        scheduler.add(request)
    engine_step(scheduler)
    long = make_request(6, list(range(100)), 1)
    scheduler.add(long)
    output = engine_step(scheduler)
    assert [(c.request.request_id, c.num_new_tokens) for c in output.chunks] == [("r6", 100)]
    output = engine_step(scheduler)
    assert len(output.chunks) == 6 and all(c.is_decode for c in output.chunks)  # decodes resume
    run_to_completion(scheduler)
    assert long.is_finished and all(r.is_finished for r in decoders)


def test_without_chunking_admission_keeps_blocks_for_running_decodes():
    scheduler = make_scheduler(
        max_num_batched_tokens=64,
        max_model_len=64,
        enable_chunked_prefill=False,
        block_size=4,
        num_blocks=5,
        enable_prefix_caching=False,
    )
    a = make_request(0, list(range(8)), 8)
    scheduler.add(a)
    engine_step(scheduler)
    assert len(a.block_table) == 2 and a.num_tokens == 9  # its next decode needs a third block
    late = make_request(1, list(range(12)), 1)
    scheduler.add(late)  # needs 3 blocks: admitting it now would leave none for a's decode
    output = engine_step(scheduler)
    assert [c.request for c in output.chunks] == [a] and not output.preempted
    run_to_completion(scheduler)
    assert scheduler.stats.num_preemptions == 0 and late.is_finished


# ---- simulated engine loops --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_run_to_completion(seed):
    """Chunked configurations cap prefill chunks too, by seed: at 1 token (seeds 1, 11), 5 (2, 7) or 16 (4)."""
    rng = random.Random(seed)
    chunked = seed % 3 != 0
    block_size = rng.choice([1, 2, 4, 16])
    max_model_len = 96
    config = dict(
        max_num_seqs=rng.randint(1, 8),
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=rng.randint(-(-max_model_len // block_size), 3 * max_model_len // block_size),
        max_num_batched_tokens=rng.randint(1, 64) if chunked else max_model_len,
        enable_prefix_caching=rng.random() < 0.7,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=(0, 1, 5, 0, 16)[seed % 5] if chunked else 0,
    )
    scheduler = make_scheduler(**config)
    bases = [[rng.randrange(50) for _ in range(80)] for _ in range(3)]
    pending = []
    for i in range(40):
        tail = [rng.randrange(50) for _ in range(rng.randint(1, 10))]
        prompt = rng.choice(bases)[: rng.randint(0, 60)] + tail
        pending.append(make_request(i, prompt, rng.randint(1, max_model_len - len(prompt))))
    added, aborted, steps = [], set(), 0
    while pending or scheduler.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # requests keep arriving while others run
            if pending:
                scheduler.add(pending[0])
                added.append(pending.pop(0))
        if rng.random() < 0.03 and added:
            victim = rng.choice(added)
            if scheduler.abort(victim.request_id) is not None:
                aborted.add(victim.request_id)
        engine_step(scheduler)
        steps += 1
        assert steps < 20_000
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_blocks
    for request in added:
        if request.request_id in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
        else:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == expected_output(request.prompt_token_ids, request.max_tokens)


@pytest.mark.parametrize("threshold", [0, 6])
def test_sustained_pressure_starves_nobody(threshold):
    """A tiny pool, long outputs and a steady stream of arrivals: preemptions happen all the time, yet the
    oldest unfinished request computes tokens in every single step, so every request finishes; with prefill chunks
    capped at 6 tokens too."""
    scheduler = make_scheduler(
        max_num_seqs=6,
        max_num_batched_tokens=32,
        block_size=4,
        num_blocks=24,
        max_model_len=96,
        long_prefill_token_threshold=threshold,
    )
    rng = random.Random(5)
    arrivals = [
        make_request(i, [rng.randrange(100) for _ in range(rng.randint(4, 30))], rng.randint(20, 60))
        for i in range(150)
    ]
    everyone = list(arrivals)
    steps = 0
    while arrivals or scheduler.has_unfinished():
        if arrivals and steps % 2 == 0:
            scheduler.add(arrivals.pop(0))
        unfinished = [r for r in everyone if scheduler.get(r.request_id) is r]
        oldest = min(unfinished, key=lambda r: r.arrival_order, default=None)
        output = engine_step(scheduler)
        assert oldest is None or oldest in [c.request for c in output.chunks], f"{oldest.request_id} starved"
        steps += 1
        assert steps < 50_000
    assert scheduler.stats.num_preemptions > 50
    assert scheduler.block_manager.num_free_blocks == 24
    for request in everyone:
        assert request.output_token_ids == expected_output(request.prompt_token_ids, request.max_tokens)


# ---- whole images (a model whose image tokens attend to each other both ways: Gemma 3) -------------------------------


def _with_images(i: int, prompt: list[int], spans: list[tuple[int, int]]) -> Request:
    from infer.worker.engine.images import PlacedImage

    request = make_request(i, prompt)
    request.images = tuple(PlacedImage(offset, length, 100 + k, None) for k, (offset, length) in enumerate(spans))
    return request


def test_whole_images_are_never_split_across_chunks():
    """8 tokens a step, images at [3, 9) and [12, 18) of a 20-token prompt: the first chunk stops before the first
    image, the next takes it whole; a request whose image's rest does not fit the budget left waits (an older
    request's decode took a token) and computes it whole later; without `whole_images` chunks end anywhere."""
    spans = [(3, 6), (12, 6)]
    scheduler = make_scheduler(max_num_batched_tokens=8, whole_images=True)
    scheduler.add(_with_images(0, list(range(20)), spans))
    chunks = [(c.start, c.end) for output in run_to_completion(scheduler) for c in output.chunks if c.start < 20]
    assert chunks == [(0, 3), (3, 11), (11, 19), (19, 20)]
    plain = make_scheduler(max_num_batched_tokens=8)
    plain.add(_with_images(0, list(range(20)), spans))
    assert [(c.start, c.end) for c in plain.schedule().chunks] == [(0, 8)]

    scheduler = make_scheduler(max_num_batched_tokens=6, whole_images=True)
    scheduler.add(make_request(0, [1, 2], max_tokens=8))
    engine_step(scheduler)  # request 0 now decodes: one token of every step's budget
    scheduler.add(_with_images(1, list(range(12)), [(3, 6)]))
    first = engine_step(scheduler)
    assert [(c.request.request_id, c.start, c.end) for c in first.chunks] == [("r0", 2, 3), ("r1", 0, 3)]
    second = engine_step(scheduler)  # [3, 9) needs 6 tokens, 5 are left: r1 waits, holding its blocks
    assert [(c.request.request_id, c.start, c.end) for c in second.chunks] == [("r0", 3, 4)]
    run = run_to_completion(scheduler)
    r1 = [(c.start, c.end) for output in run for c in output.chunks if c.request.request_id == "r1" and c.start < 12]
    assert r1 == [(3, 9), (9, 12)]


def test_with_the_threshold_an_image_longer_than_it_is_still_taken_whole():
    """Chunks capped at 4 tokens, 8 a step, images of 6 at [3, 9) and [12, 18): a chunk that would end inside an
    image stops before it, and one that starts at an image takes it whole, past the threshold."""
    scheduler = make_scheduler(max_num_batched_tokens=8, whole_images=True, long_prefill_token_threshold=4)
    scheduler.add(_with_images(0, list(range(20)), [(3, 6), (12, 6)]))
    chunks = [(c.start, c.end) for output in run_to_completion(scheduler) for c in output.chunks if c.start < 20]
    assert chunks == [(0, 3), (3, 9), (9, 12), (12, 18), (18, 20)]
