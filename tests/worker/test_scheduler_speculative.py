"""The scheduler with draft tokens (speculative decoding), torch-free: verification chunks count their drafts in
the token budget and only decoding requests get them; drafts take free blocks only (never preempting);
accept_draft_tokens counts accepted drafts' K/V and trims rejected drafts' blocks; long_prefill_token_threshold
never cuts a verification chunk; random workloads with a proposer that is sometimes right (half of them with prefill
chunks capped) run to the same outputs as without drafts, invariants checked every step."""

from __future__ import annotations

import random

import pytest
from sched_sim import expected_output, fake_next_token, make_request, make_scheduler

from infer.worker.engine.request import RequestStatus
from infer.worker.engine.scheduler import Scheduler


def verify_step(scheduler: Scheduler, output) -> None:
    """The engine's part: advance, then for each sampling chunk append the accepted drafts and the token after
    them (the fake model's), finishing at max_tokens, and accept_draft_tokens."""
    scheduler.update_after_step(output)
    for chunk in output.chunks:
        request = chunk.request
        if not chunk.samples or request.is_finished:
            continue
        appended = 0
        for j in range(chunk.num_draft_tokens + 1):
            token = fake_next_token(request.token_ids)
            request.append_token(token)
            appended += 1
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
                break
            if j == chunk.num_draft_tokens or token != chunk.draft_token_ids[j]:
                break
        if not request.is_finished and chunk.num_draft_tokens:
            scheduler.accept_draft_tokens(request, appended - 1)
    scheduler.check_invariants()


def test_drafts_are_counted_in_the_budget_and_only_decodes_get_them():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    a, b = make_request(0, [1, 2, 3], max_tokens=20), make_request(1, list(range(30)), max_tokens=20)
    scheduler.add(a)
    out = scheduler.schedule({"r0": [7, 8]})  # a is prefilling: no drafts
    assert out.chunks[0].num_draft_tokens == 0
    verify_step(scheduler, out)
    scheduler.add(b)
    out = scheduler.schedule({"r0": [5, 6, 7, 8, 9, 10], "r1": [4]})
    chunks = {c.request.request_id: c for c in out.chunks}
    assert chunks["r0"].draft_token_ids == (5, 6, 7, 8, 9, 10) and chunks["r0"].num_new_tokens == 7
    assert chunks["r1"].num_draft_tokens == 0 and chunks["r1"].num_new_tokens == 3  # the budget's rest
    assert out.num_batched_tokens == 10 and out.num_draft_tokens == 6
    assert chunks["r0"].samples and chunks["r0"].num_sampled_rows == 7
    assert chunks["r0"].token_ids == [a.token_ids[-1], 5, 6, 7, 8, 9, 10]


def test_drafts_are_cut_to_the_budget_and_dropped_when_blocks_are_short():
    scheduler = make_scheduler(max_num_batched_tokens=3)
    a = make_request(0, [1, 2, 3, 4], max_tokens=20)
    scheduler.add(a)
    verify_step(scheduler, scheduler.schedule())
    out = scheduler.schedule({"r0": [9, 9, 9, 9]})
    assert out.chunks[0].draft_token_ids == (9, 9)
    # a pool with no block to spare: the decode runs without its drafts, nobody is preempted
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_request(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=4), make_request(1, [1, 2, 3], max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    verify_step(scheduler, scheduler.schedule())
    assert scheduler.block_manager.num_free_blocks == 1 and len(a.block_table) == 2
    out = scheduler.schedule({"r0": [1, 2, 3, 4, 5, 6]})  # 8 + 6 tokens would need 2 more blocks
    assert out.chunks[0].num_draft_tokens == 0 and not out.preempted


def test_the_long_prefill_threshold_never_cuts_a_verification_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=2)
    a, b = make_request(0, [1, 2], max_tokens=20), make_request(1, list(range(30)), max_tokens=2)
    scheduler.add(a)
    verify_step(scheduler, scheduler.schedule())
    scheduler.add(b)
    out = scheduler.schedule({"r0": [5, 6, 7, 8, 9]})
    assert [(c.request.request_id, c.num_new_tokens, c.num_draft_tokens) for c in out.chunks] == [
        ("r0", 6, 5),  # the request's token and its five drafts, past the threshold of 2
        ("r1", 2, 0),  # a prefill chunk: cut to the threshold
    ]


def test_accept_draft_tokens_trims_the_rejected_drafts_blocks():
    scheduler = make_scheduler(block_size=4)
    a = make_request(0, [1, 2, 3], max_tokens=30)
    scheduler.add(a)
    verify_step(scheduler, scheduler.schedule())
    out = scheduler.schedule({"r0": [0] * 8})  # 4 tokens + 8 drafts: 3 blocks
    assert len(a.block_table) == 3
    scheduler.update_after_step(out)
    assert a.num_computed_tokens == 4  # the request's own token only
    a.append_token(fake_next_token(a.token_ids))  # every draft rejected: the correction
    with pytest.raises(ValueError, match="accepted drafts"):
        scheduler.accept_draft_tokens(a, 1)
    scheduler.accept_draft_tokens(a, 0)
    assert len(a.block_table) == 2 and scheduler.block_manager.num_free_blocks == 62
    scheduler.check_invariants()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_workloads_with_drafts_give_the_outputs_without(seed, policy):
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_blocks=rng.choice([12, 24, 64]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        policy=policy,
        enable_prefix_caching=rng.random() < 0.5,
        long_prefill_token_threshold=(0, 3)[seed % 2],
    )
    requests = [
        make_request(i, [rng.randrange(1000) for _ in range(rng.randint(1, 20))], rng.randint(1, 16)) for i in range(10)
    ]
    for r in requests:
        scheduler.add(r)
    drafted = 0
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        drafts = {}
        for r in scheduler.running:  # the true continuation, cut short or corrupted at random
            truth = expected_output(r.token_ids, 6)
            k = rng.randint(0, 5)
            if rng.random() < 0.4:
                truth[rng.randrange(6)] += 1
            drafts[r.request_id] = truth[:k]
        out = scheduler.schedule(drafts)
        drafted += out.num_draft_tokens
        assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for chunk in out.chunks:
            assert not chunk.num_draft_tokens or chunk.request.num_tokens_to_compute == 1
            assert len(chunk.request.block_table) * 4 >= chunk.end
        verify_step(scheduler, out)
    assert not scheduler.has_unfinished() and drafted > 0
    assert scheduler.block_manager.num_free_blocks == scheduler.config.num_blocks
    for r in requests:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, r.max_tokens)
