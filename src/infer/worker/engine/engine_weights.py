"""An engine's weights over its life: suspend / resume and weight updates (refit).

Owns whether the engine is suspended (what was released and how it comes back: worker/loading/weights.py's
SuspendedWeights), the bytes the current suspend released, and the files the weights in memory can be reloaded
from (none once an update came from tensors in memory). Suspending releases the KV pool and the weights, resuming
restores them (a fresh pool, step graphs made again); an update checks and stages every tensor before it changes
anything, then preempts the running requests, empties the prefix cache (and the disk tier, the image features)
and applies the tensors; the new weight version is the OutputProcessor's, which every later Delta carries.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from infer.protocol.messages import UpdateWeights
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.model_runner import ModelRunner
from infer.worker.engine.output_processor import OutputProcessor
from infer.worker.engine.scheduler import Scheduler
from infer.worker.engine.step_graphs import make_step_graphs
from infer.worker.kv.offload import KvOffload
from infer.worker.loading.weights import SuspendedWeights, WeightUpdate, apply_tensors, check_specs, release_weights

log = logging.getLogger("infer.engine")


class EngineWeights:
    """Suspend / resume and weight updates of one engine (module docstring). It preempts through `scheduler`,
    releases and restores `kv_cache`, remakes `runner`'s step graphs, and sets the weight version on `outputs`.
    `tp_size` / `pp_size`: the engine's tensor-parallel size and pipeline size (None: no pipeline), which refuse
    what the other ranks cannot follow yet; `give_memory_back`: the engine's way to return freed memory."""

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        device: torch.device,
        files: list[list[Path]] | None,
        *,
        max_model_len: int,
        kv_cache: KVCache,
        scheduler: Scheduler,
        runner: ModelRunner,
        offload: KvOffload | None,
        outputs: OutputProcessor,
        tp_size: int,
        pp_size: int | None,
        give_memory_back: Callable[[], None],
    ) -> None:
        self.config = config
        self.model = model
        self.device = device
        self._files = files  # the weights' files, each update's appended (None: nothing to reload from)
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.runner = runner
        self.offload = offload
        self.outputs = outputs
        self.tp_size = tp_size
        self.pp_size = pp_size
        self.give_memory_back = give_memory_back
        self._suspended: SuspendedWeights | None = None
        self.released_bytes = 0  # what the current suspend released

    @property
    def suspended(self) -> bool:
        return self._suspended is not None

    def suspend(self) -> int:
        """Release the KV pool and the weights (`config.suspend_weights` says how); returns the bytes released.
        Requests stay: running ones are preempted by recompute and continue after resume() with the same
        tokens (greedy, or seeded: the noise is a function of seed and token count). step() raises until
        resume(). Idempotent (0 when already suspended)."""
        if self._suspended is not None:
            return 0
        self._check_not_tensor_parallel("suspend")
        self.scheduler.preempt_all()
        self.scheduler.block_manager.reset_prefix_cache()  # the cached KV goes with the pool
        if self.runner.images is not None:
            self.runner.images.clear()  # the encoder's features go with it
        self.runner.step_graphs = None  # they hold the pool (CUDA graphs: its addresses)
        released = self.kv_cache.release()
        self._suspended = release_weights(self.model, self.config.suspend_weights, self.device, self._files)
        released += self._suspended.bytes_released
        self.released_bytes = released
        self.give_memory_back()
        log.info("suspended: %d bytes released (KV pool and weights: %s)", released, self._suspended.mode)
        return released

    def resume(self) -> int:
        """Restore the weights and a fresh (zeroed) KV pool after suspend(); returns the bytes restored.
        Idempotent (0 when not suspended)."""
        if self._suspended is None:
            return 0
        restored = self._suspended.restore(self.model, self.device) + self.kv_cache.restore()
        self._suspended = None
        self.released_bytes = 0
        self.runner.step_graphs = make_step_graphs(
            self.config, self.model, self.kv_cache, self.max_model_len, self.device
        )
        log.info("resumed: %d bytes restored", restored)
        return restored

    def update_weights(self, source: object, version: int | None = None) -> int:
        """Load new weights: a safetensors directory, an iterable of (checkpoint name, tensor) pairs, or a
        WeightUpdate. All or nothing: every tensor's name, shape and dtype is checked and every value read into
        memory and checked finite first (ValueError naming the first bad one, the old weights untouched); a
        failure while copying them in puts the old values back. A subset of the weights may be given. Returns
        the new weight version (`version`, else the current one + 1), which every later output carries.

        Requests still running are preempted by recompute (they continue on the new weights); callers that
        want them to finish on the old weights first step until `num_running` is 0 (a drain), or abort them.
        The prefix cache is emptied: KV computed by the old weights is never served again."""
        self.check_not_suspended("update_weights()")
        self._check_not_tensor_parallel("a weight update")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be a non-negative integer, got {version!r}")
        update = source if isinstance(source, WeightUpdate) else WeightUpdate.of(source)
        if not update.staged:
            check_specs(self.model, update.specs)  # before reading any value
        update = update.stage()
        update.check_unchanged()
        check_specs(self.model, update.specs)
        self.scheduler.preempt_all()
        if self.offload is not None:
            self.offload.clear()  # before the reset, whose snapshot for the KV events then leaves the disk out
        self.scheduler.block_manager.reset_prefix_cache()
        if self.runner.images is not None:
            self.runner.images.clear()  # features of the old vision weights
        applied = apply_tensors(self.model, update.tensors)
        if self._files is not None and update.files is not None:
            self._files.append(update.files)
        else:
            self._files = None
        if self.runner.step_graphs is not None:  # compiled code may hold the old packed weights
            self.runner.step_graphs = make_step_graphs(
                self.config, self.model, self.kv_cache, self.max_model_len, self.device
            )
        self.outputs.weight_version = self.outputs.weight_version + 1 if version is None else version
        if self.offload is not None:
            self.offload.new_weights(self.outputs.weight_version)
        log.info(
            "weights updated to version %d: %d tensor(s) from %s",
            self.outputs.weight_version,
            applied,
            update.description,
        )
        return self.outputs.weight_version

    def prepare_update(self, msg: UpdateWeights) -> WeightUpdate:
        """The staged WeightUpdate of an UpdateWeights message, nothing changed yet: the safetensors directory
        `msg.path`, or the tensors received now from the trainer's weight-sync group (`msg.sync`, within
        `msg.timeout_s`; received in full even when they turn out not to fit, so the trainer's broadcast
        completes); every spec checked against the model, every value in memory and finite. ValueError naming
        a bad tensor."""
        self._check_not_tensor_parallel("a weight update")
        if msg.sync is not None:
            from infer.worker.distributed.weight_sync import receive_weights

            update = WeightUpdate.from_pairs(receive_weights(msg.sync, self.device, msg.timeout_s))
            update.description = f"the trainer at {msg.sync.init_method}"
        else:
            update = WeightUpdate.of(msg.path)
        check_specs(self.model, update.specs)
        return update.stage()

    def _check_not_tensor_parallel(self, what: str) -> None:
        if self.tp_size > 1:
            raise ValueError(
                f"{what} is not supported with tensor parallelism yet (tensor_parallel_size "
                f"{self.tp_size}): the other ranks of the group hold their own shards"
            )
        if self.pp_size is not None:
            raise ValueError(
                f"{what} is not supported with pipeline parallelism yet (pipeline_parallel_size "
                f"{self.pp_size}): the other stages hold their own layers"
            )

    def check_not_suspended(self, what: str) -> None:
        if self._suspended is not None:
            raise RuntimeError(f"{what} on a suspended engine: its KV pool and weights are released; resume() first")
