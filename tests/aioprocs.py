"""Helpers for child processes: asyncio children that lead their own process group (start_new_session=True),
and a /proc scan for processes a test or script left behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path


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


def processes_mentioning(marker: bytes, *, in_cmdline: bool = True) -> list[str]:
    """Live processes (not zombies), this one excepted, whose environment (or command line, unless
    `in_cmdline` is False) contains `marker`; one "pid: command" line each."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (entry / "cmdline").read_bytes()
            if marker in (entry / "environ").read_bytes() or (in_cmdline and marker in cmdline):
                command = cmdline.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name}: {command[:160]}")
        except (OSError, IndexError):  # it exited meanwhile, or is not ours to read
            continue
    return found
