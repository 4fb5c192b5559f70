"""Priority scheduling through the engine and LLM on the tiny Llama: with every seat taken, a better priority
gets its first token before lower priorities that arrived earlier; bad priorities are refused with the field
named. Steps are counted, never timed."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def first_token_order(engine: Engine) -> list[str]:
    order: list[str] = []
    for _ in range(200):
        if not engine.has_unfinished():
            return order
        for out in engine.step():
            if out.token_ids and out.request_id not in order:
                order.append(out.request_id)
    raise AssertionError("no progress")


def test_a_better_priority_is_served_before_earlier_worse_ones(model_dir):
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=128,
            max_num_seqs=1,
            kv_cache_memory=4 << 20,
            scheduling_policy="priority",
        )
    )
    engine.add_request("running", [3, 4, 5], GREEDY, priority=5)
    engine.step()
    engine.add_request("early-1", [6, 7], GREEDY, priority=5)
    engine.add_request("early-2", [8, 9], GREEDY, priority=1)
    engine.add_request("urgent", [10, 11], GREEDY, priority=-3)
    assert first_token_order(engine)[:3] == ["urgent", "early-2", "running"]
    assert engine.scheduler.num_preemptions >= 1  # "running" gave its seat to "urgent"


def test_fcfs_is_the_default_and_ignores_priorities(model_dir):
    engine = Engine(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=1, kv_cache_memory=4 << 20)
    )
    for i, priority in enumerate([3, 2, 1]):
        engine.add_request(f"r{i}", [3 + i, 4], GREEDY, priority=priority)
    assert first_token_order(engine) == ["r0", "r1", "r2"]


def test_bad_policies_and_priorities_are_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        EngineConfig(scheduling_policy="lifo")
    with LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory=4 << 20, scheduling_policy="priority"
    ) as llm:
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, "high"])
        with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
            llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
        done = llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[1, 0])
        assert [c.finish_reason for c in done] == ["length", "length"]
        with pytest.raises(ValueError, match="priority must fit in 64 bits"):
            llm.engine.add_request("x", [3], GREEDY, priority=2**63)
