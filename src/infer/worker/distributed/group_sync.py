"""Lockstep for the ranks of an EP group: the per-step agreement and wake-ups; and `join_world`, the one bootstrap of
every group's torch.distributed world (TP, PP and EP), with `agree_min`. torch is imported only when a group runs:
the worker daemon imports this module to parse its flags.

The MoE layers of an EP group exchange tokens with collectives, so every rank must run one forward per
group step, a dummy one when it has nothing to do. Each rank still has its own requests, so the group
agrees before every step:

- **Rounds.** A round is one `agree()` call on every rank: a tiny all_reduce of (has work, leaving, draining). If
  anyone has work, every rank then runs one forward (its step, or a dummy) and the next round follows at
  once. If nobody has work, the group goes idle: every rank blocks in its own zmq poll, costing nothing.
- **Waking an idle group.** The rank that gets work first sends a wake naming the next round's number to
  every peer (zmq PUSH -> each peer's PULL socket, which is in the peer's poller) and enters the round;
  the woken peers enter it too. Stale wakes (an older round's) are dropped, so no rank ever enters a round
  its peers will not.
- **Draining.** A rank that drains (SIGTERM, the coordinator's DrainWorker) says so in every round from then on;
  a rank that hears it drains too, as if signalled: the group cannot step without the rank that goes away, so it
  drains as a whole (each rank moves its own requests out of the group). The round in which the first rank leaves
  says it too, so no mate meets the departure without draining.
- **Leaving.** A rank that stops (told to, or drained) says so in the round; every rank then leaves with
  it (the group's collectives cannot run with a member gone). A member that dies makes the next
  collective fail at once (its connections close) or time out after `timeout_s`; the survivors then give
  their requests back and exit instead of hanging.
- **Keys.** With CurveKeys (the worker's --curve-key), the wake channel is CurveZMQ: each rank's PULL is a
  CURVE server with the rank's own key pair, its peers' PUSH sockets connect with the public key it
  published in the group's key exchange, and its KeyGate lets in only the group's keys. The group's
  torch.distributed traffic (the rendezvous, gloo and NCCL collectives, the key and address exchange
  itself) is NOT encrypted or authenticated: the ranks of an EP group must share a trusted fabric.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq

from infer.protocol.keys import CurveKeys, is_loopback
from infer.protocol.transport import KeyGate, make_socket

log = logging.getLogger("infer.worker")

# The least time the members of a TP or PP group get to meet, load their shards and agree before serving: they load
# at different speeds (a busy disk, a busy CPU), and the steps' own timeout (--tp-timeout, --pp-timeout) is for a
# member that stops answering while serving, not for one still loading.
STARTUP_TIMEOUT_S = 300.0
_WAKE = struct.Struct("<q")  # the round number the sender is about to enter
_ZAP_DOMAIN = "infer-ep"


class GroupBroken(RuntimeError):
    """A collective of the group failed or timed out: a member died, hung or left."""


@dataclass(frozen=True)
class EpOptions:
    """Where this rank sits in its EP group, from flags or the launcher's environment."""

    size: int
    rank: int
    dist_init: str  # tcp://HOST:PORT of the group's rendezvous (rank 0 listens there)
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"an EP group has at least 2 ranks, got --ep-size {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"--ep-rank must be in [0, {self.size}), got {self.rank}")
        parts = urlsplit(self.dist_init)
        if parts.scheme != "tcp" or not parts.hostname or not parts.port:
            raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {self.dist_init!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--ep-timeout must be > 0, got {self.timeout_s}")

    @classmethod
    def resolve(
        cls, size: int, rank: int | None, dist_init: str | None, timeout_s: float, env: dict[str, str] | None = None
    ) -> EpOptions:
        """Flags first; else torchrun's RANK / MASTER_ADDR / MASTER_PORT, else Slurm's SLURM_PROCID (rank
        within the group = SLURM_PROCID % size; the launcher exports MASTER_ADDR / MASTER_PORT)."""
        env = dict(os.environ) if env is None else env
        if rank is None:
            if "RANK" in env:
                rank = _env_int(env, "RANK")
            elif "SLURM_PROCID" in env:
                rank = _env_int(env, "SLURM_PROCID") % size
            else:
                raise ValueError("--ep-size > 1 needs --ep-rank (or RANK / SLURM_PROCID in the environment)")
        if dist_init is None:
            if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
                raise ValueError(
                    "--ep-size > 1 needs --dist-init tcp://HOST:PORT (or MASTER_ADDR and "
                    "MASTER_PORT in the environment)"
                )
            dist_init = f"tcp://{env['MASTER_ADDR']}:{_env_int(env, 'MASTER_PORT')}"
        return cls(size=size, rank=rank, dist_init=dist_init, timeout_s=timeout_s)

    @property
    def default_group_id(self) -> str:
        """The same on every member: named after the rendezvous address."""
        parts = urlsplit(self.dist_init)
        return f"ep-{parts.hostname}:{parts.port}"


def _env_int(env: dict[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {env[name]!r}") from None


@dataclass(frozen=True)
class Agreement:
    """What one round agreed, the same on every rank: does any rank have work (every rank then steps), is any rank
    leaving (every rank leaves), is any rank draining (every rank drains)."""

    work: bool
    leaving: bool
    draining: bool


class GroupSync:
    """The per-step agreement and the wake channel of one rank (see the module doc)."""

    def __init__(
        self, options: EpOptions, ctx: zmq.Context, curve: CurveKeys | None = None, group: object = None
    ) -> None:
        """`curve`: this rank's keys (its server key, the coordinator's, is not used here): the wake channel
        runs CurveZMQ among the group's keys. Every rank must have keys, or none (ValueError on all).
        `group`: the gloo process group of the EP ranks (TP x EP: the TP rank 0 processes); None: the world."""
        import torch.distributed as dist

        self.options = options
        self.round = 0  # rounds completed; the same number on every rank
        self.active = False  # the last round had work: the next one follows without a wake
        # the agreement runs on CPU tensors; with NCCL as the default backend it needs a gloo group of its own
        if group is not None:
            self._group = group
        else:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        # keys first, so every gate knows the group's keys before any peer can connect (after the addresses)
        keys = self._gather(None if curve is None else curve.public_key)
        if any(k is None for k in keys) and any(k is not None for k in keys):
            missing = [r for r, k in enumerate(keys) if k is None]
            raise ValueError(
                f"EP group ranks {missing} have no CURVE key and the others do: give every rank "
                f"--curve-key and --coordinator-key, or none"
            )
        self._gate: KeyGate | None = None
        if curve is not None:
            group_keys = frozenset(keys)
            self._gate = KeyGate(ctx, group_keys.__contains__, logger=log, peers="EP peer")
        self.wake_socket = make_socket(
            ctx, zmq.PULL, curve=None if curve is None else curve.as_server(), zap_domain=_ZAP_DOMAIN
        )
        host = _local_address_towards(urlsplit(options.dist_init).hostname or "127.0.0.1")
        port = self.wake_socket.bind_to_random_port(f"tcp://{host}")
        if curve is not None and not is_loopback(host):
            log.info(
                "EP group wake channel on CurveZMQ; the group's torch.distributed traffic is not "
                "encrypted: its ranks must share a trusted network"
            )
        addresses = self._gather(f"tcp://{host}:{port}")
        self._peers = []
        for rank, address in enumerate(addresses):
            if rank != options.rank:
                peer_curve = None if curve is None else curve.towards(keys[rank])
                push = make_socket(ctx, zmq.PUSH, curve=peer_curve)
                push.setsockopt(zmq.SNDHWM, 16)
                push.connect(address)
                self._peers.append(push)

    def _gather(self, value: object) -> list:
        """`value` of every rank, by rank (a collective: every rank calls it, in the same order)."""
        import torch.distributed as dist

        values: list[object] = [None] * self.options.size
        dist.all_gather_object(values, value, group=self._group)
        return values

    def woken(self) -> bool:
        """Drain the wake socket; True when a peer is entering round `self.round` (older wakes are stale)."""
        woken = False
        while True:
            try:
                frame = self.wake_socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return woken
            if len(frame) == _WAKE.size and _WAKE.unpack(frame)[0] == self.round:
                woken = True

    def wake_peers(self) -> None:
        frame = _WAKE.pack(self.round)
        for push in self._peers:
            try:
                push.send(frame, zmq.NOBLOCK)
            except zmq.Again:  # a peer's queue is full of wakes already: it will wake
                pass

    def agree(self, has_work: bool, leaving: bool, draining: bool = False) -> Agreement:
        """One round: this rank's three flags, OR-ed over the group. Raises GroupBroken when a member is gone or
        silent past the timeout."""
        import torch
        import torch.distributed as dist

        flags = torch.tensor([int(has_work), int(leaving), int(draining)], dtype=torch.int64)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError variants
            raise GroupBroken(f"EP group collective failed in round {self.round}: {e}") from e
        self.round += 1
        agreed = Agreement(work=bool(flags[0]), leaving=bool(flags[1]), draining=bool(flags[2]))
        self.active = agreed.work and not agreed.leaving
        return agreed

    def close(self) -> None:
        for push in self._peers:
            push.close(0)
        self.wake_socket.close(0)
        if self._gate is not None:
            self._gate.close()


def agree_min(value: int, group: object, what: str) -> int:
    """The smallest `value` over the processes of `group` (a gloo process group; None: the whole world), e.g. the KV
    blocks every member of a TP group or pipeline can hold. GroupBroken naming `what` when a member is gone."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    except Exception as e:  # noqa: BLE001
        raise GroupBroken(f"{what} agreement failed: {e}") from e
    return int(t.item())


def join_world(
    dist_init: str, rank: int, size: int, layout: str, flags: str, timeout: datetime.timedelta, device: Any
) -> str:
    """Join the torch.distributed world of `size` processes that meets at `dist_init` (tcp://HOST:PORT; global rank 0
    hosts its TCPStore there) as global `rank`, and return the backend (NCCL on a GPU, gloo on a CPU). Blocks until
    every process has joined, at most `timeout`. First, through the store, every process checks that it was started
    with the same `layout` (the sizes that the command-line `flags` set) as global rank 0, and rank 0 checks every
    process: ValueError naming both sides otherwise, so that a mistyped size fails fast on both sides instead of
    hanging in a collective. The one bootstrap of the TP, PP and EP worlds."""
    import torch
    import torch.distributed as dist

    if not 0 <= rank < size:
        raise ValueError(f"global rank {rank} is outside the world of {size} processes")
    host, port = rendezvous_address(dist_init)
    store = dist.TCPStore(host, port, None if rank else size, rank == 0, timeout=timeout, wait_for_workers=False)
    key = "infer/layout/{}".format
    # rank 0 leaves at once when one layout differs, taking the store with it: read its layout before it can see
    # ours
    theirs = store.get(key(0)).decode() if rank else layout
    store.set(key(rank), layout)
    others = [(0, theirs)]
    if rank == 0:  # every process's layout, so that rank 0 leaves at once too
        keys = [key(r) for r in range(size)]
        store.wait(keys, timeout)
        others = [(r, value.decode()) for r, value in enumerate(store.multi_get(keys))]
    for other, stored in others:
        if stored != layout:
            raise ValueError(
                f"this process (global rank {rank}) was started with {flags} = {layout}, but global rank {other} "
                f"of the group at {dist_init} with {stored}: every process of the group must be given the same sizes"
            )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return backend


def rendezvous_address(dist_init: str) -> tuple[str, int]:
    """(HOST, PORT) of a tcp://HOST:PORT rendezvous; ValueError if it names no host or port."""
    parts = urlsplit(dist_init)
    if not parts.hostname or parts.port is None:
        raise ValueError(f"--dist-init must be tcp://HOST:PORT, got {dist_init!r}")
    return parts.hostname, parts.port


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (loopback for a loopback rendezvous). No packet is
    sent: connecting a UDP socket only picks the route."""
    try:
        target = socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve the --dist-init host {host!r}: {e}") from None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))
        return probe.getsockname()[0]
