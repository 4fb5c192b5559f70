"""Admission control and deadlines on a real cluster (coordinator + a tiny-Llama worker, real sockets).

Stopping the worker (SIGSTOP: connected, silent, within the worker timeout) or pausing the cluster keeps
accepted requests on their worker without finishing them, so the cases are deterministic: a full worker
makes the next request fail at once as "overloaded" while the accepted ones complete, and a request past
its `timeout` ends with error code "timeout" and its KV blocks come back even though its worker was paused.
"""

from __future__ import annotations

import asyncio
import signal

from infer import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # the tiny Llama: ~1 s of decoding


async def _first_delta(agen):
    return await asyncio.wait_for(agen.__anext__(), 30)


async def _rest(agen, first):
    deltas = [first]
    async for delta in agen:
        deltas.append(delta)
    return deltas


async def test_a_full_worker_refuses_the_next_request_at_once_and_finishes_the_accepted(model_cluster):
    cluster = model_cluster(workers=1, coordinator_flags=("--max-requests-per-worker", "2"))
    async with cluster.client() as client:
        streams = [client.stream([5 + i, 6, 7], LONG) for i in range(2)]
        firsts = [await _first_delta(s) for s in streams]
        worker = next(p for p in cluster.procs if p.name == "worker0")
        worker.popen.send_signal(signal.SIGSTOP)  # both stay on the worker, unfinished
        try:
            refused = await asyncio.wait_for(client.generate([9, 9, 9], LONG), 3)
        finally:
            worker.popen.send_signal(signal.SIGCONT)
        assert refused.finish_reason == "error" and refused.error_code == "overloaded"
        assert "overloaded" in refused.error and "retry later" in refused.error
        finished = [await _rest(s, f) for s, f in zip(streams, firsts)]
        assert all(d[-1].finish_reason == "length" and sum(len(x.token_ids) for x in d) == 60 for d in finished)
        later = await client.generate([9, 9, 9], LONG)  # room again
        assert later.finish_reason == "length" and len(later.token_ids) == 60
        for _ in range(600):  # the last delta comes straight from the worker, the coordinator's count a moment later
            stats = await client.stats()
            if stats.requests_completed >= 3:
                break
            await asyncio.sleep(0.05)
        assert stats.requests_rejected == 1 and stats.requests_completed == 3


async def test_a_request_past_its_timeout_is_aborted_and_its_kv_freed(model_cluster, wait_until):
    cluster = model_cluster(workers=1)
    async with cluster.client() as client:
        stream = client.stream([5, 6, 7, 8] * 8, LONG, timeout=1.5)
        first = await _first_delta(stream)
        await client.pause()  # it cannot finish now: the deadline must end it
        deltas = await asyncio.wait_for(_rest(stream, first), 10)
        final = deltas[-1]
        assert final.finish_reason == "error" and final.error_code == "timeout" and "timeout" in final.error

        async def kv_free():
            (worker,) = (await client.stats()).workers
            return (
                worker.load is not None
                and worker.load.num_running == 0
                and worker.load.num_free_blocks == worker.load.num_total_blocks
            )

        await wait_until(kv_free, 10, "the timed-out request's KV blocks to be freed")
        await client.unpause()
        stats = await client.stats()
        assert stats.requests_timed_out == 1 and stats.num_in_flight == 0
        done = await client.generate([5, 6, 7], LONG, timeout=60)  # a generous deadline changes nothing
        assert done.finish_reason == "length" and len(done.token_ids) == 60
