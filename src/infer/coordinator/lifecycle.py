"""The cluster's lifecycle as a declarative table: (state, command) -> new state + actions, or a refusal.

Requests are dispatched only in RUNNING; in every other state new requests wait in the coordinator.
PAUSE holds new work (and asks workers to stop stepping); SUSPEND additionally lets workers release
memory, and is only allowed from PAUSED; RESUME brings a suspended cluster back to PAUSED; UNPAUSE
releases what waited. STOP is accepted from any live state: pending requests fail, workers are told
to stop, the coordinator exits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from infer.protocol.codes import ClusterState, Command


class Action(enum.Enum):
    TELL_WORKERS = "forward the command to every live worker"
    RELEASE_HELD = "dispatch the requests that waited"
    FAIL_PENDING = "fail every held and in-flight request with a clear error"
    EXIT = "shut the coordinator down once workers acknowledged (or a timeout passed)"


@dataclass(frozen=True)
class Transition:
    state: ClusterState
    actions: tuple[Action, ...] = ()


@dataclass(frozen=True)
class Refusal:
    reason: str


_R, _P, _S, _X = ClusterState.RUNNING, ClusterState.PAUSED, ClusterState.SUSPENDED, ClusterState.STOPPED
_STOP = Transition(_X, (Action.FAIL_PENDING, Action.TELL_WORKERS, Action.EXIT))

# keyed by str: Command members are strs, and transition() looks any command string up in it
TABLE: dict[tuple[ClusterState, str], Transition | Refusal] = {
    (_R, Command.PAUSE): Transition(_P, (Action.TELL_WORKERS,)),
    (_R, Command.UNPAUSE): Transition(_R),
    (_R, Command.SUSPEND): Refusal("cannot suspend a running cluster: pause it first"),
    (_R, Command.RESUME): Transition(_R),
    (_R, Command.STOP): _STOP,
    (_P, Command.PAUSE): Transition(_P),
    (_P, Command.UNPAUSE): Transition(_R, (Action.TELL_WORKERS, Action.RELEASE_HELD)),
    (_P, Command.SUSPEND): Transition(_S, (Action.TELL_WORKERS,)),
    (_P, Command.RESUME): Transition(_P),
    (_P, Command.STOP): _STOP,
    (_S, Command.PAUSE): Transition(_S),
    (_S, Command.UNPAUSE): Refusal("cannot unpause a suspended cluster: resume it first"),
    (_S, Command.SUSPEND): Transition(_S),
    (_S, Command.RESUME): Transition(_P, (Action.TELL_WORKERS,)),
    (_S, Command.STOP): _STOP,
}


def transition(state: ClusterState, command: Command | str) -> Transition | Refusal:
    """What `command` does in `state`. Unknown commands and anything after STOP are refusals."""
    if state is ClusterState.STOPPED:
        return Refusal(f"the cluster is stopped; {command!r} is not possible")
    return TABLE.get((state, command), Refusal(f"unknown lifecycle command {command!r}"))


def commands_to_reach(state: ClusterState) -> tuple[Command, ...]:
    """The commands that take a worker in any state to `state`: sent to every worker that registers (one may
    join late, or come from a coordinator that died while the cluster was paused; a worker obeys the last
    command it got, so "unpause" is harmless to one already running)."""
    return {_R: (Command.UNPAUSE,), _P: (Command.PAUSE,), _S: (Command.PAUSE, Command.SUSPEND), _X: (Command.STOP,)}[
        state
    ]
