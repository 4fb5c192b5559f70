"""Several coordinators: which one leads, under a lease a majority grants (docs/architecture.md, "Several
coordinators"). No sockets; time is passed in, so tests drive it directly (tests/coordinator/test_election.py).

N coordinators (N = 1, or N >= 3: two cannot tell a dead peer from a cut cable) share one address list and
each knows its place in it. One leads at a time; only the leader admits, routes, hands out DP ranks and runs
commands (the others answer every client and worker frame with Redirect).

- The leader sends every peer a PeerBeat each `beat` seconds. A peer acknowledges a beat whose term is at least
  its own (taking that term) and trusts that leader until `lease` seconds after it received the beat.
- The leader's lease runs until `lease * (1 - DRIFT)` after it *sent* the newest beat that a majority (itself
  included) acknowledged. It leads only while the lease runs: cut off from a majority, it steps down by itself.
- A coordinator that trusts no leader (its trust ran out) stands after a stagger by its place in the list: term
  + 1, its own vote, a VoteRequest to every peer. A peer grants one vote per term, and only while it trusts no
  leader and not within BLACKOUT leases of its own start (it may have voted in a term it forgot). A peer that
  still trusts a leader ignores a higher term (a candidate cut off from the rest cannot depose a working leader
  once the cable is back).
- A majority of votes makes the candidate leader; it leads once a majority acknowledged its first beat.

Why two never lead at once: the majority that acknowledged the old leader's last lease-giving beat and the
majority that elects a new one share a member. That member voted only after its trust ran out, `lease` after it
received that beat, which is after the old lease (measured from the send, shortened by DRIFT) ended; and it
acknowledges no beat of the old term once it has voted in a newer one. Clocks are each process's monotonic
clock: only their rates must agree within DRIFT over one lease. Two leaders of one term would need two majorities
of voters that vote once per term. Workers add a fence of their own: they follow no coordinator whose Welcome
carries a lower term than one they followed.

The leader's Replica (coordinator/core.py `replica`: the lifecycle state, the weight version, the LoRA adapters,
the DP ranks) rides on its beats when it changed, and every REPLICA_EVERY beats; each peer keeps the newest, and
a new leader starts from it. Running requests need no replica: workers and clients bring them back (as after a
restart).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import msgspec

from infer.protocol.messages import Message, PeerAck, PeerBeat, Replica, VoteGrant, VoteRequest

LEASE_S = 1.5  # a leader's lease, and how long a peer trusts it after a beat
BEATS_PER_LEASE = 6
DRIFT = 0.1  # the leader's own lease is this fraction shorter than its peers' trust (clock rates may differ)
BLACKOUT = 1.0  # leases after its start during which a coordinator grants no vote
REPLICA_EVERY = 8  # beats between two replicas that did not change
PEER_MESSAGES = (PeerBeat, PeerAck, VoteRequest, VoteGrant)


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass
class Election:
    """One coordinator's view: `index` in a list of `count`; `on_message` for a peer's frame, `tick` for the
    timers, `take_outgoing` for (peer index, message) to send; `leading(now)` says whether it may serve."""

    index: int
    count: int
    now: float
    lease: float = LEASE_S
    term: int = 0
    role: Role = Role.FOLLOWER
    leader: int | None = None  # whom it trusts (itself when leading)
    replica: Replica | None = None  # the newest from a leader (its own while leading)
    _voted: tuple[int, int] | None = None  # (term, for whom)
    _votes: set[int] = field(default_factory=set)
    _trust_until: float = 0.0
    _blackout_until: float = 0.0
    _lease_until: float = -math.inf
    _elected_at: float = 0.0
    _candidate_term: int = 0
    _next_beat: float = 0.0
    _stand_at: float = 0.0
    _seq: int = 0
    _sent: dict[int, float] = field(default_factory=dict)  # beat seq -> when sent (unacknowledged ones)
    _acks: dict[int, set[int]] = field(default_factory=dict)
    _replica_sent: Replica | None = None
    _beats_since_replica: int = 0
    _outgoing: list[tuple[int, Message]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"coordinator index {self.index} is not in a list of {self.count}")
        if self.count == 2:
            raise ValueError(
                "two coordinators cannot tell a dead peer from a cut cable, so neither could take over safely: "
                "run 1, or 3 or more (a majority of 2 of 3 survives the loss of any one)"
            )
        now = self.now
        self._blackout_until = now + BLACKOUT * self.lease
        self._trust_until = now + self.lease  # a peer just started waits a lease for a leader's beat first
        self._stand_at = self._trust_until + self._stagger()
        if self.count == 1:  # alone: it leads for good
            self.term, self.role, self.leader, self._lease_until = 1, Role.LEADER, self.index, math.inf

    @property
    def majority(self) -> int:
        return self.count // 2 + 1

    @property
    def beat(self) -> float:
        return self.lease / BEATS_PER_LEASE

    def leading(self, now: float) -> bool:
        return self.role is Role.LEADER and now < self._lease_until

    def trusted_leader(self, now: float) -> int | None:
        """Another coordinator this one follows and heard from within a lease; None otherwise."""
        following = self.role is Role.FOLLOWER and self.leader is not None and self.leader != self.index
        return self.leader if following and now < self._trust_until else None

    def take_outgoing(self) -> list[tuple[int, Message]]:
        out, self._outgoing = self._outgoing, []
        return out

    def next_deadline(self) -> float:
        if self.count == 1:
            return math.inf
        if self.role is Role.LEADER:
            return min(self._next_beat, self._lease_end())
        return self._stand_at

    def set_replica(self, replica: Replica) -> None:
        """The leader's current Replica (its version set here: one more than the last when it changed)."""
        last = self.replica
        version = 0 if last is None else last.version
        if last is None or msgspec.structs.replace(replica, version=version) != last:
            self.replica = msgspec.structs.replace(replica, version=version + 1)

    # ---- timers ---------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        if self.count == 1:
            return
        if self.role is Role.LEADER:
            if now >= self._lease_end():
                self._step_down(now, trust=False)  # cut off from a majority: it leads no more
            elif now >= self._next_beat:
                self._send_beat(now)
            return
        if now >= self._stand_at:
            self._stand(now)

    def _lease_end(self) -> float:
        """When a leader steps down unless a majority acknowledges a newer beat (one it has not confirmed yet: a
        lease after its election)."""
        return self._lease_until if self._lease_until > -math.inf else self._elected_at + self.lease

    def _stagger(self) -> float:
        """The lower a coordinator's place in the list, the sooner it stands: one candidate at a time."""
        return self.index * self.beat * 2

    def _stand(self, now: float) -> None:
        """Ask for the votes of a term past any it saw. The term is taken only on winning: a coordinator cut off
        from the rest may stand again and again, and its beats and acknowledgements still carry the term it
        follows, so it deposes no one once it is back (peers that trust a leader ignore its candidacies)."""
        voted = 0 if self._voted is None else self._voted[0]
        self._candidate_term = max(self.term, self._candidate_term, voted) + 1  # a split vote: the next term
        self.role, self.leader = Role.CANDIDATE, None
        self._voted, self._votes = (self._candidate_term, self.index), {self.index}
        self._stand_at = now + self.lease / 2 + self._stagger()  # no majority by then: stand again
        self._broadcast(VoteRequest(term=self._candidate_term, sender=self.index))

    def _become_leader(self, now: float) -> None:
        self.term = self._candidate_term
        self.role, self.leader = Role.LEADER, self.index
        self._lease_until = -math.inf  # it leads once a majority acknowledged a beat of this term
        self._elected_at = now
        self._sent.clear()
        self._acks.clear()
        self._replica_sent = None
        self._send_beat(now)

    def _step_down(self, now: float, trust: bool) -> None:
        """Leader or candidate no more; `trust`: another leads (wait a lease for its beat before standing)."""
        self.role, self.leader = Role.FOLLOWER, None
        self._lease_until = -math.inf
        self._trust_until = now + self.lease if trust else now
        self._stand_at = self._trust_until + self.lease / 2 + self._stagger()

    def _send_beat(self, now: float) -> None:
        self._seq += 1
        self._sent[self._seq] = now
        self._acks[self._seq] = {self.index}
        self._next_beat = now + self.beat
        replica = None
        self._beats_since_replica += 1
        if self.replica is not None and (
            self.replica != self._replica_sent or self._beats_since_replica >= REPLICA_EVERY
        ):
            replica, self._replica_sent, self._beats_since_replica = self.replica, self.replica, 0
        for seq in [s for s in self._sent if s < self._seq - 4 * BEATS_PER_LEASE]:  # acks that never came
            del self._sent[seq], self._acks[seq]
        self._broadcast(PeerBeat(term=self.term, sender=self.index, seq=self._seq, replica=replica))

    def _broadcast(self, msg: Message) -> None:
        self._outgoing.extend((peer, msg) for peer in range(self.count) if peer != self.index)

    # ---- peers' messages ------------------------------------------------------------------------

    def on_message(self, msg: Message, now: float) -> None:
        """A peer's PeerBeat, PeerAck, VoteRequest or VoteGrant (others are not this module's)."""
        if getattr(msg, "sender", self.index) == self.index or self.count == 1:
            return  # a frame claiming to be from this coordinator (or any, when alone) is not a peer's
        if isinstance(msg, PeerBeat):
            self._on_beat(msg, now)
        elif isinstance(msg, PeerAck):
            self._on_ack(msg, now)
        elif isinstance(msg, VoteRequest):
            self._on_vote_request(msg, now)
        elif isinstance(msg, VoteGrant):
            self._on_vote(msg, now)

    def _on_beat(self, beat: PeerBeat, now: float) -> None:
        if beat.term < self.term:  # a deposed leader: our term tells it
            self._outgoing.append((beat.sender, PeerAck(term=self.term, sender=self.index, seq=beat.seq)))
            return
        if beat.term > self.term or self.role is not Role.FOLLOWER:
            self.term = beat.term
            self._step_down(now, trust=True)
        self.leader = beat.sender
        self._trust_until = now + self.lease
        self._stand_at = self._trust_until + self._stagger()
        if beat.replica is not None:
            self.replica = beat.replica
        self._outgoing.append((beat.sender, PeerAck(term=self.term, sender=self.index, seq=beat.seq)))

    def _on_ack(self, ack: PeerAck, now: float) -> None:
        if ack.term > self.term:  # a majority moved on without us
            self.term = ack.term
            self._step_down(now, trust=True)
            return
        if self.role is not Role.LEADER or ack.term != self.term:
            return
        acks = self._acks.get(ack.seq)
        if acks is None:
            return
        acks.add(ack.sender)
        if len(acks) >= self.majority:
            self._lease_until = max(self._lease_until, self._sent[ack.seq] + self.lease * (1 - DRIFT))
            for seq in [s for s in self._sent if s <= ack.seq]:
                del self._sent[seq], self._acks[seq]

    def _on_vote_request(self, request: VoteRequest, now: float) -> None:
        trusting = self.leading(now) or self.trusted_leader(now) is not None
        voted = self._voted
        free = voted is None or voted[0] < request.term or voted == (request.term, request.sender)
        grant = request.term > self.term and free and not trusting and now >= self._blackout_until
        if grant:
            if self.role is not Role.FOLLOWER:
                self._step_down(now, trust=True)  # give the candidate a lease to win
            else:
                self._stand_at = max(self._stand_at, now + self.lease + self._stagger())
            self._voted = (request.term, request.sender)
        term = request.term if grant else self.term
        self._outgoing.append((request.sender, VoteGrant(term=term, sender=self.index, granted=grant)))

    def _on_vote(self, vote: VoteGrant, now: float) -> None:
        if not vote.granted:
            if vote.term > self.term:  # a peer is further on: this candidacy is stale
                self.term = vote.term
                if self.role is Role.CANDIDATE:
                    self._step_down(now, trust=True)
            return
        if self.role is not Role.CANDIDATE or vote.term != self._candidate_term:
            return
        self._votes.add(vote.sender)
        if len(self._votes) >= self.majority:
            self._become_leader(now)
