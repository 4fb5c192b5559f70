"""coordinator/election.py on a simulated network (no sockets): one leader is elected, a dead leader is
replaced within a few leases, a leader cut off from the majority stops leading before another starts, a
candidate cut off from the rest cannot depose a working leader once it is back, the Replica reaches the
successor, and under random partitions, kills, delays and clock rates two coordinators never lead at once."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from infer.coordinator.election import Election, Role
from infer.protocol.messages import RankHold, Replica, decode, encode

LEASE = 1.0
STEP = 0.01


@dataclass
class Net:
    """N elections with per-node clock rates, message delays and cut links; `run` checks that no two lead."""

    count: int
    rates: list[float] = field(default_factory=list)
    delay: float = 0.005
    seed: int = 0
    now: float = 0.0
    nodes: dict[int, Election] = field(default_factory=dict)
    cut: set[frozenset[int]] = field(default_factory=set)
    in_flight: list[tuple[float, int, int, bytes]] = field(default_factory=list)
    leaders_seen: list[tuple[float, int, int]] = field(default_factory=list)  # (time, index, term)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.rates = self.rates or [1.0] * self.count
        for i in range(self.count):
            self.start(i)

    def local(self, i: int) -> float:
        return self.now * self.rates[i]

    def start(self, i: int) -> None:
        self.nodes[i] = Election(i, self.count, self.local(i), lease=LEASE)

    def kill(self, i: int) -> None:
        del self.nodes[i]
        self.in_flight = [m for m in self.in_flight if m[2] != i]

    def partition(self, *groups: set[int]) -> None:
        self.cut = {frozenset({a, b}) for g in groups for h in groups if g is not h for a in g for b in h}

    def heal(self) -> None:
        self.cut = set()

    def leaders(self) -> list[int]:
        return [i for i, n in self.nodes.items() if n.leading(self.local(i))]

    def run(self, seconds: float, jitter: float = 0.0) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += STEP
            for i, node in list(self.nodes.items()):
                node.tick(self.local(i))
                for to, msg in node.take_outgoing():
                    if frozenset({i, to}) not in self.cut:
                        lag = self.delay + (self.rng.random() * jitter if jitter else 0.0)
                        self.in_flight.append((self.now + lag, i, to, encode(msg)))  # over the wire format
            due = [m for m in self.in_flight if m[0] <= self.now]
            self.in_flight = [m for m in self.in_flight if m[0] > self.now]
            for _, sender, to, frame in due:
                if to in self.nodes and frozenset({sender, to}) not in self.cut:
                    self.nodes[to].on_message(decode(frame), self.local(to))
            leading = self.leaders()
            assert len(leading) <= 1, f"two coordinators lead at t={self.now:.2f}: {leading}"
            for i in leading:
                if not self.leaders_seen or self.leaders_seen[-1][1:] != (i, self.nodes[i].term):
                    self.leaders_seen.append((self.now, i, self.nodes[i].term))

    def until_leader(self, limit: float) -> tuple[float, int]:
        start = self.now
        while self.now - start < limit:
            self.run(STEP)
            if self.leaders():
                return self.now - start, self.leaders()[0]
        raise AssertionError(f"no leader within {limit} s")


def test_three_elect_one_leader_that_every_other_follows():
    net = Net(3)
    took, leader = net.until_leader(4 * LEASE)
    net.run(2 * LEASE)
    assert net.leaders() == [leader]
    assert all(n.leader == leader and n.term == net.nodes[leader].term for n in net.nodes.values())
    assert [n.role for i, n in net.nodes.items() if i != leader] == [Role.FOLLOWER, Role.FOLLOWER]


def test_a_dead_leader_is_replaced_within_two_leases_and_a_restarted_one_follows():
    net = Net(3)
    _, first = net.until_leader(4 * LEASE)
    net.run(LEASE)
    net.kill(first)
    took, second = net.until_leader(4 * LEASE)
    assert second != first and took <= 2 * LEASE
    net.start(first)  # the launcher restarts it: it follows, it does not disturb the leader
    net.run(3 * LEASE)
    assert net.leaders() == [second] and net.nodes[first].leader == second


def test_a_leader_cut_off_from_the_majority_stops_leading_before_another_starts():
    net = Net(3)
    _, old = net.until_leader(4 * LEASE)
    net.run(LEASE)
    rest = set(net.nodes) - {old}
    net.partition({old}, rest)
    net.run(4 * LEASE)  # run() asserts at every step that at most one leads
    [new] = net.leaders()
    assert new in rest
    stepped_down = [t for t, i, _ in net.leaders_seen if i == new][-1]
    assert not net.nodes[old].leading(net.local(old))
    net.heal()
    net.run(2 * LEASE)
    assert net.leaders() == [new] and net.nodes[old].leader == new and stepped_down > 0


def test_a_candidate_cut_off_from_the_rest_cannot_depose_a_working_leader_once_it_is_back():
    net = Net(3)
    _, leader = net.until_leader(4 * LEASE)
    net.run(LEASE)
    [loner, other] = sorted(set(net.nodes) - {leader})
    net.partition({loner}, {leader, other})
    net.run(6 * LEASE)  # it stands again and again; the other two keep their leader
    assert net.leaders() == [leader] and net.nodes[loner].role is Role.CANDIDATE
    term = net.nodes[leader].term
    net.heal()
    net.run(3 * LEASE)
    assert net.leaders() == [leader] and net.nodes[leader].term == term  # never stepped down
    assert [t for t, i, _ in net.leaders_seen if i != leader] == []
    assert all(n.leader == leader for n in net.nodes.values())


def test_the_replica_reaches_the_followers_and_the_successor_starts_from_it():
    net = Net(3)
    _, leader = net.until_leader(4 * LEASE)
    replica = Replica(
        version=0,
        state="paused",
        weight_version=3,
        lora_adapters={"sql": "/adapters/sql"},
        lora_models={"sql": "m"},
        ranks=[RankHold(worker_id="w0", model_id="m", dp_rank=0, group_id="dp0")],
    )
    net.nodes[leader].set_replica(replica)
    net.run(LEASE)
    for node in net.nodes.values():
        assert node.replica is not None and node.replica.state == "paused" and node.replica.version == 1
    net.nodes[leader].set_replica(replica)  # unchanged: the same version
    assert net.nodes[leader].replica.version == 1
    net.kill(leader)
    _, successor = net.until_leader(4 * LEASE)
    assert net.nodes[successor].replica.weight_version == 3


def test_a_frame_claiming_to_come_from_the_receiver_itself_changes_nothing():
    from infer.protocol.messages import PeerBeat

    node = Election(0, 3, 0.0, lease=LEASE)
    node.on_message(PeerBeat(term=99, sender=0, seq=1), 0.1)
    assert node.term == 0 and node.leader is None and node.take_outgoing() == []


def test_one_coordinator_leads_at_once_and_two_are_refused():
    alone = Election(0, 1, 0.0)
    assert alone.leading(0.0) and alone.leading(1e9)
    with pytest.raises(ValueError, match="two coordinators cannot tell a dead peer from a cut cable"):
        Election(0, 2, 0.0)
    with pytest.raises(ValueError, match="not in a list of 3"):
        Election(3, 3, 0.0)


@pytest.mark.parametrize("seed", range(12))
def test_random_partitions_kills_delays_and_clock_rates_never_make_two_leaders(seed):
    rng = random.Random(seed)
    count = rng.choice([3, 5])
    net = Net(count, rates=[1 + rng.uniform(-0.03, 0.03) for _ in range(count)], seed=seed)
    net.until_leader(6 * LEASE)
    for _ in range(12):
        event = rng.random()
        alive = sorted(net.nodes)
        if event < 0.3:
            side = set(rng.sample(alive, rng.randint(1, len(alive) - 1)))
            net.partition(side, set(range(count)) - side)
        elif event < 0.5 and len(alive) > count // 2 + 1:
            net.kill(rng.choice(alive))
        elif event < 0.65:
            dead = sorted(set(range(count)) - set(net.nodes))
            if dead:
                net.start(rng.choice(dead))
        else:
            net.heal()
        net.run(rng.uniform(0.2, 2.5) * LEASE, jitter=0.05)  # asserts at every step
    net.heal()
    for i in set(range(count)) - set(net.nodes):
        net.start(i)
    took, _ = net.until_leader(8 * LEASE)  # once whole again, the cluster has a leader
