"""Worker daemons for the cluster tests, forked from one process that has imported torch, instead of a fresh
interpreter each: the product's fork server (client/worker_forks.py, as infer-serve forks its workers), one per test
process, started on first use.

Why: the suite is CPU-bound on 2 cores, and a worker's start is ~3 s of CPU, 2-2.5 s of it `import torch`; the
cluster tests start ~220 workers. `spawn` hands a worker's argv to the server, which forks; the child runs the module
as `python -m` would (`__main__`, sys.argv, sys.path[0] the working directory, the environment at the spawn) in a
session of its own, with stdout and stderr on its log (the request's "log", which infer-serve does not use). The
fresh start, `python -m infer.worker.service.daemon` / `infer-worker`, stays covered where the product starts
workers that way: the Slurm launcher, INFER_FORK_WORKERS=0 (tests/client/test_worker_forks.py), and
tests/worker/test_worker_imports.py (the modules a fresh worker imports).

The server reaps its children and reports each exit code (Popen's: -N for signal N) and CPU seconds (os.wait4's,
which tests/conftest.py adds to the test's CPU, as it counts an exec'd child's). `ForkedPopen` answers what the tests
ask a subprocess.Popen: pid, poll(), wait(timeout), returncode, send_signal().

A spawn takes the exec path instead (`popen_daemon` decides) when INFER_TEST_EXEC_DAEMONS=1, when the environment
differs from the server's in a variable the interpreter, libgomp, a BLAS or torch read as they load (the product's
rule, client/worker_forks.py's forkable), or when the server could not start or is gone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

_START_TIMEOUT_S = 120.0


class ForkedPopen:
    """The subprocess.Popen face of a forked daemon (what tests/cluster/conftest.py's Proc uses)."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self._server = server
        self.args = ["<forked>", str(pid)]

    @property
    def returncode(self) -> int | None:
        return self._server.exit_code(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    """A client of the product's fork server (client/worker_forks.py, run by its path), synchronous: one reader
    thread, spawns one at a time."""

    def __init__(self) -> None:
        from infer.client import worker_forks

        self.env = dict(os.environ)
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, worker_forks.__file__, str(theirs.fileno()), " " * worker_forks.ARGV_ROOM],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd="/",
            start_new_session=True,
        )
        theirs.close()
        self._channel = ours
        self._incoming = ours.makefile("rb")
        self._lock = threading.Lock()  # one spawn request at a time
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        self._replies: list[dict] = []
        self.cpu_seconds = 0.0  # of the children reaped so far
        self.alive = self._read_line(_START_TIMEOUT_S) == {"ready": True}
        if self.alive:
            threading.Thread(target=self._read_loop, name="forkserver-reader", daemon=True).start()

    def _read_line(self, timeout: float) -> dict | None:
        import selectors

        with selectors.DefaultSelector() as selector:
            selector.register(self._channel, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None
        line = self._incoming.readline()
        return json.loads(line) if line else None

    def _read_loop(self) -> None:
        for line in self._incoming:
            message = json.loads(line)
            with self._changed:
                if "exited" in message:
                    self._exits[message["exited"]] = message["code"]
                    self.cpu_seconds += message["cpu"]
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:
            self.alive = False
            self._changed.notify_all()

    def spawn(self, argv: list[str], log: Path, cwd: Path | None) -> ForkedPopen | None:
        """Fork a daemon running `python *argv` (argv: ["-m", module, *args]); None if the server is gone."""
        request = {"argv": argv, "log": str(log), "cwd": str(cwd or os.getcwd()), "env": dict(os.environ)}
        with self._lock:
            try:
                self._channel.sendall((json.dumps(request) + "\n").encode())
            except OSError:
                self.alive = False
                return None
            with self._changed:
                if not self._changed.wait_for(lambda: self._replies or not self.alive, _START_TIMEOUT_S):
                    self.alive = False
                if not self._replies:
                    return None
                reply = self._replies.pop(0)
        return ForkedPopen(reply["pid"], self)

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive, timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """End the server (its children, if any are left, run on in their sessions)."""
        if self._proc.poll() is None:
            self._channel.shutdown(socket.SHUT_WR)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_SERVER: ForkServer | None = None
STARTS = {"forked": 0, "exec": 0}  # this process's daemon starts by way (tests/conftest.py sums and prints them)


def server() -> ForkServer | None:
    """This test process's server, started on first use (None: not in use or could not start)."""
    global _SERVER
    if os.environ.get("INFER_TEST_EXEC_DAEMONS") == "1":
        return None
    if _SERVER is None:
        _SERVER = ForkServer()
    return _SERVER if _SERVER.alive else None


def reaped_cpu_seconds() -> float:
    """CPU seconds of the forked daemons reaped so far (0 without a server)."""
    return 0.0 if _SERVER is None else _SERVER.cpu_seconds


def close() -> None:
    if _SERVER is not None:
        _SERVER.close()


def popen_daemon(argv: list[str], log: Path, cwd: Path | None) -> subprocess.Popen | ForkedPopen:
    """`python *argv` as a daemon in a session of its own, stdout and stderr on `log`: forked (module docstring), or
    exec'd as subprocess.Popen when it cannot be."""
    from infer.client.worker_forks import forkable  # here: the server, this file too, imports nothing of infer

    forks = server()
    if forks is not None and forkable(dict(os.environ), forks.env):
        forked = forks.spawn(argv, log, cwd)
        if forked is not None:
            STARTS["forked"] += 1
            return forked
    STARTS["exec"] += 1
    return exec_daemon(argv, log, cwd)


def exec_daemon(argv: list[str], log: Path, cwd: Path | None) -> subprocess.Popen:
    """`python *argv` as a daemon in a fresh interpreter, in a session of its own, stdout and stderr on `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
