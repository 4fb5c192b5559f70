"""Worker daemons for the cluster tests, forked from one process that has imported torch, instead of a fresh
interpreter each.

Why: the suite is CPU-bound on 2 cores, and a worker's start is ~3 s of CPU, 2-2.5 s of it `import torch`; the
cluster tests start ~220 workers (~500 s of the ~2,600 s of CPU a whole run counts). `spawn` hands a worker's argv
to this file run as a server (one per test process, started on first use): the server imported torch once, forks,
and the child runs the module as `python -m` would (`__main__`, sys.argv, sys.path[0] the working directory) in a
session of its own with stdout and stderr on its log. Nothing of infer is imported before the fork, so every module of
the daemon, and each environment variable it reads, is read in the child as in a fresh interpreter; `random` is
reseeded there. The real start, a fresh `python -m infer.worker.service.daemon` / `infer-worker`, stays covered where
the product starts workers itself: infer-serve, the Slurm launcher, the supervisors' restarts, and
tests/worker/test_worker_imports.py (the modules a fresh worker imports).

The server reaps its children and reports each exit code (Popen's: -N for signal N) and CPU seconds (os.wait4's,
which tests/conftest.py adds to the test's CPU, as it counts an exec'd child's). `ForkedPopen` answers what the tests
ask a subprocess.Popen: pid, poll(), wait(timeout), returncode, send_signal().

A spawn takes the exec path instead (`popen_daemon` decides) when INFER_TEST_EXEC_DAEMONS=1, when the environment
differs from the server's in a variable the interpreter, libgomp, a BLAS or torch read as they load (the product's
rule: client/worker_forks.py's IMPORT_TIME_PREFIXES), or when the server could not start or is gone. The product
forks its own workers the same way (client/worker_forks.py: infer-serve, LLM's coordinator mode); this file is the
tests' Cluster's, whose workers also log to a file each and count their CPU.
"""

from __future__ import annotations

import json
import os
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
    """The client of one server process (module docstring)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            cwd="/",
        )
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
            selector.register(self._proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None
        line = self._proc.stdout.readline()
        return json.loads(line) if line else None

    def _read_loop(self) -> None:
        for line in self._proc.stdout:
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
                self._proc.stdin.write((json.dumps(request) + "\n").encode())
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError):
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
        if self._proc.poll() is None:
            self._proc.stdin.close()
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


# ---- the server -------------------------------------------------------------------------------------------------


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "code": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime})


def _serve() -> dict | None:
    """The server's loop; returns (in a forked child only) the request the child is to run."""
    import selectors

    import torch  # the point: imported once, before every fork

    # as worker/parallel/tp_supervisor.py's can_fork_members: no CUDA, no Python thread (numpy's OpenBLAS pool, the
    # one native thread `import torch` leaves, stops and restarts around a fork by itself)
    if torch.cuda.is_initialized() or threading.active_count() > 1:
        return None
    _send({"ready": True})
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
        ready = selector.select(0.05)
        _reap()
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:  # the test process closed the pipe (or ended): the children run on in their sessions
            return None
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            selector.close()
            return request
        _send({"pid": pid})


def _become(request: dict) -> None:
    """In the forked child: what `python -m` would set up, then stdin, stdout, stderr and the session."""
    import random

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    random.seed()
    sys.path[0] = os.getcwd()
    sys.argv = [request["argv"][1], *request["argv"][2:]]


if __name__ == "__main__":
    job = _serve()
    if job is not None:
        _become(job)
        flag, module = job["argv"][0], job["argv"][1]
        if flag != "-m":
            raise SystemExit(f"daemon_forkserver: only `-m module` daemons fork, got {job['argv'][:2]}")
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
