"""long_prefill_token_threshold through the engine's options: validated by name (EngineConfig, LLM, infer-worker's
flag), handed on by infer-serve (an explicit 0 included), a kv_producer's default of a quarter of its step budget,
and on the tiny Llama (1 thread): short prompts behind a long one get their first token while it still prefills,
with greedy outputs equal to those without the threshold. Steps are counted, never timed."""

from __future__ import annotations

from collections import defaultdict

import pytest

from infer import LLM, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an integer >= 0 \(0: off\)"),
        (dict(long_prefill_token_threshold=1.5), r"must be an integer >= 0 \(0: off\), got 1.5"),
        (dict(long_prefill_token_threshold="8"), r"must be an integer >= 0 \(0: off\), got '8'"),
        (dict(long_prefill_token_threshold=True), r"must be an integer >= 0 \(0: off\), got True"),
        (
            dict(long_prefill_token_threshold=16, enable_chunked_prefill=False),
            r"long_prefill_token_threshold \(16\) needs chunked prefill \(--enable-chunked-prefill\)",
        ),
    ],
)
def test_a_bad_threshold_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):
        LLM(**options)  # the engine options are checked before anything starts


def test_zero_and_none_are_accepted_without_chunked_prefill():
    assert EngineConfig(enable_chunked_prefill=False, long_prefill_token_threshold=0).long_prefill_token_threshold == 0
    assert EngineConfig(enable_chunked_prefill=False).long_prefill_token_threshold is None


def test_a_kv_producer_defaults_to_a_quarter_of_its_step_budget_and_a_given_value_wins():
    def on(role: str, **options) -> int | None:
        return EngineConfig(**options).for_kv_role(role).long_prefill_token_threshold

    assert on("kv_producer") == 512  # a quarter of the default 2048
    assert on("kv_producer", max_num_batched_tokens=1000) == 250
    assert on("kv_producer", max_num_batched_tokens=2) == 1
    assert on("kv_producer", long_prefill_token_threshold=0) == 0  # off, as asked
    assert on("kv_producer", long_prefill_token_threshold=100) == 100
    assert on("kv_producer", enable_chunked_prefill=False) is None  # nothing to cap: off
    assert on("kv_consumer") is None and on("kv_both") is None  # the engine's 0
    assert on("kv_both", long_prefill_token_threshold=64) == 64


def test_the_flag_reaches_the_worker_and_infer_serve_hands_it_on_even_at_zero():
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args
    from infer.worker.service.cli import build_parser as worker_parser
    from infer.worker.service.cli import engine_config

    worker = ["--coordinator", "tcp://h:1"]
    assert engine_config(worker_parser().parse_args(worker)).long_prefill_token_threshold is None
    args = worker_parser().parse_args([*worker, "--long-prefill-token-threshold", "64"])
    assert engine_config(args).long_prefill_token_threshold == 64
    with pytest.raises(ValueError, match=r"long_prefill_token_threshold must be an integer >= 0"):
        engine_config(worker_parser().parse_args([*worker, "--long-prefill-token-threshold", "-5"]))
    for value in ("0", "300"):  # 0 too: it turns a producer's default off, so it must not be dropped as a default
        served = worker_args(serve_parser().parse_args(["--long-prefill-token-threshold", value]), [])
        assert engine_config(worker_parser().parse_args([*worker, *served])).long_prefill_token_threshold == int(value)


@pytest.mark.parametrize(
    "flags, threshold",
    [
        (["--kv-transfer-config", '{"kv_role": "kv_producer"}'], 512),
        (["--kv-transfer-config", '{"kv_role": "kv_producer"}', "--max-num-batched-tokens", "4096"], 1024),
        (["--kv-transfer-config", '{"kv_role": "kv_producer"}', "--long-prefill-token-threshold", "0"], 0),
        (["--kv-transfer-config", '{"kv_role": "kv_consumer"}'], None),
        ([], None),
    ],
)
def test_infer_worker_gives_a_producer_its_default_threshold(flags, threshold):
    from infer.worker.service.cli import build_parser, engine_config, role_engine_config, worker_flags, worker_options

    args = build_parser().parse_args(["--coordinator", "tcp://h:1", *flags])
    options = worker_options(args, worker_flags(args))
    assert role_engine_config(engine_config(args), options).long_prefill_token_threshold == threshold


def _first_tokens(model_dir, threshold: int) -> tuple[dict[str, int], dict[str, list[int]]]:
    """A 120-token prompt, then three short ones a step later, at 32 tokens a step: the step at which each request's
    first token came, and every request's tokens."""
    engine = Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory=4 << 20,
            max_num_batched_tokens=32,
            long_prefill_token_threshold=threshold,
            num_threads=1,
        )
    )
    engine.add_request("long", [(7 * j) % 900 + 3 for j in range(120)], GREEDY)
    shorts = {"s1": [5, 6, 7], "s2": [8, 9, 10, 11, 12], "s3": list(range(20, 28))}
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = defaultdict(list)
    for n in range(200):
        if n == 1:
            for rid, prompt in shorts.items():
                engine.add_request(rid, prompt, GREEDY)
        if n > 1 and not engine.has_unfinished():
            return first, dict(tokens)
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.token_ids:
                first.setdefault(out.request_id, n)
    raise AssertionError("no progress")


def test_short_prompts_get_their_first_token_beside_a_long_prefill_with_the_same_greedy_outputs(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    capped_first, capped = _first_tokens(model_dir, threshold=8)
    plain_first, plain = _first_tokens(model_dir, threshold=0)
    # 8 tokens of the long prompt and the three short ones (3 + 5 + 8, none over the threshold) in one step
    assert [capped_first[rid] for rid in ("s1", "s2", "s3")] == [1, 1, 1]
    assert capped_first["long"] == 14  # 120 tokens, 8 a step: its 15th step samples
    # without the threshold the long prompt takes the whole budget until its last chunk (24 tokens, step 3)
    assert plain_first["long"] == 3 and all(plain_first[rid] >= 3 for rid in ("s1", "s2", "s3"))
    assert capped == plain and all(len(t) == 5 for t in plain.values())
