"""infer-serve's coordinator port (client/serve.py's LocalCluster): bound once by the launcher, to a port the OS
chooses, and kept; every coordinator, a restarted one too, serves on that socket (`--listen-fd`), so the port is
never free for another process to take, between the choice and the bind nor between a coordinator and its restart."""

from __future__ import annotations

import asyncio
import signal

from infer.client import InferenceClient
from infer.client.serve import LocalCluster
from infer.protocol.ports import bound_port


async def test_a_coordinator_and_its_restart_serve_on_the_socket_the_launcher_holds():
    cluster = LocalCluster(num_workers=0, coordinator_args=["--log-level", "WARNING"])
    await cluster.start()
    try:
        assert cluster.listener is not None and cluster.port == bound_port(cluster.listener) != 0
        async with InferenceClient(cluster.address, connect_timeout=60) as client:
            assert (await client.stats()).num_healthy_workers == 0
        first = cluster.coordinator
        first.send_signal(signal.SIGKILL)
        await asyncio.wait_for(first.wait(), 30)
        restarted = await cluster.respawn_coordinator()
        async with InferenceClient(cluster.address, connect_timeout=60) as client:  # the same port, never let go
            assert (await client.stats()).num_healthy_workers == 0
        assert restarted.returncode is None
    finally:
        await cluster.shutdown()
    assert cluster.listener is None
