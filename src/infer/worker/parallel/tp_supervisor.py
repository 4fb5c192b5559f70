"""The processes of one DP rank on one node: `infer-worker --tp-size T` without --tp-rank starts its T TP ranks
(`supervise`; with --pp-size P, P stages, or P x T: each stage a TP group), LLM's direct mode the followers of this
process (`start_followers`, `start_members`). Members run in
a process group of their own and die with their parent (SIGKILL when it dies, kill -9 included).

The supervisor forks its members: it imports torch and the engine's modules once (~3 s of CPU, what each member
would spend on its own start), then each member is a fork that runs infer-worker's main with its rank flags. Its
command line is the supervisor's, so it is named by its process name instead (`member_name`: `infer-tp1`,
`infer-pp1`, `infer-pp1tp0`; `ps -o pid,comm`, /proc/PID/comm) and in the supervisor's log. Where a fork is not safe
(an import initialized CUDA or started a thread) or INFER_FORK_MEMBERS=0, each member is a new process with its own
command line, as LLM's direct mode always starts them (its process runs torch's threads).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence

from infer.protocol.env import FORK_MEMBERS, TP_SUPERVISED, read
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
    return [spawn_member([*worker_flags, *flags, "--dist-init", dist_init]) for _, flags in followers]


def spawn_member(argv: Sequence[str]) -> subprocess.Popen:
    """`infer-worker argv` as a new process (its own command line), a child of this one in a process group of its
    own, dying with it."""
    return subprocess.Popen(
        [sys.executable, "-m", "infer.worker.service.daemon", *argv],
        env={**os.environ, TP_SUPERVISED.name: "1"},
        preexec_fn=die_with_parent,
        process_group=0,
    )


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def member_name(flags: Sequence[str]) -> str:
    """The process name of a member with these rank flags: "infer-tp1", "infer-pp2", "infer-pp1tp0" (what a
    forked member shows in `ps -o comm` and /proc/PID/comm; the kernel keeps 15 bytes)."""
    ranks = dict(zip(flags[::2], flags[1::2], strict=True))
    pp, tp = ranks.get("--pp-rank"), ranks.get("--tp-rank")
    return "infer-" + (f"pp{pp}" if pp is not None else "") + (f"tp{tp}" if tp is not None else "")


class ForkedMember:
    """A member forked from this process, with the part of subprocess.Popen's interface `supervise` uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has ended; None while it runs, or once `supervise`'s os.wait() has reaped it and
        has not yet recorded its code here (a signal handler's poll in between)."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"member pid {self.pid}", timeout)
            time.sleep(0.05)
        return code

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # reaped already
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def can_fork_members() -> bool:
    """Import what every member imports before its model (torch, the engine, the EP group's bootstrap) here, once,
    and say whether members may be forked from this process: not with INFER_FORK_MEMBERS=0, nor once an import
    initialized CUDA (a forked child cannot use it) or left a Python thread running (a fork copies only the calling
    one). numpy's OpenBLAS starts its thread pool on import; it shuts the pool down around a fork (pthread_atfork)."""
    if read(FORK_MEMBERS) == "0":
        return False
    import torch

    import infer.worker.distributed.expert_parallel
    import infer.worker.engine.engine  # noqa: F401  (this package's own modules are a few ms: they import this)

    if torch.cuda.is_initialized() or threading.active_count() > 1:
        log.info("members start as new processes: this process cannot fork them (CUDA initialized or threads)")
        return False
    return True


def fork_member(main: Callable[[list[str]], object], argv: Sequence[str], name: str) -> ForkedMember:
    """A child of this process that runs `main(argv)` (infer-worker's) in a process group of its own, dying with
    this process, and never returns here: its exit code is main's."""
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = os.getpid()
    pid = os.fork()
    if pid:
        return ForkedMember(pid)
    code = 1
    try:
        os.setpgid(0, 0)
        die_with_parent()
        if os.getppid() != supervisor:  # it died before the line above took effect
            os._exit(128 + signal.SIGKILL)
        try:
            import ctypes

            ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        os.environ[TP_SUPERVISED.name] = "1"
        main(list(argv))
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # sys.exit("why"): printed, exit 1, as the interpreter does
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def supervise(
    argv: Sequence[str],
    group: Sequence[tuple[str, Sequence[str]]],
    dist_init: str | None,
    main: Callable[[list[str]], object],
) -> int:
    """Start this DP rank's processes (`group`: `members()`; each this command line + its rank flags, one shared
        --dist-init: `dist_init`, or a reserved local port, protocol/ports.py; forked, each runs `main`, infer-worker's,
        on it) and wait;
        once one exits, rank 0 gets a SIGTERM (a drain: with its group broken it gives its requests back) and
        the others SUPERVISOR_GRACE_S to follow, then SIGKILL. SIGTERM / SIGINT go to TP
        rank 0 (it drains, then stops the others). Returns the exit code of the member that ended first when it is
    not 0 (why the group ended: 2 for options or a model it refused, 128 + N for signal N), else rank 0's, else the
    first non-zero one.
        The members run in a process group of their own (a signal to the supervisor's group reaches only it) and
        die with it (SIGKILL when it dies, kill -9 included)."""
    dist_init = dist_init or f"tcp://127.0.0.1:{reserved_port()}"
    forking = can_fork_members()
    children: list[subprocess.Popen | ForkedMember] = []
    for name, flags in group:
        member_argv = [*argv, *flags, "--dist-init", dist_init]
        children.append(fork_member(main, member_argv, member_name(flags)) if forking else spawn_member(member_argv))
        log.info("%s of this DP rank: pid %d (%s)", name, children[-1].pid, member_name(flags))

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
            child.returncode = codes[child.pid]  # reaped above: the Popen must not wait for it again
            continue
        try:
            codes[child.pid] = child.wait(timeout=SUPERVISOR_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "%s (pid %d) did not exit with its group; killing it", group[children.index(child)][0], child.pid
            )
            child.kill()
            codes[child.pid] = child.wait(timeout=SUPERVISOR_GRACE_S)
    for (name, _), child in zip(group, children, strict=True):
        ended = codes[child.pid]
        how = f"code {ended}" if ended >= 0 else f"signal {-ended}"
        (log.info if ended == 0 else log.warning)("%s (pid %d) ended with %s", name, child.pid, how)
    first = codes[pid]
    code = first or codes[children[0].pid] or next((codes[c.pid] for c in children if codes[c.pid]), 0)
    return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a shell says it
