"""Workers forked from one process that has imported torch, instead of a fresh interpreter each.

A worker's start is a Python interpreter, `import torch` (2-2.5 s of CPU on a 2-core Zen 3; most of a worker's
start before its model) and then the worker's own modules and model. LocalCluster (infer-serve, `LLM` /
`AsyncLLM(use_coordinator=True)`) starts one fork server per cluster, on the first worker it starts: this file run by
its path, so that nothing of infer is imported before a fork. The server imports torch once; each worker, a restarted
one too, is a fork of it that runs `python -m infer.worker.service.daemon ...` as a fresh interpreter would: the
module as `__main__` with its sys.argv, sys.path[0] the working directory, the environment and working directory the
launcher has at the spawn, in a session of its own, stdin on /dev/null, stdout and stderr the launcher's. Every
module of the worker and every variable it reads is read in the child, as in a fresh process.

The server is the workers' parent: it reaps each and sends its exit code (as Popen gives it: -N for signal N) to
the launcher, whose `ForkedProcess` answers what LocalCluster and the Supervisor ask of a child: pid, returncode,
wait(), send_signal(). A worker starts as a new interpreter instead when INFER_FORK_WORKERS=0, when the environment
differs from the server's in a variable read while the interpreter, libgomp, a BLAS or torch load
(IMPORT_TIME_PREFIXES), or when the server cannot start. If the server dies, the workers it forked are killed (their
exit codes could no longer be read) and reported as killed: the Supervisor restarts them, as new interpreters
unless a new server starts.

The protocol: JSON lines over a socket pair, the launcher's end read by one task. Launcher -> server:
{"argv": [...], "env": {...}, "cwd": "..."[, "log": path for the child's stdout and stderr]}; server -> launcher:
{"ready": true} once torch is imported and the process may fork, {"pid": N} per spawn in order, {"exited": N,
"code": C, "cpu": seconds} as children end (their CPU: tests/daemon_forkserver.py, which runs this server for the
cluster tests' workers, counts it). The launcher closing its
end ends the server; the children run on in their sessions.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Any

log = logging.getLogger("infer.worker_forks")

# Variables read while the interpreter, libgomp, a BLAS or torch load (before the fork): a spawn whose environment
# differs from the server's in one of them starts a new interpreter. Any other (ours, TORCHINDUCTOR_CACHE_DIR) is set
# in the child before the worker's modules are imported, as in a fresh process.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
)
READY_TIMEOUT_S = 120.0  # the server's `import torch` (seconds on a loaded 2-core machine)
SPAWN_TIMEOUT_S = 30.0  # a fork's reply
REAP_INTERVAL_S = 0.1  # the server reaps its children this often (a bounded wait on the socket between)
CLOSE_TIMEOUT_S = 10.0
# The server's last argument: room for a child's command line (`_show_argv`), so that `ps`, `pgrep -f` and
# /proc/PID/cmdline show a forked worker's `python -m infer.worker.service.daemon ...`, not the server's. A longer
# one is cut at this many bytes.
ARGV_ROOM = 8192


def forkable(env: dict[str, str], server_env: dict[str, str]) -> bool:
    """Whether a child with `env` may be forked from a server started with `server_env`."""
    keys = set(env) | set(server_env)
    return not any(k.startswith(IMPORT_TIME_PREFIXES) for k in keys if env.get(k) != server_env.get(k))


class ForkedProcess:
    """The asyncio.subprocess.Process face of a forked worker: pid, returncode, wait(), send_signal(), terminate(),
    kill(). Its exit code comes from the server that reaped it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    def _set_exit(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WorkerForks:
    """The launcher's side of one fork server (module docstring). `await WorkerForks.start(python)` is None when the
    server cannot start (the log says why); then, and once `alive` is False, spawn through a new interpreter."""

    def __init__(self, server: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._server = server
        self._reader = reader
        self._writer = writer
        self.env = dict(os.environ)
        self.alive = True
        self._closing = False
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}  # exits read before their spawn's reply was handled
        self._replies: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._lock = asyncio.Lock()  # one spawn at a time: replies come in request order
        self._reading = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, python: str = sys.executable) -> WorkerForks | None:
        ours, theirs = socket.socketpair()
        try:
            server = await asyncio.create_subprocess_exec(
                python,
                os.path.abspath(__file__),
                str(theirs.fileno()),
                " " * ARGV_ROOM,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C at the launcher's terminal is the launcher's to handle
            )
        except OSError as e:
            ours.close()
            log.warning("workers start as new interpreters: the fork server did not start (%s)", e)
            return None
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        try:
            line = await asyncio.wait_for(reader.readline(), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if not line or json.loads(line) != {"ready": True}:
            log.warning(
                "workers start as new interpreters: the fork server %s",
                "cannot fork (threads or CUDA after import torch)" if line else "did not get ready",
            )
            writer.close()
            await _end(server)
            return None
        return cls(server, reader, writer)

    async def spawn(self, argv: list[str]) -> ForkedProcess | None:
        """A fork running `python *argv` (argv: ["-m", module, *args]) with this process's environment and working
        directory; None when the server is gone or its environment differs in what torch read (see forkable)."""
        if argv[:1] != ["-m"] or len(argv) < 2:
            raise ValueError(f"only `-m module` workers are forked, got {argv[:2]}")
        env = dict(os.environ)
        if not self.alive or not forkable(env, self.env):
            return None
        async with self._lock:
            request = {"argv": argv, "env": env, "cwd": os.getcwd()}
            try:
                self._writer.write((json.dumps(request) + "\n").encode())
                await self._writer.drain()
                reply = await asyncio.wait_for(self._replies.get(), SPAWN_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as e:
                log.warning("the fork server did not answer a spawn (%s): workers start as new interpreters", e)
                self.alive = False
                return None
            if "pid" not in reply:  # the reader's end-of-stream marker
                return None
            child = ForkedProcess(reply["pid"])
            self._children[child.pid] = child
            if child.pid in self._early_exits:
                child._set_exit(self._early_exits.pop(child.pid))
            return child

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                message = json.loads(line)
                if "exited" in message:
                    child = self._children.pop(message["exited"], None)
                    if child is None:
                        self._early_exits[message["exited"]] = message["code"]
                    else:
                        child._set_exit(message["code"])
                else:
                    self._replies.put_nowait(message)
        except (OSError, ValueError) as e:
            log.warning("the fork server's messages could not be read: %s", e)
        finally:
            self._lost()

    def _lost(self) -> None:
        """The server is gone: nothing can reap or report its children any more, so they are killed (each led its
        own process group) and reported as killed; the Supervisor restarts them."""
        self.alive = False
        self._replies.put_nowait({})  # a spawn waiting for its reply returns None
        if self._closing:
            return
        if self._children:
            log.error("the fork server ended: killing the %d workers it forked, to be restarted", len(self._children))
        for child in self._children.values():
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            child._set_exit(-signal.SIGKILL)
        self._children.clear()

    async def close(self) -> None:
        """End the server (its children, if any are left, run on in their sessions) and wait for it."""
        self._closing = True
        self.alive = False
        self._writer.close()
        await _end(self._server)
        self._reading.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


async def _end(server: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(server.wait(), CLOSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        server.kill()
        await server.wait()


# ---- the server: this file run by its path (nothing of infer imported before a fork) --------------------------------


def _serve(channel: socket.socket) -> dict[str, Any] | None:
    """The server's loop; returns (in a forked child only) the request it is to run, None when the launcher is gone
    or this process cannot fork."""
    import selectors

    import torch  # the point: imported once, before every fork

    # as worker/parallel/tp_supervisor.py's can_fork_members: no CUDA, no Python thread (numpy's OpenBLAS pool, the
    # native thread `import torch` leaves, stops and restarts around a fork by itself)
    if torch.cuda.is_initialized() or threading.active_count() > 1:
        channel.sendall(b'{"ready": false}\n')
        return None
    channel.sendall(b'{"ready": true}\n')
    incoming = channel.makefile("rb")
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    while True:
        ready = selector.select(REAP_INTERVAL_S)
        _reap(channel)
        if not ready:
            continue
        line = incoming.readline()
        if not line:
            return None
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            selector.close()
            incoming.close()
            channel.close()
            return request
        channel.sendall((json.dumps({"pid": pid}) + "\n").encode())


def _reap(channel: socket.socket) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        channel.sendall((json.dumps({"exited": pid, "code": code, "cpu": cpu}) + "\n").encode())


def _become(request: dict[str, Any]) -> str:
    """In the forked child: what a fresh `python -m module` would have (module docstring); returns the module."""
    import random

    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # else every worker would draw what the server's seed gives
    if "log" in request:  # stdout and stderr to a file of their own (the tests' daemons: tests/daemon_forkserver.py)
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    sys.path[0] = os.getcwd()
    sys.argv = [request["argv"][1], *request["argv"][2:]]
    _show_argv([sys.executable, *request["argv"]])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return request["argv"][1]


def _show_argv(argv: list[str]) -> None:
    """Write `argv` over this process's command line: the memory the kernel shows as /proc/self/cmdline (the
    server's arguments, the last of them ARGV_ROOM spaces), as setproctitle(3) does: the arguments joined by spaces,
    a NUL, then spaces to the end, whose last byte not being NUL tells the kernel to show the text up to the first
    NUL. The environment's memory, which C code still reads (getenv), is left alone."""
    import ctypes

    stat = open("/proc/self/stat").read()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is proc(5)'s field 3 (state)
    arg_start, arg_end = int(fields[48 - 3]), int(fields[49 - 3])
    room = arg_end - arg_start
    shown = " ".join(argv).encode(errors="replace")[: room - 2] + b"\0"
    ctypes.memmove(arg_start, shown.ljust(room, b" "), room)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher ends the server by closing its end
    sys.path[0] = os.getcwd()  # as `python -m` has it (not this file's folder, whose modules would shadow others)
    job = _serve(socket.socket(fileno=int(sys.argv[1])))
    if job is not None:
        module = _become(job)
        import runpy

        runpy.run_module(module, run_name="__main__", alter_sys=True)
