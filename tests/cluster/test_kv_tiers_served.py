"""The KV tiers beyond the pool as a user runs them: `infer-serve` (two workers of the tiny Llama, kv-aware routing)
with a pool of 48 blocks a worker, a host-memory tier of ~13 blocks and a disk tier under it (`--kv-offload-host-gb`,
`--kv-offload-dir`, `--kv-offload-gb`), and the official `openai` client. Conversations whose prompts grow turn after
turn, more of them than the pools hold, get the same greedy text as one in-process engine whose pool holds everything;
the workers loaded blocks back from host memory and from disk, and none was corrupt."""

from __future__ import annotations

import random
import time

import openai
from serve_harness import Served

from infer import LLM, SamplingParams
from infer.client.inference_client import SyncInferenceClient

FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--threads", "1", "--policy", "kv-aware"]
# 400 kB of KV pool: 48 blocks of 16 tokens (a token of the tiny Llama: 2 layers x K, V x 2 heads x 16 x 4 bytes)
SMALL_POOL = ["--kv-cache-memory", "400000"]
HOST_GB = "0.0001"  # ~107 kB: 13 blocks, so most of what the pools evict moves on down to disk
# 12 conversations of up to 184 prompt tokens (12 blocks): however they are spread over the two workers, from the
# third turn on they outgrow the pools (2 x 48 blocks), and each turn in the same order evicts the next one's prefixes
CONVERSATIONS, TURNS, FIRST, LATER, ANSWER = 12, 4, 64, 40, 6


def conversations() -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn: every prompt is the one before it and some new tokens."""
    rng = random.Random(47)
    out = []
    for _ in range(CONVERSATIONS):
        prompt = [rng.randrange(3, 1000) for _ in range(FIRST)]
        turns = [prompt]
        for _ in range(TURNS - 1):
            prompt = prompt + [rng.randrange(3, 1000) for _ in range(LATER)]
            turns.append(prompt)
        out.append(turns)
    return out


def test_conversations_past_the_pools_come_back_from_host_memory_and_disk_exactly(tiny_llama, tmp_path):
    chats = conversations()
    llm = LLM(model=str(tiny_llama), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)
    flat = [prompt for turns in chats for prompt in turns]
    reference = dict(zip(map(tuple, flat), (c.text for c in llm.generate(flat, params, use_tqdm=False)), strict=True))
    spill = tmp_path / "kv"
    spill.mkdir()
    tiers = ["--kv-offload-host-gb", HOST_GB, "--kv-offload-dir", str(spill), "--kv-offload-gb", "1"]
    served = Served(tiny_llama, tmp_path / "serve.log", "tiny", [*FLAGS, *SMALL_POOL, *tiers])
    try:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for turn in range(TURNS):  # every conversation's turn, then the next turn: each evicts the others
            for turns in chats:
                reply = client.completions.create(
                    model="tiny", prompt=turns[turn], max_tokens=ANSWER, temperature=0, extra_body={"ignore_eos": True}
                )
                assert reply.choices[0].text == reference[tuple(turns[turn])], f"turn {turn}"
        time.sleep(0.6)  # a heartbeat or two: the counters of the last steps
        with SyncInferenceClient(served.address, connect_timeout=30) as cluster:
            loads = [w.load for w in cluster.stats().workers]
    finally:
        served.stop()
    assert sum(load.kv_offload_host_loaded_blocks for load in loads) > 0
    assert sum(load.kv_offload_loaded_blocks for load in loads) > 0  # pushed out of host memory, read back from disk
    assert sum(load.kv_offload_corrupt_blocks + load.kv_offload_host_corrupt_blocks for load in loads) == 0
