"""Hostile input on a real cluster (a coordinator and 2 `infer-worker` processes on the tiny Llama, the HTTP
front in this process): issue 16's poison — `/v1/completions` with temperature 1.0, top_p 0.5,
repetition_penalty 1e-50 — once killed every worker in turn. Now it is a 400 naming the field over HTTP and
a refused frame for a client that skips our library's checks; a long request running meanwhile completes,
and both workers stay up (healthy, never re-registered)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import msgpack
import zmq
import zmq.asyncio

from infer import SamplingParams
from infer.client.api.config import FrontConfig
from infer.client.api.server import HttpFront
from infer.protocol.messages import PROTOCOL_VERSION, Error, decode

POISON = dict(temperature=1.0, top_p=0.5, repetition_penalty=1e-50)
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def _raw_submit(address: str, sampling: dict) -> Error:
    """A Submit packed by hand (our client library would refuse to build it); the coordinator's answer."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        body = {"request_id": "raw-poison", "spec": {"prompt": "Hello", "sampling": sampling}}
        await sock.send(msgpack.packb({"type": "submit", "v": PROTOCOL_VERSION, "body": body}, use_bin_type=True))
        assert await sock.poll(30_000), "the coordinator did not answer the raw Submit"
        return decode(await sock.recv())
    finally:
        sock.close()
        ctx.term()


async def test_the_issue_16_poison_is_refused_and_the_workers_keep_serving(model_cluster, smollm2_tokenizer):
    cluster = model_cluster(workers=2)
    async with cluster.client() as client:
        front = HttpFront(client, smollm2_tokenizer, FrontConfig(served_model_name="tiny"), port=0)
        front.bind()
        serving = asyncio.create_task(front.serve())
        try:
            long = asyncio.create_task(client.generate([3, 4, 5, 6], LONG))
            status, body = await asyncio.to_thread(
                _post, f"{front.url}/v1/completions", dict(model="tiny", prompt="Hello", max_tokens=8, **POISON)
            )
            assert status == 400 and "repetition_penalty" in body, body
            refused = await _raw_submit(cluster.address, {**POISON, "max_tokens": 8})
            assert isinstance(refused, Error) and "repetition_penalty" in refused.message
            done = await long
            # and a sampled request with top_p 0.5 and a (valid) strong repetition penalty runs to its end
            sampled = await client.generate(
                "Hello",
                SamplingParams(temperature=1.0, top_p=0.5, max_tokens=8, repetition_penalty=1e-3, ignore_eos=True),
            )
        finally:
            front.shutdown()
            await serving
        stats = await client.stats()
    assert done.finish_reason == "length" and len(done.token_ids) == LONG.max_tokens
    assert sampled.finish_reason == "length" and len(sampled.token_ids) == 8
    assert [(w.healthy, w.registrations) for w in stats.workers] == [(True, 1), (True, 1)]
    assert stats.requests_redispatched == 0
    assert all(p.popen.poll() is None for p in cluster.procs), cluster.dump()
