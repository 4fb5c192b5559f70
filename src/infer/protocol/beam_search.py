"""vLLM's beam-search API: BeamSearchParams in, BeamSearchOutput (sequences of BeamSearchSequence) out. Torch-free.

`LLM.beam_search(prompts, BeamSearchParams(...))` runs each prompt as one beam-search request (SamplingParams with
`beam_width`; worker/engine/beam_search.py has the rule, transformers' generate(num_beams=k, do_sample=False)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from infer.protocol.sampling import SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names and defaults; `stop`, `stop_token_ids`, `min_tokens`, `early_stopping` and `n` (the beams
    returned; default all `beam_width`) are ours. `temperature` must be 0 (beam search is deterministic here)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    stop: tuple[str, ...] | list[str] | str | None = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    min_tokens: int = 0
    early_stopping: bool | str = False
    n: int | None = None

    def __post_init__(self) -> None:
        self.to_sampling_params()  # every check of SamplingParams, each naming its field

    def to_sampling_params(self) -> SamplingParams:
        # the casts: SamplingParams.__post_init__ takes the forms users write (a str, a list, None) and stores tuples
        return SamplingParams(
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            stop=cast("tuple[str, ...]", self.stop),
            stop_token_ids=cast("tuple[int, ...]", self.stop_token_ids),
            min_tokens=self.min_tokens,
            beam_width=self.beam_width,
            n=self.beam_width if self.n is None else self.n,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's fields): `tokens` are the prompt's followed by the output's (EOS included), `text` the
    output's, `cum_logprob` the sum of the output tokens' log-probabilities, `score` it under the length penalty."""

    tokens: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str | None
    num_prompt_tokens: int = 0
    # per output token, the top log-probabilities of its step (vLLM: the top 2 * beam_width; ours: the search's K
    # candidates, 2 * beam_width or more with several EOS ids), the token's own among them
    logprobs: list[dict[int, float]] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


@dataclass
class BeamSearchOutput:
    """vLLM's: one prompt's beams, best first."""

    sequences: list[BeamSearchSequence]
