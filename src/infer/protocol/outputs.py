"""What generation returns: per-step deltas (RequestOutput, the wire's Delta) and whole completions. Torch-free,
plain named fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from infer.protocol.codes import ErrorCode, FinishReason
from infer.protocol.messages import BeamOutput, Delta

# One generated token's logprobs: {token_id: logprob} holding the sampled token and the top-n.
TokenLogprobs = dict[int, float]

# The words of `finish_reason` and `error_code`, as tuples (protocol/codes.py has them with their meanings).
FINISH_REASONS = tuple(FinishReason)
ERROR_CODES = tuple(ErrorCode)


# A stream delta, as users import it: the engine's output is the wire's Delta itself, the one record every hop
# passes on (no copies field by field).
RequestOutput = Delta


@dataclass(frozen=True)
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput): `index` among its n, and what it generated."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs, when logprobs were asked
    seed: int | None = None
    error: str | None = None


@dataclass
class Completion:
    """A finished request: the prompt, every generated token, the text and why it ended.

    With `SamplingParams.n` > 1 it is the prompt's result (vLLM's RequestOutput): `outputs` holds the n samples
    in order, and the flat fields (`text`, `token_ids`, `finish_reason`, ...) are sample 0's. With n = 1,
    `outputs` is that one sample, so `completion.outputs[0].text` works either way."""

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
    seed: int | None = None  # the sampling seed it ran with (assigned when none was given): a replay key
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # vLLM's: None for the first prompt token
    weight_version: int = 0  # the weights' version of its last delta (update_weights counts versions)
    samples: list[Completion] | None = None  # n > 1: every sample's own Completion, sample 0 first
    embedding: list[float] | None = None  # a pooling request's vector (SamplingParams.pooling)
    beams: list[BeamOutput] | None = None  # a beam search's best n beams, best first (the flat fields: the best)

    @property
    def outputs(self) -> list[CompletionOutput]:
        if self.beams is not None:
            return [
                CompletionOutput(i, b.text, list(b.token_ids), b.finish_reason, None, b.cumulative_logprob)
                for i, b in enumerate(self.beams)
            ]
        return [c._as_output(i) for i, c in enumerate(self.samples or [self])]

    def _as_output(self, index: int) -> CompletionOutput:
        cumulative = (
            None if self.logprobs is None else sum(row.get(t, 0.0) for t, row in zip(self.token_ids, self.logprobs))
        )
        return CompletionOutput(
            index, self.text, self.token_ids, self.finish_reason, self.logprobs, cumulative, self.seed, self.error
        )

    @classmethod
    def of_samples(cls, samples: list[Completion]) -> Completion:
        """The result of one prompt's n samples: sample 0's fields, and all of them in `samples`."""
        if len(samples) == 1:
            return samples[0]
        return dataclasses.replace(samples[0], samples=list(samples))

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
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)  # (in place: a long stream's deltas are not copied each time)
        if delta.embedding is not None:
            self.embedding = delta.embedding
        if delta.beams is not None:
            self.beams = list(delta.beams)
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.error = delta.error
            self.error_code = delta.error_code
            self.num_cached_tokens = delta.num_cached_tokens
