"""A launcher's children kept running: each child process (the coordinator, every worker or TP group, the HTTP
front) is watched by a task of its own and restarted under a RestartPolicy (client/restarts.py decides; this
is the shell that waits, signals and spawns).

A child that exits with code 0 was told to stop (a STOP, a SIGTERM drain) and is not restarted. Any other end
(a crash, kill -9, OOM) SIGKILLs what the child left in its process group (a TP group's members), then restarts
it after the policy's backoff, with the same command line: a worker registers again and gets a free DP rank,
a coordinator binds the same address and the workers and clients re-attach to it (coordinator/reattachment.py),
an HTTP front serves on the socket the launcher kept open. A child past its crash-loop limit is given up, and
the log says why. An *essential* child (the coordinator, the HTTP front) given up, or the coordinator exiting
with 0 (a STOP), ends the service: `ended` says why. `stop()` ends every watch before the launcher shuts the
children down, so nothing is restarted during a shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from infer.client.restarts import CrashLoop, GiveUp, RestartPolicy, how_it_ended

log = logging.getLogger("infer.serve")


class ChildProcess(Protocol):
    """What a launcher asks of a child: an asyncio.subprocess.Process, or a worker forked from the fork server
    (client/worker_forks.py's ForkedProcess)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


Spawn = Callable[[], Awaitable[ChildProcess]]


@dataclass
class Child:
    """One supervised process: `spawn` starts it again (and records it where its owner keeps it)."""

    name: str
    proc: ChildProcess
    spawn: Spawn
    crash_loop: CrashLoop
    essential: bool = False  # given up, or exiting with 0: the service ends
    restarts: int = 0
    given_up: str | None = None  # why it is not restarted any more
    watch: asyncio.Task | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Ended:
    """Why the service ends: `clean` for the coordinator's STOP, else a child given up."""

    reason: str
    clean: bool


class Supervisor:
    """Watches children (see the module doc). `trouble` completes with the first reason any child was given up,
    or the service ended (a launcher still starting fails on it); `ended` with why the service must end."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self.children: list[Child] = []
        self.trouble: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.ended: asyncio.Future[Ended] = asyncio.get_running_loop().create_future()
        self._stopping = asyncio.Event()

    def watch(self, name: str, proc: ChildProcess, spawn: Spawn, essential: bool = False) -> Child:
        child = Child(name, proc, spawn, CrashLoop(self.policy), essential)
        child.watch = asyncio.create_task(self._keep(child), name=f"supervise {name}")
        self.children.append(child)
        return child

    async def stop(self, timeout: float = 10.0) -> None:
        """No more restarts: every watch ends (a spawn under way finishes first, and is recorded)."""
        self._stopping.set()
        watches = [c.watch for c in self.children if c.watch is not None]
        if watches:
            await asyncio.wait(watches, timeout=timeout)

    async def _keep(self, child: Child) -> None:
        while True:
            exit_code = asyncio.ensure_future(child.proc.wait())
            if await self._unless_stopping(exit_code):
                return
            code = exit_code.result()
            _kill_group(child.proc)  # what it left in its group (a TP group's members)
            if code == 0:
                log.info("%s (pid %d) exited with code 0: stopped, not restarted", child.name, child.proc.pid)
                if child.essential:
                    self._end(Ended(f"{child.name} exited", clean=True))
                return
            verdict = child.crash_loop.on_exit(self.clock(), code)
            if isinstance(verdict, GiveUp):
                self._give_up(child, verdict.reason)
                return
            log.warning(
                "%s (pid %d) %s; restarting it in %.1f s (restart %d of at most %d within %g s)",
                child.name,
                child.proc.pid,
                how_it_ended(code),
                verdict.delay,
                verdict.attempt,
                self.policy.max_restarts,
                self.policy.restart_window,
            )
            if await self._unless_stopping(asyncio.sleep(verdict.delay)):
                return
            child.proc = await child.spawn()
            child.restarts += 1
            log.warning("%s restarted (pid %d)", child.name, child.proc.pid)

    def _give_up(self, child: Child, reason: str) -> None:
        child.given_up = reason
        log.error("%s (pid %d) is not restarted: %s", child.name, child.proc.pid, reason)
        what = f"{child.name} is not restarted: {reason}"
        if not self.trouble.done():
            self.trouble.set_result(what)
        if child.essential:
            self._end(Ended(what, clean=False))
        elif all(c.given_up for c in self.children if not c.essential):
            log.error("no worker is left: requests wait in the coordinator until one joins")

    def _end(self, ended: Ended) -> None:
        if not self.trouble.done():
            self.trouble.set_result(ended.reason)
        if not self.ended.done():
            self.ended.set_result(ended)

    async def _unless_stopping(self, awaitable: Awaitable[Any]) -> bool:
        """Await `awaitable` unless `stop()` comes first (then True, and the awaitable is cancelled)."""
        waiting = asyncio.ensure_future(awaitable)
        stopping = asyncio.ensure_future(self._stopping.wait())
        done, _ = await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        stopping.cancel()
        return stopping in done


def _kill_group(proc: ChildProcess) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the child led its own group
    except (ProcessLookupError, PermissionError):
        pass
