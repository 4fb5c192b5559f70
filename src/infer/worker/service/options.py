"""The worker's own options (the engine's are EngineConfig): what the coordinator is, who this rank is, its
timers and limits (WorkerOptions), and the flags of its EP / TP groups and keys as given (WorkerFlags), which it
resolves into WorkerOptions' `ep`, `tp` and `curve`. Each flag is declared once, on its field: infer-worker's
parser is built from these classes (protocol/options.py), and launchers write a worker's argv with `to_argv`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from infer.protocol.keys import CurveKeys
from infer.protocol.messages import MAX_DP_RANK, MAX_ID_LEN, MAX_MODEL_ID_LEN
from infer.protocol.options import option
from infer.protocol.tracing import require_sdk
from infer.protocol.transport import split_addresses
from infer.worker.distributed.group_sync import EpOptions
from infer.worker.kv.transfer import KvTransferConfig
from infer.worker.parallel.pp_group import PpOptions, parse_partition, resolve_stage
from infer.worker.parallel.tp_group import TpOptions, resolve_ranks

MAX_QUEUE_TIME_S = 86400.0  # the largest --max-queue-time
TP_FLAGS = ("tp_size", "tp_rank", "tp_timeout")
PP_FLAGS = ("pp_size", "pp_rank", "pp_layer_partition", "pp_timeout")
EP_FLAGS = ("ep_size", "ep_rank", "dist_init", "ep_timeout")
KEY_FLAGS = ("curve_key", "coordinator_key")


@dataclass(frozen=True)
class WorkerOptions:
    """The worker's own options (the engine's are EngineConfig). Times are seconds."""

    coordinator: str = option(
        help="the coordinator's address, tcp://HOST:PORT, or every coordinator's of a cluster with several, "
        "comma-separated (tcp://H1:P,tcp://H2:P,tcp://H3:P: the worker registers with the one that leads) "
        "(required, except by TP ranks and pipeline stages > 0: only rank / stage 0 talks to the coordinator)"
    )
    worker_id: str = option(help="this worker's identity (default: hostname-pid)")
    dp_rank: int | None = option(
        None,
        "this worker's DP rank (default: the coordinator assigns the lowest free "
        "one, and keeps it when the worker registers again)",
    )
    group_id: str | None = option(
        None, "the group of this rank (default: an EP group is named after its --dist-init; otherwise dp<rank>)"
    )
    served_model_name: str | None = option(
        None,
        "the model id this worker registers under, the name requests give its model (default: its --model); "
        "tells apart workers of one checkpoint in other dtypes or quantizations behind one coordinator",
    )
    heartbeat_interval: float = option(1.0, "seconds between heartbeats", metavar="S")
    coordinator_timeout: float = option(10.0, "seconds of coordinator silence before registering again", metavar="S")
    drain_timeout: float = option(30.0, "seconds running requests get to finish after SIGTERM", metavar="S")
    connect_timeout: float = option(60.0, "seconds to wait for the first Welcome", metavar="S")
    benchmark_mode: bool = option(
        False,
        "no model: each request yields token (prompt_len + i) %% 1000 per step, "
        "empty text, up to max_tokens (for measuring coordinator overhead)",
    )
    benchmark_step_time: float = option(
        0.0, "with --benchmark-mode: each engine step lasts S seconds (to test long steps)", metavar="S"
    )
    ep: EpOptions | None = option(None, cli=False)  # this rank's EP group (None: a group of one)
    tp: TpOptions | None = option(None, cli=False)  # this DP rank's TP group (None: one process)
    max_waiting_requests: int = option(
        1024,
        "requests that may wait beyond the --max-num-seqs running ones; a request past that is refused as overloaded",
        metavar="N",
    )
    max_queue_time: float = option(
        60.0,
        "a request that has waited S seconds in this worker's queue without "
        "starting fails as overloaded, so its client can retry instead of waiting "
        "without end (0: no bound)",
        metavar="S",
    )
    curve: CurveKeys | None = option(None, cli=False)  # CurveZMQ towards the coordinator (and the EP wake channel)
    stream_port: int = option(
        0,
        "the port of this worker's stream socket, where clients read their requests' deltas directly (0: one the "
        "OS chooses; -1: no stream socket, the coordinator relays every delta)",
        metavar="PORT",
    )
    advertise_host: str | None = option(
        None,
        "the host clients reach the stream socket at (default: 127.0.0.1 when the coordinator is on loopback, "
        "else the address of this machine's interface toward the coordinator)",
        metavar="HOST",
    )
    stream_linger: float = option(
        60.0, "seconds a finished direct stream no client fetched is kept for one (then dropped)", metavar="S"
    )
    kv_transfer_config: KvTransferConfig | None = option(
        None,
        "a KV port: disaggregated prefill and decode, and drains that move requests with their KV; vLLM's keys as "
        'JSON: {"kv_role": "kv_producer" | "kv_consumer" | "kv_both"} (kv_both: prefill and decode here); optional '
        '"kv_port" (this worker\'s KV socket, 0: one the OS chooses), "kv_transfer_timeout" (seconds a transfer may '
        'take, default 10) and "kv_shm_dir" (on one host the blocks go through files there, default /dev/shm; "": '
        "over TCP always). Without it: no KV port, kv_both",
        metavar="JSON",
        parse=KvTransferConfig.of,
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export an OpenTelemetry span of each request's worker hop (queue, prefill, decode, tokens) to this "
        "OTLP endpoint (vLLM's flag; needs pip install 'infer[otel]')",
        metavar="URL",
    )

    def __post_init__(self) -> None:
        _parse_coordinators(self.coordinator)
        if self.served_model_name is not None and not 0 < len(self.served_model_name) <= MAX_MODEL_ID_LEN:
            raise ValueError(f"--served-model-name must be 1..{MAX_MODEL_ID_LEN} characters")
        for name in ("worker_id", "group_id"):
            value = getattr(self, name)
            if value is not None and not 0 < len(value) <= MAX_ID_LEN:
                raise ValueError(f"{name} must be 1..{MAX_ID_LEN} characters, got {value!r}")
        if self.dp_rank is not None and not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ValueError(f"dp_rank must be in [0, {MAX_DP_RANK}], got {self.dp_rank}")
        for name in ("heartbeat_interval", "coordinator_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")
        if not 0 <= self.max_queue_time <= MAX_QUEUE_TIME_S:
            raise ValueError(
                f"max_queue_time must be in [0, {MAX_QUEUE_TIME_S:g}] s (0: no bound), got {self.max_queue_time}"
            )
        if not 0 <= self.benchmark_step_time <= 3600 or (self.benchmark_step_time and not self.benchmark_mode):
            raise ValueError(
                f"--benchmark-step-time must be in [0, 3600] s and needs --benchmark-mode, got "
                f"{self.benchmark_step_time}"
            )
        if self.ep is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no EP group: leave out --ep-size")
        if self.tp is not None and self.benchmark_mode:
            raise ValueError("--benchmark-mode has no model, so no TP group: leave out --tp-size")
        # the rest: worker/service/cli.py (engine flags)
        if self.kv_transfer_config is not None and self.benchmark_mode:
            role = self.kv_transfer_config.kv_role
            raise ValueError(f"--kv-transfer-config: {role} is not supported with --benchmark-mode (no KV)")
        if self.otlp_traces_endpoint is not None:
            require_sdk()
        if not -1 <= self.stream_port <= 65535:
            raise ValueError(f"--stream-port must be in [-1, 65535], got {self.stream_port}")
        if not 0 < self.stream_linger <= MAX_QUEUE_TIME_S:
            raise ValueError(f"--stream-linger must be in (0, {MAX_QUEUE_TIME_S:g}] s, got {self.stream_linger}")
        if self.coordinator_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"coordinator_timeout ({self.coordinator_timeout}) must exceed heartbeat_interval "
                f"({self.heartbeat_interval})"
            )

    @property
    def kv(self) -> KvTransferConfig:
        """--kv-transfer-config, or kv_both without a KV port when it was not given (`kv_port_open` False)."""
        return self.kv_transfer_config or KvTransferConfig()

    @property
    def kv_port_open(self) -> bool:
        """--kv-transfer-config was given: this worker has a KV socket (any role)."""
        return self.kv_transfer_config is not None

    @property
    def coordinators(self) -> tuple[str, ...]:
        """Every coordinator's address, in the order given (one, or several that elect a leader)."""
        return _parse_coordinators(self.coordinator)


def _parse_coordinators(value: str) -> tuple[str, ...]:
    """--coordinator as a tuple of addresses; ValueError naming the entry that is not one."""
    if "," not in value:
        if not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--coordinator must be tcp://HOST:PORT (or ipc://PATH), got {value!r}")
        return (value,)
    return split_addresses(value, what="--coordinator")


@dataclass(frozen=True)
class WorkerFlags:
    """infer-worker's EP / TP group and key flags as given: `groups()` resolves the groups (ranks not given come
    from torchrun's or Slurm's variables) into WorkerOptions' `ep` and `tp`, `curve_keys()` reads the key files
    into its `curve`."""

    tp_size: int = option(
        1, "processes in this DP rank. Without --tp-rank, this command starts and supervises all of them on this node"
    )
    tp_rank: int | None = option(
        None,
        "this process's rank in its TP group (one process per rank, with "
        "--dist-init; default: from $RANK or $SLURM_PROCID, global rank = ep_rank x "
        "tp_size + tp_rank; TP rank 0 talks to the coordinator)",
    )
    tp_timeout: float = option(
        60.0,
        "seconds a TP collective waits for a member, and a follower waits to hear from TP rank 0, before giving up",
        metavar="S",
    )
    pp_size: int = option(
        1,
        "pipeline stages in this DP rank, each a process "
        "holding a contiguous range of the layers. Without --pp-rank, this command starts and "
        "supervises all of them on this node",
    )
    pp_rank: int | None = option(
        None,
        "this process's stage (one process per stage, with --dist-init; default: "
        "from $RANK or $SLURM_PROCID modulo pp-size; stage 0 talks to the "
        "coordinator)",
    )
    pp_layer_partition: str | None = option(
        None,
        "layers per stage, e.g. 10,10,10 (default: an even split, the remainder on the first stages)",
        metavar="N,N,...",
    )
    pp_timeout: float = option(
        60.0,
        "seconds a stage waits for another's hidden states or logits, and for word from stage 0, before giving up",
        metavar="S",
    )
    ep_size: int = option(1, "ranks in this EP group (1: no group)")
    ep_rank: int | None = option(None, "this rank in the group (default: $RANK, else $SLURM_PROCID %% ep-size)")
    dist_init: str | None = option(
        None,
        "the EP / TP group's (or pipeline's) rendezvous, tcp://HOST:PORT, the "
        "same on every member (default: tcp://$MASTER_ADDR:$MASTER_PORT)",
    )
    ep_timeout: float = option(60.0, "seconds a group collective waits for a member before giving up", metavar="S")
    curve_key: str | None = option(
        None,
        "this worker's secret key file (infer-keygen NAME writes NAME.key_secret; "
        "its NAME.key goes into the coordinator's --authorized-keys directory)",
        metavar="FILE",
    )
    coordinator_key: str | None = option(None, "the coordinator's public key file (its NAME.key)", metavar="FILE")

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"--ep-size must be >= 1, got {self.ep_size}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.pp_size < 1:
            raise ValueError(f"--pp-size must be >= 1, got {self.pp_size}")

    def groups(self, environ: dict[str, str] | None = None) -> tuple[EpOptions | None, TpOptions | None]:
        """This process's EP and TP groups (None: a group of one); ValueError for flags that do not fit."""
        environ = dict(os.environ) if environ is None else environ
        tp_rank, ep_rank = resolve_ranks(self.tp_size, self.tp_rank, self.ep_size, self.ep_rank, environ, self.pp_size)
        ep = None
        if self.ep_size > 1:
            ep = EpOptions.resolve(self.ep_size, ep_rank, self.dist_init, self.ep_timeout, environ)
        elif self.ep_rank not in (None, 0) or (self.dist_init is not None and self.tp_size == self.pp_size == 1):
            raise ValueError("--ep-rank and --dist-init need --ep-size > 1 (or --tp-size > 1, or --pp-size > 1)")
        tp = None
        if self.tp_size > 1:
            tp = TpOptions(
                size=self.tp_size, rank=tp_rank, dist_init=self._tp_dist_init(ep, environ), timeout_s=self.tp_timeout
            )
        elif self.tp_rank not in (None, 0):
            raise ValueError("--tp-rank needs --tp-size > 1")
        return ep, tp

    def pipeline(self, environ: dict[str, str] | None = None) -> PpOptions | None:
        """This process's pipeline (None: one stage; with --tp-size each stage is a TP group, with --ep-size the
        pipeline is one DP rank of an EP group); ValueError for flags that do not fit."""
        environ = dict(os.environ) if environ is None else environ
        if self.pp_size == 1:
            if self.pp_rank not in (None, 0) or self.pp_layer_partition is not None:
                raise ValueError("--pp-rank and --pp-layer-partition need --pp-size > 1")
            return None
        partition = None if self.pp_layer_partition is None else parse_partition(self.pp_layer_partition)
        return PpOptions(
            size=self.pp_size,
            rank=resolve_stage(self.pp_size, self.pp_rank, environ, self.tp_size),
            dist_init=self._tp_dist_init(None, environ),
            timeout_s=self.pp_timeout,
            partition=partition,
        )

    def _tp_dist_init(self, ep: EpOptions | None, environ: dict[str, str]) -> str | None:
        """The TP group's rendezvous: --dist-init, the EP group's, $MASTER_ADDR:$MASTER_PORT, or (a supervisor
        with none of these) None: it picks a local port for the processes it starts."""
        if self.dist_init is not None or ep is not None:
            return self.dist_init if ep is None else ep.dist_init
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            return f"tcp://{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
        return None

    def curve_keys(self) -> CurveKeys | None:
        """CurveZMQ towards the coordinator: both key files, or neither (ValueError naming the flags)."""
        return CurveKeys.from_files(self.curve_key, self.coordinator_key, flags=("--curve-key", "--coordinator-key"))
