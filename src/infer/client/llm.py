"""LLM (blocking) and AsyncLLM (asyncio): the high-level Python API, vLLM's names.

Two modes, chosen by the options both classes share (LLMOptions):
- direct (the default): one engine in this process, stepped by an engine thread of its own behind a LocalEngine
  (client/local_engine.py). `LLM` is a blocking shell over `AsyncLLM`: its calls run AsyncLLM's on one event
  loop on a thread of its own.
- coordinator (`use_coordinator=True`, `data_parallel_size=N`): a local coordinator and N workers are
  started as child processes (LocalCluster) and spoken to through an InferenceClient; or, with
  `coordinator_address=...`, an existing cluster is joined (and never stopped by us).

Both modes give the same greedy outputs. Lifecycle commands (pause / unpause / suspend / resume) exist only in
coordinator mode; in direct mode they raise RuntimeError saying so. `close()` (or leaving `with` /
`async with`) stops every process this object started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import msgspec

from infer.client.chat_encoding import ChatEncoder
from infer.client.engine_client import EngineClient
from infer.protocol.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from infer.protocol.keys import CurveKeys
from infer.protocol.logs import LOG_LEVELS, logging_argv
from infer.protocol.lora import LoRARequest
from infer.protocol.messages import ClusterStats
from infer.protocol.options import to_argv
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams, check_priority
from infer.worker.engine.config import EngineConfig
from infer.worker.service.options import WorkerFlags

if TYPE_CHECKING:
    from infer.client.inference_client import InferenceClient
    from infer.client.serve import LocalCluster
    from infer.client.spmd import InProcessWorker, SpmdWorld
    from infer.worker.engine.engine import Engine

Prompt = (
    str | list[int] | dict[str, Any]
)  # a dict: vLLM's multimodal or encoder-decoder form (client/multimodal.py, prompt_forms.py)
T = TypeVar("T")
log = logging.getLogger("infer.llm")

SHUTDOWN_TIMEOUT_S = 30.0  # children get this long to exit after SIGTERM, then SIGKILL
SPMD_WAIT_S = 7 * 86400.0  # close() on an SPMD rank > 0 waits this long for rank 0 to stop the cluster
LOOP_STOP_TIMEOUT_S = 5.0  # LLM's event-loop thread joins within this after close()


def global_rank() -> int:
    """This process's global rank in a multi-process program: $RANK (torchrun), else $SLURM_PROCID (srun),
    else 0 (a single process). ValueError if the variable is set but not a non-negative integer."""
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer rank")
            return int(value)
    return 0


@dataclass(frozen=True)
class LLMOptions:
    """The options LLM and AsyncLLM share, validated on construction (ValueError names the culprit).

    model: safetensors dir or .gguf file; None = the embedded SmolLM2-135M-Instruct. When joining a cluster it
        only picks the tokenizer (get_tokenizer / chat); it should be the model the cluster serves.
    use_coordinator: run a local coordinator and `data_parallel_size` workers as child processes.
    data_parallel_size: number of workers (DP ranks); > 1 needs coordinator mode. When joining, the number of
        healthy workers to wait for.
    coordinator_address: tcp://host:port of a running coordinator to join (implies coordinator mode).
    ready_timeout: seconds to wait for the engine / the workers to be ready.
    log_level: log level of the child processes (coordinator mode).
    engine_options: EngineConfig's fields (vLLM's names). Direct mode builds the engine from them; coordinator
        mode passes them to every worker as flags. Unknown names raise ValueError in both modes; joining an
        existing cluster takes none (its workers are already configured).
    curve_key, coordinator_key: joining a cluster whose coordinator has CurveZMQ keys: this client's secret
        key file and the coordinator's public key file (both or neither; see infer.protocol.keys). A client
        key generates; pause / unpause / suspend / resume need an administrator key (the coordinator's admins/).
    in_memory_model, tokenizer: `model=<an object>` (a transformers PreTrainedModel or one of infer's model
        objects) with its tokenizer: the engine is built around weights already in memory (worker/loading/in_memory.py).
        In coordinator mode such an engine runs in this process (SPMD ranks, client/spmd.py).
    tensor_parallel_size: processes per engine (vLLM's name): each holds a 1/T shard of every layer
        (worker/distributed/tensor_parallel.py). Direct mode: this process is TP rank 0 and starts the other T - 1 as
        child processes; coordinator mode: every worker is started with --tp-size T.
    pipeline_parallel_size: processes per engine (vLLM's name), each holding a contiguous range of the layers
        (worker/parallel/pp_group.py; one batch at a time through the stages: capacity, not speed). Direct mode: this
        process is stage 0 and starts the other P - 1 as child processes; coordinator mode: every worker is
        started with --pp-size P. Not with tensor_parallel_size > 1 yet.
    """

    model: str | None = None
    use_coordinator: bool = False
    data_parallel_size: int = 1
    coordinator_address: str | None = None
    ready_timeout: float = 300.0
    log_level: str = "WARNING"
    engine_options: dict[str, Any] = field(default_factory=dict)
    curve_key: str | None = None
    coordinator_key: str | None = None
    in_memory_model: Any = field(default=None, compare=False, repr=False)
    tokenizer: Any = field(default=None, compare=False, repr=False)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        if pp > 1 and (self.in_memory_model is not None or self.coordinator_address is not None):
            raise ValueError(
                f"pipeline_parallel_size={pp} needs a model path and workers started here: an "
                f"in-memory model cannot be split across processes, a joined cluster is already "
                f"configured"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1 and (self.in_memory_model is not None or self.coordinator_address is not None):
            raise ValueError(
                f"tensor_parallel_size={tp} needs a model path and workers started here: an in-memory "
                f"model cannot be sharded across processes, a joined cluster is already configured"
            )
        if (self.tokenizer is None) != (self.in_memory_model is None):
            raise ValueError(
                "an in-memory model (model=<a transformers PreTrainedModel or infer model object>) "
                "needs tokenizer=<its tokenizer>, and tokenizer= goes only with one"
            )
        if self.in_memory_model is not None and self.joins_cluster:
            raise ValueError(
                "an in-memory model cannot join an existing cluster (coordinator_address=...): its "
                "weights live in this process; use use_coordinator=True (SPMD ranks) or direct mode"
            )
        if not isinstance(self.use_coordinator, bool):
            raise ValueError(f"use_coordinator must be a bool, got {self.use_coordinator!r}")
        if self.model is not None and not Path(self.model).expanduser().exists():
            raise ValueError(
                f"model path {self.model!r} does not exist (expected a .gguf file or a directory with "
                f"config.json and *.safetensors)"
            )
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {dp!r}")
        if dp > 1 and not self.coordinator_mode:
            raise ValueError(
                f"data_parallel_size={dp} needs coordinator mode (use_coordinator=True): direct mode "
                f"runs one engine in this process"
            )
        if self.coordinator_address is not None and (
            not isinstance(self.coordinator_address, str) or "://" not in self.coordinator_address
        ):
            raise ValueError(f"coordinator_address must look like tcp://host:port, got {self.coordinator_address!r}")
        if not isinstance(self.ready_timeout, (int, float)) or self.ready_timeout <= 0:
            raise ValueError(f"ready_timeout must be > 0 seconds, got {self.ready_timeout!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        self.engine_config()  # unknown names and bad values raise here, in both modes
        if (self.curve_key is not None or self.coordinator_key is not None) and not self.joins_cluster:
            raise ValueError(
                "curve_key / coordinator_key are for joining a cluster with "
                "coordinator_address=...; a cluster started here listens on loopback only"
            )
        self.client_options()  # unusable key files raise here
        if self.joins_cluster and self.engine_options:
            raise ValueError(
                f"engine option(s) {', '.join(sorted(self.engine_options))} cannot apply when joining "
                f"the cluster at {self.coordinator_address}: its workers are already configured"
            )

    @property
    def coordinator_mode(self) -> bool:
        return self.use_coordinator or self.coordinator_address is not None

    @property
    def joins_cluster(self) -> bool:
        return self.coordinator_address is not None

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_options(model=self.model, **self.engine_options)

    def client_options(self) -> dict[str, Any]:
        """InferenceClient's key options; CurveKeys.from_files validates them (ValueError)."""
        CurveKeys.from_files(self.curve_key, self.coordinator_key)
        return {"curve_key": self.curve_key, "coordinator_key": self.coordinator_key}

    def worker_args(self) -> list[str]:
        """The infer-worker flags for the engine options (model included), the TP size, and the log level."""
        return (
            self.engine_flags()
            + to_argv(WorkerFlags, {"tp_size": self.tensor_parallel_size, "pp_size": self.pipeline_parallel_size})
            + logging_argv(self.log_level)
        )

    def engine_flags(self) -> list[str]:
        """The infer-worker flags for the engine options (model included)."""
        return to_argv(EngineConfig, dict(self.engine_options, model=self.model))


@dataclass(frozen=True)
class EngineContext:
    """An engine's memory primitives (expert use): the paged KV pool and its block manager."""

    kv_cache: Any
    block_manager: Any


@dataclass(frozen=True)
class EngineController:
    """An engine's token primitives (expert use): its tokenizer and its sampler."""

    tokenizer: Any
    sampler: Any


def _transformers_tokenizer(engine: Engine) -> Any:
    """`engine`'s tokenizer as a transformers tokenizer (a RustTokenizer's is loaded on first use)."""
    from infer.worker.loading.tokenizer import transformers_tokenizer

    return transformers_tokenizer(engine.tokenizer)


def _model_path(model: str | os.PathLike[str] | None) -> str | None:
    return None if model is None else os.fspath(model)


def _default_sampling_params(setting: str, options: LLMOptions) -> SamplingParams:
    """LLM's defaults for `generation_config` (client/api/model_defaults.py reads the file, as --generation-config
    does); ValueError naming the file and field. "auto" looks beside the model (none for a model in memory)."""
    from infer.client.api.model_defaults import generation_defaults

    model_dir = None
    if setting == "auto" and options.in_memory_model is None:
        from infer.worker.loading.model_files import resolve_model

        try:
            model_dir = resolve_model(options.model)
        except (OSError, ValueError):  # the engine (or cluster) names what is wrong with the model
            model_dir = None
    try:
        return SamplingParams(**generation_defaults(setting, model_dir))
    except ValueError as e:
        raise ValueError(str(e).replace("--generation-config", "generation_config", 1)) from None


def _model_options(model: object, tokenizer: Any) -> dict[str, Any]:
    """LLMOptions' model fields for what `model=` was given: a path (or None), or an in-memory model object."""
    if model is None or isinstance(model, (str, os.PathLike)):
        return {"model": _model_path(model), "tokenizer": tokenizer}
    return {"model": None, "in_memory_model": model, "tokenizer": tokenizer}


class AsyncLLM:
    """The asyncio API. Build, then `await llm.start()` (or `async with AsyncLLM(...) as llm:`).

        async with AsyncLLM(model, use_coordinator=True, data_parallel_size=2) as llm:
            async for delta in llm.generate("Hello", SamplingParams(max_tokens=32)):
                print(delta.text, end="")

    The constructor only validates (LLMOptions); start() loads the engine (direct mode, on a worker thread) or
    starts / joins the cluster. In coordinator mode the object belongs to the event loop that started it; in
    direct mode any event loop may use it.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any = None,
        *,
        use_coordinator: bool = False,
        data_parallel_size: int = 1,
        coordinator_address: str | None = None,
        ready_timeout: float = 300.0,
        log_level: str = "WARNING",
        curve_key: str | os.PathLike[str] | None = None,
        coordinator_key: str | os.PathLike[str] | None = None,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **engine_options: Any,
    ) -> None:
        self._init(
            LLMOptions(
                use_coordinator=use_coordinator,
                data_parallel_size=data_parallel_size,
                tensor_parallel_size=tensor_parallel_size,
                pipeline_parallel_size=pipeline_parallel_size,
                coordinator_address=coordinator_address,
                ready_timeout=ready_timeout,
                log_level=log_level,
                engine_options=engine_options,
                curve_key=_model_path(curve_key),
                coordinator_key=_model_path(coordinator_key),
                **_model_options(model, tokenizer),
            )
        )

    @classmethod
    def from_options(cls, options: LLMOptions) -> AsyncLLM:
        llm = cls.__new__(cls)
        llm._init(options)
        return llm

    def _init(self, options: LLMOptions) -> None:
        self.options = options
        self._engine: EngineClient | None = None
        self._cluster: LocalCluster | None = None
        self._reaper: weakref.finalize | None = None  # kills our children if we are dropped without close()
        self._tokenizer: Any = None
        self._closed = False
        self._local: InProcessWorker | None = None  # SPMD: this rank's engine on a worker thread
        self._world: SpmdWorld | None = None
        self._loras: dict[str, str] = {}  # adapters loaded through this object: name -> folder

    # ---- startup and shutdown -------------------------------------------------------------------

    async def start(self) -> AsyncLLM:
        """Load the engine or start / join the cluster (idempotent). Raises what the engine raises (ValueError
        for bad options) or ClusterError when the cluster is not ready within `ready_timeout`."""
        if self._closed:
            raise RuntimeError("this AsyncLLM is closed")
        if self._engine is None and self._local is None:
            if not self.options.coordinator_mode:
                self._engine = await _start_local_engine(self.options)
            elif self.options.coordinator_address is not None:  # joins_cluster
                self._engine = await _join_cluster(self.options.coordinator_address, self.options)
            elif (world := self._spmd()) is not None:
                self._engine = await self._start_spmd(world)
            else:
                self._engine = await self._start_cluster()
        return self

    def _spmd(self) -> SpmdWorld | None:
        """SPMD ranks (client/spmd.py): a multi-process program, or an in-memory model (a world of one); their
        world, None when this is neither."""
        from infer.client.spmd import SpmdWorld

        world = self._world = SpmdWorld.from_env()
        if world.world_size == 1 and self.options.in_memory_model is None:
            return None
        if self.options.data_parallel_size not in (1, world.world_size):
            raise ValueError(
                f"data_parallel_size={self.options.data_parallel_size} does not match the "
                f"{world.world_size} SPMD ranks: each rank hosts one engine"
            )
        return world

    async def _start_spmd(self, world: SpmdWorld) -> InferenceClient | None:
        """Rank 0: the coordinator; every rank: its engine behind an in-process worker; rank 0: the client."""
        from infer.client.serve import LocalCluster
        from infer.client.spmd import InProcessWorker

        try:
            if world.rank == 0:
                if not world.is_loopback:
                    log.warning(
                        "SPMD: the coordinator listens on %s without keys: the ranks' network is trusted, "
                        "as their torch.distributed traffic is",
                        world.address,
                    )
                self._cluster = LocalCluster(
                    num_workers=0,
                    host=world.host,
                    port=world.port,
                    trusted_network=not world.is_loopback,
                    coordinator_args=logging_argv(self.options.log_level),
                )
                await self._cluster.start()
                world = self._world = dataclasses.replace(world, port=self._cluster.port)  # port 0: the OS's
                self._reaper = weakref.finalize(self, _kill_process_groups, [p.pid for p in self._cluster.processes])
            engine = await asyncio.wait_for(asyncio.to_thread(_make_engine, self.options), self.options.ready_timeout)
            self._local = InProcessWorker(engine, world.address, world.rank, self.options.ready_timeout)
            if world.rank != 0:
                return None
            options = dataclasses.replace(self.options, data_parallel_size=world.world_size)
            return await _join_cluster(world.address, options)
        except BaseException:
            await self._stop_cluster()
            await self._stop_local(graceful=False)
            raise

    async def _start_cluster(self) -> InferenceClient:
        from infer.client.serve import LocalCluster

        cluster = LocalCluster(
            num_workers=self.options.data_parallel_size,
            worker_args=self.options.worker_args(),
            coordinator_args=logging_argv(self.options.log_level),
        )
        self._cluster = cluster
        try:
            await cluster.start()
            self._reaper = weakref.finalize(self, _kill_process_groups, [p.pid for p in cluster.processes])
            await cluster.wait_ready(self.options.ready_timeout)
            return await _join_cluster(cluster.address, self.options)
        except BaseException:
            await self._stop_cluster()
            raise

    async def close(self) -> None:
        """Abort what is in flight and stop every process started here (coordinator and workers: SIGTERM,
        then SIGKILL after SHUTDOWN_TIMEOUT_S). A joined cluster keeps running. Idempotent."""
        self._closed = True
        engine, self._engine = self._engine, None
        try:
            if engine is not None:
                await engine.close()
        finally:
            await self._stop_cluster()  # SPMD rank 0: the coordinator's STOP ends every rank's worker
            await self._stop_local(graceful=True)

    async def _stop_local(self, graceful: bool) -> None:
        """End this SPMD rank's worker: on rank 0 (whose coordinator is gone) and after a failed start at once,
        elsewhere when rank 0 stops the cluster (bounded by SPMD_WAIT_S, or the coordinator's silence)."""
        local, self._local = self._local, None
        if local is None:
            return
        if graceful and self._world is not None and self._world.rank != 0:
            if await asyncio.to_thread(local.wait, SPMD_WAIT_S):
                return
        local.stop()
        if not await asyncio.to_thread(local.wait, SHUTDOWN_TIMEOUT_S):
            log.warning("the in-process worker did not end within %s s; leaving its thread", SHUTDOWN_TIMEOUT_S)

    async def _stop_cluster(self) -> None:
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            await cluster.shutdown(SHUTDOWN_TIMEOUT_S)
        if self._reaper is not None:
            self._reaper.detach()

    async def __aenter__(self) -> AsyncLLM:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- properties -----------------------------------------------------------------------------

    @property
    def engine(self) -> EngineClient:
        """The EngineClient behind this object: a LocalEngine (direct) or an InferenceClient (coordinator)."""
        if self._engine is None and self._local is not None and self._world is not None:
            raise RuntimeError(
                f"this is rank {self._world.rank} of {self._world.world_size} SPMD ranks: it serves "
                f"with its engine, and prompts go in on rank 0 only (check llm.is_primary_rank)"
            )
        if self._engine is None:
            raise RuntimeError(
                "this AsyncLLM is closed"
                if self._closed
                else "this AsyncLLM is not started: `await llm.start()` or use `async with AsyncLLM(...)`"
            )
        return self._engine

    @property
    def coordinator_address(self) -> str | None:
        """tcp://host:port of the coordinator (started or joined); None in direct mode."""
        if self._cluster is not None:
            return self._cluster.address
        return self.options.coordinator_address

    @property
    def child_pids(self) -> list[int]:
        """Process ids of the coordinator and workers this object started (empty otherwise)."""
        return [] if self._cluster is None else [p.pid for p in self._cluster.processes]

    @property
    def is_primary_rank(self) -> bool:
        """Whether this process feeds prompts and reads outputs: always in direct mode; with a coordinator, only
        in the process whose global rank (global_rank(): $RANK, else $SLURM_PROCID, else 0) is 0."""
        return not self.options.coordinator_mode or global_rank() == 0

    @property
    def local_engine(self) -> Engine | None:
        """The engine in this process: direct mode's (its LocalEngine's thread steps it) or this SPMD rank's (its
        worker thread steps it); None otherwise. For reading between calls, not for driving."""
        if self._local is not None:
            return self._local.engine
        from infer.client.local_engine import LocalEngine

        return self._engine.engine if isinstance(self._engine, LocalEngine) else None

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (a copy of its own in direct mode, so the engine thread's is never shared).
        Loads it on first use (blocking)."""
        if self._tokenizer is None and self.options.tokenizer is not None:
            self._tokenizer = self.options.tokenizer
        if self._tokenizer is None:
            from infer.worker.loading.model_files import load_tokenizer, resolve_model

            self._tokenizer = load_tokenizer(resolve_model(self._tokenizer_model()))
        return self._tokenizer

    def _tokenizer_model(self) -> str | None:
        if self.options.model is not None or not self.options.joins_cluster:
            return self.options.model
        served = self.engine.model_id  # a joined cluster serves this; a path when it was started with one
        return served if served is not None and Path(served).exists() else None

    # ---- generation -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        timeout: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Deltas of one request (token_ids / text new since the previous one); the last has `finished` and
        `finish_reason`. A rejected prompt is one delta with finish_reason "error" and error_code
        "invalid_request". Leaving the loop early (break, aclose) aborts the request. With `timeout`
        (seconds), a request not finished by then is aborted (its KV blocks freed) and ends with error_code
        "timeout". `priority`: lower is served first (vLLM's convention; scheduling_policy "priority").
        With `sampling_params.n` > 1 the n samples run as n requests, `<request_id>-<i>` for sample i, and their
        deltas come interleaved (each sample's in order); it ends once every sample has finished. `lora_request`:
        the adapter it runs with (loaded on first use; see LLM.generate)."""
        if lora_request is not None:
            await self._ensure_loras([lora_request])
            sampling_params = _with_loras([sampling_params or SamplingParams()], [lora_request])[0]
        samples = (sampling_params or SamplingParams()).samples()
        if len(samples) == 1:
            streams = [
                self.engine.stream(prompt, sampling_params, request_id=request_id, timeout=timeout, priority=priority)
            ]
        else:
            base = request_id or f"gen-{uuid.uuid4().hex}"
            streams = [
                self.engine.stream(prompt, sp, request_id=f"{base}-{i}", timeout=timeout, priority=priority)
                for i, sp in enumerate(samples)
            ]
        async with aclosing(_merged(streams)) as deltas:
            async for delta in deltas:
                yield delta

    async def generate_batch(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        timeout: float | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Every prompt concurrently (one params for all, or one per prompt); Completions in prompt order.
        The same contract as LLM.generate (`n` > 1, `lora_request`: see there); `use_tqdm` shows a progress bar for
        lists; `timeout` applies to each request (see generate)."""
        prompts = _as_prompt_list(prompts)
        loras = _as_lora_list(lora_request, len(prompts))
        await self._ensure_loras(loras)
        params = _with_loras(_as_params_list(sampling_params, len(prompts)), loras)
        priorities = _as_priority_list(priority, len(prompts))
        flat = _Samples(prompts, params, priorities)
        return flat.results(await self._generate_flat(flat.prompts, flat.params, flat.priorities, use_tqdm, timeout))

    async def _generate_flat(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
        timeout: float | None,
    ) -> list[Completion]:
        engine = self.engine
        bar = _progress(len(prompts), use_tqdm)

        async def one(prompt: Prompt, sp: SamplingParams, pr: int) -> Completion:
            completion = await engine.generate(prompt, sp, timeout=timeout, priority=pr)
            bar.update(1)
            return completion

        try:
            return await _gather_all([one(p, sp, pr) for p, sp, pr in zip(prompts, params, priorities)])
        finally:
            bar.close()

    async def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, timeout: float | None = None
    ) -> list[BeamSearchOutput]:
        """As LLM.beam_search (nothing streams: a beam search's beams are final only at its end)."""
        completions = await self.generate_batch(_beam_prompts(prompts), params.to_sampling_params(), timeout=timeout)
        return [beam_search_output(c) for c in completions]

    async def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
        *,
        timeout: float | None = None,
    ) -> list[Completion]:
        """As LLM.embed: one Completion per prompt with its `embedding`."""
        params = SamplingParams(pooling=pooling, normalize=normalize, temperature=0, max_tokens=1)
        return await self.generate_batch(prompts, params, timeout=timeout)

    # ---- LoRA adapters ----------------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> dict[str, str]:
        """Load `lora_request`'s adapter (on every worker in coordinator mode); the same name and folder again is a
        no-op. Returns the adapters served (name -> folder). ValueError / ClusterError naming what is wrong."""
        adapters = await self.engine.add_lora(lora_request)
        self._loras = dict(adapters)
        return adapters

    async def remove_lora(self, lora_name: str) -> dict[str, str]:
        """Unload an adapter (requests holding it finish with it); returns the adapters served."""
        adapters = await self.engine.remove_lora(lora_name)
        self._loras = dict(adapters)
        return adapters

    async def list_loras(self) -> dict[str, str]:
        return await self.engine.list_loras()

    async def _ensure_loras(self, loras: list[LoRARequest | None]) -> None:
        """Load the adapters of a generate call that are not loaded from the same folder yet (vLLM loads a
        LoRARequest on first use)."""

        def missing() -> list[LoRARequest]:
            wanted = {r.lora_name: r for r in loras if r is not None}.values()
            return [
                r
                for r in wanted
                if r.lora_name not in self._loras
                or os.path.abspath(self._loras[r.lora_name]) != os.path.abspath(r.lora_path)
            ]

        if missing():  # perhaps loaded already (--lora-modules, another client): no load, no admin key needed
            self._loras = dict(await self.engine.list_loras())
        for request in missing():
            await self.add_lora(request)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort"."""
        await self.engine.abort(request_id)

    # ---- cluster control ------------------------------------------------------------------------

    async def stats(self) -> ClusterStats:
        """Live state of the engine(s): direct mode reports one worker (answered by the engine thread)."""
        return await self.engine.stats()

    async def pause(self) -> str:
        """Coordinator mode: hold new requests (workers stop stepping); returns "paused". RuntimeError in
        direct mode."""
        return await self.engine.pause()

    async def unpause(self) -> str:
        """Coordinator mode: release what was held; returns "running". RuntimeError in direct mode."""
        return await self.engine.unpause()

    async def suspend(self) -> str:
        """Coordinator mode, from paused: workers may release memory; returns "suspended". RuntimeError in
        direct mode."""
        return await self.engine.suspend()

    async def resume(self) -> str:
        """Coordinator mode, from suspended back to "paused". RuntimeError in direct mode."""
        return await self.engine.resume()

    async def update_weights(self, source: Any, *, on_running: str = "drain", timeout: float = 600.0) -> int:
        """Load new weights (a safetensors directory, or (checkpoint name, tensor) pairs: in coordinator mode
        broadcast to every worker over torch.distributed) and return the new weight version once every engine
        serves it. `on_running`: "drain" (requests in flight finish on the old weights; new ones wait) or
        "abort". A tensor with a wrong name, shape or dtype fails it all; the old weights keep serving."""
        return await self.engine.update_weights(source, on_running=on_running, timeout=timeout)

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 8000,
        api_key: str | None = None,
        served_model_name: str | None = None,
        on_ready: Callable[[str], None] | None = None,
    ) -> None:
        """Run the OpenAI-compatible HTTP front (infer.client.api) on this engine, either mode, until cancelled.
        `port=0` picks a free port; `on_ready(url)` is called once it listens."""
        from infer.client.api.server import serve_http

        engine = self.engine
        tokenizer = self._tokenizer or await asyncio.to_thread(self.get_tokenizer)
        await serve_http(
            engine,
            tokenizer=tokenizer,
            host=host,
            port=port,
            served_model_name=served_model_name,
            api_key=api_key,
            on_ready=on_ready,
        )


async def _start_local_engine(options: LLMOptions) -> EngineClient:
    from infer.client.local_engine import LocalEngine

    return await LocalEngine.start(lambda: _make_engine(options), options.ready_timeout)


def _make_engine(options: LLMOptions) -> Engine:
    """This process's engine: from the model path, or around the in-memory model; with tensor parallelism,
    TP rank 0, the other ranks started as child processes."""
    from infer.worker.engine.engine import Engine

    if options.pipeline_parallel_size > 1:
        from infer.worker.parallel.pp_stage import pipeline_parallel_engine

        flags = options.engine_flags() + logging_argv(options.log_level)
        return pipeline_parallel_engine(
            options.engine_config(), options.pipeline_parallel_size, flags, tp_size=options.tensor_parallel_size
        )
    if options.tensor_parallel_size > 1:
        from infer.worker.parallel.tp_group import tensor_parallel_engine

        flags = options.engine_flags() + logging_argv(options.log_level)
        return tensor_parallel_engine(options.engine_config(), options.tensor_parallel_size, flags)
    return Engine(options.engine_config(), model=options.in_memory_model, tokenizer=options.tokenizer)


async def _join_cluster(address: str, options: LLMOptions) -> InferenceClient:
    """A connected InferenceClient once `data_parallel_size` workers are healthy (ClusterError otherwise)."""
    from infer.client.inference_client import InferenceClient

    client = InferenceClient(address, connect_timeout=options.ready_timeout, **options.client_options())
    await client.connect()
    try:
        await client.wait_for_workers(options.data_parallel_size, options.ready_timeout)
    except BaseException:
        await client.close()
        raise
    return client


async def _gather_all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run all; results in order. If one raises (or the caller is cancelled) the others are cancelled."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _kill_process_groups(pids: list[int]) -> None:
    """Last resort (garbage collection or interpreter exit without close()): SIGKILL our children's groups."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class _LoopThread:
    """An asyncio event loop on a daemon thread; run() blocks the caller until a coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="infer-llm-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """The coroutine's result; if the caller is interrupted (Ctrl-C), the coroutine is cancelled."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(LOOP_STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()


class LLM:
    """`LLM(model=None, **options).generate(prompts, sampling_params)` -> one Completion per prompt.

    Options are LLMOptions (use_coordinator, data_parallel_size, coordinator_address, ready_timeout, log_level)
    and engine options, EngineConfig's fields (vLLM's names: dtype, max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, kv_cache_memory, enable_prefix_caching, enable_chunked_prefill, seed,
    num_threads, ...); an unknown name raises ValueError naming it.

    A blocking shell over AsyncLLM: every call runs the AsyncLLM's coroutine on one event loop on a thread of this
    object's, and blocks until it is done (Ctrl-C cancels it: the requests it started are aborted). In direct mode
    the engine is stepped by its own thread behind a LocalEngine (client/local_engine.py), as AsyncLLM's; `engine`
    gives it for expert reading. With SPMD ranks (client/spmd.py) `engine` is this rank's engine, served by its
    worker thread. Use `with LLM(...) as llm:` or call close() (on every rank).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any = None,
        *,
        use_coordinator: bool = False,
        data_parallel_size: int = 1,
        coordinator_address: str | None = None,
        ready_timeout: float = 300.0,
        log_level: str = "WARNING",
        curve_key: str | os.PathLike[str] | None = None,
        coordinator_key: str | os.PathLike[str] | None = None,
        tokenizer: Any = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        generation_config: str = "auto",
        **engine_options: Any,
    ) -> None:
        self.options = LLMOptions(
            use_coordinator=use_coordinator,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            coordinator_address=coordinator_address,
            ready_timeout=ready_timeout,
            log_level=log_level,
            engine_options=engine_options,
            curve_key=_model_path(curve_key),
            coordinator_key=_model_path(coordinator_key),
            **_model_options(model, tokenizer),
        )
        self._default_params = _default_sampling_params(generation_config, self.options)
        self._chat_encoder: ChatEncoder | None = None  # made at the first chat
        self._loop: _LoopThread | None = _LoopThread()
        self._async: AsyncLLM | None = AsyncLLM.from_options(self.options)
        try:
            self._loop.run(self._async.start())
        except BaseException:
            self._loop.stop()
            self._loop = self._async = None
            raise

    # ---- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the engine; in coordinator mode stop every process started here (a joined cluster keeps
        running). Idempotent."""
        llm, loop, self._async, self._loop = self._async, self._loop, None, None
        if loop is None:
            return
        try:
            if llm is not None:  # set with the loop
                loop.run(llm.close())
        finally:
            loop.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def coordinator_address(self) -> str | None:
        """tcp://host:port of the coordinator (started or joined); None in direct mode."""
        return None if self._async is None else self._async.coordinator_address

    @property
    def child_pids(self) -> list[int]:
        """Process ids of the coordinator and workers this LLM started (empty otherwise)."""
        return [] if self._async is None else self._async.child_pids

    @property
    def is_primary_rank(self) -> bool:
        """Whether this process feeds prompts and reads outputs: always in direct mode (each rank of a
        multi-process program serves its own prompts); with a coordinator, only in the process whose global rank
        ($RANK, else $SLURM_PROCID, else 0) is 0."""
        return not self.options.coordinator_mode or global_rank() == 0

    @property
    def engine(self) -> Engine | None:
        """This process's Engine, for expert reading: direct mode's, or this SPMD rank's (stepped by its thread:
        read it between calls, do not drive it); None when the engines run in worker processes."""
        return None if self._async is None else self._async.local_engine

    @property
    def context(self) -> EngineContext:
        """The engine's KV cache and block manager (expert use); RuntimeError without an engine here."""
        engine = self._require_engine("context")
        return EngineContext(kv_cache=engine.kv_cache, block_manager=engine.scheduler.block_manager)

    @property
    def controller(self) -> EngineController:
        """The engine's tokenizer and sampler (expert use); RuntimeError without an engine here."""
        engine = self._require_engine("controller")
        return EngineController(tokenizer=_transformers_tokenizer(engine), sampler=engine.sampler)

    def _require_engine(self, what: str) -> Engine:
        engine = self.engine
        if engine is None:
            raise RuntimeError(
                f"{what} needs an engine in this process: direct mode, or SPMD ranks; this LLM's "
                f"engines run in worker processes"
            )
        return engine

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (in direct mode the engine's, or what the engine's Rust tokenizer
        loads of the same directory on first use: worker/loading/tokenizer.py)."""
        engine = self.engine
        if engine is not None and not self.options.coordinator_mode:
            return _transformers_tokenizer(engine)
        return self._require_async().get_tokenizer()

    # ---- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[Completion]:
        """Run every prompt in one continuous batch (direct) or spread over the workers (coordinator);
        results come back in prompt order. `use_tqdm` shows a progress bar for lists. `priority`: one integer
        per prompt, lower first (vLLM's convention; matters under scheduling_policy "priority").

        A prompt the engine rejects (empty, too long, unknown token ids, cannot fit in the KV pool) yields a
        Completion with finish_reason "error", the reason in `error` and error_code "invalid_request"; the
        others still run.

        `SamplingParams.n` > 1 (vLLM's): n samples of that prompt, run as n requests in the same batch, returned
        in one Completion whose `outputs` are the n samples in order (its flat fields are sample 0's; vLLM's
        RequestOutput shape). Seeded, sample i uses seed + i: distinct samples, reproducible as a set.

        `lora_request` (vLLM's): a LoRARequest for every prompt, or one (or None: the base model) per prompt; each
        adapter is loaded on first use (needs enable_lora=True), then runs per request in the same batch as the
        others (worker/engine/lora.py). A LoRARequest that cannot load raises ValueError (ClusterError in coordinator
        mode).
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(self._default_params if sampling_params is None else sampling_params, len(prompts))
        return self._run(
            self._require_async().generate_batch(
                prompts, params, use_tqdm=use_tqdm, priority=priority, lora_request=lora_request
            )
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate runs given no sampling_params: the fields of the model's generation_config.json
        (`generation_config="auto"`, the default; or the file or folder given) over SamplingParams' defaults, or
        those defaults alone (`generation_config="vllm"`). Sampling params given are used as they are."""
        return self._default_params

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's `params.beam_width` beams (worker/engine/beam_search.py: transformers'
        generate(num_beams=k, do_sample=False) rule), best first, one BeamSearchOutput per prompt in order. Each
        prompt is one engine request whose beams share their KV blocks. Prompts are strings, token-id lists, or vLLM's
        TextPrompt / TokensPrompt dicts ({"prompt": ...} / {"prompt_token_ids": [...]}). A prompt the engine rejects
        raises ValueError with its reason (vLLM raises too)."""
        prompts = _beam_prompts(prompts)
        return [beam_search_output(c) for c in self.generate(prompts, params.to_sampling_params(), use_tqdm)]

    def add_lora(self, lora_request: LoRARequest) -> dict[str, str]:
        """Load an adapter now (generate loads a LoRARequest on first use); the same name and folder again is a
        no-op. Returns the adapters served, name -> folder."""
        return self._run(self._require_async().add_lora(lora_request))

    def remove_lora(self, lora_name: str) -> dict[str, str]:
        """Unload an adapter (requests holding it finish with it); ValueError / ClusterError if none has that name."""
        return self._run(self._require_async().remove_lora(lora_name))

    def list_loras(self) -> dict[str, str]:
        """The adapters served, name -> folder."""
        return self._run(self._require_async().list_loras())

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[Completion]:
        """An embedding per prompt (`Completion.embedding`, a list of floats), in prompt order: the hidden states
        that feed the LM head pooled by `pooling` ("last", "mean" or "cls"), L2-normalized when `normalize`
        (worker/engine/pooling.py). Through the same engine (or cluster) as generate; a rejected prompt is a Completion
        with finish_reason "error", as there."""
        params = SamplingParams(pooling=pooling, normalize=normalize, temperature=0, max_tokens=1)
        return self.generate(prompts, params, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        allow_special_tokens_in_content: bool = False,
    ) -> list[Completion]:
        """Apply the model's chat template to one conversation (or a list of them) and generate. Special-token text
        inside a message's content is tokenized as plain text (it cannot forge a turn: client/chat_encoding.py)
        unless `allow_special_tokens_in_content`; ValueError if such content cannot be kept as text."""
        # a first item that is a dict makes `messages` one conversation; else it is a list of them
        if messages and isinstance(messages[0], dict):
            conversations = [cast("list[dict[str, str]]", messages)]
        else:
            conversations = list(cast("Sequence[list[dict[str, str]]]", messages))
        tokenizer = self.get_tokenizer()
        encoder = self._chat_encoder = self._chat_encoder or ChatEncoder(tokenizer)

        def render(conv: list[dict[str, Any]]) -> str:
            return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)

        encoded = [encoder.encode(list(conv), render, allow_special_tokens_in_content) for conv in conversations]
        completions = self.generate([ids for _, ids in encoded], sampling_params, use_tqdm)
        for completion, (text, _) in zip(completions, encoded):
            completion.prompt = text
        return completions

    # ---- cluster control ------------------------------------------------------------------------

    def stats(self) -> ClusterStats:
        """Live state: the cluster's ClusterStats, or in direct mode one worker with the engine's load."""
        return self._run(self._require_async().stats())

    def pause(self) -> str:
        """Coordinator mode: hold new requests; returns "paused". RuntimeError in direct mode."""
        return self._run(self._require_async().pause())

    def unpause(self) -> str:
        """Coordinator mode: release held requests; returns "running". RuntimeError in direct mode."""
        return self._run(self._require_async().unpause())

    def suspend(self) -> str:
        """Coordinator mode, from paused; returns "suspended". RuntimeError in direct mode."""
        return self._run(self._require_async().suspend())

    def resume(self) -> str:
        """Coordinator mode, from suspended back to "paused". RuntimeError in direct mode."""
        return self._run(self._require_async().resume())

    def update_weights(self, source: Any, *, on_running: str = "drain", timeout: float = 600.0) -> int:
        """Load new weights: a safetensors directory, or an iterable of (checkpoint name, tensor) pairs (names
        as in the checkpoint; in coordinator mode they are broadcast to every worker over torch.distributed).
        Returns the new weight version, carried by every later Completion (`weight_version`). All or nothing:
        a wrong name, shape or dtype raises (ValueError in direct mode, ClusterError in coordinator mode) and
        the old weights keep serving. The prefix cache is emptied. `on_running`: "drain" (requests in flight
        finish on the old weights; new ones wait) or "abort" them; from this blocking API nothing is in flight
        unless another thread runs requests on the same LLM."""
        return self._run(self._require_async().update_weights(source, on_running=on_running, timeout=timeout))

    def _require_async(self) -> AsyncLLM:
        if self._async is None:
            raise RuntimeError("this LLM is closed")
        return self._async

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("this LLM is closed")
        return self._loop.run(coro)


def _beam_prompts(prompts: Any) -> list[Prompt]:
    """beam_search's prompts: ours, or vLLM's TextPrompt / TokensPrompt dicts."""

    def one(prompt: Any) -> Any:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"]
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        return prompt

    return _as_prompt_list([one(p) for p in prompts] if isinstance(prompts, (list, tuple)) else one(prompts))


def beam_search_output(completion: Completion) -> BeamSearchOutput:
    """vLLM's shape of a finished beam search; ValueError with the reason when it failed."""
    if completion.beams is None:
        raise ValueError(
            f"beam search of request {completion.request_id} ended with {completion.finish_reason}: "
            f"{completion.error or 'no beams'}"
        )
    prompt = list(completion.prompt_token_ids)
    return BeamSearchOutput(
        [
            BeamSearchSequence(
                prompt + list(b.token_ids),
                b.text,
                b.cumulative_logprob,
                b.score,
                b.finish_reason,
                len(prompt),
                list(b.logprobs or []),
            )
            for b in completion.beams
        ]
    )


class _Samples:
    """Prompts with their params, flattened into one engine request per sample (`SamplingParams.samples()`), and
    the results folded back into one Completion per prompt."""

    def __init__(self, prompts: list[Prompt], params: list[SamplingParams], priorities: list[int]) -> None:
        self.prompts: list[Prompt] = []
        self.params: list[SamplingParams] = []
        self.priorities: list[int] = []
        self.counts: list[int] = []
        for prompt, sp, priority in zip(prompts, params, priorities):
            samples = sp.samples()
            self.prompts += [prompt] * len(samples)
            self.params += samples
            self.priorities += [priority] * len(samples)
            self.counts.append(len(samples))

    def results(self, completions: list[Completion]) -> list[Completion]:
        out, at = [], 0
        for count in self.counts:
            out.append(Completion.of_samples(completions[at : at + count]))
            at += count
        return out


async def _merged(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[RequestOutput, None]:
    """The deltas of several streams as they come; closing this closes them all (aborting what runs)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as deltas:
            async for delta in deltas:
                yield delta
        return
    queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    queue.put_nowait(delta)
        except Exception as e:  # the reader raises it
            queue.put_nowait(e)
        queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):  # a dict: vLLM's {"prompt": ..., "multi_modal_data": ...} (multimodal.py)
        return [cast(Prompt, prompts)]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # a single token-id prompt
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a token-id list, or a list of those; got {type(prompts).__name__}")
    # a list of prompts (an int among them is passed on as it is, for the engine to refuse as that prompt's error)
    return [list(p) if isinstance(p, tuple) else p for p in cast(Sequence[Prompt], prompts)]


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
    return params


def _as_lora_list(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    """vLLM's `lora_request`: one for every prompt, or one (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    requests = list(lora_request)
    if len(requests) != n:
        raise ValueError(f"got {len(requests)} lora_request for {n} prompts; pass one, or one per prompt")
    for r in requests:
        if r is not None and not isinstance(r, LoRARequest):
            raise ValueError(f"lora_request must be LoRARequest or None, got {type(r).__name__}")
    return requests


def _with_loras(params: list[SamplingParams], loras: list[LoRARequest | None]) -> list[SamplingParams]:
    return [p if r is None else msgspec.structs.replace(p, lora_name=r.lora_name) for p, r in zip(params, loras)]


def _as_priority_list(priority: Sequence[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if isinstance(priority, (int, str, bytes)):
        raise ValueError(f"priority must be a list of integers, one per prompt, got {priority!r}")
    priorities = [check_priority(p) for p in priority]
    if len(priorities) != n:
        raise ValueError(f"got {len(priorities)} priorities for {n} prompts; pass one per prompt")
    return priorities


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req", disable=not enabled or total < 2, dynamic_ncols=True)
