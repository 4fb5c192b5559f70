"""Proposers of draft tokens for speculative decoding (worker/speculative/verification.py verifies them). No torch.

A proposer looks at the requests that decode this step and proposes up to `num_tokens[i]` draft tokens for
each; it keeps no per-request state the engine must clean up. Proposers must be deterministic given the
context (a point-mass draft distribution: the exactness argument in worker/speculative/verification.py rests on it).
Model-based proposers (a draft model with its own small KV pool, EAGLE / MTP heads that read the target's
hidden states) fit the same call; they would be handed what they need when they are built.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol, cast

from infer.worker.engine.request import Request
from infer.worker.speculative.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """One list of at most `num_tokens[i]` draft tokens per request (possibly empty), continuing
        `requests[i].token_ids`."""
        ...

    def release(self, request_id: str) -> None:
        """Forget what the proposer keeps for a request (it finished); unknown ids are ignored."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's "ngram"): for n from `max_n` down to `min_n`, find the earliest earlier occurrence
    of the context's last n tokens (prompt + output) and propose the tokens that followed it; when none occurs,
    the same lookup skipping the last token, as if it had been inserted (see ngram_drafts)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        return [ngram_drafts(r.token_ids, self.min_n, self.max_n, k) for r, k in zip(requests, num_tokens)]

    def release(self, request_id: str) -> None:
        pass  # nothing kept


def ngram_drafts(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens following the earliest occurrence of the longest suffix n-gram (min_n <= n <= max_n) that
    also occurs earlier in `token_ids`. When no suffix n-gram does, the last token is taken as an insertion: the
    tokens that followed the same lookup's match in `token_ids[:-1]`. A model that copies a passage while
    editing it (a comma added, "In May, the" for "In May the") loses every n-gram at the added token; this
    picks the copy up again at the next step instead of two or three steps later ([] when neither matches)."""
    if k < 1 or len(token_ids) <= min_n:
        return []
    data = array("i", token_ids).tobytes()  # a C search over 4-byte tokens (bytes.find)
    start = _continuation(data, len(token_ids), min_n, max_n)
    if start is None and len(token_ids) > min_n + 1:
        start = _continuation(data, len(token_ids) - 1, min_n, max_n)
        if start is not None:
            return list(token_ids[start : min(start + k, len(token_ids) - 1)])
    return [] if start is None else list(token_ids[start : start + k])


def _continuation(data: bytes, length: int, min_n: int, max_n: int) -> int | None:
    """Where the tokens after the match start (ngram_drafts' rule) among the first `length` tokens of `data`
    (int32 tokens); None without a match."""
    width = array("i").itemsize
    end = length * width
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[end - n * width : end]
        stop = end - width  # a match must end before the last token
        at = data.find(suffix, 0, stop)
        while at != -1 and at % width:  # a match inside a token: search on from the next byte
            at = data.find(suffix, at + 1, stop)
        if at != -1:
            return at // width + n
    return None


def make_proposer(config: SpeculativeConfig, **target: Any) -> Proposer:
    """The proposer of `config.method`; `target`: what a draft model needs of the target engine (dtype, device,
    block_size, num_blocks, max_model_len, vocab_size; worker/speculative/draft_model.py)."""
    if config.method == "ngram":
        # both set: SpeculativeConfig.__post_init__ fills an ngram config's bounds
        return NgramProposer(cast(int, config.prompt_lookup_min), cast(int, config.prompt_lookup_max))
    if config.method == "draft_model":
        from infer.worker.speculative.draft_model import DraftModelProposer  # torch: only a draft model needs it

        return DraftModelProposer(cast(str, config.model), **target)  # __post_init__ requires it for draft_model
    raise ValueError(f"no proposer for method {config.method!r}")
