"""infer-serve as a child process for the HTTP tests that need the whole cluster (the openai client's)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
from pathlib import Path

from group_procs import launched


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of the child's stdout within `timeout` seconds (AssertionError otherwise)."""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not selector.select(timeout):
            raise AssertionError(f"infer-serve printed nothing in {timeout} s")
        return proc.stdout.readline().decode()
    finally:
        selector.close()


class Served:
    """`infer-serve --workers 2` in a process group of its own; `url` is its HTTP front, `address` its
    coordinator. `model` None: the embedded model."""

    def __init__(self, model: Path | None, log: Path, name: str, flags: list[str]) -> None:
        self.log = log
        model_flags = [] if model is None else ["--model", str(model)]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "infer.client.serve",
                    *model_flags,
                    "--workers",
                    "2",
                    "--port",
                    "0",
                    "--served-model-name",
                    name,
                    "--heartbeat-interval",
                    "0.2",
                    "--log-level",
                    "WARNING",
                    *flags,
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        line = _read_line(self.proc, 120)
        match = re.search(r"HTTP at (http://\S+?);.*connect to (tcp://\S+)", line)
        assert match, f"{line!r}\n{log.read_text()}"
        self.url, self.address = match.group(1), match.group(2)

    def stop(self) -> None:
        """SIGTERM (infer-serve stops its coordinator and workers), then SIGKILL whatever is left:
        infer-serve's group and its children's groups (each child, a forked worker too, leads its own session)."""
        children = launched(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for pgid in [self.proc.pid, *map(int, children)]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
