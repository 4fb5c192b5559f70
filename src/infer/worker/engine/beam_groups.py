"""BeamGroups: the engine's beam searches, each a BeamSearch (worker/engine/beam_search.py) whose live beams run as
scheduler Requests. Torch-free.

Why one group per request inside the engine (and not vLLM's loop of one-token requests per round): the beams
of a group are sequences of the same continuous batch, stepped together by the scheduler, and a fork shares the
parent's KV blocks by reference count instead of finding them again through the prefix cache each round.

A group starts as one request, the prompt's (its id is the request id the caller knows: `beam_group`). Each
beam reports its top K log-probabilities when the step that computed its last token ends (Request.num_logprobs
makes the sampler produce them); once all live beams of a group have reported, the group advances:
- a beam with no continuation ends (its blocks go back: the scheduler's `finish`);
- a beam with c continuations keeps running with the first and is forked c - 1 times (Scheduler.fork: its full
  blocks shared, its partial last block copied; the copies are applied to the KV pool by the engine before
  the next forward), each fork appending its own token;
- a finished search ends every beam it still runs and gives its best `n` hypotheses, with their texts.
Preemption takes a group's beams together (Scheduler._preempt); a preempted beam recomputes its tokens and
reports again (the latest report counts), and a fork of a waiting beam waits too. A beam that has reported waits,
holding its blocks, for its siblings (a step may give them fewer seats than beams).
Streaming: nothing comes out before the end (as vLLM): the beams' tokens are not final until the search is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from infer.protocol.codes import FinishReason
from infer.protocol.messages import BeamOutput, TokenIds
from infer.worker.engine.beam_search import Beam, BeamSearch, Hypothesis
from infer.worker.engine.detokenizer import IncrementalDetokenizer
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.scheduler import Scheduler

BlockCopy = tuple[int, int]  # (source block, destination block) of the KV pool


@dataclass
class BeamGroup:
    """One beam-search request: its search, the requests running its live beams (by beam id), its root request
    (the prompt's: queue time, cached tokens) and the ids that finish a beam."""

    root: Request
    search: BeamSearch
    finish_ids: frozenset[int]
    beams: dict[str, Request] = field(default_factory=dict)
    num_forks: int = 0

    @property
    def request_id(self) -> str:
        return self.root.request_id

    @property
    def params(self) -> Any:
        return self.root.params


class BeamGroups:
    """The beam searches of one engine, by request id."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any) -> None:
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._groups: dict[str, BeamGroup] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def get(self, request_id: str) -> BeamGroup | None:
        return self._groups.get(request_id)

    @staticmethod
    def num_candidates(width: int, eos_token_ids: frozenset[int]) -> int:
        return BeamSearch(width, 1, num_eos=len(eos_token_ids)).num_candidates

    def start(self, root: Request) -> None:
        """Track `root` (added to the scheduler already; `beam_group` is its own id) as a new search."""
        params = root.params
        finish_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else root.eos_token_ids)
        search = BeamSearch.start(
            root.request_id,
            params.beam_width or 1,  # set on every beam search; `or 1` as the engine reads it
            root.max_tokens,
            params.length_penalty,
            params.early_stopping,
            num_eos=len(root.eos_token_ids),
        )
        self._groups[root.request_id] = BeamGroup(root, search, finish_ids, {root.request_id: root})

    def report(self, request: Request, logprobs: Mapping[int, float] | None) -> None:
        """A beam's step sampled: its top log-probabilities are its candidates (the tokens min_tokens bans left
        out, as transformers' MinNewTokensLengthLogitsProcessor does)."""
        group = self._groups[request.beam_group or ""]
        candidates = dict(logprobs or {})
        if request.num_output_tokens < group.params.min_tokens:
            for token_id in group.finish_ids:
                candidates.pop(token_id, None)
        group.search.report(request.request_id, candidates)

    def advance(self) -> tuple[list[BlockCopy], list[BeamGroup]]:
        """Advance every group whose live beams have all reported: the KV block copies its forks need (apply
        them before the next forward) and the groups that are done (ended: `outputs` gives their result)."""
        copies: list[BlockCopy] = []
        done: list[BeamGroup] = []
        for group in list(self._groups.values()):
            if group.search.ready:
                if self._advance(group, copies):
                    self.end(group.request_id, RequestStatus.FINISHED_STOPPED)
                    done.append(group)
        return copies, done

    def _advance(self, group: BeamGroup, copies: list[BlockCopy]) -> bool:
        step = group.search.advance(lambda beam, token_id: self._finish_reason(group, beam, token_id))
        for beam_id in step.dropped:
            self._scheduler.finish(group.beams.pop(beam_id), RequestStatus.FINISHED_ABORTED)
        if step.done:
            return True
        continued: set[str] = set()
        grown: list[tuple[Request, int]] = []
        forks: list[BlockCopy] = []
        for index, continuation in enumerate(step.continuations):
            beam = group.beams[continuation.parent]
            if continuation.parent in continued:  # another continuation of the same beam: a fork of it
                beam = self._fork(group, beam, forks)
                group.search.rename(index, beam.request_id)
            continued.add(continuation.parent)
            grown.append((beam, continuation.token_id))
        for beam, token_id in grown:  # after every fork: a fork copies its parent's tokens as they were
            beam.append_token(token_id)
        # a fork that found no free block preempted the group (Scheduler.fork): the copies made before it are void
        held = {
            block for beam in group.beams.values() if beam.status is RequestStatus.RUNNING for block in beam.block_table
        }
        copies.extend(copy for copy in forks if copy[1] in held)
        return False

    def _fork(self, group: BeamGroup, parent: Request, copies: list[BlockCopy]) -> Request:
        group.num_forks += 1
        child = dataclasses.replace(
            parent,
            request_id=f"{group.request_id}#beam{group.num_forks}",
            status=RequestStatus.WAITING,
            token_ids=list(parent.token_ids),
            num_computed_tokens=0,
            block_table=[],
            block_hashes=[],
            num_preemptions=0,
        )
        copy = self._scheduler.fork(parent, child)
        if copy is not None:
            copies.append(copy)
        group.beams[child.request_id] = child
        return child

    def _finish_reason(self, group: BeamGroup, beam: Beam, token_id: int) -> str | None:
        """How `beam` + `token_id` ends (the rule of worker/engine/beam_search.py), or None."""
        if token_id in group.finish_ids:
            return "stop"
        output = beam.token_ids + (token_id,)
        if group.params.stop and self._text(group, output)[1]:
            return "stop"
        if len(output) >= group.search.max_tokens:
            return "length"
        return None

    def _text(self, group: BeamGroup, output: Sequence[int]) -> tuple[str, bool]:
        """The text of output tokens (cut at a stop string, as the engine cuts a request's), and whether it
        stopped there."""
        detok = IncrementalDetokenizer(self._tokenizer, group.root.prompt_token_ids, group.params)
        text = detok.add(output)
        return text + detok.finish(), detok.stopped

    def end(self, request_id: str, status: RequestStatus) -> BeamGroup | None:
        """End a group: every beam it still runs leaves the scheduler (its blocks freed); forget it. None if
        it is not (or no longer) a group."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for beam in group.beams.values():
            if not beam.is_finished and self._scheduler.get(beam.request_id) is beam:
                self._scheduler.finish(beam, status)
        group.beams.clear()
        return group

    def outputs(self, group: BeamGroup) -> list[BeamOutput]:
        """The best `n` hypotheses of a finished search, best first, with their texts."""
        return [self._output(group, h) for h in group.search.result(group.params.n)]

    def _output(self, group: BeamGroup, hypothesis: Hypothesis) -> BeamOutput:
        return BeamOutput(
            token_ids=TokenIds(hypothesis.token_ids),
            text=self._text(group, hypothesis.token_ids)[0],
            cumulative_logprob=hypothesis.cumulative_logprob,
            score=hypothesis.score,
            finish_reason=FinishReason(hypothesis.finish_reason),
            logprobs=[dict(step) for step in hypothesis.logprobs],
        )
