"""Admission, routing and deadlines: a Submit is refused as overloaded, held, or routed and dispatched; held
requests go out in order (resumed ones first, then by priority) when room appears; requests past their timeout
fail from one deadline heap (protocol/deadlines.py, which LocalEngine uses too); a request whose worker died, gave it up
or drains goes back to the front of the queue (failover), or fails past its retries or as a likely poison. No I/O: a
job the Coordinator (core.py) builds, on the books, the routing policy and the cluster's status (every other job
calls it; it calls none). It owns the deadline heap, the routable workers and a routing policy per model: a request
runs on a worker of its model (RequestRecord.model, coordinator/models.py), and each model's queue of held requests
moves on its own (a model with no free worker holds up none of the others)."""

from __future__ import annotations

import logging
import random
import secrets
from typing import cast

import msgspec

from infer.coordinator.books import Books
from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.kv_index import DEFAULT_OVERLAP_WEIGHT, KvAware
from infer.coordinator.lifecycle import ClusterState
from infer.coordinator.load_index import LoadIndex
from infer.coordinator.models import Models, Refusal, Target
from infer.coordinator.outbox import Send
from infer.coordinator.routing import POLICIES, LeastLoaded, PrefixAffinity, RoundRobin, RoutingPolicy
from infer.coordinator.sessions import Sessions
from infer.coordinator.state import ClusterStatus, RequestRecord, WorkerRecord
from infer.protocol.deadlines import DeadlineHeap
from infer.protocol.journal import StreamJournal
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.messages import Abort, Delta, Dispatch, KvEvents, KvMove, KvResync, Placement, Submit
from infer.protocol.sampling import SamplingParams
from infer.protocol.tracing import HopSpan

log = logging.getLogger("infer.coordinator")

QUARANTINE_DEATHS = 2  # worker deaths while it ran that fail a request as a likely poison


def make_policy(name: str, kv_overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> RoutingPolicy:
    """The policy `name` (coordinator/routing.py's, or kv-aware: coordinator/kv_index.py); `kv_overlap_weight`:
    kv-aware's weight of a token not to prefill against a token of queue."""
    if name == "kv-aware":
        return KvAware(kv_overlap_weight)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    if name == "prefix-affinity":
        return PrefixAffinity()
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")


class Admission:
    """Which requests go where, and when; the deadline heap; the routable workers."""

    def __init__(
        self, books: Books, send: Send, status: ClusterStatus, models: Models, config: CoordinatorConfig
    ) -> None:
        self.books = books
        self.send = send
        self.status = status
        self.models = models
        self.policies: dict[str, RoutingPolicy] = {}  # one per model: each remembers only its own ranks
        self.config = config
        self._seeds = random.Random()  # seeds for sampled requests that come without one
        self._awaiting: dict[str, RequestRecord] = {}  # detached direct streams waiting for their client's copy
        self.routable_cache: list[WorkerRecord] | None = None
        self.index = LoadIndex()  # the routable workers by load, rebuilt with routable_cache
        books.worker_unloaded = self.index.touch
        self.deadlines: DeadlineHeap[str] = DeadlineHeap()  # request ids by deadline; stale entries skipped
        self.sessions = Sessions()  # conversations pinned to the rank of their last request (Submit.session_id)
        self._kv_warnings = RateLimitedLog(log)

    def policy(self, model_id: str) -> RoutingPolicy:
        """The routing policy of `model_id`'s workers (made on first use)."""
        policy = self.policies.get(model_id)
        if policy is None:
            policy = self.policies[model_id] = make_policy(self.config.policy, self.config.kv_overlap_weight)
        return policy

    def on_kv_events(self, worker: WorkerRecord, events: KvEvents, now: float) -> None:
        """A worker's prefix-cache changes into its model's index (kv-aware only; a draining worker's are dropped:
        it takes nothing new). A gap or a broken bound drops the worker's entries and asks it for a snapshot."""
        policy = self.policy(worker.model_id)
        if not isinstance(policy, KvAware) or worker.draining:
            return
        problem = policy.index.apply(worker.worker_id, worker, worker.dp_rank, events, worker.num_kv_blocks, now)
        if problem is not None:
            self._kv_warnings.warning(
                "KV events of worker %s dropped, snapshot asked for: %s", safe(worker.worker_id), problem
            )
            self.send(worker.identity, KvResync(reason=problem))

    def worker_draining(self, worker: WorkerRecord) -> None:
        """`worker` drains: out of routing (the caller marked it) with every rank of its EP group (the group drains
        as a whole: worker/service/core.py `group_drains`), and what routing remembers of them goes."""
        self.routes_changed()
        for rank in self.books.workers:
            if rank.group_key == worker.group_key:
                self._forget(rank)

    def _forget(self, worker: WorkerRecord) -> None:
        self.policy(worker.model_id).forget_rank(worker.dp_rank)
        self.sessions.forget_rank(worker.model_id, worker.dp_rank)

    def new_record(self, identity: bytes, submit: Submit, now: float, target: Target | None = None) -> RequestRecord:
        """The record of an accepted Submit, to run on `target` (default: the model the Submit names)."""
        target = Target(submit.model) if target is None else target
        spec = submit.spec
        sampling = spec.sampling
        if target.lora_name is not None:  # `model` named the adapter: the request runs with it
            sampling = msgspec.structs.replace(sampling, lora_name=target.lora_name)
        seeded = self._seeded(sampling)
        request = RequestRecord(
            request_id=submit.request_id,
            client=identity,
            spec=spec if seeded is spec.sampling else msgspec.structs.replace(spec, sampling=seeded),
            model=target.model_id,
            session_id=submit.session_id,
            pin_rank=submit.pin_rank,
            submitted_at=now,
            deadline=None if submit.timeout_s is None else now + submit.timeout_s,
            traceparent=submit.traceparent,
        )
        if self.config.otlp_traces_endpoint is not None:
            request.trace = HopSpan.child_of(
                "coordinator", submit.traceparent, now, **{"gen_ai.request.id": submit.request_id}
            )
        if request.deadline is not None:
            self._add_deadline(request, request.deadline)
        return request

    def _seeded(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with a seed of its own if it samples (temperature > 0) and has none: a re-dispatch then
        continues the same random stream, and the client can replay it (the first delta reports it)."""
        if sampling.seed is not None or sampling.greedy:
            return sampling
        return sampling.with_seed(self._seeds.getrandbits(63))

    def admit(self, request: RequestRecord, now: float) -> None:
        """Dispatch an accepted request now, or hold it behind the ones of its model already waiting."""
        if self._dispatching and not any(r.model == request.model for r in self.books.requests.held.values()):
            self._dispatch(request, now)
        else:
            self.books.requests.hold(request, now)

    def admission_refusal(self, submit: Submit, model_id: str | None = None) -> str | None:
        """Why a new request must be refused at once as overloaded (its queues are full), or None.

        Priority (lower first) decides who is shed: with every worker at its limit, a request of a better
        priority than some request in flight is held (first in line for the next free seat, and its worker
        ranks it first) instead of refused; with the held queue full, a newcomer of a better priority
        takes the place of the worst held request that has not started, which fails as "overloaded". Only the
        workers of the request's model (`model_id`; None: the default) count."""
        routable = self.routable_for(model_id)
        if self.status.state is not ClusterState.RUNNING or not routable:
            return self._held_room(submit)
        if submit.pin_rank is not None:
            pinned = [w for w in routable if w.dp_rank == submit.pin_rank]
            if pinned and not self._has_room(pinned[0]):
                return (
                    f"the cluster is overloaded: dp_rank {submit.pin_rank} already has "
                    f"{pinned[0].num_in_flight} requests, its limit; retry later"
                )
            return None
        model = routable[0].model_id
        if self._indexed(model):
            full = self.index.best(model, self._has_room) is None
        else:
            full = not any(self._has_room(w) for w in routable)
        if full:
            if submit.spec.priority < self._worst_priority_in_flight():
                return self._held_room(submit)
            busiest = max(routable, key=lambda w: w.num_in_flight)
            return (
                f"the cluster is overloaded: every worker{self._of_model(busiest)} has its limit of requests (dp_rank "
                f"{busiest.dp_rank}: {busiest.num_in_flight}); retry later"
            )
        return None

    def _held_room(self, submit: Submit) -> str | None:
        """None if `submit` may wait in the coordinator, shedding a held request of a worse priority to make room
        when the queue is full; else why it is refused."""
        limit = self.config.max_held_requests
        if len(self.books.requests.held) < limit:
            return None
        worst = self.books.requests.worst_held_priority()
        if worst is not None and worst <= submit.spec.priority:  # nobody to shed: refused without a scan
            return self._overloaded_held(limit)
        fresh = [r for r in self.books.requests.held.values() if not r.num_delivered]
        victim = max(reversed(fresh), key=lambda r: r.priority, default=None)  # the newest of the worst
        if victim is not None and victim.priority > submit.spec.priority:
            self.books.fail(
                victim,
                f"request {victim.request_id!r} was shed from the coordinator's full queue for a "
                f"request of a better priority ({submit.spec.priority} < {victim.priority}); retry "
                f"later",
                code="overloaded",
            )
            return None
        return self._overloaded_held(limit)

    def _overloaded_held(self, limit: int) -> str:
        return (
            f"the cluster is overloaded: {len(self.books.requests.held)} requests already wait in the "
            f"coordinator (the limit, --max-held-requests {limit}); retry later"
        )

    def _worst_priority_in_flight(self) -> int:
        """The largest priority among the requests on workers (so the least urgent); on the refusal path only."""
        return max(
            (r.priority for r in self.books.requests.by_id.values() if r.worker_id is not None), default=-(2**63)
        )

    def _of_model(self, worker: WorkerRecord) -> str:
        """ " of model 'm'" when the cluster serves several models (error texts), else nothing."""
        return f" of model {worker.model_id!r}" if len(self.models.served()) > 1 else ""

    def _has_room(self, worker: WorkerRecord) -> bool:
        limit = worker.request_limit(self.config.max_requests_per_worker)
        return limit is None or worker.num_in_flight < limit

    def _dispatch(self, request: RequestRecord, now: float) -> bool:
        """Route and send `request` to a worker of its model; False (it stays or becomes held) if none can take it
        now."""
        if request.model is None and not self._settle_model(request):
            return True
        routable = self.routable_for(request.model)
        disaggregated = any(w.kv_role != "kv_both" for w in routable) or request.handed_off
        if disaggregated:
            routable = self._by_kv_role(request, routable)
        pinned = request.pin_rank is not None and request.retries == 0 and not request.handed_off
        scanned = pinned or request.suspect or request.session_id is not None or disaggregated
        if routable and not scanned and self._indexed(routable[0].model_id):
            best = self.index.best(routable[0].model_id, self._has_room)  # O(log workers): no scan
            if best is None:
                self.books.requests.hold(request, now)
                return False
            worker = best
        elif not (candidates := [w for w in routable if self._has_room(w)]):
            self.books.requests.hold(request, now)
            return False
        elif pinned:
            pinned_to = next((w for w in candidates if w.dp_rank == request.pin_rank), None)
            if pinned_to is None and any(w.dp_rank == request.pin_rank for w in routable):
                self.books.requests.hold(request, now)  # its rank is full: it waits for room there
                return False
            if pinned_to is None:
                ranks = ", ".join(str(w.dp_rank) for w in sorted(routable, key=lambda w: w.dp_rank))
                self.books.fail(
                    request,
                    f"request {request.request_id!r} is pinned to dp_rank {request.pin_rank}, "
                    f"which is not available (healthy ranks: {ranks})",
                )
                return True
            worker = pinned_to
        else:
            worker = self._route(request, self._for_suspect(request, candidates))
        if request.num_delivered and request.prompt_token_ids is None:
            self.books.fail(
                request,
                f"request {request.request_id!r} cannot be resumed: its worker never reported the prompt's token ids",
            )
            return True
        if request.remaining_budget() == 0:  # every token is out; only the final delta was lost
            self.books.counters.requests_completed += 1
            self.books.finish(request, Delta.final(request.request_id, "length"), {})
            return True
        self.books.place(request, worker)
        worker.requests_routed += 1
        worker.dispatches_sent += 1
        request.dispatch_seq = worker.dispatches_sent
        if request.trace is not None:
            request.trace.event("dispatch", now)
            request.trace.attributes["infer.worker_id"] = worker.worker_id
        self.send(worker.identity, self._dispatch_message(request, worker))
        return True

    def _route(self, request: RequestRecord, candidates: list[WorkerRecord]) -> WorkerRecord:
        """Its session's rank when that can take it (coordinator/sessions.py), else its model's policy's choice
        (kv-aware: by the blocks each rank holds of its prompt, keyed by its adapter as on the worker)."""
        model = worker_model(candidates)
        session = request.session_id
        worker = None if session is None else self.sessions.home(model, session, candidates)
        if worker is None:
            policy = self.policy(model)
            if isinstance(policy, KvAware):
                worker = policy.choose_for(request.routing_prompt, candidates, request.sampling.lora_name)
            else:
                worker = policy.choose(request.routing_prompt, candidates)
        if session is not None:
            self.sessions.remember(model, session, worker.dp_rank)
        return worker

    def _by_kv_role(self, request: RequestRecord, routable: list[WorkerRecord]) -> list[WorkerRecord]:
        """Disaggregated prefill and decode (docs/architecture.md): a new request goes to producers and kv_both
        workers, a handed-off one to its consumer (else to any consumer or kv_both worker); a role with no worker
        that can take the request leaves it to the others, so a request never waits for a missing role."""
        if request.handed_off:
            mine = [w for w in routable if w.worker_id == request.kv_consumer and self._has_room(w)]
            if mine:
                return mine
            wanted = [w for w in routable if w.kv_role != "kv_producer" and self._has_room(w)]
        else:
            wanted = [w for w in routable if w.kv_role != "kv_consumer" and self._has_room(w)]
        return wanted or routable

    def _kv_consumer_for(self, request: RequestRecord, producer: WorkerRecord) -> WorkerRecord | None:
        """The consumer a producer's request goes on at (the model's policy among the consumers with room)."""
        consumers = [w for w in self.routable_for(request.model) if w.kv_role == "kv_consumer" and self._has_room(w)]
        if not consumers:
            return None
        policy = self.policy(producer.model_id)
        if isinstance(policy, KvAware):
            return policy.choose_for(request.routing_prompt, consumers, request.sampling.lora_name)
        return policy.choose(request.routing_prompt, consumers)

    def move_target(self, request: RequestRecord, source: WorkerRecord) -> KvMove | None:
        """Where a draining worker's request goes on with its KV (docs/architecture.md, "A drain that moves KV"): the
        model's policy among the routable workers with a KV port and room (consumers and kv_both workers before
        producers; a producer's request keeps the consumer it was dispatched with, which may hold its blocks by
        then), never a rank of `source`'s EP group nor of another group with a draining rank (a group cannot step
        without its members: it goes away with them); None: no such worker (the request finishes on `source`). Its
        hand-off then goes there (`request.kv_consumer`)."""
        if request.model is None:
            return None
        leaving = {source.group_key} | {w.group_key for w in self.books.workers if w.draining}
        able = [
            w
            for w in self.routable_for(request.model)
            if w.hello.kv_address is not None and w.group_key not in leaving and self._has_room(w)
        ]
        candidates = [w for w in able if w.kv_role != "kv_producer"] or able
        if not candidates:
            return None
        policy = self.policy(source.model_id)
        target = next((w for w in candidates if w.worker_id == request.kv_consumer), None)
        if target is None and isinstance(policy, KvAware):
            target = policy.choose_for(request.routing_prompt, candidates, request.sampling.lora_name)
        elif target is None:
            target = policy.choose(request.routing_prompt, candidates)
        request.kv_consumer = target.worker_id
        return KvMove(
            request_id=request.request_id, kv_address=cast(str, target.hello.kv_address), kv_key=target.key or ""
        )

    def handoff(self, request: RequestRecord, producer: WorkerRecord, now: float) -> None:
        """A producer prefilled `request` and sent its KV to its consumer: continue it there (as a failover does,
        from where its stream stands, but not counted as a retry: nothing failed)."""
        self.books.detach(request)
        request.handed_off = True
        log.debug("request %s handed off by %s to %s", request.request_id, producer.worker_id, request.kv_consumer)
        self._run_again(request, now)  # the client's copy, on a direct stream, then goes to the consumer

    def _run_again(self, request: RequestRecord, now: float) -> None:
        """Queue a detached request to run again from where its stream stands, first in line. A direct stream: only
        the client knows what it holds, so it re-attaches with its copy (resume_from) first."""
        if request.direct:
            request.direct, request.placement, request.awaiting_client = False, None, now
            self._awaiting[request.request_id] = request
            self.send(request.client, Placement(request_id=request.request_id))
            return
        self.books.requests.hold(request, now)
        self.books.requests.held.move_to_end(request.request_id, last=False)

    def _dispatch_message(self, request: RequestRecord, worker: WorkerRecord) -> Dispatch:
        """The request's Dispatch; a direct stream (docs/architecture.md, "Direct streams") when its client reads
        them and the worker has a stream socket: the owner's key and a new token go to the worker, and the client
        hears where to subscribe (Placement)."""
        dispatch = request.dispatch()
        if worker.kv_role == "kv_producer" and not request.handed_off:
            consumer = self._kv_consumer_for(request, worker)
            request.kv_consumer = None if consumer is None else consumer.worker_id
            if consumer is not None:
                dispatch = msgspec.structs.replace(
                    dispatch, kv_consumer_address=consumer.hello.kv_address, kv_consumer_key=consumer.key or ""
                )
        client = self.books.clients.get(request.client)
        address = worker.hello.stream_address
        request.direct = address is not None and client is not None and client.streams and not self.config.relay_streams
        if not request.direct or client is None:
            return dispatch
        token = secrets.token_hex(16)
        request.placement = Placement(
            request_id=request.request_id, stream_address=address, worker_key=worker.key, stream_token=token
        )
        self.send(request.client, request.placement)
        return msgspec.structs.replace(dispatch, stream_owner=client.key, stream_token=token)

    def _settle_model(self, request: RequestRecord) -> bool:
        """A request that named no model before any worker registered runs on the default model now that there is
        one; False (it failed) if the cluster now serves several with no default."""
        target = self.models.resolve(None, request.sampling.lora_name)
        if isinstance(target, Refusal):
            self.books.fail(request, f"request {request.request_id!r}: {target.message}", target.code)
            return False
        request.model = target.model_id
        return True

    def _for_suspect(self, request: RequestRecord, candidates: list[WorkerRecord]) -> list[WorkerRecord]:
        """A suspect goes where no other suspect runs, when such a worker can take it: should one of them be a
        poison, the next death then hits it alone, not the bystanders that died with it once."""
        if not request.suspect:
            return candidates
        clear = [
            w
            for w in candidates
            if not any(r is not None and r.suspect for r in map(self.books.requests.get, w.requests))
        ]
        return clear or candidates

    @property
    def _dispatching(self) -> bool:
        """New work goes to the workers: running, and no weight update under way (it holds new requests)."""
        return self.status.state is ClusterState.RUNNING and not self.status.refit_pending

    def dispatch_held(self, now: float) -> None:
        """Held requests out in order, each model's queue on its own: a request no worker of its model can take
        now keeps the later ones of that model held, and no others."""
        if not self._dispatching or not self.books.requests.held or not self.routable():
            return
        stuck: set[str | None] = set()  # models whose next held request found no worker
        for request in self._held_in_order():
            if request.model in stuck:
                continue
            if not self._dispatch(request, now):
                stuck.add(request.model)

    def _held_in_order(self) -> list[RequestRecord]:
        """Held requests in dispatch order: resumed ones (a failover) first, then by priority, each in the order
        they were held."""
        held = list(self.books.requests.held.values())
        if all(r.priority == held[0].priority for r in held):
            return held
        return sorted(held, key=lambda r: (r.retries == 0, r.priority))

    def failover(self, request: RequestRecord, reason: str, now: float) -> None:
        """Move `request` off its worker and queue it (first in line) to resume where its stream stands."""
        self.books.detach(request)
        if request.retries >= self.config.max_retries:
            self.books.fail(
                request,
                f"request {request.request_id!r} failed: {reason}; it was already "
                f"re-dispatched {request.retries} time(s), the limit (--max-retries)",
            )
            return
        if len(request.worker_deaths) >= QUARANTINE_DEATHS:
            self._quarantine(request, reason)
            return
        request.retries += 1
        self.books.counters.requests_redispatched += 1
        self._run_again(request, now)

    def _quarantine(self, request: RequestRecord, reason: str) -> None:
        """Fail a request that was running on QUARANTINE_DEATHS workers when they died: a likely poison."""
        workers = ", ".join(repr(w) for w in request.worker_deaths)
        log.warning(
            "request %r quarantined: running on %d workers that died (%s)",
            request.request_id,
            len(request.worker_deaths),
            workers,
        )
        self.books.fail(
            request,
            f"request {request.request_id!r} failed: it was running on two workers that "
            f"died ({workers}; last: {reason}), so it is quarantined as their likely cause "
            f"instead of being moved to another worker",
            "internal",
        )

    def resume_from(self, request: RequestRecord, submit: Submit, now: float) -> None:
        """A detached direct stream's client sent its copy (a re-attach Submit): resume from it, first in line."""
        request.awaiting_client = None
        self._awaiting.pop(request.request_id, None)
        delivered = submit.delivered_token_ids
        request.journal = StreamJournal.lengths_only(delivered, submit.delivered_text_len if delivered else 0)
        request.learn_prompt_ids(submit.spec.prompt_token_ids)
        request.take_seed(submit.spec.sampling.seed)
        self.books.requests.hold(request, now)
        self.books.requests.held.move_to_end(request.request_id, last=False)
        self.dispatch_held(now)

    def move_to_copy(self, request: RequestRecord, submit: Submit, now: float) -> None:
        """A running direct stream's client sent its copy (its worker did not serve the stream): abort it there
        (silently) and resume it from the copy; not a retry (no worker failed here)."""
        worker = self.books.workers.by_id.get(request.worker_id) if request.worker_id is not None else None
        self.books.detach(request)
        if worker is not None:
            self.send(worker.identity, Abort(request_ids=[request.request_id]))
        request.direct, request.placement = False, None
        log.info("request %s resumes from its client's copy (its stream was not served)", safe(request.request_id))
        self.resume_from(request, submit, now)

    def worker_died(self, worker: WorkerRecord) -> None:
        """`worker` is dead: out of routing, and its model's policy and sessions forget its rank (its requests move:
        `failover`)."""
        self.routes_changed()
        self._forget(worker)

    def note_version(self, worker: WorkerRecord, version: int) -> None:
        """What a worker's load or answer says it serves: it routes only at the cluster's version."""
        if version != worker.weight_version:
            worker.weight_version = version
            self.routes_changed()

    def note_load(self, worker: WorkerRecord) -> None:
        """`worker.load` is a new report: the version it serves, and its place in the routing index."""
        if worker.load is not None:
            self.note_version(worker, worker.load.weight_version)
        self.index.touch(worker)

    def routes_changed(self) -> None:
        """A worker joined, died or drains: `routable` is worked out afresh."""
        self.routable_cache = None

    def routable(self) -> list[WorkerRecord]:
        """Healthy workers whose whole group is healthy (a dead member stalls an EP group's collectives) and not
        draining (a draining member takes its group with it: every rank drains), and that serve the cluster's
        weight version (a worker behind is brought to it first: commands.py)."""
        if self.routable_cache is None:
            out = {w.group_key for w in self.books.workers if not w.healthy or w.draining}
            version = self.status.weight_version
            self.routable_cache = [
                w for w in self.books.workers if w.healthy and w.group_key not in out and w.weight_version == version
            ]
            self.index.rebuild(self.routable_cache)
        return self.routable_cache

    def routable_for(self, model_id: str | None) -> list[WorkerRecord]:
        """The routable workers of `model_id` (None: of the default model; none while there is no default)."""
        model = self.models.default if model_id is None else model_id
        self.routable()  # the index follows it
        return [] if model is None else self.index.members(model)

    def _indexed(self, model: str) -> bool:
        """Whether the routing index chooses `model`'s workers (least-loaded, EP groups of one rank; a request of a
        session is routed by `_route`); else the candidates are scanned by the model's policy."""
        return isinstance(self.policy(model), LeastLoaded) and self.index.indexed(model)

    def _add_deadline(self, request: RequestRecord, deadline: float) -> None:
        self.deadlines.push(deadline, request.request_id, len(self.books.requests), self._deadline_current)

    def _deadline_current(self, deadline: float, request_id: str) -> bool:
        request = self.books.requests.get(request_id)
        return request is not None and request.deadline == deadline

    def expire_deadlines(self, now: float) -> None:
        """Fail every request past its deadline with error code "timeout"; its worker aborts it (KV freed)."""
        for _, rid in self.deadlines.pop_due(now, self._deadline_current):
            request = self.books.requests.by_id[rid]
            self.books.counters.requests_timed_out += 1
            waited = now - request.submitted_at
            self.books.fail(
                request,
                f"request {rid!r} did not finish within its timeout ({waited:.1f} s); it was "
                f"aborted after {request.num_delivered} token(s)",
                "timeout",
            )
            self.dispatch_held(now)

    def check_held(self, now: float) -> None:
        self._check_awaiting(now)
        self.dispatch_held(now)
        if self.status.state is not ClusterState.RUNNING:
            return  # paused requests wait as long as the pause lasts
        limit = self.config.queue_timeout

        def waited(request: RequestRecord) -> float:
            return now - cast(float, request.held_since)  # a held request has one (RequestTable.hold sets it)

        for request in [r for r in self.books.requests.held.values() if waited(r) > limit]:
            self.books.fail(
                request,
                f"request {request.request_id!r} waited {waited(request):.1f} s for a "
                f"healthy worker (queue timeout {limit} s)",
            )

    def _check_awaiting(self, now: float) -> None:
        """Detached direct streams whose client sent no copy within the client timeout fail (a client that is
        gone, or that had it end already, never will); those that ended otherwise are forgotten here."""
        limit = self.config.client_timeout
        for rid, request in list(self._awaiting.items()):
            if request.awaiting_client is None or self.books.requests.get(rid) is not request:
                del self._awaiting[rid]
            elif now - request.awaiting_client > limit:
                del self._awaiting[rid]
                request.awaiting_client = None
                self.books.fail(
                    request,
                    f"request {rid!r} failed: its worker left and its client sent no copy to resume it from within "
                    f"{limit:g} s (--client-timeout)",
                )


def worker_model(workers: list[WorkerRecord]) -> str:
    """The model of `workers` (never empty, all of one model)."""
    return workers[0].model_id
