"""A prompt far too long for the context, sent over ZeroMQ to a real coordinator and worker (the tiny Llama,
max_model_len 256): the worker refuses it before tokenizing (tokenizing 20 MB takes seconds on its loop,
long enough to miss heartbeats and be declared dead), so the refusal comes at once, as invalid_request,
while another request on the same worker streams on and the worker stays healthy (nothing re-dispatched)."""

from __future__ import annotations

import asyncio
import time

from infer.protocol.sampling import SamplingParams

HUGE_PROMPT = "hello world " * (20_000_000 // 12)   # 20 MB
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


async def _refusal_while_streaming(cluster) -> None:
    async with cluster.client() as client:
        done = []
        async with asyncio.timeout(60):
            stream = client.stream([3, 4, 5], LONG)
            done.append(await anext(stream))
            started = time.monotonic()
            refused = await client.generate(HUGE_PROMPT, SamplingParams(max_tokens=4))
            elapsed = time.monotonic() - started
            done.extend([delta async for delta in stream])
        assert refused.finish_reason == "error" and refused.error_code == "invalid_request", refused
        assert "refused without tokenizing" in refused.error and "256 tokens" in refused.error
        assert elapsed < 1.0, f"the refusal took {elapsed:.1f} s"   # at once, not after tokenizing
        assert sum(len(d.token_ids) for d in done) == 200 and done[-1].finish_reason == "length"
        stats = await client.stats()
        assert stats.requests_redispatched == 0 and stats.num_healthy_workers == 1
        assert stats.workers[0].registrations == 1
        again = await client.generate("hello world " * 10, SamplingParams(max_tokens=4, temperature=0))
        assert again.finish_reason == "length" and len(again.token_ids) == 4


def test_a_20_mb_prompt_is_refused_at_once_while_another_stream_continues(model_cluster):
    cluster = model_cluster(workers=1)
    asyncio.run(_refusal_while_streaming(cluster))
