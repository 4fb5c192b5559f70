"""What the cluster tests of multi-process DP ranks (TP groups, pipelines) share: a port for a rendezvous,
waiting for the ranks, the processes under a supervising infer-worker, their state, and the prompts and batches
whose greedy tokens the tests compare with transformers."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from ports import reserved_port

from infer.client.inference_client import SyncInferenceClient

__all__ = ["children", "members_named", "prompts", "ready", "reserved_port", "state", "twice_in_one_batch"]


def ready(cluster, workers: int) -> None:
    """Wait until `workers` DP ranks are healthy (the cluster's logs printed if they are not within 180 s)."""
    try:
        with SyncInferenceClient(cluster.address, connect_timeout=30) as client:
            client.wait_for_workers(workers, timeout=180)
    except BaseException:
        print(cluster.dump())
        raise


def children(pid: int) -> list[int]:
    """The pids of the direct children of `pid`."""
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def launched(pid: int) -> list[int]:
    """The processes a launcher (infer-serve, LLM's coordinator mode) started: its children, each fork server
    (client/worker_forks.py) among them replaced by the workers it forked (their command lines are their own); none
    once the launcher is gone."""
    found = []
    try:
        for child in children(pid):
            try:
                if b"worker_forks.py" not in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(child)
                    continue
                found += children(child)
            except FileNotFoundError:  # it ended meanwhile
                continue
    except FileNotFoundError:
        pass
    return found


def members_named(supervisor: int, name: str) -> list[int]:
    """The members of a supervising infer-worker with this process name ("infer-tp1", "infer-pp1": it forks them,
    worker/parallel/tp_supervisor.py member_name; their command line is its own)."""
    found = []
    for pid in children(supervisor):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except FileNotFoundError:
            continue
    return found


def state(pid: int) -> str:
    """The process state letter of `pid` ("Z" when it is gone too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "Z"


def prompts(count: int, seed: int) -> list[list[int]]:
    """`count` prompts of 2..69 random ids, then two that share a prefix of 40 (2+ full blocks: cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(2, 70))] for _ in range(count)]
    return prompts + [shared + p[:5] for p in prompts[:2]]


async def twice_in_one_batch(cluster, prompts: list, params) -> list[list[list[int]]]:
    """Every prompt at once, twice: the second round hits the prefix cache."""
    async with cluster.client() as client:
        rounds = []
        for _ in range(2):
            done = await asyncio.wait_for(asyncio.gather(*(client.generate(p, params) for p in prompts)), 180)
            rounds.append([c.token_ids for c in done])
    assert sum(c.num_cached_tokens for c in done) >= 16 * sum(len(p) // 16 for p in prompts) // 2
    return rounds
