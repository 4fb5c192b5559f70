"""Routing policies on plain rank views: least-loaded, round-robin, prefix-affinity (affinity, yielding to
load, a bounded and pruned table)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from infer.coordinator.admission import make_policy
from infer.coordinator.routing import LeastLoaded, PrefixAffinity, RoundRobin


@dataclass
class Rank:
    dp_rank: int
    score: float = 0.0
    num_in_flight: int = 0
    group_id: str = "one"


def test_least_loaded_takes_the_lowest_score_then_fewest_in_flight_then_lowest_rank():
    policy = LeastLoaded()
    assert policy.choose("p", [Rank(0, 0.5), Rank(1, 0.2), Rank(2, 0.9)]).dp_rank == 1
    assert policy.choose("p", [Rank(0, 0.2, 3), Rank(1, 0.2, 1)]).dp_rank == 1
    assert policy.choose("p", [Rank(3, 0.2, 1), Rank(1, 0.2, 1)]).dp_rank == 1


def test_least_loaded_weighs_an_ep_group_by_its_busiest_rank():
    """Group a's idle rank is less loaded than any rank of b, but a steps at its busy rank's pace: b wins,
    and within b the less loaded rank. Once b's busiest passes a's, a's idle rank is taken."""
    policy = LeastLoaded()
    ranks = [
        Rank(0, 0.6, group_id="a"),
        Rank(1, 0.0, group_id="a"),
        Rank(2, 0.3, group_id="b"),
        Rank(3, 0.2, group_id="b"),
    ]
    assert policy.choose("p", ranks).dp_rank == 3
    ranks[2].score = 0.7
    assert policy.choose("p", ranks).dp_rank == 1


def test_round_robin_cycles_and_survives_membership_changes():
    policy = RoundRobin()
    ranks = [Rank(0), Rank(1), Rank(2)]
    assert [policy.choose("p", ranks).dp_rank for _ in range(5)] == [0, 1, 2, 0, 1]
    assert policy.choose("p", [Rank(0), Rank(2)]).dp_rank == 2  # rank 1 left
    assert policy.choose("p", [Rank(0), Rank(2)]).dp_rank == 0


def test_prefix_affinity_sends_a_shared_prefix_home():
    policy = PrefixAffinity(chunk_chars=8)
    ranks = [Rank(0), Rank(1)]
    system = "You are a helpful assistant. " * 4
    home = policy.choose(system + "question one", ranks)
    ranks[home.dp_rank].score = 0.1  # a little busier than the other: still within the margin
    for i in range(5):
        assert policy.choose(system + f"another question {i}", ranks).dp_rank == home.dp_rank
    assert policy.choose([5] * 40, ranks).dp_rank == 1 - home.dp_rank  # unseen prefix: least loaded


def test_prefix_affinity_yields_to_load():
    policy = PrefixAffinity(chunk_chars=8, overload_margin=0.25)
    ranks = [Rank(0), Rank(1)]
    prompt = "shared prefix " * 10
    assert policy.choose(prompt, ranks).dp_rank == 0
    ranks[0].score = 0.5  # over the margin above rank 1: the prefix moves
    assert policy.choose(prompt, ranks).dp_rank == 1
    ranks[0].score, ranks[1].score = 0.0, 1.0  # a full pool is overloaded whatever the others do
    assert policy.choose(prompt, ranks).dp_rank == 0


def test_prefix_table_is_bounded_and_pruned():
    policy = PrefixAffinity(max_entries=50, chunk_tokens=4)
    ranks = [Rank(0), Rank(1)]
    for i in range(200):
        policy.choose([i] * 16, ranks)
    assert len(policy) == 50
    policy.forget_rank(0)
    policy.forget_rank(1)
    assert len(policy) == 0
    policy.choose([7] * 16, [Rank(0)])
    assert policy.choose([7] * 16, [Rank(1)]).dp_rank == 1  # a home that is not routable is dropped


def test_make_policy_names_the_known_ones():
    assert make_policy("prefix-affinity").name == "prefix-affinity"
    with pytest.raises(ValueError, match="least-loaded, round-robin, prefix-affinity"):
        make_policy("random")
