"""The processes of one DP rank's TP group on one node: `infer-worker --tp-size T` without --tp-rank
starts T members (`supervise`), LLM's direct mode its T - 1 followers (`start_followers`). Members run in
a process group of their own and die with their parent (SIGKILL when it dies, kill -9 included).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from infer.protocol.env import TP_SUPERVISED

if TYPE_CHECKING:
    from infer.worker.tp_group import TpOptions

log = logging.getLogger("infer.worker")

SUPERVISOR_GRACE_S = 5.0     # once a member exits, the others get this long before SIGKILL


def reap(children: Sequence[subprocess.Popen]) -> None:
    """Wait SUPERVISOR_GRACE_S for each child to exit, then SIGKILL it."""
    for child in children:
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("TP member pid %d did not exit with its group; killing it", child.pid)
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)


def start_followers(size: int, dist_init: str, worker_flags: Sequence[str]) -> list[subprocess.Popen]:
    """TP ranks 1 .. size-1 as `infer-worker` child processes of this one (which is TP rank 0)."""
    env = {**os.environ, TP_SUPERVISED.name: "1"}
    return [subprocess.Popen([sys.executable, "-m", "infer.worker.daemon", *worker_flags, "--tp-size", str(size),
                              "--tp-rank", str(rank), "--dist-init", dist_init], env=env,
                             preexec_fn=die_with_parent, process_group=0) for rank in range(1, size)]


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def supervise(argv: Sequence[str], options: TpOptions) -> int:
    """Start this DP rank's T processes (this command line + --tp-rank r, one shared --dist-init) and wait;
    once one exits, rank 0 gets a SIGTERM (a drain: with its group broken it gives its requests back) and
    the others SUPERVISOR_GRACE_S to follow, then SIGKILL. SIGTERM / SIGINT go to TP
    rank 0 (it drains, then stops the others). Returns the exit code of the member that ended first when it is
not 0 (why the group ended: 2 for options or a model it refused, 128 + N for signal N), else rank 0's, else the
first non-zero one.
    The members run in a process group of their own (a signal to the supervisor's group reaches only it) and
    die with it (SIGKILL when it dies, kill -9 included)."""
    dist_init = options.dist_init or f"tcp://127.0.0.1:{free_local_port()}"
    env = {**os.environ, TP_SUPERVISED.name: "1"}
    children = []
    for rank in range(options.size):
        cmd = [sys.executable, "-m", "infer.worker.daemon", *argv, "--tp-rank", str(rank), "--dist-init", dist_init]
        children.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, process_group=0))
        log.info("TP rank %d of this DP rank: pid %d", rank, children[-1].pid)

    def forward(signum: int, _frame: object) -> None:
        if children[0].poll() is None:
            children[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pid, status = os.wait()   # the first member to exit
    codes = {pid: os.waitstatus_to_exitcode(status)}
    if children[0].pid not in codes:   # rank 0 (idle, it may not have noticed yet): give back and leave
        children[0].send_signal(signal.SIGTERM)
    for child in children:
        if child.pid in codes:
            child.returncode = codes[child.pid]
            continue
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("TP rank %d (pid %d) did not exit with its group; killing it", children.index(child),
                        child.pid)
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)
    first = codes[pid]
    code = first or children[0].returncode or next((c.returncode for c in children if c.returncode), 0)
    return code if code >= 0 else 128 - code   # killed by signal N: 128 + N, as a shell says it
