"""Many models behind one coordinator (no I/O): which models the cluster serves, which one a request names, and
whether a worker of a model may join. Shared by the jobs like the books (it reads the worker table, calls no job).

A model is what a worker's Hello names (`model_id`: its path, or its --served-model-name): two dtypes or
quantizations of one checkpoint are two models when their workers are given two names. Each model's workers are a
world of their own: their DP ranks and EP groups are the model's (rank 0 of one model and rank 0 of another are
two workers), and a request runs only on a worker of its model.

Which model a request runs on (`resolve`):
- `Submit.model` names a served model: that one. It names a LoRA adapter some worker holds: the model of the
  workers that hold it (the adapter's base), with the adapter as the request's `lora_name`.
- It names nothing: the default model, which is --model-id's first entry, else the only model served. A cluster
  of several models without --model-id has no default: the request is refused with the models named, rather
  than sent to whichever model registered first (an order no caller controls).
- Anything else: refused with error code "model_not_found", naming the models (and adapters) served.
A model counts as served from its first worker's registration on, healthy or not (a request for it waits for a
worker like any other, then fails "unavailable" past --queue-timeout); --model-id's models are served from the
start; so are, at a leader that took over (several coordinators), the models of the DP ranks the last leader gave
out, while they are held for their workers: a request arriving before those workers registered again waits for
them instead of being refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer.coordinator.state import WorkerTable
from infer.protocol.codes import ErrorCode
from infer.protocol.messages import Hello

MAX_NAMES_LISTED = 20  # models or adapters an error names (a cluster may serve more)


def quoted(name: str | None) -> str:
    """A model or adapter name for an error text: quoted, escaped, at most 200 characters of it."""
    return repr(name if name is None or len(name) <= 200 else name[:200] + "...")


@dataclass(frozen=True)
class Target:
    """Where a request runs: a model (None: the default model, none known yet) and the LoRA adapter that
    `Submit.model` named (None: the request's own `sampling.lora_name` stands)."""

    model_id: str | None
    lora_name: str | None = None


@dataclass(frozen=True)
class Refusal:
    message: str
    code: ErrorCode


class Models:
    """The models served: every model a registered worker has, and those --model-id pins."""

    def __init__(self, workers: WorkerTable, pinned: tuple[str, ...]) -> None:
        self.workers = workers
        self.pinned = pinned  # --model-id's models, the default first; (): any model may join
        self._served: tuple[frozenset[str], list[str]] = (frozenset(), list(pinned))

    def served(self) -> list[str]:
        """Every model served, in order: --model-id's first, then the others by name (do not change the list)."""
        known = self.workers.model_ids()
        if known is not self._served[0]:
            self._served = (known, [*self.pinned, *sorted(known - set(self.pinned))])
        return self._served[1]

    @property
    def default(self) -> str | None:
        """Where a request that names no model goes: --model-id's first model, else the only model served."""
        if self.pinned:
            return self.pinned[0]
        served = self.served()
        return served[0] if len(served) == 1 else None

    def join_problem(self, hello: Hello) -> str | None:
        """Why a worker of `hello.model_id` may not join (--model-id names others), or None."""
        if not self.pinned or hello.model_id in self.pinned:
            return None
        names = ", ".join(map(quoted, self.pinned))
        return (
            f"model id differs: the cluster serves {names} (from --model-id), worker {hello.peer_id!r} has "
            f"{quoted(hello.model_id)}"
        )

    def resolve(self, model: str | None, lora_name: str | None) -> Target | Refusal:
        """The model a request naming `model` runs on (see the module doc), or why it cannot run."""
        served = self.served()
        if model is None:
            return self._unnamed(served, lora_name)
        if model in served:
            return Target(model)
        bases = self.adapter_bases(model)
        if len(bases) == 1 and lora_name in (None, model):
            return Target(bases[0], lora_name=model)
        if len(bases) > 1:
            return Refusal(
                f"the LoRA adapter {quoted(model)} is loaded on workers of several models "
                f"({self._names(bases)}): name the base model in 'model' and the adapter in 'lora_name'",
                ErrorCode.INVALID_REQUEST,
            )
        if bases:  # an adapter by `model` and another one by `lora_name`
            return Refusal(
                f"'model' names the LoRA adapter {quoted(model)} and 'lora_name' another ({quoted(lora_name)})",
                ErrorCode.INVALID_REQUEST,
            )
        return Refusal(f"the model {quoted(model)} is not served here; {self.describe()}", ErrorCode.MODEL_NOT_FOUND)

    def _unnamed(self, served: list[str], lora_name: str | None) -> Target | Refusal:
        if lora_name is not None:
            bases = self.adapter_bases(lora_name)
            if len(bases) == 1:
                return Target(bases[0])
        default = self.default
        if default is not None or not served:
            return Target(default)  # None: no worker yet; the request waits for the first (as on one model)
        return Refusal(
            f"the request names no model and this cluster serves several ({self._names(served)}) with no default "
            f"(--model-id): name one",
            ErrorCode.INVALID_REQUEST,
        )

    def adapter_bases(self, lora_name: str) -> list[str]:
        """The models whose workers hold the LoRA adapter `lora_name` (healthy or not), by name."""
        return sorted({w.model_id for w in self.workers if lora_name in w.lora_adapters})

    def describe(self) -> str:
        """What the cluster serves, for an error: its models, and its LoRA adapters with their base model."""
        served = self.served()
        if not served:
            return "no model is served yet (no worker has registered)"
        adapters = sorted({(name, w.model_id) for w in self.workers for name in w.lora_adapters})
        text = f"it serves {self._names(served)}"
        if adapters:
            listed = ", ".join(f"{quoted(name)} (on {quoted(base)})" for name, base in adapters[:MAX_NAMES_LISTED])
            more = f" and {len(adapters) - MAX_NAMES_LISTED} more" if len(adapters) > MAX_NAMES_LISTED else ""
            text += f" and the LoRA adapters {listed}{more}"
        return text

    @staticmethod
    def _names(names: list[str]) -> str:
        listed = ", ".join(map(quoted, names[:MAX_NAMES_LISTED]))
        return listed + (f" and {len(names) - MAX_NAMES_LISTED} more" if len(names) > MAX_NAMES_LISTED else "")
