"""BeamSearch: one prompt's beams, ranked and stopped as transformers' `generate(num_beams=k, do_sample=False)`.

The decision core of one beam-search request, torch-free and engine-free (worker/engine/beam_groups.py runs it): each
live beam reports its candidates (the top next tokens with their log-probabilities) once the step that computed
its last token ends; when every live beam has reported, `advance` says which beams continue with which token
(best first), which beams are dropped, and whether the search is over; the finished hypotheses accumulate.

The rule is transformers' vectorized `_beam_search` (5.x), step for step:
- candidates: every live beam's cumulative log-probability plus each next token's; the best K over all beams,
  best first (ties: lower beam, then lower token), K = max(2, 1 + number of EOS ids) x width (so that `width`
  candidates that do not finish remain when the best ones end in EOS; EOS ids past 3 are not counted). At the
  first step only the prompt's beam exists (transformers' other beams start at -1e9 and never rank).
- a candidate finishes (`Finish`) on an EOS id (unless ignore_eos) or a stop token id, both only from min_tokens
  on, on a stop string in its text, or at max_tokens / the context length. A finishing candidate among the first
  `width` of the K becomes a hypothesis scored cumulative / generated_len ** length_penalty (its last token
  counted); the best `width` hypotheses are kept. Finishing candidates past the first `width` are dropped.
- the next live beams: the first `width` candidates that do not finish.
- done: no candidate continues (max_tokens reached); or `width` hypotheses and early_stopping is True; or `width`
  hypotheses and the best live beam cannot beat the worst of them: its cumulative log-probability over its
  generated length ** length_penalty (over max_tokens, with early_stopping "never" and a positive length_penalty,
  the best it could reach) is not above the worst hypothesis's score.
- the result: the hypotheses, best score first.
Where fewer than `width` candidates continue (stop strings can end any token), fewer beams live on (transformers
would carry beams at -1e9 that never win).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Beam:
    """A live beam: the scheduler request that runs it, its output tokens and their summed log-probability;
    `logprobs`: for each output token, the top log-probabilities its step reported (the token's own among them)."""

    beam_id: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float
    logprobs: tuple[Mapping[int, float], ...] = ()


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: output tokens (the finishing token included), summed log-probability, score, reason, and
    each token's step's top log-probabilities (as Beam.logprobs)."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS, stop token, stop string) or "length"
    logprobs: tuple[Mapping[int, float], ...] = ()


@dataclass(frozen=True)
class Continuation:
    """A next live beam: `parent` (a beam id) followed by `token_id`."""

    parent: str
    token_id: int
    cumulative_logprob: float


@dataclass(frozen=True)
class Advance:
    """What one round of the search decided: the next live beams, best first; the beams that have no
    continuation (their requests end); whether the search is over (its hypotheses are the result)."""

    continuations: tuple[Continuation, ...]
    dropped: tuple[str, ...]
    done: bool


# How a candidate (its parent beam, its token id) ends: "stop", "length", or None when it goes on.
Finish = Callable[[Beam, int], "str | None"]


@dataclass
class BeamSearch:
    """The beams and hypotheses of one prompt. `max_tokens`: the most tokens a beam may generate (the
    request's max_tokens, capped by the context); `num_eos`: how many EOS ids the model has (for K)."""

    width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_eos: int = 1
    live: list[Beam] = field(default_factory=list)
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best score first, at most `width`
    reports: dict[str, Mapping[int, float]] = field(default_factory=dict)  # this round's, by beam id
    improvable: bool = True

    @classmethod
    def start(
        cls,
        root_id: str,
        width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        num_eos: int = 1,
    ) -> BeamSearch:
        """A search whose only beam is the prompt, run by request `root_id`."""
        return cls(width, max_tokens, length_penalty, early_stopping, num_eos, live=[Beam(root_id, (), 0.0)])

    @property
    def num_candidates(self) -> int:
        """K: the top log-probabilities each beam reports."""
        return max(2, 1 + min(self.num_eos, 3)) * self.width

    @property
    def ready(self) -> bool:
        """Every live beam has reported this round."""
        return bool(self.live) and all(b.beam_id in self.reports for b in self.live)

    def report(self, beam_id: str, candidates: Mapping[int, float]) -> None:
        """A live beam's next-token log-probabilities (its top K at least); a repeated report (the beam
        recomputed after a preemption) replaces the first."""
        if all(b.beam_id != beam_id for b in self.live):
            raise ValueError(f"beam {beam_id!r} is not live")
        self.reports[beam_id] = candidates

    def advance(self, finish: Finish) -> Advance:
        """One round, once `ready`: rank the candidates, keep hypotheses, choose the next live beams."""
        if not self.ready:
            raise ValueError("advance() before every live beam reported")
        ranked = self._ranked()
        gen_len = len(self.live[0].token_ids) + 1
        beams = {b.beam_id: b for b in self.live}
        continuations: list[Continuation] = []
        finished: list[Hypothesis] = []
        for position, (total, index, token_id) in enumerate(ranked):
            if position >= self.width and len(continuations) >= self.width:
                break
            parent = self.live[index]
            reason = finish(parent, token_id)
            if reason is None:
                if len(continuations) < self.width:
                    continuations.append(Continuation(parent.beam_id, token_id, total))
            elif position < self.width:
                finished.append(
                    Hypothesis(
                        parent.token_ids + (token_id,),
                        total,
                        total / gen_len**self.length_penalty,
                        reason,
                        parent.logprobs + (self.reports[parent.beam_id],),
                    )
                )
        self._keep(finished)
        self.live = [
            Beam(
                c.parent,
                beams[c.parent].token_ids + (c.token_id,),
                c.cumulative_logprob,
                beams[c.parent].logprobs + (self.reports[c.parent],),
            )
            for c in continuations
        ]
        self.reports = {}
        parents = {c.parent for c in continuations}
        dropped = tuple(b for b in beams if b not in parents)
        return Advance(tuple(continuations), dropped, self._done(gen_len))

    def rename(self, index: int, beam_id: str) -> None:
        """Live beam `index` now runs as request `beam_id` (a fork of its parent's)."""
        beam = self.live[index]
        self.live[index] = dataclasses.replace(beam, beam_id=beam_id)

    def result(self, n: int) -> list[Hypothesis]:
        """The best `n` hypotheses, best first (at the end; before, the live beams are not among them)."""
        return self.hypotheses[:n]

    def _ranked(self) -> list[tuple[float, int, int]]:
        """The best K (cumulative log-probability, beam index, token id) over every live beam's report."""
        candidates = [
            (beam.cumulative_logprob + lp, index, token_id)
            for index, beam in enumerate(self.live)
            for token_id, lp in self.reports[beam.beam_id].items()
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        return candidates[: self.num_candidates]

    def _keep(self, finished: list[Hypothesis]) -> None:
        """Merge this round's hypotheses into the kept ones (earlier ones first among equal scores)."""
        merged = self.hypotheses + finished
        merged.sort(key=lambda h: -h.score)  # stable: the earlier among equal scores stays ahead
        self.hypotheses = merged[: self.width]

    def _done(self, gen_len: int) -> bool:
        if not self.live:
            return True
        if len(self.hypotheses) < self.width:
            return False
        if self.early_stopping is True:
            return True
        if self.early_stopping == "never" and self.length_penalty > 0:
            best_len = self.max_tokens
        else:
            best_len = gen_len
        best_possible = self.live[0].cumulative_logprob / best_len**self.length_penalty
        self.improvable = self.improvable and best_possible > self.hypotheses[-1].score
        return not self.improvable
