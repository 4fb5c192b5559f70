"""Fault isolation in the engine: one request's failure fails that request alone (finish_reason "error", code
"internal", its KV blocks freed) and every other request completes with the tokens it would have had alone.

- The poison of issue 16 (temperature 1, top_p 0.5, repetition_penalty 1e-50: 0 in float32, so logits went
  inf / NaN and the top-p cut raised) is now refused by SamplingParams; here it is forced past validation, as
  a gap in validation would let it through, and the sampler's per-row check of the logits catches it.
- A model forward that raises only while one request is in the batch: the step is retried one request at a
  time, the culprit fails, the others go on. A forward that always raises is the engine's failure, not a
  request's: step() raises (the worker exits and the coordinator moves its requests).
- A property test over random, extreme-but-valid sampling parameters: no step raises and no logprob is
  non-finite.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.protocol.outputs import Completion
from infer.protocol.sampling import MAX_REPETITION_PENALTY, MAX_TOP_K, MIN_REPETITION_PENALTY, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [40, 41, 42], "c": [300, 301, 302, 303, 304, 305, 306]}
POISON_TOKEN = 777  # the faulty forward below raises whenever this token id is in the batch


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            dtype="float32",
            max_model_len=128,
            kv_cache_memory=4 << 20,
            block_size=4,
        )
    )


@pytest.fixture(scope="module")
def reference(engine) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run alone."""
    return {rid: _run(engine, {rid: (prompt, GREEDY)})[rid][0] for rid, prompt in PROMPTS.items()}


def _run(engine: Engine, requests: dict[str, tuple]) -> dict[str, tuple[list[int], Completion]]:
    """Every request to its end: (tokens, its deltas folded into a Completion: the final one's reason and error,
    every delta's logprobs) by id. The engine's books are checked after."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {rid: Completion(rid, []) for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            done[delta.request_id].add(delta)
    _assert_all_blocks_free(engine)
    return {rid: (done[rid].token_ids, done[rid]) for rid in requests}


def _assert_all_blocks_free(engine: Engine) -> None:
    engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kv_blocks


def _poison() -> SamplingParams:
    """Issue 16's parameters, forced past validation (which now refuses them)."""
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1e-50)
    # seeded: the engine gives an unseeded request a seed by msgspec.structs.replace, which would validate again
    params = SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.5, max_tokens=8, seed=7)
    msgspec.structs.force_setattr(params, "repetition_penalty", 1e-50)
    return params


def test_non_finite_logits_fail_that_request_alone(engine, reference):
    requests = {rid: (prompt, GREEDY) for rid, prompt in PROMPTS.items()}
    requests["poison"] = ([5, 6, 7, 8], _poison())
    got = _run(engine, requests)
    tokens, final = got["poison"]
    assert final.finish_reason == "error" and final.error_code == "internal"
    assert "non-finite logits" in final.error and tokens == []
    for rid in PROMPTS:
        assert got[rid][0] == reference[rid] and got[rid][1].finish_reason == "length"
    assert engine.stats.finish_reasons["error"] >= 1


class _FaultyModel:
    """The engine's own model, except that a forward over a batch holding POISON_TOKEN raises (a fault no
    valid input produces, injected at the model's call)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, batch, kv_cache):
        if bool((batch.input_ids == POISON_TOKEN).any()):
            raise RuntimeError("injected fault: the forward failed")
        return self.model(batch, kv_cache)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_a_forward_that_fails_with_one_request_fails_it_alone(engine, reference, monkeypatch):
    monkeypatch.setattr(engine.runner, "model", _FaultyModel(engine.runner.model))
    requests = {rid: (prompt, GREEDY) for rid, prompt in PROMPTS.items()}
    requests["culprit"] = ([11, 12, POISON_TOKEN, 13], GREEDY)
    got = _run(engine, requests)
    tokens, final = got["culprit"]
    assert final.finish_reason == "error" and final.error_code == "internal"
    assert "injected fault" in final.error and tokens == []
    for rid in PROMPTS:
        assert got[rid][0] == reference[rid] and got[rid][1].finish_reason == "length"
    # the engine goes on serving: a later batch, the culprit's prompt included, fails only the culprit again
    again = _run(engine, {"a2": (PROMPTS["a"], GREEDY), "culprit2": ([POISON_TOKEN], GREEDY)})
    assert again["a2"][0] == reference["a"] and again["culprit2"][1].error_code == "internal"
    # alone in its step, it fails alone too: a forward with no request still runs, so the engine is healthy
    alone = _run(engine, {"culprit3": ([5, POISON_TOKEN], GREEDY)})
    assert alone["culprit3"][1].error_code == "internal"


def test_a_forward_that_always_fails_is_the_engines_failure(engine, monkeypatch):
    def broken(batch, kv_cache):
        raise RuntimeError("injected fault: the device is gone")

    monkeypatch.setattr(engine.runner, "model", _Broken(engine.runner.model, broken))
    engine.add_request("x", PROMPTS["a"], GREEDY)
    with pytest.raises(RuntimeError, match="device is gone"):
        engine.step()
    engine.abort("x")
    engine.take_pending()
    _assert_all_blocks_free(engine)


class _Broken(_FaultyModel):
    def __init__(self, model, forward) -> None:
        super().__init__(model)
        self.forward = forward

    def __call__(self, batch, kv_cache):
        return self.forward(batch, kv_cache)


# ---- random, extreme-but-valid parameters never break a step -----------------------------------------

EXTREME_FLOATS = [0.0, 5e-324, 1e-45, 1e-40, 1e-30, 1e-5, 0.5, 1.0 - 1e-7, 1.0]


def _extreme_or_uniform(low: float, high: float) -> st.SearchStrategy[float]:
    extremes = [x for x in EXTREME_FLOATS if low <= x <= high]
    return st.one_of(
        st.sampled_from(extremes + [low, high]),
        st.floats(low, high, allow_nan=False, allow_infinity=False, allow_subnormal=True),
    )


def _valid_params(**kwargs) -> SamplingParams | None:
    try:
        return SamplingParams(**kwargs)
    except ValueError:
        return None


PARAMS = st.builds(
    _valid_params,
    temperature=st.one_of(st.sampled_from([0.0, 1e-6, 1e-5, 1.0, 1e30, 3e38]), st.floats(0, 100)),
    top_p=_extreme_or_uniform(0.0, 1.0),
    top_k=st.one_of(st.sampled_from([-1, 0, 1, 2, 10**6, MAX_TOP_K]), st.integers(-1, 60000)),
    min_p=_extreme_or_uniform(0.0, 1.0),
    presence_penalty=st.one_of(st.sampled_from([-2.0, 2.0, 5e-324]), st.floats(-2, 2)),
    frequency_penalty=st.one_of(st.sampled_from([-2.0, 2.0, -5e-324]), st.floats(-2, 2)),
    repetition_penalty=st.one_of(
        st.sampled_from([MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 1.0]),
        st.floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
    ),
    min_tokens=st.integers(0, 3),
    max_tokens=st.just(2),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(PARAMS.filter(lambda p: p is not None), min_size=1, max_size=3))
def test_extreme_valid_parameters_never_break_a_step(engine, batch):
    requests = {f"p{i}": ([3 + i, 90, 90, 4000 + i], params) for i, params in enumerate(batch)}
    got = _run(engine, requests)
    for rid, (tokens, final) in got.items():
        assert final.finish_reason in ("length", "stop"), (requests[rid][1], final.error)
        assert all(0 <= t < engine.vocab_size for t in tokens)
        assert all(math.isfinite(v) for row in final.logprobs or () for v in row.values())
