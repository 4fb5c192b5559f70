"""What the model-family cluster tests share (tests/cluster/test_*families*, sliding windows, DeepSeek MoE, GPT-OSS,
TP): the engine flags of a tiny fp32 model, a module's models made once with transformers' greedy tokens beside
them, a batch of prompts through one client, and the TP 2 x EP 2 launch (two EP ranks, each a TP group of 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from group_procs import ready, reserved_port
from hf_reference import transformers_greedy

from infer import SamplingParams

ENGINE_FLAGS = ("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000", "--threads", "1",
                "--block-size", "4")  # fmt: skip
TP_FLAGS = ("--tp-size", "2", "--tp-timeout", "5", "--max-num-batched-tokens", "32")


def greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)


def models_made_once(
    tmp_path_factory, build: Callable[[str, Path], Path], prompts: Sequence[Sequence[int]], max_new: int
) -> Callable[[str], tuple[Path, list[list[int]]]]:
    """name -> (model directory, transformers' greedy tokens on `prompts`), each built by `build(name, folder)` once."""
    made: dict[str, tuple[Path, list[list[int]]]] = {}

    def make(name: str) -> tuple[Path, list[list[int]]]:
        if name not in made:
            path = build(name, tmp_path_factory.mktemp(name))
            made[name] = path, transformers_greedy(path, prompts, max_new)
        return made[name]

    return make


async def generate(
    client, prompts: Sequence[Sequence[int]], params: SamplingParams, pin: Callable[[int], int | None] = lambda i: None
) -> list[list[int]]:
    """Every prompt at once through `client` (prompt i pinned to DP rank `pin(i)`); their tokens in prompt order."""
    done = await asyncio.wait_for(
        asyncio.gather(*(client.generate(p, params, pin_rank=pin(i)) for i, p in enumerate(prompts))), 240
    )
    return [c.token_ids for c in done]


def start_tp2_x_ep2(cluster, model: Path, engine_flags: Sequence[str] = ENGINE_FLAGS) -> None:
    """A coordinator and one EP group of 2 ranks, each rank a TP group of 2 processes; returns once both are ready."""
    cluster.coordinator()
    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    for ep_rank in range(2):
        cluster.worker(ep_rank, *engine_flags, *TP_FLAGS, "--ep-size", "2", "--ep-rank", str(ep_rank),
                       "--dist-init", dist_init, "--ep-timeout", "20", model=model)  # fmt: skip
    ready(cluster, 2)
