"""CoordinatorConfig: the coordinator's options, validated once (frozen); each field declares its
infer-coordinator flag (protocol/options.py builds the parser from it)."""

from __future__ import annotations

from dataclasses import dataclass

from infer.coordinator.election import LEASE_S
from infer.coordinator.kv_index import DEFAULT_OVERLAP_WEIGHT
from infer.coordinator.routing import POLICIES
from infer.protocol.options import option
from infer.protocol.tracing import require_sdk
from infer.protocol.transport import split_addresses


@dataclass(frozen=True)
class CoordinatorConfig:
    """Options of one coordinator.

    heartbeat_interval: how often the coordinator sends each worker a Heartbeat (and runs its timers).
    worker_timeout: a worker silent this long is declared dead (a hang); a worker whose connection is
        gone (a send to it is unroutable) is declared dead at once.
    client_timeout: a client with requests in flight and silent this long is declared dead: its requests
        are aborted on the workers.
    max_retries: how many times one request may be re-dispatched after worker failures before it fails.
    queue_timeout: how long a request may wait for a healthy worker (while running) before it fails.
    stop_timeout: how long STOP waits for workers to acknowledge before the coordinator exits anyway.
    drain_timeout: on SIGTERM / SIGINT, how long requests already accepted get to finish (new ones are
        refused as "unavailable") before STOP; 0 runs STOP at once. A second signal runs STOP at once.
    model_id: the models the cluster serves, comma-separated: a worker of any other is refused, and the first is
        the default, where requests that name no model go. None: workers of any model join; requests that name
        none go to the cluster's only model, and are refused (naming the models) once it serves several
        (coordinator/models.py).
    max_requests_per_worker: admission bound on the requests one worker has at a time (running and
        waiting in its engine); None takes each worker's own bound (its max_num_seqs + max_waiting). A
        request that finds every routable worker full is refused at once with error code "overloaded".
    max_held_requests: bound on requests held in the coordinator (paused, no healthy worker yet); past it
        new requests are refused as "overloaded".
    max_step_time: a worker whose heartbeat says its current engine step has run longer than this is declared
        dead (its engine is stuck; heartbeats come from a thread of their own, so a long step alone is fine).
    restart_grace: after the coordinator starts, how long a request a client re-attaches (after a restart)
        waits for its worker to register again with it before it is re-dispatched from the client's tokens.
    curve_secret_key, authorized_keys: CurveZMQ: the coordinator's secret key file and the directory of the
        public keys (*.key) it lets in, one folder per role: workers/, clients/, admins/ (infer.protocol.keys).
    worker_keys, client_keys, admin_keys: one directory of public keys per role, instead of (or replacing
        that role's folder of) authorized_keys. With curve_secret_key, at least one of the four is needed.
    otlp_traces_endpoint: record each request's hop as an OpenTelemetry span (protocol/tracing.py), the child
        of its Submit's traceparent, and export it there; None: no tracing.
    trusted_network: allow binding a non-loopback host without keys (plaintext, anyone who reaches the port
        may connect); without it such a bind is refused.
    peers, peer_index, lease: several coordinators (coordinator/election.py): every coordinator's address in one
        order all share, this one's place in it, and the leader's lease.
    """

    host: str = option("127.0.0.1", "address to bind (0.0.0.0 for all)")
    port: int = option(5555, "TCP port (0 picks a free one; the log's 'listening on' line names it)")
    listen_fd: int | None = option(
        None,
        "serve on this inherited listening TCP socket, bound to --host / --port by the parent that started this "
        "process and kept by it (infer-serve's: its port is never free between a choice and a bind, nor "
        "between a coordinator and its restart)",
        metavar="FD",
    )
    policy: str = option(
        "least-loaded",
        "routing policy (kv-aware: by the prefix-cache blocks each worker reports holding, against its queue; "
        "docs/architecture.md)",
        choices=POLICIES,
    )
    kv_overlap_weight: float = option(
        DEFAULT_OVERLAP_WEIGHT,
        "kv-aware: what a prompt token a worker need not prefill (it holds its KV) is worth against a token of "
        "work queued there (0: load only; higher: follow the cache further onto busier workers)",
        metavar="W",
    )
    heartbeat_interval: float = option(1.0, "seconds between heartbeats and timer runs", metavar="S")
    worker_timeout: float = option(10.0, "declare a silent worker dead after S seconds", metavar="S")
    client_timeout: float = option(10.0, "abort the requests of a client silent for S seconds", metavar="S")
    relay_streams: bool = option(
        False,
        "relay every delta through the coordinator, as before direct streams (docs/architecture.md): for comparison "
        "and for workers or clients that cannot reach each other",
    )
    max_retries: int = option(3, "re-dispatches allowed per request after worker failures", metavar="N")
    queue_timeout: float = option(120.0, "fail a request that waited S seconds for a healthy worker", metavar="S")
    stop_timeout: float = option(5.0, "on STOP, wait at most S seconds for workers to acknowledge", metavar="S")
    drain_timeout: float = option(
        0.0,
        "on SIGTERM / SIGINT, let accepted requests finish for up to S seconds (new "
        "ones are refused) before STOP (0: STOP at once; a second signal: STOP at "
        "once)",
        metavar="S",
    )
    model_id: str | None = option(
        None,
        "the model ids the cluster serves, comma-separated (workers of others are refused); the first is the "
        "default for requests that name no model (default: any model joins; requests that name none go to the "
        "only model served)",
    )
    coordinator_id: str = option("coordinator", "the name this coordinator gives itself in Welcome and stats")
    max_requests_per_worker: int | None = option(
        None,
        "requests one worker may have at a time; a request finding every worker full is refused as "
        "overloaded at once (default: each worker's own bound, max_num_seqs + its waiting limit)",
        metavar="N",
    )
    max_held_requests: int = option(
        10000,
        "requests held in the coordinator (paused, no healthy worker); past it new ones are refused as overloaded",
        metavar="N",
    )
    restart_grace: float = option(
        5.0,
        "after a restart, how long a re-attached request waits for its worker to "
        "register again before it is re-dispatched",
        metavar="S",
    )
    max_step_time: float = option(
        600.0,
        "declare a worker dead when its heartbeat says one engine step has run longer than S seconds (a stuck engine)",
        metavar="S",
    )
    curve_secret_key: str | None = option(
        None, "the coordinator's secret key file (infer-keygen NAME writes NAME.key_secret)", metavar="FILE"
    )
    authorized_keys: str | None = option(
        None,
        "the public key files (*.key) allowed in, one folder per role: DIR/workers (register and serve), "
        "DIR/clients (submit, stream, abort, stats), DIR/admins (a client that may also pause, unpause, "
        "suspend, resume and stop the cluster). Re-read when they change: a removed key's open connections "
        "are cut off. A refused peer is logged and never reaches the coordinator; a flat DIR (no role "
        "folders) is refused",
        metavar="DIR",
    )
    worker_keys: str | None = option(
        None, "directory of the workers' public keys (instead of --authorized-keys DIR/workers)", metavar="DIR"
    )
    client_keys: str | None = option(
        None, "directory of the clients' public keys (instead of --authorized-keys DIR/clients)", metavar="DIR"
    )
    admin_keys: str | None = option(
        None, "directory of the administrators' public keys (instead of --authorized-keys DIR/admins)", metavar="DIR"
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "export an OpenTelemetry span of each request's coordinator hop to this OTLP endpoint (vLLM's flag; "
        "needs pip install 'infer[otel]'; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL grpc or http/protobuf)",
        metavar="URL",
    )
    trusted_network: bool = option(
        False,
        "allow a non-loopback --host without keys (plaintext: anyone who reaches "
        "the port is a worker, a client and an administrator); without keys, "
        "only loopback is allowed otherwise",
    )

    peers: str | None = option(
        None,
        "every coordinator of this cluster, this one included: tcp://HOST:PORT addresses, comma-separated, in one "
        "order all share (workers, HTTP fronts and clients take the same list). 1, or 3 or more: they elect one "
        "leader under a lease a majority grants; the others answer with Redirect and take over when it dies "
        "(docs/architecture.md, 'Several coordinators'). With keys all share one key pair",
        metavar="LIST",
    )
    peer_index: int | None = option(
        None, "this coordinator's place in --peers, from 0 (default: the one entry whose port is --port)", metavar="I"
    )
    lease: float = option(
        LEASE_S,
        "with --peers: the leader's lease; a leader that dies is replaced about one lease later, one cut off from "
        "a majority stops leading within one",
        metavar="S",
    )

    def __post_init__(self) -> None:
        if self.peers is not None:
            peers = split_addresses(self.peers, what="--peers", tcp_ports=True)
            if len(peers) == 2:
                raise ValueError(
                    "--peers names 2 coordinators: two cannot tell a dead peer from a cut cable, so neither could "
                    "take over safely; run 1, or 3 or more (a majority of 2 of 3 survives the loss of any one)"
                )
            if self.port == 0:
                raise ValueError("--peers needs a fixed --port (the one its entry in the list names)")
            index = self.peer_index
            if index is None:
                mine = [i for i, a in enumerate(peers) if a.rpartition(":")[2] == str(self.port)]
                if len(mine) != 1:
                    raise ValueError(
                        f"--peer-index is needed: {len(mine)} entries of --peers {self.peers!r} have port {self.port}"
                    )
            elif not 0 <= index < len(peers):
                raise ValueError(f"--peer-index {index} is not a place in --peers (0..{len(peers) - 1})")
            if not isinstance(self.lease, (int, float)) or not 0.1 <= self.lease <= 60:
                raise ValueError(f"lease must be in [0.1, 60] seconds, got {self.lease!r}")
        elif self.peer_index is not None:
            raise ValueError("--peer-index needs --peers")
        if self.model_id is not None and not all(self.model_ids):
            raise ValueError(f"model_id must be model ids separated by commas, got {self.model_id!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.kv_overlap_weight, (int, float)) or not 0 <= self.kv_overlap_weight <= 1000:
            raise ValueError(f"kv_overlap_weight must be in [0, 1000], got {self.kv_overlap_weight!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.listen_fd is not None and (self.listen_fd < 0 or self.port == 0):
            raise ValueError(f"listen_fd {self.listen_fd} needs a file descriptor >= 0 and the port it is bound to")
        for name in (
            "heartbeat_interval",
            "worker_timeout",
            "client_timeout",
            "queue_timeout",
            "stop_timeout",
            "max_step_time",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.drain_timeout, (int, float)) or not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be a number of seconds >= 0, got {self.drain_timeout!r}")
        if self.worker_timeout <= self.heartbeat_interval or self.client_timeout <= self.heartbeat_interval:
            raise ValueError(
                f"worker_timeout ({self.worker_timeout}) and client_timeout ({self.client_timeout}) "
                f"must exceed heartbeat_interval ({self.heartbeat_interval})"
            )
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        for name in ("max_requests_per_worker", "max_held_requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.restart_grace, (int, float)) or not 0 <= self.restart_grace <= 3600:
            raise ValueError(f"restart_grace must be in [0, 3600] seconds, got {self.restart_grace!r}")
        if self.otlp_traces_endpoint is not None:
            require_sdk()
        key_dirs = (self.authorized_keys, self.worker_keys, self.client_keys, self.admin_keys)
        if (self.curve_secret_key is None) != all(d is None for d in key_dirs):
            raise ValueError(
                "--curve-secret-key and --authorized-keys go together: give both (the "
                "coordinator's secret key file and the directory of the public keys it lets in, "
                "or --worker-keys / --client-keys / --admin-keys) or neither"
            )

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The models --model-id pins, the default first; () when any model may join."""
        return () if self.model_id is None else tuple(m.strip() for m in self.model_id.split(","))

    @property
    def peer_addresses(self) -> tuple[str, ...]:
        """Every coordinator's address (--peers); (its own endpoint,) when it is the only one."""
        return (self.endpoint,) if self.peers is None else split_addresses(self.peers, tcp_ports=True)

    @property
    def index(self) -> int:
        """Its place in peer_addresses."""
        if self.peer_index is not None:
            return self.peer_index
        if self.peers is None:
            return 0
        port = str(self.port)
        return next(i for i, a in enumerate(self.peer_addresses) if a.rpartition(":")[2] == port)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"
