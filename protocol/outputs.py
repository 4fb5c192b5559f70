"""What generation returns: per-step deltas and whole completions. Torch-free, plain named fields."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-n.
TokenLogprobs = dict[int, float]

FINISH_REASONS = ("stop", "length", "abort", "error")

# Why a request failed (with finish_reason "error"), for callers that must tell bad input from a busy cluster:
#   invalid_request: the request itself can never be served (prompt too long, bad token ids, bad options);
#   unavailable:     the cluster cannot serve it now (no healthy worker in time, draining, stopping, retries spent);
#   internal:        a component failed while serving it;
#   overloaded:      a queue on its way was full (coordinator, worker or HTTP front): retry later, it was not run;
#   timeout:         it did not finish within its own `timeout`; it was aborted and its KV blocks freed;
#   client_too_slow: its client did not read what the coordinator sent it (its queue reached the high-water
#                    mark), so the coordinator aborted its requests; the client hears it when it reads again;
#   client_lost:     (an Error, no request id) the coordinator declared this client lost (silent past
#                    --client-timeout, or unroutable) and aborted its requests on the workers; the client
#                    re-attaches them (they resume from the tokens it holds) or fails them;
#   draining:        (worker -> coordinator only) a draining worker refused a dispatch; the coordinator moves
#                    the request to another worker and routes nothing more to this one.
ERROR_CODES = ("invalid_request", "unavailable", "internal", "overloaded", "timeout", "client_too_slow",
               "client_lost", "draining")


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
