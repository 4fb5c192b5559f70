"""Key roles (torch-free, no I/O): what a peer authenticated by its CURVE key may do.

- worker: register (Hello role "worker"), receive Dispatches, send StepBatches, ControlAcks, worker errors.
- client: Hello role "client", Submit, Abort, StatsRequest, heartbeats.
- admin: everything a client may do, plus the lifecycle commands (Control: pause, unpause, suspend, resume,
  stop).

A key may hold several roles (its file in several role folders). Without CURVE (loopback or
--trusted-network) there are no keys and every peer may do everything.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class Role(str, enum.Enum):
    WORKER = "worker"
    CLIENT = "client"
    ADMIN = "admin"


ROLE_FOLDERS = {Role.WORKER: "workers", Role.CLIENT: "clients", Role.ADMIN: "admins"}
CLIENT_ROLES = frozenset({Role.CLIENT, Role.ADMIN})  # an administrator may also act as a client
NO_ROLES: frozenset[Role] = frozenset()


class KeyRoles(Protocol):
    """The roles of each authorized public key (z85 text), read from memory (never from disk).

    `generation` changes whenever the mapping does (a key added, revoked or moved), so a reader can tell
    when to look at the peers it already let in again."""

    generation: int

    def roles_of(self, key: bytes) -> frozenset[Role]:
        """The roles of `key`; empty when it is not (or no longer) authorized."""
        ...


@dataclass
class StaticKeyRoles:
    """A KeyRoles held in memory and changed by hand (tests, embedding)."""

    roles: dict[bytes, frozenset[Role]] = field(default_factory=dict)
    generation: int = 0

    def roles_of(self, key: bytes) -> frozenset[Role]:
        return self.roles.get(key, NO_ROLES)

    def grant(self, key: bytes, *roles: Role) -> None:
        self.roles[key] = frozenset(roles)
        self.generation += 1

    def revoke(self, key: bytes) -> None:
        self.roles.pop(key, None)
        self.generation += 1
