"""A torch-free stand-in for the engine around the scheduler: requests, a deterministic fake model, and the
post-step bookkeeping (append the sampled token, finish at max_tokens). Shared by the scheduler and block
manager tests."""

from __future__ import annotations

from typing import Callable

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make_scheduler(**overrides) -> Scheduler:
    """A scheduler of 8 sequences, 64-token steps, 64 blocks of 4 tokens, unless `overrides` say otherwise."""
    options = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=2048, block_size=4, num_blocks=64)
    options.update(overrides)
    return Scheduler(SchedulerConfig(**options))


def make_request(i: int, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(
        request_id=f"r{i}",
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_order=i,
        max_tokens=max_tokens,
    )


def finish_step(scheduler: Scheduler, output: SchedulerOutput, next_token: Callable[[list[int]], int]) -> None:
    """What the engine does after the model ran: advance the scheduler, append one token to every chunk that
    samples, finish requests at max_tokens, and check the scheduler's invariants."""
    scheduler.update_after_step(output)
    for chunk in output.chunks:
        request = chunk.request
        if chunk.samples and not request.is_finished:
            request.append_token(next_token(request.token_ids))
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    scheduler.check_invariants()


def fake_next_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token is a function of the whole sequence so far."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) * 7 + len(token_ids)) % 1000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(fake_next_token(ids))
    return ids[len(prompt) :]
