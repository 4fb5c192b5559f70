"""Scheduler: continuous batching over the paged KV cache, torch-free.

Each step gives every scheduled request a number of new tokens to compute, starting at its
`num_computed_tokens`: a prefill chunk, or 1 for a decode. One step's loop in the engine:

    output = scheduler.schedule()          # which requests compute which tokens
    ... run the model on output.chunks ...
    scheduler.update_after_step(output)    # those tokens are now computed (and cached)
    ... append a sampled token to every chunk with .samples; finish() the requests that stop ...

Policy (vLLM v1 style, "unified" prefill/decode):
- Per step at most `max_num_seqs` requests and `max_num_batched_tokens` tokens.
- Running requests first, oldest first, each up to what it still has to compute; when blocks run out,
  the newest running request is preempted by recompute (blocks dropped, back to the waiting queue in
  arrival order) until the allocation fits.
- Then waiting requests strictly first-come first-served: a request that does not fit stops admission
  (no skipping ahead). Without chunked prefill, waiting prompts are admitted before running decodes
  (a whole prompt must fit the budget, which decodes would otherwise eat), keeping back the blocks
  the running requests need this step.
- Short prefills beside a long one (`long_prefill_token_threshold` T > 0, chunked prefill only; vLLM's name and
  rule, but for verification chunks, which vLLM cuts too), under either policy: a chunk of more than one token that
  is not a verification chunk (a prompt's, or a preempted or resumed request's recompute) takes at most T tokens in
  a step, running and waiting requests alike.
  What a long prompt leaves of the budget goes on, in the order above, to the requests after it: a waiting prompt
  of up to T uncached tokens is admitted, prefilled whole and samples its first token in a step in which a long one
  only advances (as far as the budget, seats and blocks go). Decodes and verification chunks are never cut. With
  `whole_images`, a chunk that starts in an image still takes the image's rest whole (T is exceeded by at most that
  image), so an image longer than T never stalls its request. The cost: a prompt of n uncached tokens takes at
  least ceil(n / T) steps to prefill, even alone, instead of ceil(n / max_num_batched_tokens).
Speculative decoding: `schedule(drafts)` takes draft tokens proposed for running requests that are decoding
(one token to compute). Such a request's chunk becomes a verification chunk: its last token plus its drafts,
`1 + len(draft_token_ids)` tokens counted in the token budget (drafts cut to what the budget leaves), with slots
allocated for the drafts when free blocks allow (no request is preempted for drafts: without the blocks the
chunk is a plain decode). `update_after_step` counts only the request's own token computed; the engine then
appends the accepted tokens and calls `accept_draft_tokens`, which counts the accepted drafts' KV as computed
and gives back the blocks past the request's tokens (rejected drafts' slots: rolled back by bookkeeping, never
copied). Only computed tokens' full blocks are registered in the prefix cache, so rejected drafts never are.

Micro-batches in flight (a pipeline's stage 0, worker/engine/micro_batches.py): `schedule(busy=ids, max_seqs=n)` plans a
step beside earlier ones whose tokens are not computed yet: the `busy` requests are neither scheduled (their next
tokens are unknown) nor preempted (a later stage still writes their KV); a request that needs their blocks waits.
`max_seqs` caps this step's requests (its share), below max_num_seqs, which still caps the running requests.

Beam search (worker/engine/beam_groups.py): the beams of one search are requests sharing `beam_group` (and its rank, so
they sit together in both queues). Preempting any of them preempts them all (a search never waits, holding blocks,
on a beam of its own that waits for blocks); `fork` adds a beam beside its parent, sharing its computed KV.

No starvation: the oldest unfinished request is never preempted by another (victims are the newest).
With chunked prefill it is scheduled in every step: first among the running, or, when it waits, nothing
else runs (newer requests are never admitted ahead of it) and it is admitted first. T leaves it at least
one token a step, and what it leaves of the budget goes to newer requests in the same order as before.
Without chunked prefill, admissions go first but stop at `max_num_seqs` running requests, so decodes are
delayed only while free slots fill.

Policy "priority" (`SchedulerConfig.policy`; vLLM's convention, lower `Request.priority` first): every
request has a rank, `(priority, arrival)`, and "oldest" above becomes "best ranked". Running and waiting
requests are served in one order, best rank first, so a waiting request of a better rank than a running
one is admitted before it gets its tokens; when seats (`max_num_seqs`) or blocks are short, the worst
ranked running request is preempted (by recompute) for a better ranked one, never for a worse one.
Aging rule: a request that has waited `priority_aging_steps` engine steps since it arrived (preemptions do
not reset the clock) is *aged*: aged requests rank ahead of every request that is not, first-come
first-served among themselves. So under any flood of better priorities a request is served FCFS-fairly
at the latest `priority_aging_steps` steps after it arrived, and the FCFS argument above applies to it
(the oldest aged request is never preempted). With "fcfs" every request ranks by arrival alone.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from infer.protocol.sampling import check_priority
from infer.worker.engine.block_manager import BlockManager
from infer.worker.engine.request import Request, RequestStatus

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine's scheduler. Without chunked prefill the token budget must hold a whole
    `max_model_len` prompt, else a long prompt (or a preempted request's recompute) could never run."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # "fcfs" or "priority" (see the module docstring)
    priority_aging_steps: int = 1000  # "priority": steps after which a waiting request ranks first (aging)
    # > 0 when every layer of the model has a sliding window: the largest. After each step a running request's
    # blocks wholly before position num_computed_tokens - release_window + 1 are given back (no later query
    # of it sees them). 0: every block is kept until the request ends.
    release_window: int = 0
    # > 0 with LoRA adapters (worker/engine/lora.py): the running requests use at most this many distinct adapters (the
    # engine's weight slots); a waiting request of another adapter waits (FCFS: admission stops there). 0: no bound.
    max_loras: int = 0
    # A model whose image tokens attend to each other both ways (Gemma 3): a prefill chunk never ends inside an
    # image (it stops before the image, or takes the image's rest whole, or the request waits for the budget), so
    # each image token's keys are in the pool or in its chunk (worker/engine/attention.py image_span_attention).
    whole_images: bool = False
    # > 0 (chunked prefill only): the most tokens one request's prefill chunk takes in a step (module docstring,
    # "Short prefills beside a long one"; vLLM's long_prefill_token_threshold). 0: a chunk takes all the budget left.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_blocks",
            "priority_aging_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if isinstance(self.release_window, bool) or not isinstance(self.release_window, int) or self.release_window < 0:
            raise ValueError(f"release_window must be an integer >= 0, got {self.release_window!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "whole_images"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: off), got {threshold!r}")
        if threshold and not self.enable_chunked_prefill:
            raise ValueError(
                f"long_prefill_token_threshold ({threshold}) needs chunked prefill: without it a prompt is computed "
                f"whole in one step, so there is no chunk to cap"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so a whole prompt fits in one step"
            )


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `[start, start + num_new_tokens)` of `request.token_ids + draft_token_ids` are computed this step.

    `request_num_tokens` is `request.num_tokens` when scheduled (the request keeps growing afterwards).
    `draft_token_ids`: a verification chunk's draft tokens (speculative decoding), the last of its new tokens;
    it then samples `1 + len(draft_token_ids)` rows, one per position from the request's last token on.
    """

    request: Request
    start: int
    num_new_tokens: int
    request_num_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, request: Request, num_new_tokens: int, draft_token_ids: tuple[int, ...] = ()) -> ScheduledChunk:
        return cls(request, request.num_computed_tokens, num_new_tokens, request.num_tokens, draft_token_ids)

    @property
    def end(self) -> int:
        """Context length after this step (computed tokens + new tokens, drafts included)."""
        return self.start + self.num_new_tokens

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Rows this chunk samples: 0 (mid-prefill), 1, or 1 + its drafts (a verification chunk)."""
        return 1 + self.num_draft_tokens if self.samples else 0

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes (its drafts last)."""
        tokens = self.request.token_ids[self.start : self.start + self.num_new_tokens - self.num_draft_tokens]
        return tokens + list(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the request's last token, so the step samples a new token."""
        return self.end - self.num_draft_tokens == self.request_num_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token to compute, or a verification chunk (computed as one decode row per token)."""
        return self.num_new_tokens == 1 or bool(self.draft_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. `chunks`: decodes (one token, or a verification chunk) first, then prefill chunks;
    arrival order within each group. `preempted`: requests that lost their blocks this step (now waiting, to
    recompute)."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_decodes(self) -> int:
        return sum(1 for chunk in self.chunks if chunk.is_decode)

    @property
    def num_draft_tokens(self) -> int:
        return sum(chunk.num_draft_tokens for chunk in self.chunks)


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics and load reports. Prefix-cache counts are totals since start."""

    num_running: int
    num_waiting: int
    num_queued_tokens: int  # tokens still to compute, over waiting and running requests
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_free_blocks: int
    num_used_blocks: int
    kv_cache_usage: float

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queried_tokens:
            return 0.0
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens


@dataclass
class _Step:
    """The step being built: remaining budgets, chunks so far, requests preempted so far."""

    token_budget: int
    max_seqs: int
    drafts: Mapping[str, Sequence[int]] = field(default_factory=dict)  # proposed draft tokens, by request id
    busy: frozenset[str] = frozenset()  # ids of requests in a micro-batch still in flight: not scheduled, kept
    chunks: dict[str, ScheduledChunk] = field(default_factory=dict)  # by request id
    preempted: list[Request] = field(default_factory=list)

    @property
    def full(self) -> bool:
        return self.token_budget <= 0 or len(self.chunks) >= self.max_seqs

    def has(self, request: Request) -> bool:
        return request.request_id in self.chunks

    def add(self, request: Request, num_new_tokens: int, draft_token_ids: tuple[int, ...] = ()) -> None:
        self.chunks[request.request_id] = ScheduledChunk.of(request, num_new_tokens, draft_token_ids)
        self.token_budget -= num_new_tokens

    def drop(self, request: Request) -> None:
        """Unschedule a request (it is being preempted), giving its tokens back to the budget."""
        self.token_budget += self.chunks.pop(request.request_id).num_new_tokens

    def output(self) -> SchedulerOutput:
        chunks = sorted(self.chunks.values(), key=lambda c: (not c.is_decode, c.request.arrival_order))
        return SchedulerOutput(tuple(chunks), tuple(self.preempted), sum(c.num_new_tokens for c in chunks))


class Scheduler:
    """Decides, each step, which requests compute which tokens, and owns their KV blocks.

    Invariants (checked by `check_invariants`):
    - every unfinished request is in exactly one of `waiting` (status WAITING, no blocks, nothing
      computed) or `running` (status RUNNING, blocks covering its computed tokens);
    - both queues are sorted by rank (`_rank`: arrival order under "fcfs");
    - block ref counts equal the block-table entries of the running requests.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._requests: dict[str, Request] = {}
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._num_preemptions = 0
        self._num_steps = 0  # schedule() calls: the aging clock of the priority policy

    # ---- requests in and out ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request. Raises ValueError if it is malformed or could never run: prompt longer
        than max_model_len, or more KV blocks than the whole pool for prompt + max_tokens."""
        self.check_new(request)
        self._requests[request.request_id] = request
        request.arrival_step = self._num_steps
        bisect.insort(self._waiting, request, key=self._rank)

    def check_new(self, request: Request) -> None:
        """The checks of `add`, without adding (for a request that must wait for something first)."""
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.status is not RequestStatus.WAITING or request.block_table or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} must be new (waiting, no blocks, nothing computed)")
        check_priority(request.priority)
        if request.num_prompt_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be >= 1, got {request.max_tokens}")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens "
                f"is longer than max_model_len ({self.config.max_model_len})"
            )
        needed_tokens = request.num_prompt_tokens + request.max_tokens
        needed_blocks = self.block_manager.blocks_for_tokens(needed_tokens)
        cross_blocks = self.block_manager.num_cross_blocks_to_allocate(request)
        if needed_blocks + cross_blocks > self.config.num_blocks and cross_blocks:
            raise ValueError(
                f"request {request.request_id!r} can never fit in the KV cache: its encoder prompt of "
                f"{request.num_encoder_tokens} tokens needs {cross_blocks} KV blocks of cross-attention keys and "
                f"values, and decoder prompt + max_tokens = {needed_tokens} tokens need {needed_blocks} more, but "
                f"the pool has only {self.config.num_blocks} blocks of {self.config.block_size} tokens"
            )
        if needed_blocks > self.config.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} can never fit in the KV cache: prompt + max_tokens = "
                f"{needed_tokens} tokens need {needed_blocks} KV blocks of {self.config.block_size} tokens, "
                f"but the pool has only {self.config.num_blocks} blocks "
                f"({self.config.num_blocks * self.config.block_size} tokens)"
            )

    def finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        """Remove an unfinished request (waiting or running), free its blocks, set its final status."""
        if not status.finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        if request.request_id not in self._requests or self._requests[request.request_id] is not request:
            raise ValueError(f"request {request.request_id!r} is not in the scheduler (finished already?)")
        queue = self._running if request.status is RequestStatus.RUNNING else self._waiting
        queue.remove(request)
        del self._requests[request.request_id]
        self.block_manager.free(request)
        request.status = status
        request.error = error

    def abort(self, request_id: str) -> Request | None:
        """Finish a waiting or running request as aborted; None if the id is unknown (or finished)."""
        request = self._requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def preempt_all(self) -> int:
        """Preempt every running request by recompute (their blocks freed, their tokens kept): before the KV
        pool is released or the weights change. Returns how many were preempted."""
        step = _Step(0, 0)
        running = list(self._running)
        for request in reversed(running):
            self._preempt_one(request, step)
        return len(running)

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Add `child`, a new beam of `parent`'s beam group holding a copy of its tokens, beside it: a running
        parent's computed KV is shared with it (BlockManager.fork: full blocks by reference, the partial last
        block copied; the copy (parent's block, child's block) is returned for the engine to apply before the
        next forward); a waiting parent's child waits too, to compute its tokens when admitted."""
        if parent.request_id not in self._requests or self._requests[parent.request_id] is not parent:
            raise ValueError(f"request {parent.request_id!r} is not in the scheduler")
        if child.request_id in self._requests:
            raise ValueError(f"request id {child.request_id!r} is already in the scheduler")
        if parent.beam_group is None or child.beam_group != parent.beam_group:
            raise ValueError(f"request {child.request_id!r} is no beam of {parent.request_id!r}'s group")
        child.arrival_step = parent.arrival_step
        if (
            parent.status is RequestStatus.RUNNING
            and parent.num_computed_tokens % self.config.block_size
            and not self.block_manager.num_free_blocks
        ):
            self._preempt(parent, _Step(0, 0))  # no block for the copy: the group recomputes later, as a whole
        self._requests[child.request_id] = child
        if parent.status is not RequestStatus.RUNNING:
            bisect.insort(self._waiting, child, key=self._rank)
            return None
        copy = self.block_manager.fork(parent, child)
        child.status = RequestStatus.RUNNING
        bisect.insort(self._running, child, key=self._rank)
        return copy

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._running)

    @property
    def stats(self) -> SchedulerStats:
        blocks = self.block_manager
        queued = sum(r.num_tokens_to_compute for r in self._waiting) + sum(
            r.num_tokens_to_compute for r in self._running
        )
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_queued_tokens=queued,
            num_preemptions=self._num_preemptions,
            prefix_cache_queried_tokens=blocks.num_queried_tokens,
            prefix_cache_hit_tokens=blocks.num_hit_tokens,
            num_free_blocks=blocks.num_free_blocks,
            num_used_blocks=blocks.num_used_blocks,
            kv_cache_usage=blocks.usage,
        )

    # ---- one step --------------------------------------------------------------------------------

    def schedule(
        self,
        drafts: Mapping[str, Sequence[int]] | None = None,
        busy: frozenset[str] = frozenset(),
        max_seqs: int | None = None,
    ) -> SchedulerOutput:
        """Plan one step (see the module docstring for the policy). Allocates the blocks it plans for.
        `drafts`: draft tokens proposed for running requests (speculative decoding; see the module docstring).
        `busy`: running requests of micro-batches still in flight (a pipeline: see the module docstring).
        `max_seqs`: at most this many requests in this step (a micro-batch's share; default max_num_seqs)."""
        self._num_steps += 1
        seats = self.config.max_num_seqs if max_seqs is None else min(max_seqs, self.config.max_num_seqs)
        step = _Step(self.config.max_num_batched_tokens, seats, drafts or {}, busy)
        if self.config.policy == "priority":
            self._schedule_by_rank(step)
        elif self.config.enable_chunked_prefill:
            self._schedule_running(step)
            if not step.preempted:  # blocks are short: admitting now would only preempt again
                self._schedule_waiting(step, reserved_blocks=0)
        else:
            self._schedule_waiting(step, reserved_blocks=self._blocks_needed_by_running())
            self._schedule_running(step)
        return step.output()

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Mark each chunk's tokens computed and register newly full blocks in the prefix cache; with a
        release window, give back the blocks out of it. Chunks of requests finished or aborted since
        `schedule()` are skipped."""
        for chunk in output.chunks:
            request = chunk.request
            if not self._is_running(request):
                continue
            if request.num_computed_tokens != chunk.start:
                raise ValueError(
                    f"request {request.request_id!r}: chunk starts at {chunk.start} but "
                    f"{request.num_computed_tokens} tokens are computed "
                    f"(a stale or repeated output?)"
                )
            request.num_computed_tokens = chunk.end - chunk.num_draft_tokens
            self.block_manager.cache_full_blocks(request)
            if self.config.release_window:
                self.block_manager.release_before(request, chunk.end - self.config.release_window + 1)

    def accept_draft_tokens(self, request: Request, num_accepted: int) -> None:
        """After a verification step: the engine appended the request's accepted drafts (and the token sampled
        after them); their KV, computed by the step, now counts as computed. The blocks past the request's
        tokens (rejected drafts' slots) go back to the pool; newly full blocks are registered."""
        if not self._is_running(request):
            raise ValueError(f"request {request.request_id!r} is not running")
        if (
            isinstance(num_accepted, bool)
            or not isinstance(num_accepted, int)
            or not (0 <= num_accepted <= request.num_tokens_to_compute - 1)
        ):
            raise ValueError(
                f"request {request.request_id!r}: {num_accepted!r} accepted drafts, but "
                f"{request.num_tokens_to_compute} tokens are uncomputed (the last is never computed)"
            )
        request.num_computed_tokens += num_accepted
        self.block_manager.trim(request)
        self.block_manager.cache_full_blocks(request)

    def _rank(self, request: Request) -> tuple[int, int, int]:
        """Lower is served first: arrival under "fcfs"; under "priority" aged requests by arrival, then the
        others by (priority, arrival). Changes only when schedule() advances the clock (aging)."""
        if self.config.policy == "fcfs" or self._is_aged(request):
            return (0, 0, request.arrival_order)
        return (1, request.priority, request.arrival_order)

    def _is_aged(self, request: Request) -> bool:
        return self._num_steps - request.arrival_step >= self.config.priority_aging_steps

    def _schedule_by_rank(self, step: _Step) -> None:
        """Priority policy: running and waiting requests in one order, best rank first. A waiting request
        that does not fit preempts worse ranked running ones, or ends admission for this step."""
        self._waiting.sort(key=self._rank)  # aging may have reordered both since the last step
        self._running.sort(key=self._rank)
        running = list(self._running)
        admitting = True
        while not step.full:
            while running and (
                running[0].status is not RequestStatus.RUNNING
                or step.has(running[0])
                or running[0].request_id in step.busy
            ):
                running.pop(0)  # preempted by a better ranked request a moment ago, or in flight
            head = self._waiting[0] if admitting and self._waiting else None
            if head is not None and (not running or self._rank(head) < self._rank(running[0])):
                admitting = self._admit(head, step, reserved_blocks=0, may_preempt=True)
                continue
            if not running:
                return
            request = running.pop(0)
            if min(request.num_tokens_to_compute, step.token_budget) > 0:
                self._schedule_one(request, step)

    def _is_running(self, request: Request) -> bool:
        return request.status is RequestStatus.RUNNING and self._requests.get(request.request_id) is request

    def _schedule_running(self, step: _Step) -> None:
        """Give running requests (oldest first) what they still need, preempting the newest when needed."""
        for request in list(self._running):
            if step.full:
                return
            if request.status is not RequestStatus.RUNNING or step.has(request) or request.request_id in step.busy:
                continue  # preempted a moment ago, admitted this step, or in flight
            if min(request.num_tokens_to_compute, step.token_budget) <= 0:
                continue  # nothing to compute until the engine appends its sampled token
            if not self._schedule_one(request, step):
                return

    def _schedule_one(self, request: Request, step: _Step) -> bool:
        """Schedule a running request's next tokens (with its drafts when it decodes, has drafts and their
        slots are free); False if it was preempted instead."""
        drafts = self._drafts_for(request, step)
        if drafts and self.block_manager.allocate(request, 1 + len(drafts), num_draft_tokens=len(drafts)):
            step.add(request, 1 + len(drafts), drafts)
            return True
        available = min(request.num_tokens_to_compute, step.token_budget)
        num_new = self._chunk_size(request, request.num_computed_tokens, available)
        if num_new == 0:
            return True  # an image's rest does not fit this step's budget: it waits, holding its blocks
        if not self._allocate_or_preempt(request, num_new, step):
            return False
        step.add(request, num_new)
        return True

    def _chunk_size(self, request: Request, start: int, available: int) -> int:
        """Tokens of `request` to compute from `start` when `available` of them fit this step (0: it must wait):
        cut to `long_prefill_token_threshold` when over it (a decode's one token never is; an image the chunk starts
        in is still taken whole), then with `whole_images` cut back so that the chunk never ends inside an image."""
        threshold = self.config.long_prefill_token_threshold
        num_new = available
        if 0 < threshold < num_new:
            num_new = max(threshold, min(available, self._image_rest(request, start)))
        return self._image_bounded(request, num_new, start)

    def _image_rest(self, request: Request, start: int) -> int:
        """With `whole_images`, the tokens from `start` to the end of the image it falls in; else 0."""
        if not self.config.whole_images:
            return 0
        return next((image.end - start for image in request.images if image.offset <= start < image.end), 0)

    def _image_bounded(self, request: Request, num_new: int, start: int) -> int:
        """With `whole_images`, a chunk of `num_new` tokens from `start` that would end inside an image: cut back to
        the image's start, or 0 when it starts in the image (its rest does not fit)."""
        if not self.config.whole_images:
            return num_new
        end = start + num_new
        for image in request.images:
            if image.offset < end < image.end:
                return max(0, image.offset - start)
        return num_new

    @staticmethod
    def _drafts_for(request: Request, step: _Step) -> tuple[int, ...]:
        """The request's proposed drafts, cut to the budget; () unless it decodes (one token to compute)."""
        drafts = step.drafts.get(request.request_id)
        if not drafts or request.num_tokens_to_compute != 1 or step.token_budget < 2:
            return ()
        return tuple(drafts[: step.token_budget - 1])

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> bool:
        """Allocate for `request`, preempting the newest running requests until it fits. False if the
        request itself had to be preempted (alone, or with its beam group)."""
        while not self.block_manager.allocate(request, num_new):
            victim = self._victim(step)
            if victim is None:  # only requests in flight hold blocks to take: it waits for them
                return False
            self._preempt(victim, step)
            if request.status is not RequestStatus.RUNNING:
                return False
        return True

    def _victim(self, step: _Step) -> Request | None:
        """The worst ranked running request that may be preempted (not in flight), or None."""
        return next((r for r in reversed(self._running) if r.request_id not in step.busy), None)

    def _preempt(self, request: Request, step: _Step) -> None:
        """Preempt by recompute: drop blocks and progress; the tokens so far are kept and recomputed. The beams
        of a beam search go together (worker/engine/beam_groups.py): a group never waits on a beam of its own."""
        group = request.beam_group
        members = [request] if group is None else [r for r in self._running if r.beam_group == group]
        for member in reversed(members):
            self._preempt_one(member, step)

    def _preempt_one(self, request: Request, step: _Step) -> None:
        self._running.remove(request)
        if step.has(request):
            step.drop(request)
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._num_preemptions += 1
        bisect.insort(self._waiting, request, key=self._rank)
        step.preempted.append(request)

    def _schedule_waiting(self, step: _Step, reserved_blocks: int) -> None:
        """Admit waiting requests in arrival order until one does not fit; leave `reserved_blocks` free."""
        while self._waiting and not step.full:
            if not self._admit(self._waiting[0], step, reserved_blocks, may_preempt=False):
                return

    def _admit(self, request: Request, step: _Step, reserved_blocks: int, may_preempt: bool) -> bool:
        """Move the head of the waiting queue to running with its first chunk; False if it does not fit
        (a seat, the token budget, blocks beyond `reserved_blocks`). With `may_preempt`, worse ranked running
        requests are preempted while seats or blocks are short."""
        if not self._lora_fits(request):
            return False
        cached = [] if request.computes_whole_prompt else self.block_manager.find_cached_prefix(request)
        num_new = self._prefill_chunk(request, len(cached), step.token_budget)
        if num_new == 0:
            return False
        while (
            len(self._running) >= self.config.max_num_seqs
            or self.block_manager.num_blocks_to_allocate(request, num_new, cached) + reserved_blocks
            > self.block_manager.num_free_blocks
        ):
            victim = self._victim(step)
            if not may_preempt or victim is None or self._rank(victim) <= self._rank(request):
                return False
            self._preempt(victim, step)
        if not self.block_manager.allocate(request, num_new, cached):
            return False
        self._waiting.remove(request)
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=self._rank)
        step.add(request, num_new)
        return True

    def _lora_fits(self, request: Request) -> bool:
        """Whether `request`'s adapter may run now: the base model always, an adapter while the running requests'
        distinct adapters, it included, stay within `max_loras`."""
        if not request.lora_id or not self.config.max_loras:
            return True
        running = self.running_lora_ids()
        return request.lora_id in running or len(running) < self.config.max_loras

    def running_lora_ids(self) -> set[int]:
        """The adapters (ids > 0) the running requests hold."""
        return {r.lora_id for r in self._running if r.lora_id}

    def _prefill_chunk(self, request: Request, num_cached_blocks: int, token_budget: int) -> int:
        """Tokens of a waiting request to compute now (0: it must wait). Without chunked prefill all of
        the rest must fit."""
        remaining = request.num_tokens - num_cached_blocks * self.config.block_size
        if self.config.enable_chunked_prefill:
            start = num_cached_blocks * self.config.block_size
            return self._chunk_size(request, start, min(remaining, token_budget))
        return remaining if remaining <= token_budget else 0

    def _blocks_needed_by_running(self) -> int:
        """Free blocks the running requests need to compute all they still have to compute."""
        return sum(
            self.block_manager.num_blocks_to_allocate(r, r.num_tokens_to_compute)
            for r in self._running
            if r.num_tokens_to_compute > 0
        )

    # ---- checks ----------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ValueError if the queues, statuses or block ownership are inconsistent."""
        for queue, status in ((self._waiting, RequestStatus.WAITING), (self._running, RequestStatus.RUNNING)):
            ranks = [self._rank(r) for r in queue]
            if ranks != sorted(ranks):
                raise ValueError(f"the {status.value} queue is out of rank order: {ranks}")
            for request in queue:
                if request.status is not status or self._requests.get(request.request_id) is not request:
                    raise ValueError(
                        f"request {request.request_id!r} ({request.status.value}) misplaced in {status.value}"
                    )
        for request in self._waiting:
            if request.block_table or request.num_computed_tokens:
                raise ValueError(f"waiting request {request.request_id!r} holds blocks or computed tokens")
        for request in self._running:
            if request.num_computed_tokens > len(request.block_table) * self.config.block_size:
                raise ValueError(f"running request {request.request_id!r} computed more tokens than its blocks hold")
        if len(self._waiting) + len(self._running) != len(self._requests):
            raise ValueError("a request is in no queue, or in both")
        self.block_manager.check_invariants(holders=self._running)
