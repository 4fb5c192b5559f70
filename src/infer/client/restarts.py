"""The restart policy of a launcher's children (infer-serve; the Slurm launcher's tasks): exponential backoff and
a crash-loop limit. No I/O, no torch; time is passed in.

A child that dies is restarted after `restart_backoff * 2**k` seconds (at most `restart_backoff_max`), k being
the restarts it had within the last `restart_window` seconds; a death past `max_restarts` restarts within the
window gives it up (`GiveUp`, with the reason for the log). Restarts older than the window are forgotten, so a
child that crashed once a day is restarted every time, promptly. Exit code 2 is every daemon's "your options (or
the model they name) are refused" (a bad flag, a TP size the model's heads do not split into): the same command
would fail again, so it is given up at once, without a crash loop of pointless restarts.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass

from infer.protocol.options import option

EXIT_USAGE = 2  # every daemon's exit code for options (or a model) it refuses


@dataclass(frozen=True)
class RestartPolicy:
    """How a launcher restarts the processes it started (each field is its flag)."""

    max_restarts: int = option(
        5,
        "restarts of one process (a worker, the coordinator, the HTTP front) within "
        "--restart-window; the next death after them gives it up (0: never restart)",
    )
    restart_window: float = option(
        300.0, "seconds over which --max-restarts counts one process's restarts", metavar="S"
    )
    restart_backoff: float = option(
        1.0,
        "seconds before restarting a process that died; doubled for each restart it had within --restart-window",
        metavar="S",
    )
    restart_backoff_max: float = option(30.0, "the longest wait before a restart", metavar="S")

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        for name in ("restart_window", "restart_backoff", "restart_backoff_max"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 86400:
                raise ValueError(f"{name} must be in [0, 86400] seconds, got {value!r}")
        if self.restart_backoff_max < self.restart_backoff:
            raise ValueError(
                f"restart_backoff_max ({self.restart_backoff_max}) must be >= restart_backoff ({self.restart_backoff})"
            )


@dataclass(frozen=True)
class Restart:
    """Restart the process after `delay` seconds; it is restart number `attempt` within the window."""

    delay: float
    attempt: int


@dataclass(frozen=True)
class GiveUp:
    """Do not restart the process again: `reason` says why (for the log)."""

    reason: str


class CrashLoop:
    """One process's deaths under a RestartPolicy: each `on_exit` says when to restart it, or gives it up.

    Invariant: `_restarts` holds the times of the restarts granted within the window, oldest first, at most
    `max_restarts` of them."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._restarts: deque[float] = deque()

    def on_exit(self, now: float, returncode: int) -> Restart | GiveUp:
        """The process ended at `now` with `returncode` (a Popen's: -N for signal N), not 0."""
        how = how_it_ended(returncode)
        if returncode == EXIT_USAGE:
            return GiveUp(
                f"it {how}: its options or model were refused (its log says why), and restarting it with "
                f"the same command cannot help"
            )
        window = self.policy.restart_window
        while self._restarts and now - self._restarts[0] > window:
            self._restarts.popleft()
        done = len(self._restarts)
        if done >= self.policy.max_restarts:
            if self.policy.max_restarts == 0:
                return GiveUp(f"it {how}; restarts are off (--max-restarts 0)")
            return GiveUp(
                f"it {how} after {done} restarts within {window:g} s (--max-restarts "
                f"{self.policy.max_restarts}, --restart-window {window:g}): a crash loop"
            )
        delay = min(self.policy.restart_backoff * 2.0**done, self.policy.restart_backoff_max)
        self._restarts.append(now + delay)
        return Restart(delay, done + 1)


def how_it_ended(returncode: int) -> str:
    """A child's return code in words: "exited with code 2", "was killed by SIGKILL"."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"
