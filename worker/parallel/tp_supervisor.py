"""The processes of one DP rank on one node: `infer-worker --tp-size T` without --tp-rank starts its T TP ranks
(`supervise`; with --pp-size P, P stages, or P x T: each stage a TP group), LLM's direct mode the followers of this
process (`start_followers`, `start_members`). Members run in
a process group of their own and die with their parent (SIGKILL when it dies, kill -9 included).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from infer.protocol.env import TP_SUPERVISED
from infer.protocol.ports import reserved_port

log = logging.getLogger("infer.worker")

SUPERVISOR_GRACE_S = 5.0  # once a member exits, the others get this long before SIGKILL


def reap(children: Sequence[subprocess.Popen]) -> None:
    """Wait SUPERVISOR_GRACE_S for each child to exit, then SIGKILL it."""
    for child in children:
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("TP member pid %d did not exit with its group; killing it", child.pid)
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)


def members(tp_size: int, pp_size: int = 1) -> list[tuple[str, list[str]]]:
    """The processes of one DP rank, the engine's first: (name, rank flags) of each TP rank, or of each pipeline
    stage, or (PP x TP) of each stage's TP ranks, stage by stage (the order of their global ranks)."""
    if pp_size == 1:
        return [(f"TP rank {t}", ["--tp-rank", str(t)]) for t in range(tp_size)]
    return [
        (
            f"PP stage {s}" + (f" TP rank {t}" if tp_size > 1 else ""),
            ["--pp-rank", str(s), *(["--tp-rank", str(t)] if tp_size > 1 else [])],
        )
        for s in range(pp_size)
        for t in range(tp_size)
    ]


def start_followers(
    size: int, dist_init: str, worker_flags: Sequence[str], size_flag: str = "--tp-size", rank_flag: str = "--tp-rank"
) -> list[subprocess.Popen]:
    """TP ranks 1 .. size-1 as `infer-worker` child processes of this one (which is TP rank 0); with
    `size_flag` / `rank_flag` "--pp-size" / "--pp-rank", pipeline stages 1 .. size-1 (worker/parallel/pp_group.py)."""
    return start_members(
        [(rank_flag, [rank_flag, str(rank)]) for rank in range(1, size)],
        dist_init,
        [*worker_flags, size_flag, str(size)],
    )


def start_members(
    followers: Sequence[tuple[str, Sequence[str]]], dist_init: str, worker_flags: Sequence[str]
) -> list[subprocess.Popen]:
    """`followers` (`members()` after the first) as `infer-worker` child processes of this one, each with
    `worker_flags` (the sizes included), its rank flags and `dist_init`."""
    env = {**os.environ, TP_SUPERVISED.name: "1"}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "infer.worker.service.daemon", *worker_flags, *flags, "--dist-init", dist_init],
            env=env,
            preexec_fn=die_with_parent,
            process_group=0,
        )
        for _, flags in followers
    ]


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def supervise(argv: Sequence[str], group: Sequence[tuple[str, Sequence[str]]], dist_init: str | None) -> int:
    """Start this DP rank's processes (`group`: `members()`; each this command line + its rank flags, one shared
        --dist-init: `dist_init`, or a reserved local port, protocol/ports.py) and wait;
        once one exits, rank 0 gets a SIGTERM (a drain: with its group broken it gives its requests back) and
        the others SUPERVISOR_GRACE_S to follow, then SIGKILL. SIGTERM / SIGINT go to TP
        rank 0 (it drains, then stops the others). Returns the exit code of the member that ended first when it is
    not 0 (why the group ended: 2 for options or a model it refused, 128 + N for signal N), else rank 0's, else the
    first non-zero one.
        The members run in a process group of their own (a signal to the supervisor's group reaches only it) and
        die with it (SIGKILL when it dies, kill -9 included)."""
    dist_init = dist_init or f"tcp://127.0.0.1:{reserved_port()}"
    env = {**os.environ, TP_SUPERVISED.name: "1"}
    children = []
    for name, flags in group:
        cmd = [sys.executable, "-m", "infer.worker.service.daemon", *argv, *flags, "--dist-init", dist_init]
        children.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, process_group=0))
        log.info("%s of this DP rank: pid %d", name, children[-1].pid)

    def forward(signum: int, _frame: object) -> None:
        if children[0].poll() is None:
            children[0].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    pid, status = os.wait()  # the first member to exit
    codes = {pid: os.waitstatus_to_exitcode(status)}
    if children[0].pid not in codes:  # rank 0 (idle, it may not have noticed yet): give back and leave
        children[0].send_signal(signal.SIGTERM)
    for child in children:
        if child.pid in codes:
            child.returncode = codes[child.pid]
            continue
        try:
            child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "%s (pid %d) did not exit with its group; killing it", group[children.index(child)][0], child.pid
            )
            child.kill()
            child.wait(timeout=SUPERVISOR_GRACE_S)
    for (name, _), child in zip(group, children, strict=True):
        how = f"code {child.returncode}" if child.returncode >= 0 else f"signal {-child.returncode}"
        (log.info if child.returncode == 0 else log.warning)("%s (pid %d) ended with %s", name, child.pid, how)
    first = codes[pid]
    code = first or children[0].returncode or next((c.returncode for c in children if c.returncode), 0)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says it
