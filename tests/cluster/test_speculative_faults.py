"""kill -9 of a worker mid-stream with speculative decoding on: only accepted tokens are ever delivered, so the
coordinator's re-dispatch (prompt + delivered tokens) continues every stream exactly as a run without a fault
and without speculation: greedy streams on the tiny Llama, and sampled (seeded or not) streams of multi-byte
text with stop strings on the word-chain model."""

from __future__ import annotations

import json
import random

from fault_streams import (
    CHAIN_PROMPTS,
    assert_exact_streams,
    assert_same_streams,
    chain_params,
    replayed_without_a_fault,
    streams_through_a_fault,
)

from infer import LLM, SamplingParams

SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "disable_by_batch_size": 64,
    }
)
# tests/cluster/conftest.py's ENGINE_FLAGS, with speculation
SPEC_FLAGS = (
    "--dtype",
    "float32",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "8000000",
    "--threads",
    "1",
    "--speculative-config",
    SPEC,
)
GREEDY = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
PROMPTS = [[(i * 7 + j * 13) % 300 + 3 for j in range(5)] * 4 for i in range(8)]  # repeating: drafts can be right


def _accepted(stats) -> int:
    return sum(w.load.spec_decode_num_accepted_tokens for w in stats.workers if w.load is not None)


async def _kill_the_busiest(cluster, client) -> None:
    victim = max((await client.stats()).workers, key=lambda w: w.num_in_flight)
    assert victim.num_in_flight > 0
    cluster.proc_of(victim.worker_id).kill9()


async def test_greedy_streams_are_exact_after_kill_9_with_speculation(model_cluster, tiny_llama):
    cluster = model_cluster(workers=2, engine_flags=SPEC_FLAGS)
    reference = LLM(
        model=str(tiny_llama), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1
    ).generate(PROMPTS, GREEDY, use_tqdm=False)
    strike_after = random.randint(3, 8)
    streams, after = await streams_through_a_fault(
        cluster, PROMPTS, GREEDY, lambda client: _kill_the_busiest(cluster, client), strike_after=strike_after
    )
    assert after.requests_redispatched > 0
    assert_exact_streams(streams, [want.token_ids for want in reference])
    assert _accepted(after) > 0  # the survivor speculated (and some drafts were right)
    assert any(len(d.token_ids) > 1 for deltas in streams for d in deltas)  # a step delivered several tokens


async def test_sampled_streams_are_exact_after_kill_9_with_speculation(model_cluster, word_chain_model):
    cluster = model_cluster(workers=2, model=word_chain_model, engine_flags=SPEC_FLAGS)
    params = [chain_params(i) for i in range(len(CHAIN_PROMPTS))]
    strike_after = random.randint(3, 8)
    streams, after = await streams_through_a_fault(
        cluster, CHAIN_PROMPTS, params, lambda client: _kill_the_busiest(cluster, client), strike_after=strike_after
    )
    assert after.requests_redispatched > 0
    reference = await replayed_without_a_fault(word_chain_model, CHAIN_PROMPTS, streams, params)
    assert_same_streams(streams, reference, f" (struck after {strike_after} deltas)")
    assert _accepted(after) > 0
