"""AsyncLLM and LocalEngine: deltas that add up to LLM's output, early exit aborts, errors come back as
deltas, lifecycle per mode, a failed engine step and close() never leave a caller hanging, a request past its
timeout ends with a "timeout" delta and frees its KV blocks; coordinator mode streams the same greedy tokens
and stops the processes it started."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from pathlib import Path

import pytest
from aioprocs import pid_gone

from infer import LLM, AsyncLLM, SamplingParams
from infer.client.engine_client import ClusterError, EngineClient
from infer.client.local_engine import LocalEngine
from infer.worker.engine.config import EngineConfig

ENGINE_OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
STEP_DELAY_S = 0.01  # the slowed engine's extra time per step: LONG takes more than 2 s there
PROMPTS = ["The capital of France", [5, 6, 7, 8], "a much longer prompt " * 10, "one"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(tiny_llama) -> LLM:
    """The blocking LLM in direct mode: the outputs AsyncLLM must reproduce."""
    return LLM(tiny_llama, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def direct(tiny_llama):
    """A direct-mode AsyncLLM shared by the module (a LocalEngine serves any event loop)."""
    llm = AsyncLLM(tiny_llama, **ENGINE_OPTIONS)
    asyncio.run(llm.start())
    yield llm
    asyncio.run(llm.close())


def _local_engine(model: Path) -> LocalEngine:
    from infer.worker.engine.engine import Engine

    return LocalEngine(Engine(EngineConfig.from_options(model=str(model), **ENGINE_OPTIONS)))


@pytest.fixture(scope="module")
def slow_local(tiny_llama):
    """A LocalEngine whose steps take at least STEP_DELAY_S, so LONG reliably outlives a short timeout."""
    local = _local_engine(tiny_llama)
    execute = local.engine.runner.execute

    def slowed(chunks):
        time.sleep(STEP_DELAY_S)
        return execute(chunks)

    local.engine.runner.execute = slowed  # before any request: the engine thread is idle
    yield local
    asyncio.run(local.close())


async def _assert_every_block_free(local: LocalEngine) -> None:
    stats = await local.stats()
    load = stats.workers[0].load
    assert (load.num_waiting, load.num_running, stats.num_in_flight) == (0, 0, 0)
    assert load.num_free_blocks == load.num_total_blocks


async def test_generate_yields_deltas_that_add_up_to_llms_output(direct, reference):
    expected = reference.generate("The capital of France", GREEDY, use_tqdm=False)[0]
    deltas = [d async for d in direct.generate("The capital of France", GREEDY)]
    assert len(deltas) == GREEDY.max_tokens and [d.finished for d in deltas] == [False] * 7 + [True]
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == expected.text and deltas[-1].finish_reason == "length"
    assert deltas[0].num_prompt_tokens == len(expected.prompt_token_ids)
    assert deltas[0].queue_time_s is not None


async def test_generate_batch_matches_llm_in_prompt_order(direct, reference):
    expected = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = await direct.generate_batch(PROMPTS, GREEDY)
    assert [(c.token_ids, c.text, c.prompt_token_ids, c.finish_reason) for c in got] == [
        (c.token_ids, c.text, c.prompt_token_ids, c.finish_reason) for c in expected
    ]


async def test_leaving_generate_early_aborts_the_request(direct):
    before = await direct.stats()
    async with aclosing(direct.generate("keep going", LONG)) as deltas:
        async for delta in deltas:
            assert not delta.finished
            break
    stats = await direct.stats()
    load = stats.workers[0].load
    assert (load.num_waiting, load.num_running, stats.num_in_flight) == (0, 0, 0)
    assert load.num_free_blocks == load.num_total_blocks
    assert stats.requests_aborted == before.requests_aborted + 1


async def test_a_too_long_prompt_is_an_invalid_request_delta(direct):
    [delta] = [d async for d in direct.generate("x " * 400, GREEDY)]
    assert (delta.finished, delta.finish_reason, delta.error_code) == (True, "error", "invalid_request")
    assert "context length" in delta.error


async def test_a_request_id_in_flight_is_refused_and_abort_ends_its_stream(direct):
    async with aclosing(direct.generate([1, 2, 3], LONG, request_id="dup")) as first:
        await anext(first)
        [refused] = [d async for d in direct.generate([4, 5], GREEDY, request_id="dup")]
        assert refused.error_code == "invalid_request" and "already in flight" in refused.error
        await direct.abort("dup")
        rest = [d async for d in first]
    assert rest[-1].finish_reason == "abort"


async def test_lifecycle_raises_in_direct_mode(direct):
    assert isinstance(direct.engine, LocalEngine) and isinstance(direct.engine, EngineClient)
    for command in ("pause", "unpause", "suspend", "resume"):
        with pytest.raises(RuntimeError, match=f"{command}\\(\\) needs coordinator mode"):
            await getattr(direct, command)()


async def test_a_failed_step_fails_every_request_and_then_every_call(tiny_llama, monkeypatch):
    local = _local_engine(tiny_llama)
    execute = local.engine.runner.execute
    broken = []

    def breaks_once_both_run(chunks):  # the fault: once a step holds both requests, no forward runs any more
        if len(chunks) == 2:
            broken.append(True)
        if broken:
            raise RuntimeError("injected fault")
        return execute(chunks)

    def dummy_fails_too():  # so the engine finds itself broken (one request's failure would fail it alone)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(local.engine.runner, "execute", breaks_once_both_run)
    monkeypatch.setattr(local.engine.runner, "execute_dummy", dummy_fails_too)

    async def collect(prompt):
        return [d async for d in local.stream(prompt, LONG)]

    for deltas in await asyncio.gather(collect([1, 2, 3]), collect([4, 5, 6])):
        last = deltas[-1]
        assert (last.finish_reason, last.error_code) == ("error", "internal")
        assert "injected fault" in last.error
    with pytest.raises(ClusterError, match="injected fault"):
        await local.generate([7, 8], GREEDY)
    with pytest.raises(ClusterError, match="injected fault"):
        await local.stats()
    await local.close()


async def test_close_fails_waiters_and_refuses_new_requests(tiny_llama):
    local = _local_engine(tiny_llama)
    async with aclosing(local.stream([1, 2, 3], LONG)) as deltas:
        await anext(deltas)
        await local.close()
        with pytest.raises(ClusterError, match="closed"):
            async for _ in deltas:
                pass
    assert not local._thread.is_alive()
    with pytest.raises(ClusterError, match="closed"):
        await local.generate([4, 5], GREEDY)


async def test_an_unstarted_or_closed_async_llm_says_so(tiny_llama):
    llm = AsyncLLM(tiny_llama, **ENGINE_OPTIONS)
    with pytest.raises(RuntimeError, match="not started"):
        await llm.stats()
    await llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        await llm.start()


async def test_serve_puts_the_http_front_on_the_local_engine(direct, reference):
    import openai

    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(direct.serve(port=0, served_model_name="tiny", on_ready=ready.set_result))
    try:
        url = await asyncio.wait_for(ready, 60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        models = await asyncio.to_thread(client.models.list)
        assert [m.id for m in models.data] == ["tiny"]
        answer = await asyncio.to_thread(
            client.completions.create, model="tiny", prompt="The capital of France", max_tokens=8, temperature=0
        )
        expected = reference.generate(
            "The capital of France", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
        )[0]
        assert answer.choices[0].text == expected.text
    finally:
        server.cancel()
        await asyncio.wait_for(asyncio.gather(server, return_exceptions=True), 10)


async def test_coordinator_mode_streams_the_same_tokens_and_stops_its_processes(tiny_llama, reference):
    expected = reference.generate("The capital of France", GREEDY, use_tqdm=False)[0]
    async with AsyncLLM(tiny_llama, use_coordinator=True, num_threads=1, ready_timeout=120, **ENGINE_OPTIONS) as llm:
        pids = llm.child_pids
        deltas = [d async for d in llm.generate("The capital of France", GREEDY)]
        assert len(deltas) > 1 and [t for d in deltas for t in d.token_ids] == expected.token_ids
        assert "".join(d.text for d in deltas) == expected.text

        async with aclosing(llm.generate("keep going", LONG)) as stream:
            await anext(stream)
        stats = await llm.stats()
        assert stats.num_in_flight == 0 and stats.requests_aborted == 1

        assert await llm.pause() == "paused"
        held = asyncio.create_task(llm.generate_batch("held", GREEDY))
        done, _ = await asyncio.wait([held], timeout=0.5)
        assert not done and (await llm.stats()).num_held == 1
        assert await llm.unpause() == "running"
        [completion] = await asyncio.wait_for(held, 30)
        assert completion.finish_reason == "length"
    assert len(pids) == 2 and all(pid_gone(pid) for pid in pids)


# ---- per-request timeouts (direct mode) -----------------------------------------------------------


async def test_a_stream_past_its_timeout_ends_with_a_timeout_delta_and_frees_its_blocks(slow_local):
    before = await slow_local.stats()
    started = time.monotonic()
    deltas = [d async for d in slow_local.stream([1, 2, 3], LONG, request_id="late", timeout=0.5)]
    elapsed = time.monotonic() - started
    last = deltas[-1]
    assert (last.finished, last.finish_reason, last.error_code) == (True, "error", "timeout")
    assert "'late' did not finish within its timeout of 0.5 s" in last.error
    assert 0 < sum(len(d.token_ids) for d in deltas) < LONG.max_tokens  # it ran, and was cut off
    assert not any(d.finished for d in deltas[:-1]) and elapsed >= 0.5
    await _assert_every_block_free(slow_local)
    after = await slow_local.stats()
    assert after.requests_failed == before.requests_failed + 1


async def test_generate_past_its_timeout_returns_the_timeout_instead_of_raising(slow_local):
    completion = await slow_local.generate("The capital of France", LONG, timeout=0.3)
    assert (completion.finish_reason, completion.error_code) == ("error", "timeout")
    assert completion.prompt_token_ids and len(completion.token_ids) < LONG.max_tokens
    await _assert_every_block_free(slow_local)


async def test_timeouts_cut_only_their_own_requests(slow_local, reference):
    timed = [asyncio.create_task(slow_local.generate([20 + i, 21, 22], LONG, timeout=0.4)) for i in range(3)]
    untimed = [asyncio.create_task(slow_local.generate(p, GREEDY)) for p in PROMPTS]  # in the same batches
    assert [c.error_code for c in await asyncio.gather(*timed)] == ["timeout"] * 3
    done = await asyncio.gather(*untimed)
    expected = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [(c.token_ids, c.finish_reason) for c in done] == [(c.token_ids, c.finish_reason) for c in expected]
    await _assert_every_block_free(slow_local)


async def test_a_finished_requests_deadline_does_not_touch_a_later_request_with_its_id(slow_local):
    # 8 steps well inside 2 s, on a loaded machine too (0.4 s was not, beside a whole suite on 2 cores)
    first = await slow_local.generate([4, 5, 6], GREEDY, request_id="again", timeout=2.0)
    assert first.finish_reason == "length"
    longer = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)  # >= 2.5 s: past the first's deadline
    second = await slow_local.generate([4, 5, 6], longer, request_id="again")
    assert (second.finish_reason, len(second.token_ids)) == ("length", 250)


@pytest.mark.parametrize("timeout", [0, -1.0, 7 * 86400.0 + 1, float("nan"), True, "5"])
async def test_an_invalid_timeout_raises_value_error(direct, timeout):
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        [d async for d in direct.engine.stream([1, 2], GREEDY, timeout=timeout)]
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        await direct.engine.generate([1, 2], GREEDY, timeout=timeout)
    await _assert_every_block_free(direct.engine)


async def test_a_request_id_longer_than_a_delta_carries_raises_value_error(direct):
    """The engine's output is the wire's Delta, whose request id has at most 256 characters (as a cluster's)."""
    with pytest.raises(ValueError, match="request_id must be at most 256 characters"):
        await direct.engine.generate([1, 2], GREEDY, request_id="r" * 257)
    assert (await direct.engine.generate([1, 2], GREEDY, request_id="r" * 256)).finish_reason == "length"
    await _assert_every_block_free(direct.engine)


async def test_deadlines_of_finished_requests_do_not_pile_up(direct):
    one = SamplingParams(temperature=0, max_tokens=1)
    for _ in range(20):  # 400 requests with a deadline an hour away, each done in a step or two
        await asyncio.gather(*(direct.engine.generate([1, 2, i], one, timeout=3600) for i in range(20)))
    assert len(direct.engine._deadlines) <= 2 * 20 + 64 + 1  # finished ones are pruned, not kept an hour


def test_n_samples_through_asyncllm_batch_and_stream(direct, reference):
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=11, n=2)
    expected = reference.generate("hello", params, use_tqdm=False)[0]

    async def run():
        batch = (await direct.generate_batch(["hello"], params))[0]
        texts: dict[str, list[int]] = {}
        finished = []
        async for delta in direct.generate("hello", params, request_id="req"):
            texts.setdefault(delta.request_id, []).extend(delta.token_ids)
            if delta.finished:
                finished.append(delta.request_id)
        return batch, texts, finished

    batch, streamed, finished = asyncio.run(run())
    assert [o.token_ids for o in batch.outputs] == [o.token_ids for o in expected.outputs]
    assert sorted(finished) == ["req-0", "req-1"]
    assert [streamed["req-0"], streamed["req-1"]] == [o.token_ids for o in expected.outputs]


async def test_local_engine_start_builds_on_the_engine_thread_and_reports_what_failed(tiny_llama):
    """LocalEngine.start builds the engine on the thread that steps it (libgomp: an engine built with all cores on
    one thread and stepped on another decoded at half speed); a build that raises reaches the caller; one that
    outlasts the timeout is a TimeoutError, and the engine is closed once built."""
    import threading

    from infer.worker.engine.engine import Engine

    built_on: list[str] = []
    closed = threading.Event()

    def make() -> Engine:
        built_on.append(threading.current_thread().name)
        return Engine(EngineConfig.from_options(model=str(tiny_llama), **ENGINE_OPTIONS))

    local = await LocalEngine.start(make, timeout=120)
    try:
        assert built_on == ["infer-local-engine"] and local.engine is not None
        done = await local.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(done.token_ids) == 3
    finally:
        await local.close()

    def broken() -> Engine:
        raise ValueError("no such model: /nowhere")

    with pytest.raises(ValueError, match="no such model"):
        await LocalEngine.start(broken, timeout=120)

    def slow() -> Engine:
        time.sleep(1.0)
        engine = make()
        real_close = engine.close
        engine.close = lambda: (real_close(), closed.set())  # type: ignore[method-assign]
        return engine

    with pytest.raises(TimeoutError):
        await LocalEngine.start(slow, timeout=0.2)
    assert await asyncio.to_thread(closed.wait, 120)
