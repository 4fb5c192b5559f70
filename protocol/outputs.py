"""What generation returns: per-step deltas (RequestOutput, the wire's Delta) and whole completions. Torch-free,
plain named fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.messages import Delta

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-n.
TokenLogprobs = dict[int, float]

# The words of `finish_reason` and `error_code`, as tuples (protocol/codes.py has them with their meanings).
FINISH_REASONS = tuple(FinishReason)
ERROR_CODES = tuple(ErrorCode)


# A stream delta, as users import it: the engine's output is the wire's Delta itself, the one record every hop
# passes on (no copies field by field).
RequestOutput = Delta


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

    def add(self, delta: Delta) -> None:
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
