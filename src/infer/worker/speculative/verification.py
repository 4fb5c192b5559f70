"""Speculative decoding's verification: the sampling rows of a verification chunk, and acceptance.

A verification chunk (worker/engine/scheduler.py) computes a decoding request's last token followed by k draft tokens
d_1..d_k in one forward, as k + 1 decode rows (worker/engine/model_runner.py: row j attends to the context up to its own
position, so it has the bits the decode step at that position would have); each row is sampled as that decode step
would be: row j sees the request as if d_1..d_j had been generated (penalties, min_tokens and bad-words bans, the
grammar's bitmask after them) and draws with the noise of output position `num_output_tokens + j` of the request's
seed (worker/engine/sampler.py). Acceptance walks the rows in order: row j's token t_j is emitted; while t_j equals
d_{j+1} the next row is valid too (its context is exactly what the request would have been), else the walk stops.
So a verification step emits t_0..t_a, the a accepted drafts plus the token after them (the correction, or the
bonus token when all k are accepted).

Exactness. Greedy rows take the argmax: the longest prefix of drafts equal to the target's argmax is accepted,
plus the bonus token. Sampled rows: the drafts of our proposers are deterministic given the context, a point
mass q = 1[d]; rejection sampling then accepts d with probability min(1, p(d) / q(d)) = p(d) and on rejection
samples from the normalized residual max(0, p - q), which is p without d. Drawing t ~ p with the request's own
noise and accepting iff t == d realizes exactly that: P(accept) = p(d), and a rejected row's t is distributed
as p conditioned on t != d, the residual. The output distribution is the target's, and since each row uses
the same noise the non-speculative step would have used at that position, seeded requests give the same
tokens with speculation on or off (run to run, and across a failover that re-prefills the delivered tokens).
A proposer with a non-degenerate draft distribution (a draft model sampled at temperature > 0, EAGLE) would
need the general residual step; the proposers here draw greedily, so q stays a point mass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from infer.protocol.outputs import TokenLogprobs
from infer.worker.engine.request import Request
from infer.worker.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from infer.worker.engine.structured import GrammarState


@dataclass(frozen=True)
class _FixedMask:
    """A grammar bitmask row computed ahead (GrammarState.masks_along); fills like a GrammarState."""

    mask: torch.Tensor  # [W] int32

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.mask


def sampling_rows(chunk: ScheduledChunk) -> list[Request]:
    """The requests to sample for a sampling chunk, one per row: the request itself, or for a verification
    chunk a view of it per position j (its tokens + the first j drafts; its grammar's mask after them)."""
    request, drafts = chunk.request, chunk.draft_token_ids
    if not drafts:
        return [request]
    masks = request.grammar.masks_along(drafts) if request.grammar is not None else None
    # a _FixedMask stands in for the GrammarState: these views go only to the sampler, which calls only fill()
    return [
        dataclasses.replace(
            request,
            token_ids=request.token_ids + list(drafts[:j]),
            grammar=None if masks is None else cast("GrammarState", _FixedMask(masks[j])),
        )
        for j in range(len(drafts) + 1)
    ]


@dataclass(frozen=True)
class Verified:
    """What a sampling chunk's rows give: the tokens to append (t_0..t_a), their logprobs, and how many of the
    chunk's drafts were accepted (a); `bad`: a row up to the one that stops the walk was not finite."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]
    num_accepted: int
    bad: bool = False


def verify(
    drafts: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs | None], bad_rows: Sequence[bool]
) -> Verified:
    """Walk a chunk's sampled rows (len(drafts) + 1 of them) in order: emit each row's token while the previous
    one equalled its draft (module docstring)."""
    for j, token_id in enumerate(token_ids):
        if bad_rows[j]:
            return Verified((), (), 0, bad=True)
        if j == len(drafts) or token_id != drafts[j]:
            return Verified(tuple(token_ids[: j + 1]), tuple(logprobs[: j + 1]), j)
    raise ValueError(f"{len(token_ids)} sampled rows for {len(drafts)} drafts: expected {len(drafts) + 1}")
