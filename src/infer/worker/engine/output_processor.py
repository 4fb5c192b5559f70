"""Output processing: a step's scheduled chunks and sampled rows turned into Deltas.

Owns each request's incremental detokenizer (from add_request to its final Delta), the weight version every Delta
carries, and the engine's counters (EngineStats) for what it counts. `step_rows` reads the sampler's tensors into
one StepRow per scheduled chunk; `OutputProcessor.process` appends each row's tokens to its request (a grammar's
matcher advanced, text detokenized), checks EOS / stop ids / stop strings / length, finishes requests through the
scheduler and gives one Delta per request that moved. A beam's row goes to its search instead
(worker/engine/beam_groups.py); `beam_final` is a search's one Delta. `final` and `fail` make the last Delta of a
request the engine ends for any reason (finished, aborted, shed, failed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence, cast

from infer.protocol.messages import Delta, TokenIds
from infer.protocol.outputs import TokenLogprobs
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.beam_groups import BeamGroup, BeamGroups
from infer.worker.engine.detokenizer import IncrementalDetokenizer
from infer.worker.engine.request import Request, RequestStatus
from infer.worker.engine.sampler import Sampler, SamplerOutput
from infer.worker.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from infer.worker.speculative.proposers import Proposer
from infer.worker.speculative.verification import verify

log = logging.getLogger("infer.engine")


@dataclass
class EngineStats:
    """Monotonic counters since the engine started (Prometheus-style)."""

    num_steps: int = 0
    num_requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefill_tokens_computed: int = 0  # tokens actually run through the model before the first sample
    generation_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    # speculative decoding (vLLM's spec_decode counters): verification chunks, their draft tokens, the drafts
    # accepted, and accepted drafts by position (index j: drafts accepted at position j + 1 of a chunk)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class OutputProcessor:
    """Turns a step's rows into Deltas and makes every request's final Delta (module docstring). It finishes
    requests through `scheduler`, reports beams' rows to `beams`, and releases a finished request's per-request
    state in `sampler` and `proposer`."""

    def __init__(
        self,
        scheduler: Scheduler,
        beams: BeamGroups,
        sampler: Sampler,
        proposer: Proposer | None,
        tokenizer: Any,
        stats: EngineStats,
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.beams = beams
        self.sampler = sampler
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.stats = stats
        self.max_model_len = max_model_len
        self.weight_version = 0  # +1 (or the coordinator's number) per update_weights; every Delta carries it
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def detokenizer(
        self, prompt_ids: list[int], params: SamplingParams, resumed: list[int], resumed_text_len: int | None
    ) -> IncrementalDetokenizer:
        """A new request's detokenizer, its resumed tokens replayed (Engine.add_request); `track` it once the
        request is queued."""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
        if resumed:
            detok.resume(resumed, resumed_text_len)
        return detok

    def track(self, request_id: str, detok: IncrementalDetokenizer) -> None:
        self._detokenizers[request_id] = detok

    def process(self, scheduled: SchedulerOutput, rows: list[StepRow]) -> list[Delta]:
        computed = [(c, row) for c, row in zip(scheduled.chunks, rows) if row.error is None]
        self.stats.num_steps += 1
        self.stats.prefill_tokens_computed += sum(
            c.num_new_tokens for c, _ in computed if c.start < c.request.num_prompt_tokens
        )
        for chunk, row in computed:
            if chunk.num_draft_tokens:
                self._count_verification(chunk, row)
        for chunk, row in computed:  # a beam's step gives its candidates to its search (worker/engine/beam_groups.py)
            if row.token_ids and chunk.request.beam_group is not None and not chunk.request.is_finished:
                self.beams.report(chunk.request, row.logprobs[0] if row.logprobs else None)
        outputs = [
            self._append_tokens_or_fail(c, row) for c, row in computed if row.token_ids and c.request.beam_group is None
        ]
        self.stats.generation_tokens += sum(len(d.token_ids) for d in outputs)
        return outputs

    def _count_verification(self, chunk: ScheduledChunk, row: StepRow) -> None:
        stats = self.stats
        stats.spec_decode_num_drafts += 1
        stats.spec_decode_num_draft_tokens += chunk.num_draft_tokens
        stats.spec_decode_num_accepted_tokens += row.num_accepted
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        per_pos.extend([0] * (chunk.num_draft_tokens - len(per_pos)))
        for j in range(row.num_accepted):
            per_pos[j] += 1

    def _append_tokens_or_fail(self, chunk: ScheduledChunk, row: StepRow) -> Delta:
        try:
            return self._append_tokens(chunk, row)
        except Exception as e:
            if chunk.request.is_finished:  # it failed while finishing: nothing is left to fail
                raise
            log.exception("post-processing request %r failed", chunk.request.request_id)
            return cast(  # not a beam (the caller's filter), so _fail returns its Delta
                Delta,
                self.fail(
                    chunk.request,
                    f"the engine failed after sampling token(s) {list(row.token_ids)}: {type(e).__name__}: {e}",
                ),
            )

    def _append_tokens(self, chunk: ScheduledChunk, row: StepRow) -> Delta:
        """Append the row's tokens (one; or a verification's accepted drafts and the token after them) up to the
        first that finishes the request (the rest are dropped: an accepted run is cut at a stop)."""
        request = chunk.request
        if request.pooled is not None:  # its prompt is complete: the vector, not the token, is its output
            if not request.pooled.complete:
                raise RuntimeError("a pooling request reached its last prompt token with positions not pooled")
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            return self.final(request, "", [], embedding=request.pooled.vector(), **self.first_output_fields(request))
        detok = self._detokenizers[request.request_id]
        token_ids: list[int] = []
        text, status = "", None
        for token_id in row.token_ids:
            request.append_token(token_id)
            if request.grammar is not None and not request.grammar.accept(token_id):
                raise RuntimeError(f"the grammar rejected sampled token {token_id}")
            token_ids.append(token_id)
            text += detok.add([token_id])
            status = self._stop_status(request, token_id, detok)
            if status is not None:
                break
        # a row with logprobs has a dict for each token (its request asked for them, so the sampler computed them)
        lps = None if row.logprobs is None else cast("list[TokenLogprobs]", list(row.logprobs[: len(token_ids)]))
        first = self.first_output_fields(request)
        if status is None:
            if chunk.num_draft_tokens:
                self.scheduler.accept_draft_tokens(request, len(token_ids) - 1)
            return Delta(
                request_id=request.request_id,
                token_ids=TokenIds(token_ids),
                text=text,
                logprobs=lps,
                num_prompt_tokens=request.num_input_tokens,
                num_cached_tokens=request.num_cached_tokens,
                weight_version=self.weight_version,
                **first,
            )
        self.scheduler.finish(request, status)
        return self.final(request, text, token_ids, lps, **first)

    @staticmethod
    def first_output_fields(request: Request) -> dict[str, Any]:
        """What only a request's first output carries (its queue time, seed and prompt logprobs); {} after it."""
        if request.queue_time_reported:
            return {}
        request.queue_time_reported = True
        return {
            "queue_time_s": request.queue_time_s,
            "seed": request.params.seed,
            "prompt_logprobs": request.prompt_logprobs,
        }

    def _stop_status(self, request: Request, token_id: int, detok: IncrementalDetokenizer) -> RequestStatus | None:
        params = request.params
        if request.grammar is not None and request.grammar.terminated:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.min_tokens:
            if (token_id in request.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if detok.stopped:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def final(
        self,
        request: Request,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        release_text: bool = True,
        **first: Any,
    ) -> Delta:
        """The last output of `request` (finished, its status set): the text held back is released unless
        `release_text` is False; `first`: the fields of a first output (`first_output_fields`), or queue_time_s."""
        detok = self._detokenizers.pop(request.request_id, None)
        if request.beam_group is not None:  # a beam search shed before it started: its search ends too
            self.beams.end(request.beam_group, request.status)
        if detok is not None and release_text:
            text += detok.finish()
        self.sampler.release(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        reason = cast(str, request.status.finish_reason)  # the scheduler finished it: it has one
        self.stats.num_requests_finished += 1
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        return Delta.final(
            request.request_id,
            reason,
            request.error,
            request.error_code,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            num_prompt_tokens=request.num_input_tokens,
            num_cached_tokens=request.num_cached_tokens,
            weight_version=self.weight_version,
            **first,
        )

    def beam_final(
        self, group: BeamGroup, status: RequestStatus, error: str | None = None, error_code: str | None = None
    ) -> Delta:
        """The one output of a beam search: its best n beams (the best one's tokens and text as the request's),
        or how it ended without them (abort, error)."""
        beams = self.beams.outputs(group) if status is RequestStatus.FINISHED_STOPPED else None
        best = beams[0] if beams else None
        # `status` is a finished one (the search ended), which has a finish reason
        reason = best.finish_reason if best is not None else cast(str, status.finish_reason)
        self.stats.num_requests_finished += 1
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
        root = group.root
        return Delta.final(
            group.request_id,
            reason,
            error,
            error_code,
            token_ids=[] if best is None else best.token_ids,
            text="" if best is None else best.text,
            beams=beams,
            num_prompt_tokens=root.num_prompt_tokens,
            num_cached_tokens=root.num_cached_tokens,
            weight_version=self.weight_version,
            **self.first_output_fields(root),
        )

    def fail(self, request: Request, message: str) -> Delta | None:
        """Finish `request` alone as failed by the engine (code "internal"), its KV blocks freed (a beam: its
        whole search; None when a sibling failed it already)."""
        log.error("request %r failed: %s", request.request_id, message)
        if request.beam_group is not None:
            group = self.beams.end(request.beam_group, RequestStatus.FINISHED_ERROR)
            return None if group is None else self.beam_final(group, RequestStatus.FINISHED_ERROR, message, "internal")
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, message)
        request.error_code = "internal"
        return self.final(request, "", [])


NON_FINITE_LOGITS = (
    "the model produced non-finite logits (NaN or inf) for this request, after its penalties; "
    "it was stopped rather than sampled from them"
)


@dataclass(frozen=True)
class StepRow:
    """What one step gave one scheduled chunk: its sampled token (a verification chunk: its accepted drafts
    and the token after them; worker/speculative/verification.py) and their logprobs, nothing (a chunk that does not
    sample: mid-prefill), or the error that fails its request. `num_accepted`: drafts accepted."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] | None = None
    error: str | None = None
    num_accepted: int = 0


def step_rows(chunks: Sequence[ScheduledChunk], sampled: SamplerOutput | None) -> list[StepRow]:
    """One StepRow per chunk from the sampler's tensors (one host copy each); a row the sampler found
    non-finite fails its chunk with NON_FINITE_LOGITS (a verification chunk's: up to where its walk stops)."""
    if sampled is None:
        return [StepRow() for _ in chunks]
    wants = [c.request.num_logprobs for c in chunks for _ in range(c.num_sampled_rows)]
    token_ids = sampled.token_ids.tolist()
    lps = _logprobs_rows(sampled, wants)
    bad = set(sampled.bad_rows)
    rows, at = [], 0
    for chunk in chunks:
        n = chunk.num_sampled_rows
        if not n:
            rows.append(StepRow())
            continue
        found = verify(
            chunk.draft_token_ids, token_ids[at : at + n], lps[at : at + n], [i in bad for i in range(at, at + n)]
        )
        at += n
        if found.bad:
            rows.append(StepRow(error=NON_FINITE_LOGITS))
        else:
            with_lps = chunk.request.num_logprobs is not None
            rows.append(StepRow(found.token_ids, found.logprobs if with_lps else None, num_accepted=found.num_accepted))
    return rows


def _logprobs_rows(sampled: SamplerOutput, wants: list[int | None]) -> list[TokenLogprobs | None]:
    """One {token_id: logprob} dict per sampled row that asked for logprobs (sampled token + its top-n);
    `wants`: each row's Request.num_logprobs."""
    if sampled.sampled_logprobs is None:
        return [None] * len(wants)
    chosen = sampled.token_ids.tolist()
    values = sampled.sampled_logprobs.tolist()
    top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
    top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
    rows: list[TokenLogprobs | None] = []
    for i, n in enumerate(wants):
        if n is None:
            rows.append(None)
            continue
        row = {chosen[i]: values[i]}
        if top_ids is not None and top_lps is not None and n > 0:  # set together by the sampler
            for t, v in zip(top_ids[i][:n], top_lps[i][:n]):
                row.setdefault(t, v)
        rows.append(row)
    return rows
