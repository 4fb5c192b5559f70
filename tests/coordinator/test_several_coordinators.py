"""The coordinator core as one of several (coordinator/election.py), driven by hand: a coordinator that does not
lead answers every client and worker frame with Redirect (the leader's address once it knows one) and changes
nothing; the leader's Welcome carries its term; its Replica holds the lifecycle state, the weight version, the LoRA
adapters and the DP ranks, and a successor built from it starts paused, at that version, with those adapters, and
gives each worker its old rank even when another registers first, and holds a request for a model none of whose
workers has registered again yet (rather than refusing a model it does not know yet); a deposed leader redirects
everyone it knew; peer frames need the coordinators' own key."""

from __future__ import annotations

from core_harness import MODEL, dispatches, worker_hello

from infer.coordinator.config import CoordinatorConfig
from infer.coordinator.core import Coordinator
from infer.coordinator.election import Election
from infer.protocol.messages import (
    Control,
    Hello,
    Message,
    PeerAck,
    PeerBeat,
    Redirect,
    RequestSpec,
    StatsRequest,
    Submit,
    VoteGrant,
    Welcome,
    decode,
    encode,
)
from infer.protocol.roles import Role, StaticKeyRoles

PEERS = "tcp://127.0.0.1:7000,tcp://127.0.0.1:7001,tcp://127.0.0.1:7002"
LEASE = 1.0
OPTIONS = {"heartbeat_interval": 0.1, "worker_timeout": 1.0, "client_timeout": 1.0, "stop_timeout": 1.0}


def _config(index: int) -> CoordinatorConfig:
    return CoordinatorConfig(port=7000 + index, peers=PEERS, lease=LEASE, **OPTIONS)


def _run(core: Coordinator, identity: bytes, msg: Message, now: float) -> list[tuple[bytes, Message]]:
    core.handle(identity, [encode(msg)], now)
    return [(i, decode(encode(m))) for i, m in core.take_outgoing()]


def _leading_election(index: int = 0) -> tuple[Election, float]:
    """An election of 3 that `index` has won (a vote, then an acknowledged beat), and the time it leads from."""
    election = Election(index, 3, 0.0, lease=LEASE)
    now = 2 * LEASE  # past its stagger too
    election.tick(now)  # it stands
    other = (index + 1) % 3
    election.on_message(VoteGrant(term=1, sender=other, granted=True), now)
    [(_, beat)] = [(to, m) for to, m in election.take_outgoing() if isinstance(m, PeerBeat) and to == other]
    election.on_message(PeerAck(term=1, sender=other, seq=beat.seq), now)
    assert election.leading(now)
    return election, now


def test_a_coordinator_that_does_not_lead_redirects_every_frame_and_changes_nothing():
    election = Election(1, 3, 0.0, lease=LEASE)
    core = Coordinator(_config(1), 0.0, election=election)
    [(to, redirect)] = _run(core, b"c", Hello(role="client", peer_id="c"), 0.1)
    assert to == b"c" and isinstance(redirect, Redirect) and redirect.leader is None
    assert "does not lead" in redirect.reason and "no leader yet" in redirect.reason
    [(_, redirect)] = _run(core, b"w0", worker_hello("w0", None), 0.1)
    assert isinstance(redirect, Redirect) and not core.workers.by_id
    # once it follows coordinator 0 it names it
    election.on_message(PeerBeat(term=1, sender=0, seq=1), 0.2)
    [(_, redirect)] = _run(core, b"c", StatsRequest(), 0.2)
    assert redirect.leader == "tcp://127.0.0.1:7000" and "coordinator 0 does" in redirect.reason


def test_the_leader_serves_and_its_welcome_carries_its_term():
    election, now = _leading_election(0)
    core = Coordinator(_config(0), now, election=election)
    out = _run(core, b"w0", worker_hello("w0", None), now)
    [welcome] = [m for _, m in out if isinstance(m, Welcome)]
    assert welcome.term == election.term == 1 and welcome.dp_rank == 0


def test_a_successor_starts_from_the_leaders_replica():
    election, now = _leading_election(0)
    leader = Coordinator(_config(0), now, election=election)
    _run(leader, b"w0", worker_hello("w0", None), now)
    _run(leader, b"w1", worker_hello("w1", None), now)
    _run(leader, b"admin", Control(command="pause"), now)
    leader.status.weight_version = 3
    leader.loras.adapters["sql"] = "/adapters/sql"
    leader.loras.adapter_models["sql"] = MODEL
    replica = leader.replica()
    assert replica.state == "paused" and replica.weight_version == 3
    assert sorted((r.worker_id, r.dp_rank) for r in replica.ranks) == [("w0", 0), ("w1", 1)]

    successor_election, later = _leading_election(1)
    successor_election.replica = decode(encode(PeerBeat(term=1, sender=0, seq=1, replica=replica))).replica
    successor = Coordinator(_config(1), later, election=successor_election)
    assert successor.state == "paused" and successor.status.weight_version == 3
    # a new worker registers first: it does not take w1's rank; w1 gets its own back (its Hello says none)
    out = _run(successor, b"w9", worker_hello("w9", None), later)
    assert [m.dp_rank for _, m in out if isinstance(m, Welcome)] == [2]
    assert any(isinstance(m, Control) and m.command == "pause" for _, m in out)  # brought to the paused state
    out = _run(successor, b"w1", worker_hello("w1", None), later)
    assert [m.dp_rank for _, m in out if isinstance(m, Welcome)] == [1]
    assert successor.loras.adapters == {"sql": "/adapters/sql"}


def test_a_successor_holds_a_request_for_a_model_whose_workers_have_not_registered_again():
    election, now = _leading_election(0)
    leader = Coordinator(_config(0), now, election=election)
    _run(leader, b"w0", worker_hello("w0", None), now)
    _run(leader, b"q0", worker_hello("q0", None, model="other"), now)
    successor_election, later = _leading_election(1)
    successor_election.replica = leader.replica()
    successor = Coordinator(_config(1), later, election=successor_election)
    _run(successor, b"w0", worker_hello("w0", None), later)  # MODEL's worker is back, "other"'s not yet
    _run(successor, b"c", Hello(role="client", peer_id="c"), later)
    out = _run(successor, b"c", Submit(request_id="r", spec=RequestSpec(prompt_token_ids=[1, 2]), model="other"), later)
    assert out == [] and "r" in successor.books.requests.held  # held: neither refused nor sent to MODEL's worker
    [models] = [m for _, m in _run(successor, b"c", StatsRequest(), later) if m.TYPE == "cluster_stats"]
    assert [m.model_id for m in models.models] == ["other", MODEL]  # (by name) what an HTTP front admits requests by
    out = _run(successor, b"q0", worker_hello("q0", None, model="other"), later + 0.1)
    assert [d.request_id for d in dispatches(out)[b"q0"]] == ["r"]


def test_a_deposed_leader_redirects_every_worker_and_client_it_knew():
    election, now = _leading_election(0)
    core = Coordinator(_config(0), now, election=election)
    _run(core, b"w0", worker_hello("w0", None), now)
    _run(core, b"c", Hello(role="client", peer_id="c"), now)
    election.on_message(PeerBeat(term=2, sender=2, seq=1), now + 0.1)  # coordinator 2 won term 2
    core.step_down(now + 0.1)
    out = [(i, decode(encode(m))) for i, m in core.take_outgoing()]
    assert sorted(i for i, m in out if isinstance(m, Redirect)) == [b"c", b"w0"]
    assert all(m.leader == "tcp://127.0.0.1:7002" for _, m in out)


def test_with_keys_only_the_coordinators_key_sends_peer_frames_and_it_sends_nothing_else():
    peer_key, client_key = b"P" * 40, b"C" * 40
    keys = StaticKeyRoles()
    keys.grant(client_key, Role.CLIENT)
    election = Election(1, 3, 0.0, lease=LEASE)
    core = Coordinator(_config(1), 0.0, keys=keys, election=election, peer_key=peer_key)
    core.handle(b"x", [encode(PeerBeat(term=5, sender=0, seq=1))], 0.1, key=client_key)
    assert election.term == 0 and election.leader is None  # a client's key cannot make a leader
    core.handle(b"p", [encode(PeerBeat(term=5, sender=0, seq=1))], 0.1, key=peer_key)
    assert election.term == 5 and election.leader == 0
    core.handle(b"p", [encode(Hello(role="client", peer_id="p"))], 0.2, key=peer_key)
    assert not any(isinstance(m, Welcome) for _, m in core.take_outgoing())
