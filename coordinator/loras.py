"""LoRA adapters across the cluster (no I/O): an administrator's LoraCommand (load / unload) goes to every healthy
worker and is answered once each did (a WorkerBarrier, barriers.py); the cluster's adapters (name -> folder) are
loaded into a worker that registers later. A job of the Coordinator (core.py): given the books and the send
function, it calls no other job.

Requests name their adapter in SamplingParams.lora_name, which a re-dispatch carries unchanged: a request moved to
another worker runs with the same adapter there (every worker holds the cluster's adapters).
"""

from __future__ import annotations

import logging

from infer.coordinator.barriers import WorkerBarrier
from infer.coordinator.books import Books
from infer.coordinator.outbox import Send
from infer.coordinator.state import ClusterStatus, WorkerRecord
from infer.protocol.logsafe import safe
from infer.protocol.messages import Error, LoraCommand, LoraDone

log = logging.getLogger("infer.coordinator")

LORA_TIMEOUT_S = 120.0  # how long a load / unload waits for every worker's answer


class Loras:
    """The pending LoRA command and the cluster's adapters."""

    def __init__(self, books: Books, send: Send, status: ClusterStatus) -> None:
        self.books = books
        self.send = send
        self.status = status  # its model_id: the name no adapter may take
        self.barrier: WorkerBarrier | None = None
        self.command: LoraCommand | None = None
        self.adapters: dict[str, str] = {}  # loaded through this coordinator: sent to workers that join later

    def on_command(self, identity: bytes, msg: LoraCommand, now: float) -> None:
        client = self.books.client(identity, now)
        if client is None:
            return
        what = f"{msg.action}_lora_adapter {msg.lora_name!r}"
        workers = {w.worker_id for w in self.books.workers if w.healthy}
        refusal = (
            f"{self.barrier.what} is still waiting for the workers"
            if self.barrier is not None
            else "no healthy worker"
            if not workers
            else self._name_refusal(msg)
        )
        if refusal is not None:
            self.send(identity, Error(message=f"{what} refused: {refusal}"))
            return
        self.barrier = WorkerBarrier(what, identity, workers, now + LORA_TIMEOUT_S)
        self.command = msg
        for worker in [w for w in self.books.workers if w.worker_id in workers]:
            self.send(worker.identity, msg)
        log.info("%s: sent to %d worker(s)", safe(what), len(workers))

    def _name_refusal(self, msg: LoraCommand) -> str | None:
        """Why a load may not take its name: the cluster's model id (the base model's name, a front's default
        `model`) is no adapter's (the workers refuse it too)."""
        if msg.action == "load" and msg.lora_name == self.status.model_id:
            return "the name is the base model's (the cluster's model id): give the adapter another"
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
            if command.action == "load" and command.lora_path is not None:
                self.adapters[command.lora_name] = command.lora_path
            else:
                self.adapters.pop(command.lora_name, None)
        if failure is not None:
            log.warning("%s", safe(failure, 2000))
        self.send(
            barrier.client,
            LoraDone(
                action=command.action, lora_name=command.lora_name, error=failure, lora_adapters=self.cluster_adapters()
            ),
        )

    def on_worker_registered(self, worker: WorkerRecord) -> None:
        """Load the cluster's adapters the worker lacks (its answers update its table; failures are logged)."""
        worker.lora_adapters = dict(worker.hello.lora_adapters)
        for name, path in sorted(self.adapters.items()):
            if worker.lora_adapters.get(name) != path:
                self.send(worker.identity, LoraCommand(action="load", lora_name=name, lora_path=path))

    def cluster_adapters(self) -> dict[str, str]:
        """The healthy workers' adapters (name -> folder; a name on several workers: the first's folder)."""
        adapters: dict[str, str] = {}
        for worker in sorted((w for w in self.books.workers if w.healthy), key=lambda w: w.dp_rank):
            for name, path in worker.lora_adapters.items():
                adapters.setdefault(name, path)
        return adapters
