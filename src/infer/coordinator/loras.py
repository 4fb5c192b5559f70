"""LoRA adapters across the cluster (no I/O): an administrator's LoraCommand (load / unload) goes to every healthy
worker of the adapter's base model (`LoraCommand.model`, else the cluster's default model: coordinator/models.py) and
is answered once each did (a WorkerBarrier, barriers.py); the cluster's adapters (name -> folder, and the model
they were loaded on) are loaded into a worker of that model that registers later. A job of the Coordinator
(core.py): given the books and the send function, it calls no other job.

Requests name their adapter in SamplingParams.lora_name, which a re-dispatch carries unchanged: a request moved to
another worker runs with the same adapter there (every worker of its model holds the model's adapters).
"""

from __future__ import annotations

import logging

import msgspec

from infer.coordinator.barriers import WorkerBarrier
from infer.coordinator.books import Books
from infer.coordinator.models import Models, quoted
from infer.coordinator.outbox import Send
from infer.coordinator.state import ClusterStatus, WorkerRecord
from infer.protocol.logsafe import safe
from infer.protocol.messages import Error, LoraCommand, LoraDone

log = logging.getLogger("infer.coordinator")

LORA_TIMEOUT_S = 120.0  # how long a load / unload waits for every worker's answer


class Loras:
    """The pending LoRA command and the cluster's adapters."""

    def __init__(self, books: Books, send: Send, status: ClusterStatus, models: Models) -> None:
        self.books = books
        self.send = send
        self.status = status
        self.models = models  # the models served: names no adapter may take, and an adapter's base
        self.barrier: WorkerBarrier | None = None
        self.command: LoraCommand | None = None
        # loaded through this coordinator: sent to the workers of their base model that join later
        self.adapters: dict[str, str] = {}  # name -> folder
        self.adapter_models: dict[str, str] = {}  # name -> base model

    def on_command(self, identity: bytes, msg: LoraCommand, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        what = f"{msg.action}_lora_adapter {msg.lora_name!r}"
        model, refusal = self._base_model(msg)
        workers = {w.worker_id for w in self.books.workers if w.healthy and model in (None, w.model_id)}
        refusal = refusal or (
            f"{self.barrier.what} is still waiting for the workers"
            if self.barrier is not None
            else "no healthy worker" + ("" if model is None else f" of model {quoted(model)}")
            if not workers
            else self._name_refusal(msg)
        )
        if refusal is not None:
            self.send(identity, Error(message=f"{what} refused: {refusal}"))
            return
        self.barrier = WorkerBarrier(what, identity, workers, now + LORA_TIMEOUT_S)
        self.command = msg if model is None else msgspec.structs.replace(msg, model=model)
        for worker in [w for w in self.books.workers if w.worker_id in workers]:
            self.send(worker.identity, msg)
        log.info("%s: sent to %d worker(s)", safe(what), len(workers))

    def _base_model(self, msg: LoraCommand) -> tuple[str | None, str | None]:
        """The model whose workers carry out `msg` (None: every worker: an unload naming no model), or why none."""
        served = self.models.served()
        if msg.model is not None:
            if msg.model not in served:
                return None, f"the model {quoted(msg.model)} is not served here; {self.models.describe()}"
            return msg.model, None
        if msg.action == "unload":
            return None, None
        if self.models.default is None and len(served) > 1:
            return None, (
                f"the cluster serves several models ({', '.join(map(quoted, served))}) and no default "
                f"(--model-id): name the adapter's base model"
            )
        return self.models.default, None

    def _name_refusal(self, msg: LoraCommand) -> str | None:
        """Why a load may not take its name: a model's id (the name requests give a base model, a front's default
        `model`) is no adapter's (the workers refuse their own model's too)."""
        if msg.action == "load" and (msg.lora_name == self.status.model_id or msg.lora_name in self.models.served()):
            return "the name is the base model's (a served model's id): give the adapter another"
        return None

    def on_done(self, identity: bytes, msg: LoraDone, now: float) -> None:
        worker = self.books.workers.by_identity.get(identity)
        if worker is None:
            self.books.reject(identity, "only workers send lora_done")
            return
        worker.last_seen = now
        worker.lora_adapters = dict(msg.lora_adapters)
        if msg.error is not None and self.barrier is None:
            log.warning(
                "worker %s could not %s LoRA adapter %r: %s",
                safe(worker.worker_id),
                safe(msg.action),
                safe(msg.lora_name),
                safe(msg.error, 1000),
            )
        command = self.command
        if (
            self.barrier is not None
            and command is not None
            and (msg.action, msg.lora_name) == (command.action, command.lora_name)
        ):
            self.barrier.answer(worker.worker_id, msg.error)
            self.check(now)

    def check(self, now: float) -> None:
        """Answer the client once every worker answered (or died, or the deadline passed)."""
        barrier, command = self.barrier, self.command
        if barrier is None or command is None:
            return
        barrier.forget({w.worker_id for w in self.books.workers if w.healthy})
        if not barrier.done() and not barrier.expired(now):
            return
        self.barrier = self.command = None
        failure = barrier.failure()
        if len(barrier.errors) < len(barrier.workers):  # some worker carried it out: the cluster's table follows
            if command.action == "load" and command.lora_path is not None and command.model is not None:
                self.adapters[command.lora_name] = command.lora_path
                self.adapter_models[command.lora_name] = command.model
            else:
                self.adapters.pop(command.lora_name, None)
                self.adapter_models.pop(command.lora_name, None)
        if failure is not None:
            log.warning("%s", safe(failure, 2000))
        self.send(
            barrier.client,
            LoraDone(
                action=command.action, lora_name=command.lora_name, error=failure, lora_adapters=self.cluster_adapters()
            ),
        )

    def on_worker_registered(self, worker: WorkerRecord) -> None:
        """Load its model's adapters the worker lacks (its answers update its table; failures are logged)."""
        worker.lora_adapters = dict(worker.hello.lora_adapters)
        for name, path in sorted(self.adapters.items()):
            if self.adapter_models.get(name) == worker.model_id and worker.lora_adapters.get(name) != path:
                self.send(worker.identity, LoraCommand(action="load", lora_name=name, lora_path=path))

    def cluster_adapters(self) -> dict[str, str]:
        """The healthy workers' adapters (name -> folder; a name on several workers: the first's folder)."""
        adapters: dict[str, str] = {}
        for worker in sorted((w for w in self.books.workers if w.healthy), key=lambda w: w.dp_rank):
            for name, path in worker.lora_adapters.items():
                adapters.setdefault(name, path)
        return adapters
