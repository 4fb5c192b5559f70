"""Routing by what the workers hold, through real processes (a coordinator and 2 tiny-Llama workers on loopback,
and infer-serve with the official `openai` client): under --policy kv-aware a conversation's later turns go to the
rank whose prefix cache holds it (its hit counter proves the blocks were reused), the blocks a worker evicts move
routing away, a killed worker's entries go with it (a new process at its rank holds nothing), the outputs equal
least-loaded's token for token (greedy), and X-Session-ID pins a chat to its rank. Each turn waits until the
coordinator counted the previous one done: the KvEvents of a step ride on the StepBatch that ends the request."""

from __future__ import annotations

import urllib.request

import openai
import pytest
from serve_harness import Served

from infer.client.inference_client import SyncInferenceClient
from infer.protocol.sampling import SamplingParams

ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 400 kB of KV pool: 48 blocks of 16 tokens (a token of the tiny Llama: 2 layers x K, V x 2 heads x 16 x 4 bytes)
SMALL_POOL = [*ENGINE_FLAGS[:4], "--kv-cache-memory", "400000", "--threads", "1"]


def turns(first: list[int], count: int) -> list[list[int]]:
    """The new user tokens of each turn of a conversation (turn 0: its first prompt)."""
    return [first] + [[(7 * t + i) % 400 + 3 for i in range(8)] for t in range(1, count)]


async def stats_by_rank(client) -> dict[int, object]:
    stats = await client.stats()
    return {w.dp_rank: w for w in stats.workers if w.healthy}


async def completed(client) -> int:
    return (await client.stats()).requests_completed


async def converse(client, wait_until, user_turns, pin_first: int | None = None):
    """Run a conversation: each prompt is everything so far plus the turn's tokens; returns (outputs, ranks)."""
    history: list[int] = []
    outputs, ranks = [], []
    for t, user in enumerate(user_turns):
        before = await stats_by_rank(client)
        done = await completed(client)
        history = history + user
        pin = pin_first if t == 0 else None
        completion = await client.generate(history, GREEDY, pin_rank=pin)
        await wait_until(lambda: _more(client, done), 60, "the coordinator to count the turn done")
        after = await stats_by_rank(client)
        (rank,) = [r for r in after if after[r].requests_routed > before[r].requests_routed]
        outputs.append(completion.token_ids)
        ranks.append(rank)
        history = history + completion.token_ids
    return outputs, ranks


async def _more(client, done: int) -> bool:
    return await completed(client) > done


def hits(stats, rank: int) -> int:
    load = stats[rank].load
    return 0 if load is None else load.prefix_cache_hits  # None: a worker just joined, before its first report


async def test_turns_follow_the_cache_evictions_move_them_and_a_killed_worker_holds_nothing(
    model_cluster, tiny_llama, wait_until
):
    cluster = model_cluster(coordinator_flags=("--policy", "kv-aware"), engine_flags=tuple(SMALL_POOL))
    conversation = turns(list(range(100, 140)), 4)
    async with cluster.client() as client:
        # The first turn is pinned to rank 1 (idle ranks tie: least-loaded would take rank 0 every time).
        start = await stats_by_rank(client)
        outputs, ranks = await converse(client, wait_until, conversation, pin_first=1)
        assert ranks == [1, 1, 1, 1]
        now = await stats_by_rank(client)
        # turns 2..4 reused every full block the turn before computed (its prompt and all but the last token it
        # generated): 47 // 16 * 16 = 32 tokens, then 63 -> 48, then 79 -> 64
        assert hits(now, 1) - hits(start, 1) >= 32 + 48 + 64
        assert hits(now, 0) == hits(start, 0)
        # The coordinator's own account (ModelStats, the front's /metrics): the index holds rank 1's blocks, and the
        # turns it routed by overlap were expected to hit what they did hit.
        (model,) = (await client.stats()).models
        assert model.kv_index_entries >= 64 // 16
        assert model.kv_routed_cached_tokens >= 32 + 48 + 64
        assert model.kv_routed_prompt_tokens > model.kv_routed_cached_tokens

        # Evictions: fill rank 1's pool with other prompts; what it reports evicted no longer draws the conversation.
        history = [t for user, out in zip(conversation, outputs) for t in user + out]
        for i in range(5):
            done = await completed(client)
            await client.generate([(i * 31 + j) % 500 + 1 for j in range(200)], GREEDY, pin_rank=1)
            await wait_until(lambda: _more(client, done), 60, "the filler to end")
        _, moved = await converse(client, wait_until, [history + [9, 9, 9, 9]])
        assert moved == [0]  # nothing cached anywhere now (rank 1 evicted it): the least loaded, rank 0

        # Rank 0 now holds the conversation; rank 1 gets a longer branch of it. Then rank 1's worker is killed -9
        # and a new process registers under the same worker id (so at rank 1), with an empty cache: the dead one's
        # entries must count for nothing, or the branch's next turn would go to rank 1 for its longer prefix.
        branch = history + [9, 9, 9, 9] + list(range(200, 240))
        _, pinned = await converse(client, wait_until, [branch], pin_first=1)
        assert pinned == [1]
        victim = cluster.proc_of(next(w.worker_id for w in (await client.stats()).workers if w.dp_rank == 1))
        victim.kill9()
        await wait_until(lambda: _healthy(client, 1), 60, "rank 1 declared dead")
        cluster.worker(1, *SMALL_POOL, "--worker-id", victim.worker_id, model=tiny_llama)
        await wait_until(lambda: _healthy(client, 2), 120, "the new process at rank 1")
        _, after_kill = await converse(client, wait_until, [branch + [5, 6]])
        assert after_kill == [0]

    # The same conversation under least-loaded: the same tokens, turn by turn (greedy).
    plain = model_cluster(engine_flags=tuple(SMALL_POOL))
    async with plain.client() as client:
        plain_outputs, plain_ranks = await converse(client, wait_until, conversation, pin_first=1)
    assert plain_outputs == outputs
    assert plain_ranks == [1, 0, 0, 0]  # least-loaded: idle ranks tie, the lower wins; the cache is left behind


async def _healthy(client, count: int) -> bool:
    return len(await stats_by_rank(client)) == count


# ---- the HTTP front: X-Session-ID --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    server = Served(
        tiny_llama, tmp_path_factory.mktemp("serve") / "serve.log", "tiny", ["--policy", "kv-aware", *ENGINE_FLAGS]
    )
    yield server
    server.stop()


def test_x_session_id_pins_a_chat_to_its_rank_with_the_official_client(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with SyncInferenceClient(served.address, connect_timeout=30) as cluster:

        def ask(content: str, session: str | None, chat: bool = True) -> int:
            """One chat turn (or a plain completion); the DP rank it ran on (the one whose routed count moved)."""
            before = {w.dp_rank: w.requests_routed for w in cluster.stats().workers}
            headers = {} if session is None else {"X-Session-ID": session}
            common = dict(model="tiny", max_tokens=4, temperature=0, extra_headers=headers)
            if chat:
                reply = client.chat.completions.create(messages=[{"role": "user", "content": content}], **common)
            else:
                reply = client.completions.create(prompt=content, **common)
            assert reply.choices[0].finish_reason in ("length", "stop")
            after = {w.dp_rank: w.requests_routed for w in cluster.stats().workers}
            (rank,) = [r for r in after if after[r] > before[r]]
            return rank

        # A long stream keeps rank 0 busy while the session's first turn arrives: the session starts on rank 1.
        hog = client.completions.create(
            model="tiny", prompt="busy", max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(hog))
        assert ask("the first turn of beta", "beta") == 1
        for _ in hog:
            pass
        # The session returns to rank 1 with every turn; so does a prompt sharing nothing with what rank 1 holds
        # (no chat template either), where kv-aware alone takes the lower of two idle ranks, as it does without the
        # header.
        assert [ask(f"turn {t} of beta, about something else", "beta") for t in range(3)] == [1, 1, 1]
        assert ask("zebra quokka yak, nothing cached anywhere", "beta", chat=False) == 1
        assert ask("narwhal okapi ibex, nothing cached either", None, chat=False) == 0

        with pytest.raises(openai.BadRequestError, match="X-Session-ID"):
            ask("hi", "s" * 300)
        assert ask("still serving", "beta") == 1

        # A prompt of several blocks asked again, with no session: the policy routes it by what a rank now holds
        # (once that rank's events are in: the request ends on the stream before its StepBatch reaches the
        # coordinator), and counts the tokens it expected to hit.
        long_prompt = " ".join(f"word{i}" for i in range(60))
        for _ in range(50):
            ask(long_prompt, None, chat=False)
            if cluster.stats().models[0].kv_routed_cached_tokens > 0:
                break
        assert cluster.stats().models[0].kv_routed_cached_tokens >= 16

    # The index on the front's /metrics: what the workers hold, and the routed tokens of the turns above.
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    series = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("infer:kv_")}
    assert series["infer:kv_index_entries"] > 0
    assert series["infer:kv_routed_prompt_tokens_total"] >= series["infer:kv_routed_cached_tokens_total"] > 0
    assert series["infer:kv_index_resyncs_total"] >= 0
