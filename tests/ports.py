"""The tests' ports (protocol/ports.py): sockets bound to port 0 and held; torch's TCPStore on port 0 hosted by the
test's own process, its port passed to the ranks, which join as clients (no rank binds a number that another
process may have taken since it was picked); and, where a daemon must be told its number before it starts,
`reserved_port`."""

from __future__ import annotations

import datetime
from typing import Any

from infer.protocol.ports import LOOPBACK, bound_port, listening_socket, reserved_port

__all__ = ["LOOPBACK", "bound_port", "join_gloo", "listening_socket", "reserved_port", "tcp_store"]


def tcp_store(host: str = LOOPBACK) -> Any:
    """A TCPStore server on a port the OS chose (`.port`), hosted by this process for as long as it is referenced."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, None, True, wait_for_workers=False)


def join_gloo(rank: int, world_size: int, port: int, host: str = LOOPBACK, timeout_s: float = 60.0) -> None:
    """Join the default process group (gloo) through the TCPStore a parent hosts at host:port (`tcp_store`)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
