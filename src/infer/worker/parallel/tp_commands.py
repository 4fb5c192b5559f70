"""The step commands of a TP group: TP rank 0 (`TpLeader`) sends each model forward it runs to the other
ranks before running it, and each follower (`serve_follower`) runs the same forward on its shards, so the
collectives inside the forward keep the group in step (see worker/parallel/tp_group.py for the group itself).

Commands go over zmq (PUSH -> each follower's PULL; frames are msgpack maps, tensors as raw bytes, never
pickled): "forward" (the step's ForwardBatch), "logits" (rows of the last forward's hidden states whose
logits rank 0 gathers), "dummy" (an EP group's dummy step), "ping" (while idle, every `ping_interval_s`),
"stop" (with the exit code rank 0 leaves with: a follower exits with the same code, so a launcher that restarts
failed processes restarts the whole group, and none of a group told to stop).

**A member gone, even while the group is idle.** Each end watches its connections (a zmq socket monitor, and
ZMTP heartbeats every ping interval that close a connection silent for the group's timeout): rank 0 marks the
group `lost` when a follower's connection closes, and its worker then gives its requests back and exits as for a
failed collective; a follower whose connection from rank 0 closes exits at once (`LeaderGone`), as after the
timeout of silence. A process killed on another node is noticed within a second, not at the next request.
The channel is plain TCP: like the group's torch.distributed traffic it belongs on a trusted network.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import urlsplit

import msgpack
import zmq

from infer.protocol.bounds import check_shape
from infer.protocol.logsafe import RateLimitedLog, safe
from infer.protocol.transport import make_socket
from infer.worker.distributed.group_sync import GroupBroken, _local_address_towards
from infer.worker.parallel.tp_supervisor import reap

if TYPE_CHECKING:
    import torch

    from infer.worker.distributed.tensor_parallel import TensorParallel
    from infer.worker.engine.forward_batch import ForwardBatch

log = logging.getLogger("infer.worker")


class ChannelOptions(Protocol):
    """What the channel reads of its group's options (tp_group.TpOptions, pp_group.PpOptions)."""

    @property
    def dist_init(self) -> str | None: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def ping_interval_s(self) -> float: ...


class CommandGroup(Protocol):
    """The processes a command channel joins (tp_group.Parallel: a TP group; pp_group.PipelineGroup: a pipeline's
    processes): `commands` their process group (rank 0 the engine's process), their options, their names."""

    @property
    def commands(self) -> TensorParallel | None: ...

    @property
    def options(self) -> ChannelOptions: ...

    def member(self, index: int) -> str: ...


_LAST_WORDS_MS = 1000  # how long a follower waits for the frames rank 0 sent before its connection closed


class LeaderGone(RuntimeError):
    """A follower heard nothing from TP rank 0 within the timeout, or its connection from rank 0 closed."""


class BadCommand(ValueError):
    """A frame on the command channel that is not a command rank 0 sends (the text says what is wrong)."""


_OPS = frozenset({"forward", "lora_copy_in", "logits", "dummy", "stop", "ping"})
_MAX_COMMAND_DEPTH = 8  # rank 0's commands nest 4 deep (a forward's batch's tensors' shapes)


def parse_command(frame: bytes) -> dict[str, Any]:
    """A command frame as rank 0 writes it: a msgpack map with a known "op"; BadCommand otherwise."""
    try:
        check_shape(frame, max_depth=_MAX_COMMAND_DEPTH)
        command = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises ValueError / its own errors, by what is wrong
        raise BadCommand(f"not a msgpack command: {type(e).__name__}: {safe(e)}") from None
    op = command.get("op") if isinstance(command, dict) else None
    if not (isinstance(op, str) and op in _OPS):  # (an op may be any value: a list is not even hashable)
        raise BadCommand(f"not a command: {type(command).__name__} with op {safe(repr(op))}")
    return command


def _watch_peer(sock: zmq.Socket, interval_s: float, timeout_s: float) -> zmq.Socket:
    """ZMTP heartbeats on `sock` (a connection silent for `timeout_s` closes) and a monitor socket that reports
    each closed connection (call before connecting or binding: events before it are not reported)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def _closed(monitor: zmq.Socket) -> bool:
    """Whether `monitor` reported a closed connection (its queue is drained)."""
    closed = False
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return closed
        closed = True


def _gather_addresses(tp: TensorParallel, address: str | None) -> list[str | None]:
    import torch.distributed as dist

    values: list[Any] = [None] * tp.size
    dist.all_gather_object(values, address, group=tp.cpu_group)
    return values


_BATCH_TENSORS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "query_start_loc",
    "logits_indices",
)


def _pack_tensor(t: torch.Tensor) -> list[Any]:
    import torch

    t = t.detach().to("cpu").contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        t = t.view(torch.int16)
    return [name, list(t.shape), t.numpy().tobytes()]


def _unpack_tensor(packed: list[Any], device: torch.device) -> torch.Tensor:
    import numpy as np
    import torch

    dtype, shape, data = packed
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype=np.int16).reshape(shape)
        return torch.from_numpy(bits.copy()).view(torch.bfloat16).to(device)
    array = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
    return torch.from_numpy(array.copy()).to(device)


# A vision model's step (worker/engine/vision.py, worker/models/llava.py): rank 0 alone holds the requests' images and
# runs the vision tower; the other ranks take its features with the batch and place them as it does (the rows they
# replace, the images' spans for two-way attention, M-RoPE's positions), so every rank's text layers see the same
# input embeddings.
_IMAGE_TENSORS = ("image_rows", "image_embeds", "mrope_positions", "rope_cache")


def encode_batch(batch: ForwardBatch) -> dict[str, Any]:
    body: dict[str, Any] = {name: _pack_tensor(getattr(batch, name)) for name in _BATCH_TENSORS}
    for name in _IMAGE_TENSORS:
        value = getattr(batch, name)
        if value is not None:
            body[name] = _pack_tensor(value)
    if batch.image_spans is not None:
        body["image_spans"] = [list(span) for span in batch.image_spans]
    body.update(
        num_decodes=batch.num_decodes,
        query_lens=list(batch.query_lens),
        context_lens=list(batch.context_lens),
        block_size=batch.block_size,
        decode_split_tokens=batch.decode_split_tokens,
    )
    if batch.prefill_decode_from is not None:  # recomputed generated rows take the decode arithmetic on every rank
        body["prefill_decode_from"] = _pack_tensor(batch.prefill_decode_from)
    return body


def decode_batch(body: dict[str, Any], device: torch.device) -> ForwardBatch:
    from infer.worker.engine.forward_batch import ForwardBatch

    known = {f.name for f in fields(ForwardBatch)}
    values: dict[str, Any] = {name: _unpack_tensor(body[name], device) for name in _BATCH_TENSORS}
    values.update(
        num_decodes=body["num_decodes"],
        query_lens=tuple(body["query_lens"]),
        context_lens=tuple(body["context_lens"]),
        block_size=body["block_size"],
        decode_split_tokens=body["decode_split_tokens"],
    )
    if body.get("prefill_decode_from") is not None:
        values["prefill_decode_from"] = _unpack_tensor(body["prefill_decode_from"], device)
    for name in _IMAGE_TENSORS:
        if body.get(name) is not None:
            values[name] = _unpack_tensor(body[name], device)
    if body.get("image_spans") is not None:
        values["image_spans"] = tuple((int(seq), int(lo), int(hi)) for seq, lo, hi in body["image_spans"])
    return ForwardBatch(**{k: v for k, v in values.items() if k in known})


class TpLeader:
    """TP rank 0's side of the command channel: a PUSH socket to each follower, and a thread that pings
    them while nothing else is sent (a follower takes silence for rank 0's death) and watches their
    connections (`lost`: why the group is broken, once a follower's connection has closed)."""

    def __init__(
        self,
        parallel: CommandGroup,
        ctx: zmq.Context | None = None,
        children: Sequence[subprocess.Popen] = (),
    ) -> None:
        """`children`: the follower processes this process started (stop() waits for them, and leaves the
        torch.distributed world so that another group can be made here)."""
        # the TP group, or a pipeline's processes (worker/parallel/pp_group.py): set, as the world is joined before
        self._group = cast("TensorParallel", parallel.commands)
        self._member = parallel.member
        self._children = list(children)
        # a context of its own unless given one: stop() terminates it, which waits (LINGER) until the "stop" frames
        # have left, before this process exits (with os._exit, in a torch.distributed world: cli._exit)
        self._own_ctx = ctx is None
        ctx = self._ctx = zmq.Context() if ctx is None else ctx
        self._lock = threading.Lock()
        self._interval = parallel.options.ping_interval_s
        self._pushes = []
        self._monitors: list[tuple[int, zmq.Socket]] = []  # used by the ping thread only
        self.lost: str | None = None
        for rank, address in enumerate(_gather_addresses(self._group, None)[1:], start=1):
            push = make_socket(ctx, zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            self._monitors.append((rank, _watch_peer(push, self._interval, parallel.options.timeout_s)))
            push.connect(cast(str, address))  # a follower's (only rank 0 sends None)
            self._pushes.append(push)
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping_while_alive, name="infer-tp-ping", daemon=True)
        self._pinger.start()

    def forward(self, batch: ForwardBatch, lora_rows: list[tuple[int, int]] | None = None) -> None:
        """`lora_rows`: the forward's (LoRA slot, rows) runs when it has adapter rows (worker/engine/lora.py)."""
        if self.lost is not None:
            raise GroupBroken(self.lost)
        command: dict[str, Any] = {"op": "forward", "batch": encode_batch(batch)}
        if lora_rows is not None:
            command["lora_rows"] = [list(run) for run in lora_rows]
        self._send(command)

    def lora_copy_in(self, name: str, path: str, lora_id: int, slot: int) -> None:
        """Every follower reads the LoRA adapter's folder (its shards) into `slot`."""
        self._send({"op": "lora_copy_in", "name": name, "path": path, "lora_id": lora_id, "slot": slot})

    def logits(self, rows: torch.Tensor) -> None:
        self._send({"op": "logits", "rows": _pack_tensor(rows)})

    def dummy(self) -> None:
        self._send({"op": "dummy"})

    def _send(self, command: dict[str, Any]) -> None:
        frame = msgpack.packb(command, use_bin_type=True)
        with self._lock:
            for push in self._pushes:
                push.send(frame, copy=False)

    def _ping_while_alive(self) -> None:
        while not self._stop.wait(self._interval):
            self._watch_followers()
            try:
                self._send({"op": "ping"})
            except zmq.ZMQError:
                return

    def _watch_followers(self) -> None:
        for rank, monitor in self._monitors:
            if self.lost is None and _closed(monitor):
                self.lost = (
                    f"{self._member(rank)}'s connection closed (the process died, or was silent for the "
                    f"group's timeout)"
                )
                log.error("group broken: %s", self.lost)

    def stop(self, code: int = 0) -> None:
        """Tell the followers to exit with `code` (rank 0's own exit code), and close the channel (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._pinger.join(timeout=5)
        try:
            self._send({"op": "stop", "code": code})
        except zmq.ZMQError:
            pass
        for push in self._pushes:
            push.disable_monitor()
            push.setsockopt(zmq.LINGER, 2000)
            push.close()
        for _, monitor in self._monitors:
            monitor.close(0)
        if self._own_ctx:
            self._ctx.term()  # returns once the frames above are sent, or after their LINGER
        if self._children:
            reap(self._children)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class FollowerChannel:
    """A follower's end of the command channel: one PULL socket, and the monitor of its connection from rank 0."""

    def __init__(self, parallel: CommandGroup, ctx: zmq.Context | None = None) -> None:
        ctx = ctx or zmq.Context.instance()
        self.timeout_s = parallel.options.timeout_s
        self.leader = parallel.member(0)  # its name in messages
        self.pull = make_socket(ctx, zmq.PULL)
        self.monitor = _watch_peer(self.pull, parallel.options.ping_interval_s, self.timeout_s)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self.leader_closed = False
        self.dropped = RateLimitedLog(log)  # frames that were not commands
        dist_init = parallel.options.dist_init or "tcp://127.0.0.1:0"
        host = _local_address_towards(urlsplit(dist_init).hostname or "127.0.0.1")
        port = self.pull.bind_to_random_port(f"tcp://{host}")
        _gather_addresses(cast("TensorParallel", parallel.commands), f"tcp://{host}:{port}")  # set: world joined

    def receive(self) -> dict[str, Any]:
        """The next command; LeaderGone after `timeout_s` of silence, or once the leader's connection has closed
        and what it sent before (its "stop", say: the monitor may report the close first) has been read. A frame
        that is not a command (rank 0 sends none: another peer on the port) is dropped with a log line."""
        while True:
            events = dict(self.poller.poll(int(self.timeout_s * 1000)))
            if self.monitor in events and _closed(self.monitor):
                self.leader_closed = True
            if self.pull not in events:
                if not self.leader_closed:
                    raise LeaderGone(f"nothing heard from {self.leader} for {self.timeout_s:g} s")
                if not self.pull.poll(_LAST_WORDS_MS):
                    raise LeaderGone(f"{self.leader}'s connection closed")
            frame = self.pull.recv()
            try:
                return parse_command(frame)
            except BadCommand as e:
                self.dropped.warning("dropped a frame on the TP command channel (%d bytes): %s", len(frame), e)

    def close(self) -> None:
        self.pull.disable_monitor()
        self.monitor.close(0)
        self.pull.close(0)


def start_follower(config: Any) -> tuple[torch.device, torch.dtype]:
    """A follower process's first steps (a TP rank > 0, a pipeline's later processes): SIGTERM and SIGINT ignored
    (rank 0 decides when the group ends: it drains first), its thread count, its device and dtype."""
    import signal

    import torch

    from infer.worker.engine.engine_setup import pick_device, pick_dtype

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = pick_device(config.device)
    return device, pick_dtype(config.dtype, device)


def serve_follower(
    model: Any, kv_cache: Any, block_size: int, channel: FollowerChannel, device: torch.device, lora: Any = None
) -> int:
    """A follower process's life once it is loaded (a TP rank > 0, or any process of a pipeline but stage 0's first):
    `follow` rank 0's commands until they end, then close `channel`. Returns the process's exit code: rank 0's
    when it said stop, 1 when rank 0 is gone (LeaderGone) or the group broke (GroupBroken), logged."""
    try:
        return follow(model, kv_cache, block_size, channel, device, lora)
    except (LeaderGone, GroupBroken) as e:
        log.error("fatal: %s; exiting", e)
        return 1
    finally:
        channel.close()


def follow(
    model: Any, kv_cache: Any, block_size: int, channel: FollowerChannel, device: torch.device, lora: Any = None
) -> int:
    """Run rank 0's commands on this rank's shards (or a pipeline stage's layers: worker/parallel/pp_stage.py's
    StageModel, whose forward returns row numbers and whose compute_logits sends them on) until "stop" (returns rank 0's
    exit code, which this process exits with), silence or rank 0's connection closed (LeaderGone), or a broken
    collective or hand-off (GroupBroken). `lora`: this rank's LoraManager (worker/engine/lora.py) when LoRA is enabled:
    rank 0 says what goes in which slot."""
    import torch

    from infer.worker.engine.lora import lora_step
    from infer.worker.engine.model_runner import dummy_forward_batch

    hidden = None
    with torch.inference_mode():
        while True:
            command = channel.receive()
            op = command["op"]
            if op == "forward":
                try:  # its arguments read before the forward: a frame that is not rank 0's costs only itself
                    batch = decode_batch(command["batch"], device)
                    step = None if lora is None or "lora_rows" not in command else lora.step(command["lora_rows"])
                except Exception as e:  # noqa: BLE001 - missing keys, wrong types, shapes that do not fit
                    channel.dropped.warning("dropped a forward command whose batch cannot be read: %r", e)
                    continue
                with lora_step(step):
                    hidden = model(batch, kv_cache)
            elif op == "lora_copy_in":
                if lora is None:
                    raise ValueError("a LoRA command, but LoRA is not enabled on this rank")
                name, path, lora_id, slot = (command.get(key) for key in ("name", "path", "lora_id", "slot"))
                if not (isinstance(name, str) and isinstance(path, str) and type(lora_id) is type(slot) is int):
                    channel.dropped.warning("dropped a lora_copy_in command for %s", safe(repr(name)))
                    continue
                lora.copy_in(lora.read(name, path, lora_id), slot)
            elif op == "logits":
                try:
                    rows = _unpack_tensor(command["rows"], device)
                    if hidden is None:
                        raise ValueError("a logits command before any forward")
                except Exception as e:  # noqa: BLE001
                    channel.dropped.warning("dropped a logits command: %r", e)
                    continue
                model.compute_logits(hidden[rows])
            elif op == "dummy":
                model(dummy_forward_batch(block_size, device), kv_cache)
            elif op == "stop":
                code = command.get("code", 0)
                code = code if isinstance(code, int) and 0 <= code < 256 else 1
                (log.info if code == 0 else log.error)(
                    "%s says stop (it exits with code %d); exiting", channel.leader, code
                )
                return code
