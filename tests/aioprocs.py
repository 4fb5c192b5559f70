"""Helpers for asyncio child processes that lead their own process group (start_new_session=True)."""

from __future__ import annotations

import asyncio
import os
import signal


async def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child's whole process group (if it is still running) and reap it."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()


def pid_gone(pid: int) -> bool:
    """True once no process has this pid (it exited and was reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
