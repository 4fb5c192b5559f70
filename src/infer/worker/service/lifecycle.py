"""One worker's lifecycle as a declarative table: (state, command) -> new state + what the engine does.

The worker obeys the last command it got, whatever its state: the coordinator sends every worker that
registers the commands that reach the cluster's state (`coordinator/lifecycle.py: commands_to_reach`), and a
worker may have missed some (it joined late, or its coordinator restarted). So unlike the cluster's table no
command is refused here; "resume" always lands in PAUSED, as the cluster's SUSPENDED -> PAUSED, and the engine's
suspend / resume are idempotent (0 bytes when there is nothing to release or restore).

Draining (after SIGTERM) is not a state of this table: it is a deadline beside it, and a running worker that
drains reports its state as "draining" (`WorkerCore.state_name`: WorkerState.DRAINING, protocol/codes.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from infer.protocol.codes import Command, WorkerState


class Action(enum.Enum):
    SUSPEND_ENGINE = "release the KV pool and the weights (Engine.suspend)"
    RESUME_ENGINE = "restore them (Engine.resume)"
    ABORT_ALL = "give every request back (their final deltas keep the text held back out)"
    EXIT = "leave the EP group, if any, and exit 0"


@dataclass(frozen=True)
class Transition:
    state: WorkerState
    actions: tuple[Action, ...] = ()


_R, _P, _S = WorkerState.RUNNING, WorkerState.PAUSED, WorkerState.SUSPENDED
_BY_COMMAND = {
    Command.PAUSE: Transition(_P),
    Command.UNPAUSE: Transition(_R),
    Command.SUSPEND: Transition(_S, (Action.SUSPEND_ENGINE,)),
    Command.RESUME: Transition(_P, (Action.RESUME_ENGINE,)),
    Command.STOP: Transition(WorkerState.STOPPED, (Action.ABORT_ALL, Action.EXIT)),
}

TABLE: dict[tuple[WorkerState, Command], Transition] = {
    (state, command): transition for state in (_R, _P, _S) for command, transition in _BY_COMMAND.items()
}


def transition(state: WorkerState, command: Command) -> Transition:
    """What `command` does to a worker in `state`. `Control` frames only carry known commands (the codec
    checks them), and a stopped worker handles no more frames: KeyError for anything else is a bug."""
    return TABLE[(state, command)]
