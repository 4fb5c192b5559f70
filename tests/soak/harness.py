"""Plumbing shared by the hardening scripts (tests/soak/chaos.py, tests/soak/soak.py, benchmarks/overload.py)
and tests/cluster/test_chaos.py.

- ProcessCluster: infer-coordinator and infer-worker as real child processes on loopback TCP, each in its own
  session, that can be killed with SIGKILL and started again (the coordinator on the same port). Every process
  carries a marker in its environment, so leftovers (a leak) are found in /proc after shutdown.
- Memory: VmRSS / VmHWM of every process from /proc/PID/status.
- Requests: one request as a stream or a generate call, optionally aborted part-way, judged token by token
  against --benchmark-mode's deterministic output (token i of a P-token prompt is (P + i) % 1000) or, with
  a real model and ignore_eos, by its length. Every request ends in exactly one Outcome status.
- Load: a closed loop (capacity: completed requests/s at saturation) and an open loop (Poisson arrivals).
- Results: benchmarks/common.py's write_result (date, machine, git revision) under benchmarks/results/.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aioprocs import processes_mentioning  # tests/ is on sys.path (pytest, and each script's first lines)

from infer import SamplingParams
from infer.client.inference_client import ClusterError, InferenceClient
from infer.protocol.ports import reserved_port

REPO = Path(__file__).resolve().parents[2]
MARKER_VAR = "INFER_HARNESS_RUN"
HOST = "127.0.0.1"

# Short timeouts so faults are noticed in about a second (the same spirit as tests/cluster/conftest.py); for
# --benchmark-mode workers, whose steps take microseconds. Workers with a model keep the production defaults
# (heartbeat 1 s, timeouts 10 s): one engine step on a busy CPU can take longer than 2 s.
FAST_COORDINATOR_FLAGS = (
    "--heartbeat-interval",
    "0.2",
    "--worker-timeout",
    "2",
    "--client-timeout",
    "5",
    "--stop-timeout",
    "5",
)
FAST_WORKER_FLAGS = ("--heartbeat-interval", "0.2", "--coordinator-timeout", "2", "--drain-timeout", "2")
QUIET = ("--log-level", "WARNING")


def expected_tokens(prompt_len: int, count: int) -> list[int]:
    """--benchmark-mode's output for a `prompt_len`-token prompt: token i is (prompt_len + i) % 1000."""
    return [(prompt_len + i) % 1000 for i in range(count)]


def read_memory_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of a live process in kB; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None  # a zombie has no memory lines


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes_marked(marker: str) -> list[str]:
    """Live (not zombie) processes whose environment holds `marker` (MARKER_VAR=run id), this one excepted."""
    return processes_mentioning(marker.encode() + b"\0", in_cmdline=False)


# ---- the processes -------------------------------------------------------------------------------------


@dataclass
class Daemon:
    """One started process (a coordinator or a worker); kept after it dies, with its last memory figures."""

    name: str  # "coordinator", "worker1", ...
    instance: str  # name plus its start count: "worker1#2"
    popen: subprocess.Popen
    log: Path
    started_at: float
    rss_kb: int = 0  # at the last sample
    peak_kb: int = 0  # VmHWM at the last sample: the peak of this process's life

    def alive(self) -> bool:
        return self.popen.poll() is None

    def sample(self) -> int | None:
        """Read its memory now (VmRSS, kept with VmHWM); None if it is gone."""
        memory = read_memory_kb(self.popen.pid)
        if memory is None:
            return None
        self.rss_kb, self.peak_kb = memory[0], max(self.peak_kb, memory[1])
        return self.rss_kb

    def kill9(self) -> None:
        """SIGKILL its whole process group and reap it."""
        self.sample()
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass(frozen=True)
class ClusterSpec:
    """What a ProcessCluster runs. benchmark=True: workers in --benchmark-mode (no model, deterministic
    tokens); else `model` (None: the embedded default model). fast_timeouts (default: with benchmark) adds
    the short timeouts above. The flags come after those."""

    workers: int = 3
    benchmark: bool = True
    model: str | None = None
    fast_timeouts: bool | None = None
    coordinator_flags: tuple[str, ...] = ()
    worker_flags: tuple[str, ...] = ()


class ProcessCluster:
    """A coordinator and `spec.workers` workers (dp ranks 0..N-1) as child processes; see the module doc."""

    def __init__(self, spec: ClusterSpec, logs: Path) -> None:
        self.spec = spec
        self.logs = logs
        self.logs.mkdir(parents=True, exist_ok=True)
        self.port = reserved_port(HOST)
        self.run_id = uuid.uuid4().hex  # in every process's environment: MARKER_VAR=run_id
        self.daemons: list[Daemon] = []  # every process started, the dead ones too
        self.coordinator: Daemon | None = None
        self.workers: dict[int, Daemon] = {}
        self.worker_ids: dict[int, str] = {}
        self._starts = itertools.count(1)

    @property
    def address(self) -> str:
        return f"tcp://{HOST}:{self.port}"

    @property
    def fast(self) -> bool:
        return self.spec.benchmark if self.spec.fast_timeouts is None else self.spec.fast_timeouts

    def _spawn(self, name: str, argv: list[str]) -> Daemon:
        count = sum(d.name == name for d in self.daemons) + 1
        log = self.logs / f"{name}-{count}.log"
        env = {**os.environ, MARKER_VAR: self.run_id, "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                [sys.executable, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        daemon = Daemon(name, f"{name}#{count}", popen, log, time.monotonic())
        self.daemons.append(daemon)
        return daemon

    def start_coordinator(self) -> Daemon:
        self.coordinator = self._spawn(
            "coordinator",
            [
                "-m",
                "infer.coordinator.daemon",
                "--host",
                HOST,
                "--port",
                str(self.port),
                *(FAST_COORDINATOR_FLAGS if self.fast else ()),
                *QUIET,
                *self.spec.coordinator_flags,
            ],
        )
        return self.coordinator

    def start_worker(self, rank: int, same_id: bool = False) -> Daemon:
        """Start dp rank `rank`; same_id: under the id of its previous process (a supervisor restarting it
        with a fixed --worker-id), else under a new one (a fresh process, like the default hostname-pid)."""
        if not same_id or rank not in self.worker_ids:
            self.worker_ids[rank] = f"w{rank}-{next(self._starts)}"
        argv = [
            "-m",
            "infer.worker.service.daemon",
            "--coordinator",
            self.address,
            "--dp-rank",
            str(rank),
            "--worker-id",
            self.worker_ids[rank],
            *(FAST_WORKER_FLAGS if self.fast else ()),
            *QUIET,
        ]
        if self.spec.benchmark:
            argv.append("--benchmark-mode")
        elif self.spec.model is not None:
            argv += ["--model", self.spec.model]
        self.workers[rank] = self._spawn(f"worker{rank}", [*argv, *self.spec.worker_flags])
        return self.workers[rank]

    def client(self, **options: Any) -> InferenceClient:
        fast = self.fast
        options = {
            "heartbeat_interval": 0.2 if fast else 1.0,
            "silence_timeout": 10.0 if fast else 30.0,
            "connect_timeout": 30.0,
            **options,
        }
        return InferenceClient(self.address, **options)

    async def connected_clients(self, count: int, **options: Any) -> list[InferenceClient]:
        clients = [self.client(**options) for _ in range(count)]
        for client in clients:
            await client.connect()
        return clients

    async def start(self, ready_timeout: float = 180.0) -> None:
        """Start everything and wait (on the coordinator's side) until every worker is healthy."""
        self.start_coordinator()
        for rank in range(self.spec.workers):
            self.start_worker(rank)
        async with self.client() as client:
            try:
                await client.wait_for_workers(self.spec.workers, ready_timeout)
            except ClusterError as e:
                raise RuntimeError(f"the cluster did not come up: {e}\n{self.dump()}") from None

    def live(self) -> list[Daemon]:
        return [d for d in self.daemons if d.alive()]

    def sample_memory(self) -> dict[str, int]:
        """VmRSS (kB) of every live process, by instance."""
        return {d.instance: rss for d in self.live() if (rss := d.sample()) is not None}

    def cpu(self) -> dict[str, float]:
        """CPU seconds used so far by every live process, by instance, and by this one ("loadgen")."""
        used = {d.instance: t for d in self.live() if (t := cpu_seconds(d.popen.pid)) is not None}
        return {**used, "loadgen": cpu_seconds(os.getpid()) or 0.0}

    def peaks(self) -> dict[str, int]:
        """The peak RSS (VmHWM, kB) of every process started, dead ones as last sampled."""
        for daemon in self.live():
            daemon.sample()
        return {d.instance: d.peak_kb for d in self.daemons}

    async def shutdown(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop the cluster the way a user does (the lifecycle STOP), wait for every process to exit, SIGKILL
        what did not, reap everything, then look for any process of this cluster still alive (a leak)."""
        stop_error = None
        if self.coordinator is not None and self.coordinator.alive():
            try:
                async with self.client(connect_timeout=10.0, call_timeout=timeout) as client:
                    await client.stop()
            except (ClusterError, OSError) as e:
                stop_error = str(e)
        await asyncio.gather(*(_exits(d.popen, timeout) for d in self.live()))
        killed = [d.instance for d in self.live()]
        for daemon in self.daemons:
            daemon.kill9()
        return {
            "stop_error": stop_error,
            "killed_after_stop": killed,
            "exit_codes": {d.instance: d.popen.returncode for d in self.daemons},
            "leaked": processes_marked(f"{MARKER_VAR}={self.run_id}"),
        }

    async def finish(self, clients: list[InferenceClient]) -> tuple[dict[str, int], dict[str, Any]]:
        """The end of a run: close `clients`, then the peak RSS of every process and the shutdown's report."""
        for client in clients:
            await client.close()
        peaks = self.peaks()
        return peaks, await self.shutdown()

    def kill_all(self) -> None:
        """The last resort (a finally): SIGKILL and reap every process of the cluster."""
        for daemon in self.daemons:
            daemon.kill9()

    @contextlib.contextmanager
    def dumped_on_failure(self) -> Iterator[None]:
        """Around a run: if it raises, print every process's log tail and SIGKILL them all."""
        try:
            yield
        except BaseException:
            print(self.dump(), file=sys.stderr)
            self.kill_all()
            raise

    def dump(self, chars: int = 3000) -> str:
        return "\n".join(
            f"==== {d.instance} ({d.log}, exit {d.popen.poll()}) ====\n{d.log_tail(chars)}" for d in self.daemons
        )


async def _exits(popen: subprocess.Popen, timeout: float) -> bool:
    """Whether the child exits (and is reaped) within `timeout` seconds (the blocking wait in a thread)."""
    try:
        await asyncio.to_thread(popen.wait, timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


async def wait_until(predicate: Callable[[], Awaitable[Any]], timeout: float, interval: float = 0.1) -> Any:
    """Re-check an async predicate until it returns something true (returned) or `timeout` passes (None)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = await predicate()
        except (ClusterError, TimeoutError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(interval)


def idle(stats: Any, workers: int) -> bool:
    """`workers` healthy workers, nothing in flight or held, and every KV pool entirely free."""
    healthy = [w for w in stats.workers if w.healthy]
    return (
        len(healthy) == workers
        and stats.num_in_flight == 0
        and stats.num_held == 0
        and all(
            w.load is not None
            and w.load.num_running == 0
            and w.load.num_waiting == 0
            and w.load.num_free_blocks == w.load.num_total_blocks
            for w in healthy
        )
    )


# ---- one request ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    max_tokens: int
    stream: bool = False
    abort_after_tokens: int | None = None  # stream: abort once this many tokens arrived
    abort_after_s: float | None = None  # generate: abort after this long

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=self.max_tokens, ignore_eos=True)

    @property
    def aborts(self) -> bool:
        return self.abort_after_tokens is not None or self.abort_after_s is not None


STATUSES = ("completed", "aborted", "rejected", "timeout", "error", "raised", "hung", "bad")


@dataclass
class Outcome:
    """How one request ended. status:
    completed  finish_reason length, every token as expected
    aborted    we aborted it: finish_reason abort, the tokens so far as expected
    rejected   refused at once: error code "overloaded", no token
    timeout    error code "timeout" (its own deadline)
    error      finish_reason error with both a message and a code (a clear error)
    raised     the client raised ClusterError (the connection failed; the message says why)
    hung       no end within the harness's deadline
    bad        a broken promise: a gap, a repeat, wrong tokens, two ends, an error without message or code,
               an abort nobody asked for, a short output (`problem` says which)"""

    request_id: str
    kind: str  # "stream" | "generate"
    max_tokens: int
    sent_at: float
    ended_at: float | None = None
    status: str = "hung"
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    num_tokens: int = 0
    problem: str | None = None

    @property
    def latency(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.sent_at


def judge(outcome: Outcome, spec: RequestSpec, token_ids: list[int], finishes: int, oracle: bool) -> None:
    """Set outcome.status (and problem) from what the client received."""
    outcome.num_tokens = len(token_ids)
    want = expected_tokens(len(spec.prompt), spec.max_tokens)
    if finishes != 1:
        outcome.status, outcome.problem = "bad", f"{finishes} final deltas"
    elif oracle and token_ids != want[: len(token_ids)]:
        at = next((i for i, (a, b) in enumerate(zip(token_ids, want)) if a != b), len(want))
        outcome.status = "bad"
        outcome.problem = (
            f"tokens differ from the expected from index {at} (gap or repeat): got "
            f"{token_ids[max(0, at - 2) : at + 3]}, want {want[max(0, at - 2) : at + 3]}; "
            f"{len(token_ids)} tokens for max_tokens {spec.max_tokens}"
        )
    elif outcome.finish_reason == "length":
        ok = len(token_ids) == spec.max_tokens
        outcome.status = "completed" if ok else "bad"
        outcome.problem = None if ok else f"'length' after {len(token_ids)} of {spec.max_tokens} tokens"
    elif outcome.finish_reason == "abort":
        outcome.status = "aborted" if spec.aborts else "bad"
        outcome.problem = None if spec.aborts else "aborted, but nobody asked for it"
    elif outcome.finish_reason == "error":
        if not outcome.error or not outcome.error_code:
            outcome.status = "bad"
            outcome.problem = f"unclear error: {outcome.error!r} code {outcome.error_code!r}"
        elif outcome.error_code == "overloaded" and not token_ids:
            outcome.status = "rejected"
        elif outcome.error_code == "timeout":
            outcome.status = "timeout"
        else:
            outcome.status = "error"
    else:
        outcome.status, outcome.problem = "bad", f"unexpected finish_reason {outcome.finish_reason!r}"


async def run_request(client: InferenceClient, spec: RequestSpec, deadline_s: float, oracle: bool) -> Outcome:
    """Send `spec` through `client` and judge how it ended (see Outcome). Never raises: a ClusterError is
    status "raised", no end within `deadline_s` is "hung" (the request is then abandoned, which aborts it)."""
    kind = "stream" if spec.stream else "generate"
    outcome = Outcome(spec.request_id, kind, spec.max_tokens, time.monotonic())
    received: list[int] = []
    finishes = 0

    async def consume_stream() -> None:
        nonlocal finishes
        abort_at = spec.abort_after_tokens
        async for delta in client.stream(spec.prompt, spec.params, request_id=spec.request_id):
            received.extend(delta.token_ids)
            if delta.finished:
                finishes += 1
                outcome.finish_reason, outcome.error = delta.finish_reason, delta.error
                outcome.error_code = delta.error_code
            elif abort_at is not None and len(received) >= abort_at:
                abort_at = None
                await client.abort(spec.request_id)

    async def consume_generate() -> None:
        nonlocal finishes
        task = asyncio.ensure_future(client.generate(spec.prompt, spec.params, request_id=spec.request_id))
        if spec.abort_after_s is not None:
            done, _ = await asyncio.wait({task}, timeout=spec.abort_after_s)
            if not done:
                await client.abort(spec.request_id)
        completion = await task
        received.extend(completion.token_ids)
        finishes = 1 if completion.finish_reason is not None else 0
        outcome.finish_reason, outcome.error = completion.finish_reason, completion.error
        outcome.error_code = completion.error_code

    try:
        await asyncio.wait_for(consume_stream() if spec.stream else consume_generate(), deadline_s)
    except asyncio.TimeoutError:
        outcome.status, outcome.num_tokens = "hung", len(received)
        outcome.problem = f"no end after {deadline_s} s ({len(received)} tokens received)"
        return outcome
    except ClusterError as e:
        outcome.ended_at = time.monotonic()
        outcome.status, outcome.error, outcome.num_tokens = "raised", str(e), len(received)
        return outcome
    outcome.ended_at = time.monotonic()
    judge(outcome, spec, received, finishes, oracle)
    return outcome


# ---- load ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """Random requests from a seed: prompt lengths and max_tokens uniform in their ranges; a fraction streamed
    and a fraction aborted part-way. Token ids are random in 1..999 (every model here has them)."""

    prompt_len: tuple[int, int] = (4, 64)
    max_tokens: tuple[int, int] = (32, 256)
    stream_fraction: float = 0.5
    abort_fraction: float = 0.0
    seed: int = 0
    tag: str = "r"
    _rng: random.Random = field(init=False, repr=False)
    _ids: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._ids = itertools.count()

    def next(self) -> RequestSpec:
        rng = self._rng
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(*self.prompt_len))]
        max_tokens = rng.randint(*self.max_tokens)
        stream = rng.random() < self.stream_fraction
        abort_tokens = abort_s = None
        if rng.random() < self.abort_fraction:
            if stream:
                abort_tokens = rng.randint(1, max(1, max_tokens - 1))
            else:
                abort_s = rng.uniform(0.005, 0.5)
        return RequestSpec(f"{self.tag}-{next(self._ids)}", prompt, max_tokens, stream, abort_tokens, abort_s)

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


async def closed_loop(
    clients: list[InferenceClient],
    workload: Workload,
    concurrency: int,
    seconds: float,
    deadline_s: float,
    oracle: bool,
) -> tuple[list[Outcome], float]:
    """Keep `concurrency` requests outstanding for `seconds`; the requests still out then run to the end
    (they are in the outcomes; the duration counted ends at `seconds`). Returns outcomes and the duration."""
    outcomes: list[Outcome] = []
    start = time.monotonic()
    turn = itertools.count()

    async def lane() -> None:
        while time.monotonic() - start < seconds:
            client = clients[next(turn) % len(clients)]
            outcomes.append(await run_request(client, workload.next(), deadline_s, oracle))

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return outcomes, seconds


def completed_rate(outcomes: list[Outcome], start: float, end: float) -> float:
    """Requests completed per second within [start, end] (monotonic times)."""
    done = [o for o in outcomes if o.status == "completed" and start <= (o.ended_at or -1.0) <= end]
    return len(done) / (end - start) if end > start else 0.0


async def measure_capacity(
    clients: list[InferenceClient],
    workload: Workload,
    concurrency: int,
    seconds: float,
    warmup: float,
    deadline_s: float,
    oracle: bool,
) -> dict[str, Any]:
    """Completed requests/s at saturation: a closed loop of `concurrency` outstanding requests; completions in
    the `seconds` after a `warmup` count. RuntimeError when none completed (nothing to scale a load by)."""
    start = time.monotonic()
    outcomes, _ = await closed_loop(clients, workload, concurrency, warmup + seconds, deadline_s, oracle)
    rate = completed_rate(outcomes, start + warmup, start + warmup + seconds)
    if rate <= 0:
        raise RuntimeError(f"no request completed while measuring capacity: {count_statuses(outcomes)}")
    tokens = sum(
        o.num_tokens
        for o in outcomes
        if o.status == "completed"
        and o.ended_at is not None
        and start + warmup <= o.ended_at <= start + warmup + seconds
    )
    return {
        "requests_per_s": rate,
        "tokens_per_s": tokens / seconds,
        "concurrency": concurrency,
        "seconds": seconds,
        "warmup_s": warmup,
        "statuses": count_statuses(outcomes),
        "not_completed": [
            f"{o.request_id} {o.status}: {o.error_code} {o.problem or o.error}"[:200]
            for o in outcomes
            if o.status != "completed"
        ][:10],
    }


async def open_loop(
    clients: list[InferenceClient],
    workload: Workload,
    rate: float,
    seconds: float,
    deadline_s: float,
    oracle: bool,
    seed: int = 0,
    max_outstanding: int | None = None,
) -> dict[str, Any]:
    """Poisson arrivals at `rate`/s for `seconds` (arrivals are never delayed by the cluster: open loop; with
    `max_outstanding` a new arrival waits for a slot and is counted as throttled). Every request runs to its
    end (bounded by `deadline_s`). Returns the outcomes, the send window and how far sending fell behind."""
    rng = random.Random(f"{seed}:arrivals")
    tasks: list[asyncio.Task] = []
    slots = asyncio.Semaphore(max_outstanding) if max_outstanding else None
    throttled = 0
    max_lag = 0.0
    start = time.monotonic()
    due = 0.0
    turn = itertools.count()

    async def one(spec: RequestSpec, client: InferenceClient) -> Outcome:
        try:
            return await run_request(client, spec, deadline_s, oracle)
        finally:
            if slots is not None:
                slots.release()

    while True:
        due += rng.expovariate(rate)
        if due >= seconds:
            break
        delay = start + due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            max_lag = max(max_lag, -delay)
        if slots is not None:
            if slots.locked():
                throttled += 1
            await slots.acquire()
        tasks.append(asyncio.create_task(one(workload.next(), clients[next(turn) % len(clients)])))
    sent_until = time.monotonic()
    outcomes = list(await asyncio.gather(*tasks))
    return {
        "outcomes": outcomes,
        "start": start,
        "sent_until": sent_until,
        "end": time.monotonic(),
        "offered": len(tasks),
        "throttled": throttled,
        "max_send_lag_s": max_lag,
    }


class LoopLag:
    """How late this process's event loop wakes up: a task sleeping `interval` again and again records each
    overshoot. A busy load generator shows here, so its own delays are not blamed on the cluster."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval)
            self.lags.append(max(0.0, time.monotonic() - before - self.interval))

    def __enter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._task.cancel()


def count_statuses(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for o in outcomes:
        counts[o.status] += 1
    return counts


def percentiles_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    data = sorted(values)

    def at(q: float) -> float:
        return round(1000 * data[min(len(data) - 1, int(q * len(data)))], 2)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(1000 * data[-1], 2)}


def self_memory_kb() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process (the load generator)."""
    return read_memory_kb(os.getpid()) or (0, 0)


def write_result(kind: str, payload: dict[str, Any]) -> Path:
    """benchmarks/common.py's write_result: benchmarks/results/<kind>-<UTC time>.json with date, machine and
    git revision. Loaded by path: benchmarks/ is not a package."""
    spec = importlib.util.spec_from_file_location("infer_bench_common", REPO / "benchmarks" / "common.py")
    common = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(common)
    return common.write_result(kind, payload)


def problems(outcomes: list[Outcome], limit: int = 10) -> list[dict[str, Any]]:
    """The first `limit` outcomes that are hung or bad, for the report."""
    return [asdict(o) for o in outcomes if o.status in ("hung", "bad")][:limit]
