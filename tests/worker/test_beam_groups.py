"""The torch-free parts of beam search, in milliseconds: BeamSearch's rule on hand-made candidates (ranking,
hypotheses, the length penalty, early stopping), BlockManager.fork (full blocks shared by ref count, the partial
one copied), Scheduler.fork and the preemption of a beam group as a whole."""

from __future__ import annotations

import math

import pytest

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.beam_search import BeamSearch
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import Scheduler, SchedulerConfig

EOS = 0


def _finish(max_tokens: int):
    return lambda beam, token_id: (
        "stop" if token_id == EOS else "length" if len(beam.token_ids) + 1 >= max_tokens else None
    )


def _lp(**probs: float) -> dict[int, float]:
    return {int(k[1:]): math.log(p) for k, p in probs.items()}


def test_first_round_takes_the_prompts_best_tokens_and_eos_becomes_a_hypothesis():
    search = BeamSearch.start("root", width=2, max_tokens=5)
    search.report("root", _lp(t0=0.5, t7=0.3, t9=0.2))  # EOS first: a hypothesis; 7 and 9 go on
    step = search.advance(_finish(5))
    assert [(c.parent, c.token_id) for c in step.continuations] == [("root", 7), ("root", 9)]
    assert step.dropped == () and not step.done
    assert [(h.token_ids, h.finish_reason) for h in search.hypotheses] == [((EOS,), "stop")]
    assert search.hypotheses[0].score == pytest.approx(math.log(0.5))


def test_candidates_rank_over_beams_and_a_beam_without_continuation_is_dropped():
    search = BeamSearch.start("root", width=2, max_tokens=9)
    search.report("root", _lp(t1=0.6, t2=0.4))
    search.advance(_finish(9))
    search.rename(1, "b2")
    search.report("root", _lp(t3=0.5, t4=0.5))  # 0.6 * 0.5 = 0.30 each
    search.report("b2", _lp(t5=0.9, t6=0.1))  # 0.4 * 0.9 = 0.36
    step = search.advance(_finish(9))
    assert [(c.parent, c.token_id) for c in step.continuations] == [("b2", 5), ("root", 3)]
    assert [b.token_ids for b in search.live] == [(2, 5), (1, 3)]
    assert search.live[0].cumulative_logprob == pytest.approx(math.log(0.36))


def test_length_penalty_and_the_stopping_rules():
    # width 1, two rounds: EOS at length 1 (p 0.4) against a beam that goes on (p 0.6, then 0.5 at length 2)
    def run(length_penalty: float, early_stopping: bool | str) -> tuple[list[tuple[int, ...]], bool]:
        search = BeamSearch.start(
            "r", width=1, max_tokens=3, length_penalty=length_penalty, early_stopping=early_stopping
        )
        search.report("r", _lp(t0=0.4, t8=0.6))
        step = search.advance(_finish(3))
        if step.done:
            return [h.token_ids for h in search.hypotheses], True
        search.report("r", _lp(t0=0.5, t9=0.5))
        search.advance(_finish(3))
        return [h.token_ids for h in search.hypotheses], False

    # the live beam ranks first (0.6 > 0.4): EOS is no hypothesis (position 1 >= width 1)... then EOS at length 2
    assert run(1.0, False) == ([(8, EOS)], False)
    search = BeamSearch.start("r", width=1, max_tokens=4, early_stopping=True)
    search.report("r", _lp(t0=0.7, t8=0.3))
    assert search.advance(_finish(4)).done  # width hypotheses and early_stopping: done
    search = BeamSearch.start("r", width=1, max_tokens=4, length_penalty=1.0)
    search.report("r", _lp(t0=0.7, t8=0.3))
    assert search.advance(_finish(4)).done  # log 0.3 / 1 < log 0.7: cannot improve
    search = BeamSearch.start("r", width=1, max_tokens=4, length_penalty=2.0, early_stopping="never")
    search.report("r", _lp(t0=0.7, t8=0.3))
    assert not search.advance(_finish(4)).done  # log 0.3 / 4**2 could beat log 0.7


def _request(rid: str, tokens: list[int], group: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=8), max_tokens=8, beam_group=group)


def test_block_manager_fork_shares_full_blocks_and_copies_the_partial_one():
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    parent = _request("p", list(range(10, 20)))  # 10 tokens: 2 full blocks + 2 tokens
    assert blocks.allocate(parent, 10)
    parent.num_computed_tokens = 10
    blocks.cache_full_blocks(parent)
    child = _request("c", list(parent.token_ids))
    copy = blocks.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2] and child.num_computed_tokens == 10
    assert copy == (parent.block_table[2], child.block_table[2]) and child.block_table[2] != parent.block_table[2]
    assert [blocks.ref_count(b) for b in parent.block_table] == [2, 2, 1]
    assert blocks.num_used_blocks == 4  # not 6: only the partial block was copied
    blocks.check_invariants(holders=[parent, child])
    blocks.free(child)  # a dropped beam gives its blocks back
    assert [blocks.ref_count(b) for b in parent.block_table] == [1, 1, 1] and blocks.num_used_blocks == 3
    aligned = _request("a", list(range(8)))
    assert blocks.allocate(aligned, 8)
    aligned.num_computed_tokens = 8
    assert blocks.fork(aligned, _request("a2", list(range(8)))) is None  # no partial block: nothing copied


def _scheduler(num_blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=num_blocks
        )
    )


def _step(scheduler: Scheduler) -> None:
    scheduler.update_after_step(scheduler.schedule())


def test_scheduler_fork_and_group_preemption():
    scheduler = _scheduler()
    root = _request("g", list(range(6)), group="g")
    other = _request("x", list(range(30, 36)))
    scheduler.add(root)
    scheduler.add(other)
    _step(scheduler)
    child = _request("g#1", list(root.token_ids), group="g")
    copy = scheduler.fork(root, child)
    assert copy is not None and child.status is RequestStatus.RUNNING
    for beam, token in ((root, 1), (child, 2)):
        beam.append_token(token)
    scheduler.check_invariants()
    scheduler._preempt(child, scheduler_step())  # any beam preempted: the whole group goes
    assert root.status is child.status is RequestStatus.WAITING and other.status is RequestStatus.RUNNING
    assert root.block_table == child.block_table == [] and scheduler.num_preemptions == 2
    scheduler.check_invariants()
    waiting_child = _request("g#2", list(root.token_ids), group="g")
    assert scheduler.fork(root, waiting_child) is None  # a waiting beam's fork waits too
    assert waiting_child.status is RequestStatus.WAITING
    scheduler.check_invariants()
    with pytest.raises(ValueError, match="no beam"):
        scheduler.fork(other, _request("y", list(other.token_ids)))


def scheduler_step():
    from infer.worker.engine.scheduler import _Step

    return _Step(0, 0)


def test_a_fork_without_a_free_block_preempts_its_group_and_voids_its_copies():
    from infer.worker.engine.beam_groups import BeamGroups

    scheduler = _scheduler(num_blocks=3)
    root = Request(
        "g",
        [1, 2, 3, 4, 5, 6],
        SamplingParams(temperature=0, max_tokens=2, beam_width=3),
        max_tokens=2,
        beam_group="g",
        num_beam_candidates=6,
    )
    scheduler.add(root)
    groups = BeamGroups(scheduler, tokenizer=None)
    groups.start(root)
    _step(scheduler)  # 6 tokens: a full block and a partial one; 1 block free
    groups.report(root, _lp(t7=0.5, t8=0.3, t9=0.2))
    copies, done = groups.advance()  # 3 beams: the first fork takes the free block, the second
    assert copies == [] and done == []  # finds none: the whole group waits, its copy void
    beams = [r for r in scheduler.waiting if r.beam_group == "g"]
    assert sorted(r.token_ids[-1] for r in beams) == [7, 8, 9] and scheduler.num_running == 0
    assert scheduler.block_manager.num_used_blocks == 0
    scheduler.check_invariants()
