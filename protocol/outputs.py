"""What generation returns: per-step deltas and whole completions. Torch-free, plain named fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.protocol.codes import ErrorCode, FinishReason

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-n.
TokenLogprobs = dict[int, float]

# The words of `finish_reason` and `error_code`, as tuples (protocol/codes.py has them with their meanings).
FINISH_REASONS = tuple(FinishReason)
ERROR_CODES = tuple(ErrorCode)


@dataclass
class RequestOutput:
    """The part of one request produced by one engine step (a stream delta).

    `token_ids` and `text` are new since the previous delta; the last delta has `finished` set
    and carries `finish_reason` (and `error` when it is "error").
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error_code: str | None = None
    queue_time_s: float | None = None   # first delta only: seconds it waited in the engine before it was scheduled
    seed: int | None = None             # first delta only: the sampling seed (given, or assigned when none was)
    prompt_logprobs: list[TokenLogprobs] | None = None   # first delta only, with params.prompt_logprobs: prompt
                                                         # tokens 1.. (token 0 has none), each row holding the token
    weight_version: int = 0             # the version of the weights that computed this delta (0: as loaded)


@dataclass
class Completion:
    """A finished request: the prompt, every generated token, the text and why it ended."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    prompt: str | None = None
    num_cached_tokens: int = 0
    error_code: str | None = None
    seed: int | None = None     # the sampling seed it ran with (assigned when none was given): a replay key
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # vLLM's: None for the first prompt token
    weight_version: int = 0     # the weights' version of its last delta (update_weights counts versions)

    def add(self, delta: RequestOutput) -> None:
        """Fold one stream delta into this completion."""
        self.token_ids.extend(delta.token_ids)
        self.text += delta.text
        if delta.seed is not None:
            self.seed = delta.seed
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None, *delta.prompt_logprobs]
        self.weight_version = delta.weight_version
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
            self.error_code = delta.error_code
            self.num_cached_tokens = delta.num_cached_tokens
