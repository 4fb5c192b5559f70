"""Blocks out of every layer's sliding window given back (block_manager.release_before, the scheduler's
release_window): a windowed request holds about window / block_size blocks however long it runs, the pool's
invariants hold at every step, the prefix cache keeps its chain, and a preempted or finished request frees the
rest. No torch: the scheduler driven as the engine drives it (tests/sched_sim.py)."""

from __future__ import annotations

import pytest
from sched_sim import finish_step, make_request

from infer.worker.engine.block_manager import RELEASED, BlockManager
from infer.worker.engine.scheduler import Scheduler, SchedulerConfig


def _scheduler(release_window: int, prefix_caching: bool, num_blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=256,
            block_size=4,
            num_blocks=num_blocks,
            enable_prefix_caching=prefix_caching,
            release_window=release_window,
        )
    )


def _run(scheduler: Scheduler, requests, held: list[int]) -> None:
    for request in requests:
        scheduler.add(request)
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        finish_step(scheduler, output, lambda ids: (ids[-1] * 7 + 3) % 200 + 3)
        held.append(scheduler.block_manager.num_used_blocks)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_windowed_request_holds_about_window_over_block_size_blocks(prefix_caching):
    scheduler = _scheduler(release_window=8, prefix_caching=prefix_caching)
    request = make_request(0, list(range(3, 73)), max_tokens=40)  # 70 prompt tokens in chunks of 16
    held: list[int] = []
    _run(scheduler, [request], held)
    # window 8 + a chunk of 16 + the block being filled (+1 kept for the cache chain)
    assert max(held) <= (8 + 16) // 4 + 2 + prefix_caching
    assert held[-1] == 0 and scheduler.block_manager.num_free_blocks == 64


def test_without_a_window_every_block_is_kept():
    scheduler = _scheduler(release_window=0, prefix_caching=True)
    held: list[int] = []
    _run(scheduler, [make_request(0, list(range(3, 73)), max_tokens=40)], held)
    assert max(held) >= 25  # the context's 108 tokens before the last step


def test_released_blocks_stay_cached_and_the_chain_goes_on():
    """The released blocks keep their content in the free queue: the same prompt again hits the cache from its
    first block (while nothing evicted them), and the tables of both carry released entries only in front."""
    scheduler = _scheduler(release_window=8, prefix_caching=True)
    prompt = list(range(3, 73))
    _run(scheduler, [make_request(0, prompt, max_tokens=10)], [])
    again = make_request(1, prompt, max_tokens=10)
    scheduler.add(again)
    output = scheduler.schedule()
    assert again.num_cached_tokens == 68  # 17 full blocks of the 70-token prompt, the last one computed
    finish_step(scheduler, output, lambda ids: 5)
    assert again.block_table[0] == RELEASED and RELEASED not in again.block_table[-3:]


def test_preemption_frees_what_is_left():
    """A pool of 16 blocks for three windowed requests of 60 tokens (admission still counts a request's whole
    context): the pool is shared by releasing, and every block comes back."""
    scheduler = _scheduler(release_window=8, prefix_caching=True, num_blocks=16)
    held: list[int] = []
    _run(scheduler, [make_request(i, list(range(10 * i + 3, 10 * i + 33)), max_tokens=30) for i in range(3)], held)
    assert scheduler.block_manager.num_free_blocks == 16 and max(held) <= 16


def test_release_before_keeps_the_last_registered_block_and_is_idempotent():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    request = make_request(0, list(range(3, 27)), max_tokens=1)  # 24 tokens: 6 blocks
    assert manager.allocate(request, 24)
    request.num_computed_tokens = 24
    manager.cache_full_blocks(request)
    assert manager.release_before(request, 100) == 5  # block 5, the last registered, stays
    assert request.block_table[:5] == [RELEASED] * 5 and request.block_table[5] != RELEASED
    assert manager.release_before(request, 100) == 0
    manager.check_invariants(holders=[request])
    manager.free(request)
    assert manager.num_free_blocks == 16 and manager.num_cached_blocks == 6
