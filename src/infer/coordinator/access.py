"""Who may send what (torch-free, no I/O): key roles, and routing identities bound to keys.

With CurveZMQ every frame reaching the coordinator carries the public key its connection authenticated
with (the ZAP User-Id). AccessControl decides, frame by frame:

- the key must still hold a role (a key whose file was removed is revoked: its peers are cut off);
- the routing identity belongs to the key that used it first: a frame from the same identity with another
  key (the first connection is gone and someone else took its id) cuts the identity off;
- the message needs a role: Hello "worker", StepBatch, DrainMoves and ControlAck a worker key; Hello "client",
  Submit, Abort and StatsRequest a client or administrator key; Control (pause, unpause, suspend, resume,
  stop), DrainWorker (scale one worker down), UpdateWeights and LoraCommand (load / unload a LoRA adapter) an
  administrator key; WeightsUpdated and
  LoraDone a worker key; the coordinators' own messages (PeerBeat, PeerAck, VoteRequest, VoteGrant) the key they
  share, which may send nothing else. A Heartbeat with a load report (a worker's) needs a worker key, one without a
  client or administrator key; Error goes with any role.

Without keys (loopback or --trusted-network) everything is allowed, as before roles existed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from infer.coordinator.election import PEER_MESSAGES
from infer.protocol.messages import (
    Abort,
    Control,
    ControlAck,
    DrainMoves,
    DrainWorker,
    Error,
    Heartbeat,
    Hello,
    LoraCommand,
    LoraDone,
    Message,
    StatsRequest,
    StepBatch,
    Submit,
    UpdateWeights,
    WeightsUpdated,
)
from infer.protocol.roles import CLIENT_ROLES, KeyRoles, Role

log = logging.getLogger("infer.coordinator")

WORKER_ROLES = frozenset({Role.WORKER})
ADMIN_ROLES = frozenset({Role.ADMIN})
ANY_ROLE = frozenset(Role)
_REQUIRED: dict[type[Message], frozenset[Role]] = {
    Submit: CLIENT_ROLES,
    Abort: CLIENT_ROLES,
    StatsRequest: CLIENT_ROLES,
    Control: ADMIN_ROLES,
    StepBatch: WORKER_ROLES,
    DrainMoves: WORKER_ROLES,
    DrainWorker: ADMIN_ROLES,
    ControlAck: WORKER_ROLES,
    Error: ANY_ROLE,
    UpdateWeights: ADMIN_ROLES,
    WeightsUpdated: WORKER_ROLES,
    LoraCommand: ADMIN_ROLES,
    LoraDone: WORKER_ROLES,
}
LOG_BURST, LOG_PERIOD_S = 5, 10.0


def required_roles(msg: Message) -> frozenset[Role]:
    """The roles of which a sender of `msg` needs one."""
    if isinstance(msg, Hello):
        return WORKER_ROLES if msg.role == "worker" else CLIENT_ROLES
    if isinstance(msg, Heartbeat):
        return WORKER_ROLES if msg.load is not None else CLIENT_ROLES
    return _REQUIRED.get(type(msg), ANY_ROLE)


def describe_key(key: bytes) -> str:
    """A key as logs and answers name it: its first 8 characters (enough to find its file)."""
    return key[:8].decode(errors="replace") + "..."


def _roles_text(roles: frozenset[Role]) -> str:
    return " or ".join(sorted(r.value for r in roles)) or "no"


@dataclass(frozen=True)
class Denial:
    """Why a frame is refused. `cut_off`: the identity loses everything it had and gets nothing more (its
    key was revoked, or its routing id now belongs to another key); `silent`: it was cut off before, the
    frame is dropped without an answer."""

    reason: str
    cut_off: bool = False
    silent: bool = False


class AccessControl:
    """The role and identity checks of one coordinator; `keys` None: no CURVE, everyone trusted."""

    def __init__(self, keys: KeyRoles | None, peer_key: bytes | None = None) -> None:
        """`peer_key`: the key the other coordinators of the cluster authenticate with (they share this one's key
        pair); only it may send their messages (coordinator/election.py)."""
        self.keys = keys
        self.peer_key = peer_key
        self._bound: dict[bytes, bytes] = {}  # routing identity -> the key that first sent from it
        self._cut_off: set[bytes] = set()  # identities answered with nothing more
        self._generation = None if keys is None else keys.generation
        self._window_start, self._logged, self._suppressed = -math.inf, 0, 0

    def check(self, identity: bytes, key: bytes | None, msg: Message) -> Denial | None:
        """None if `identity`, authenticated as `key`, may send `msg`; else why not."""
        if self.keys is None:
            return None
        if identity in self._cut_off:
            return Denial("cut off before", silent=True)
        if key is None:
            return Denial("the frame carries no authenticated key", cut_off=True)
        if isinstance(msg, PEER_MESSAGES) or (self.peer_key is not None and key == self.peer_key):
            if key == self.peer_key and isinstance(msg, PEER_MESSAGES):
                return None
            return Denial(f"{msg.TYPE!r} refused: only the cluster's coordinators send it, and they send nothing else")
        bound = self._bound.setdefault(identity, key)
        if bound != key:
            return Denial(
                f"its routing identity belongs to key {describe_key(bound)}, not to this connection's "
                f"key {describe_key(key)}",
                cut_off=True,
            )
        roles = self.keys.roles_of(key)
        if not roles:
            return Denial(f"its key {describe_key(key)} is no longer authorized (revoked)", cut_off=True)
        needed = required_roles(msg)
        if roles & needed:
            return None
        what = f"hello as a {msg.role}" if isinstance(msg, Hello) else f"{msg.TYPE!r}"
        if isinstance(msg, Control):
            what = f"lifecycle command {msg.command!r}"
        return Denial(
            f"{what} refused: it needs a {_roles_text(needed)} key, and key {describe_key(key)} is a "
            f"{_roles_text(roles)} key (the coordinator's authorized keys: workers/, clients/, admins/)"
        )

    def cut_off(self, identity: bytes) -> None:
        self._cut_off.add(identity)

    def lost_roles(self, needs: Callable[[bytes], frozenset[Role] | None]) -> list[tuple[bytes, str]]:
        """After the key set changed: the identities whose key no longer holds a role they need (`needs`:
        what the identity acts as now, None for nothing yet), each with the reason. Empty if nothing changed."""
        if self.keys is None or self.keys.generation == self._generation:
            return []
        self._generation = self.keys.generation
        lost = []
        for identity, key in self._bound.items():
            if identity in self._cut_off:
                continue
            roles, needed = self.keys.roles_of(key), needs(identity)
            if not roles:
                lost.append((identity, f"its key {describe_key(key)} is no longer authorized (revoked)"))
            elif needed is not None and not roles & needed:
                lost.append((identity, f"its key {describe_key(key)} is no longer a {_roles_text(needed)} key"))
        return lost

    def prune(self, keep: Callable[[bytes], bool]) -> None:
        """Forget the bindings of identities the coordinator no longer knows (nothing of theirs remains)."""
        self._bound = {i: k for i, k in self._bound.items() if keep(i) or i in self._cut_off}

    def log_denial(self, identity: bytes, msg: Message, denial: Denial, now: float) -> None:
        """A WARNING per denial, at most LOG_BURST per LOG_PERIOD_S (the rest counted, the count logged)."""
        if now - self._window_start >= LOG_PERIOD_S:
            self._window_start, self._logged = now, 0
        self._logged += 1
        if self._logged > LOG_BURST:
            self._suppressed += 1
            return
        held, self._suppressed = self._suppressed, 0
        log.warning(
            "refused %r from peer %s: %s%s",
            msg.TYPE,
            identity.hex()[:16],
            denial.reason,
            f" ({held} refusals not logged before this one)" if held else "",
        )
