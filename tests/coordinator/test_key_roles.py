"""Key roles in the coordinator's core, frame by frame: each frame comes in with the key its CurveZMQ
connection authenticated (the ZAP User-Id). A client key cannot register as a worker, forge deltas or drive
the lifecycle; an administrator key can (and may act as a client); a routing identity stays with the key
that used it first; a revoked key's peers are cut off at the next tick. Without keys nothing changes."""

from __future__ import annotations

from core_harness import Harness, delta, worker_hello

from infer.protocol.messages import (
    Abort,
    Control,
    ControlAck,
    Delta,
    DeltaBatch,
    Dispatch,
    Error,
    Heartbeat,
    Hello,
    Load,
    Message,
    Refused,
    RequestSpec,
    StatsRequest,
    StepBatch,
    Submit,
    TokenIds,
    Welcome,
)
from infer.protocol.roles import Role, StaticKeyRoles
from infer.protocol.sampling import SamplingParams

WORKER_KEY, CLIENT_KEY, OTHER_CLIENT_KEY, ADMIN_KEY = (c * 40 for c in (b"W", b"C", b"D", b"A"))
W0, C1, C2, ADMIN = b"w0", b"c1", b"c2", b"admin"


def of_type(out: list[tuple[bytes, Message]], kind: type, to: bytes | None = None) -> list[Message]:
    return [m for identity, m in out if isinstance(m, kind) and (to is None or identity == to)]


def deltas_to(out: list[tuple[bytes, Message]], client: bytes) -> list[Delta]:
    return [d for batch in of_type(out, DeltaBatch, client) for d in batch.deltas]


def keyed() -> tuple[Harness, StaticKeyRoles]:
    """A core with keys: one worker key, two client keys, one admin key; worker w0 registered."""
    keys = StaticKeyRoles()
    keys.grant(WORKER_KEY, Role.WORKER)
    keys.grant(CLIENT_KEY, Role.CLIENT)
    keys.grant(OTHER_CLIENT_KEY, Role.CLIENT)
    keys.grant(ADMIN_KEY, Role.ADMIN)
    h = Harness(keys=keys)
    assert of_type(h.send(W0, worker_hello("w0", 0), WORKER_KEY), Welcome, W0)
    return h, keys


def submit(h: Harness, client: bytes, key: bytes, rid: str) -> list[tuple[bytes, Message]]:
    return h.send(
        client,
        Submit(
            request_id=rid,
            spec=RequestSpec(
                prompt_token_ids=TokenIds([1, 2, 3]), sampling=SamplingParams(temperature=0.0, max_tokens=10)
            ),
        ),
        key,
    )


def step(h: Harness, identity: bytes, key: bytes, *deltas: Delta) -> list[tuple[bytes, Message]]:
    load = Load(num_waiting=0, num_running=len(deltas), num_free_blocks=90, num_total_blocks=100, num_queued_tokens=0)
    return h.send(identity, StepBatch(deltas=list(deltas), load=load), key)


def test_a_client_key_cannot_register_as_a_worker_and_never_gets_a_dispatch():
    h, _ = keyed()
    intruder = b"intruder"
    out = h.send(intruder, worker_hello("w-evil", 1), CLIENT_KEY)
    (refused,) = of_type(out, Refused, intruder)
    assert "needs a worker key" in refused.reason and "client key" in refused.reason
    assert intruder not in h.core.workers.by_identity
    for n in range(4):  # every request goes to the real worker, none to the intruder
        out = submit(h, C1, CLIENT_KEY, f"r{n}")
        assert [i for i, m in out if isinstance(m, Dispatch)] == [W0]
    # deltas it forges for a request it does not run are refused, never relayed
    out = step(h, intruder, CLIENT_KEY, delta("r0", 666, 667, prompt=[1, 2, 3]))
    assert not deltas_to(out, C1) and of_type(out, Error, intruder)
    assert h.core.requests.get("r0").journal.token_ids == []


def test_a_worker_key_cannot_act_as_a_client_and_an_admin_key_can():
    h, _ = keyed()
    (error,) = of_type(submit(h, b"w-as-client", WORKER_KEY, "r0"), Error)
    assert (
        error.request_id == "r0" and error.code == "invalid_request" and "needs a admin or client key" in error.message
    )
    assert h.core.requests.get("r0") is None
    assert of_type(h.send(b"w-as-client", Heartbeat(sent_at=0.0), WORKER_KEY), Error)  # no client record
    assert b"w-as-client" not in h.core.clients
    assert of_type(h.send(ADMIN, Hello(role="client", peer_id="ops"), ADMIN_KEY), Welcome, ADMIN)
    assert of_type(submit(h, ADMIN, ADMIN_KEY, "r1"), Dispatch, W0)


def test_only_an_admin_key_drives_the_lifecycle():
    h, _ = keyed()
    submit(h, C1, CLIENT_KEY, "r0")
    for command in ("pause", "suspend", "stop"):
        (error,) = of_type(h.send(C1, Control(command=command), CLIENT_KEY), Error, C1)
        assert f"lifecycle command {command!r} refused: it needs a admin key" in error.message
        assert h.core.state.value == "running"
    out = h.send(C1, StatsRequest(), CLIENT_KEY)  # a client may still read stats and be served
    assert of_type(out, type(h.core.stats(h.now)), C1)
    assert deltas_to(step(h, W0, WORKER_KEY, delta("r0", 7, prompt=[1, 2, 3])), C1)[0].token_ids == [7]
    (ack,) = of_type(h.send(ADMIN, Control(command="pause"), ADMIN_KEY), ControlAck, ADMIN)
    assert ack.state == "paused" and of_type(h.out(), Control) == []  # the Control to w0 left with the ack
    (ack,) = of_type(h.send(ADMIN, Control(command="unpause"), ADMIN_KEY), ControlAck, ADMIN)
    assert ack.state == "running"


def test_a_routing_identity_stays_with_its_first_key():
    h, _ = keyed()
    submit(h, C1, CLIENT_KEY, "r0")
    assert deltas_to(step(h, W0, WORKER_KEY, delta("r0", 7, prompt=[1, 2, 3])), C1)
    # The same routing id with another client's key: ZeroMQ gave the id to a new connection (the first one is
    # gone), so the id is cut off: the first client's request is aborted on the worker, nothing more of it
    # leaves, and the newcomer gets one Refused and then silence.
    out = h.send(C1, Hello(role="client", peer_id="thief"), OTHER_CLIENT_KEY)
    (refused,) = of_type(out, Refused, C1)
    assert "routing identity belongs to key" in refused.reason
    assert not deltas_to(out, C1) and not of_type(out, Welcome)
    assert h.core.requests.get("r0") is None
    assert [m.request_ids for m in of_type(out, Abort, W0)] == [["r0"]]
    out = step(h, W0, WORKER_KEY, delta("r0", 8))
    assert not deltas_to(out, C1)
    assert h.send(C1, StatsRequest(), OTHER_CLIENT_KEY) == []
    assert h.send(C1, StatsRequest(), CLIENT_KEY) == []  # the id is burnt for both


def test_another_key_on_a_workers_routing_id_cuts_the_worker_off_and_its_requests_move():
    h, _ = keyed()
    h.send(b"w1", worker_hello("w1", 1), WORKER_KEY)
    submit(h, C1, CLIENT_KEY, "r0")
    owner = h.core.requests.get("r0").worker_id
    identity = owner.encode()
    out = h.send(identity, Hello(role="client", peer_id="thief"), CLIENT_KEY)
    assert of_type(out, Refused, identity)
    moved = [i for i, m in out if isinstance(m, Dispatch)]
    assert moved and identity not in moved and h.core.requests.get("r0").worker_id != owner


def test_a_revoked_client_is_cut_off_at_the_next_tick():
    h, keys = keyed()
    submit(h, C1, CLIENT_KEY, "r0")
    submit(h, C2, OTHER_CLIENT_KEY, "r1")
    keys.revoke(CLIENT_KEY)
    out = h.advance(0.2)
    (refused,) = of_type(out, Refused, C1)
    assert "no longer authorized (revoked)" in refused.reason
    assert h.core.requests.get("r0") is None and h.core.requests.get("r1") is not None
    assert [m.request_ids for m in of_type(out, Abort, W0)] == [["r0"]]
    out = step(h, W0, WORKER_KEY, delta("r0", 1, prompt=[1, 2, 3]), delta("r1", 2, prompt=[1, 2, 3]))
    assert not deltas_to(out, C1) and deltas_to(out, C2)[0].token_ids == [2]
    assert submit(h, C1, CLIENT_KEY, "r2") == []  # dropped unanswered


def test_a_frame_of_a_revoked_key_is_refused_before_the_tick():
    h, keys = keyed()
    keys.revoke(CLIENT_KEY)
    out = submit(h, C1, CLIENT_KEY, "r0")
    assert of_type(out, Refused, C1) and not of_type(out, Dispatch)


def test_a_revoked_worker_is_cut_off_and_its_requests_move():
    h, keys = keyed()
    keys.grant(b"X" * 40, Role.WORKER)
    assert of_type(h.send(b"w1", worker_hello("w1", 1), b"X" * 40), Welcome)
    submit(h, C1, CLIENT_KEY, "r0")
    submit(h, C1, CLIENT_KEY, "r1")
    on_w1 = [r for r in ("r0", "r1") if h.core.requests.get(r).worker_id == "w1"]
    assert on_w1
    keys.revoke(b"X" * 40)
    out = h.advance(0.2)
    assert of_type(out, Refused, b"w1")
    assert all(h.core.requests.get(r).worker_id == "w0" for r in on_w1)
    assert not [m for i, m in out if i == b"w1" and not isinstance(m, Refused)]


def test_a_key_moved_out_of_the_worker_role_loses_its_registration():
    h, keys = keyed()
    keys.grant(WORKER_KEY, Role.CLIENT)
    out = h.advance(0.2)
    assert of_type(out, Refused, W0) and not h.core.workers.by_id["w0"].healthy


def test_without_keys_every_peer_may_do_everything():
    h = Harness()
    h.worker("w0", 0)
    assert of_type(h.send(C1, Control(command="pause")), ControlAck, C1)
    assert of_type(h.send(b"w1", worker_hello("w1", 1)), Welcome)
