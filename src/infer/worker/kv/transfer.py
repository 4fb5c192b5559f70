"""Disaggregated prefill and decode between workers: the KV role (`--kv-transfer-config`) and the transfers, sans-I/O
(no torch, no sockets: the engine's bytes come through `KvPort`, worker/kv/port.py; the sockets are
worker/service/daemon.py's).

A producer (kv_producer) runs a request the coordinator dispatched with a consumer named (`Dispatch.kv_consumer_*`)
until its first token, then gives it back; between the two, `KvSender` moves its KV to the consumer:

    producer --KvOffer(tokens, fingerprint, adapter)--> consumer's KV socket (the prompt's full blocks, by their tokens)
    producer <--KvWant(first_block)-- consumer                             (the leading blocks it holds already)
    producer --KvBlocks(first_block.., payloads, checksums) x frames--> consumer
    producer <--KvStored(stored) x frames-- consumer                       (stored as cached prefix-cache blocks)

and only then tells the coordinator (the request's abort delta, ErrorCode.KV_HANDOFF), which continues the request
on that consumer as a resumed request: its admission hits the blocks, it prefills only the tail. A transfer ends
after its last KvStored, a refusal, or `kv_transfer_timeout` seconds from its start, whichever comes first: a dead or
stalled consumer costs that long, then the request goes on anyway (the consumer, or whoever takes it, recomputes
what it lacks). A producer that dies mid-transfer is a dead worker: its requests fail over as ever.

`KvReceiver` answers on the consumer; it keeps no state between frames (each carries the tokens it belongs to).

A LoRA request's KV travels with its adapter's name (its blocks are the adapter's: the prefix cache keys them by the
adapter): the consumer stores them under its own id of that adapter, and refuses the offer when it has none loaded
by that name (the request then recomputes there, or wherever the coordinator sends it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import xxhash

from infer.protocol.logsafe import safe
from infer.protocol.messages import KV_ROLES, KvBlocks, KvOffer, KvStored, KvWant, Message

log = logging.getLogger("infer.kv_transfer")

MAX_FRAME_PAYLOAD = 32 << 20  # bytes of block payloads per KvBlocks frame (frames are bounded at 64 MiB)
MAX_TRANSFER_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class KvTransferConfig:
    """`--kv-transfer-config` (vLLM's flag and key names): `kv_role` kv_both (the default: no transfers),
    kv_producer (prefills, hands requests off) or kv_consumer (receives KV blocks, decodes); `kv_port` the consumer's
    KV socket (0: one the OS chooses); `kv_transfer_timeout` seconds a producer waits for a transfer to finish;
    `kv_shm_dir` the shared-memory directory blocks go through when the consumer sees it too ("": TCP always)."""

    kv_role: str = "kv_both"
    kv_port: int = 0
    kv_transfer_timeout: float = 10.0
    kv_shm_dir: str = "/dev/shm"  # shared memory between a producer and a consumer that both see it ("": never)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r:.80}"
            )
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config: kv_port must be an integer in [0, 65535], got {self.kv_port!r}")
        if not isinstance(self.kv_shm_dir, str) or (self.kv_shm_dir and not self.kv_shm_dir.startswith("/")):
            raise ValueError(f'kv_transfer_config: kv_shm_dir must be an absolute path or "", got {self.kv_shm_dir!r}')
        timeout = self.kv_transfer_timeout
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout <= MAX_TRANSFER_TIMEOUT_S
        ):
            raise ValueError(
                f"kv_transfer_config: kv_transfer_timeout must be in (0, {MAX_TRANSFER_TIMEOUT_S:g}] s, got {timeout!r}"
            )

    @classmethod
    def of(cls, value: KvTransferConfig | dict[str, Any] | str) -> KvTransferConfig:
        """From a dict of its keys or their JSON text; an unknown key or a bad value is a ValueError naming it."""
        if isinstance(value, KvTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config: not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {type(value).__name__}")
        known = ("kv_role", "kv_port", "kv_transfer_timeout", "kv_shm_dir")
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(
                f"kv_transfer_config: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
            )
        if "kv_role" not in value:
            raise ValueError("kv_transfer_config: 'kv_role' is required")
        return cls(**value)

    @property
    def producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def consumer(self) -> bool:
        return self.kv_role == "kv_consumer"

    def __str__(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


class Exported(NamedTuple):
    """A request's KV as a producer sends it: the tokens whose KV it holds, each full block's bytes, and the LoRA
    adapter they were computed with (None: the base model)."""

    token_ids: list[int]
    payloads: list[bytes]
    lora_name: str | None = None


class KvBlocksPort(Protocol):
    """What the transfers need of the engine (worker/kv/port.py's KvPort). `first_missing` and `store` raise
    ValueError for an adapter this engine has not loaded."""

    def export(self, request_id: str) -> Exported | None: ...

    def first_missing(self, token_ids: Sequence[int], lora_name: str | None = None) -> int: ...

    def store(
        self, token_ids: Sequence[int], first_block: int, payloads: Sequence[bytes], lora_name: str | None = None
    ) -> int: ...

    def fingerprint(self, weight_version: int) -> bytes: ...

    @property
    def block_bytes(self) -> int: ...


class SharedMemory(Protocol):
    """Where blocks go between workers that share a directory in memory (worker/service/kv_links.py ShmArea)."""

    def new_probe(self) -> tuple[str, str]: ...

    def sees(self, path: str, token: str) -> bool: ...

    def write(self, payloads: Sequence[bytes]) -> str: ...

    def read(self, path: str, size: int) -> bytes | None: ...

    def remove(self, path: str) -> None: ...


@dataclass
class Transfer:
    """One request's KV on its way from this producer to a consumer."""

    request_id: str
    address: str
    server_key: str  # the consumer's public key, z85 ("" without keys)
    token_ids: list[int]
    payloads: list[bytes]
    fingerprint: bytes
    deadline: float
    num_blocks: int = 0
    frames_left: int = 0  # KvStored still expected
    shm_paths: list[str] = dataclasses.field(default_factory=list)  # its files in shared memory (removed at its end)
    stored: int = 0
    outcome: str | None = None  # set when it ended: "stored N of M blocks", or why not
    lora_name: str | None = None


class KvSender:
    """A producer's transfers in flight (see the module docstring): `start` one, feed the consumer's answers to
    `on_message`, `tick` for the deadlines; `take_outgoing` gives (address, server key, message) to send, `take_done`
    the transfers that ended."""

    def __init__(self, timeout_s: float, shm: SharedMemory | None = None) -> None:
        self.timeout_s = timeout_s
        self.shm = shm  # set by the shell when shared memory is on
        self._shm_peers: set[str] = set()  # consumers reached through shared memory (logged once each)
        self.transfers: dict[str, Transfer] = {}  # by transfer id = request id
        self._outgoing: list[tuple[str, str, Message]] = []
        self._done: list[Transfer] = []
        self.completed = 0  # transfers whose every frame was answered
        self.failed = 0  # refused or timed out

    def start(
        self,
        request_id: str,
        address: str,
        server_key: str,
        exported: Exported | None,
        fingerprint: bytes,
        now: float,
    ) -> None:
        tokens, payloads, lora_name = exported if exported is not None else ([], [], None)
        transfer = Transfer(
            request_id,
            address,
            server_key,
            tokens,
            payloads,
            fingerprint,
            now + self.timeout_s,
            len(payloads),
            lora_name=lora_name,
        )
        if not payloads:
            return self._end(transfer, "nothing to send (no full block)", failed=False)
        self.transfers[request_id] = transfer
        probe, token = self.shm.new_probe() if self.shm is not None else (None, None)
        if probe is not None:
            transfer.shm_paths.append(probe)
        offer = KvOffer(
            transfer_id=request_id,
            fingerprint=fingerprint,
            token_ids=tokens,
            shm_probe=probe,
            shm_token=token,
            lora_name=lora_name,
        )
        self._outgoing.append((address, server_key, offer))

    def on_message(self, msg: Message) -> None:
        transfer = self.transfers.get(getattr(msg, "transfer_id", ""))
        if transfer is None:
            return  # ended already (a late answer) or unknown
        if isinstance(msg, KvWant):
            self._send_blocks(transfer, msg)
        elif isinstance(msg, KvStored):
            transfer.stored += msg.stored
            transfer.frames_left -= 1
            if msg.refusal is not None:
                log.info(
                    "KV transfer of %s: the consumer dropped blocks: %s", safe(transfer.request_id), safe(msg.refusal)
                )
            if transfer.frames_left <= 0:
                self._end(transfer, f"stored {transfer.stored} of {transfer.num_blocks} blocks", failed=False)

    def _send_blocks(self, transfer: Transfer, want: KvWant) -> None:
        if want.refusal is not None:
            return self._end(transfer, f"refused by the consumer: {safe(want.refusal)}", failed=True)
        first = min(want.first_block, transfer.num_blocks)
        transfer.stored = first  # held there already
        if first == transfer.num_blocks:
            return self._end(transfer, "the consumer holds every block already", failed=False)
        per_frame = max(1, MAX_FRAME_PAYLOAD // max(1, len(transfer.payloads[0])))
        starts = range(first, len(transfer.payloads), per_frame)
        transfer.frames_left = len(starts)
        shm = self.shm if want.shm else None
        if shm is not None and transfer.address not in self._shm_peers:
            self._shm_peers.add(transfer.address)
            log.info("KV transfers to %s go through shared memory", safe(transfer.address))
        for start in starts:
            blocks = transfer.payloads[start : start + per_frame]
            path = None
            if shm is not None:
                path = shm.write(blocks)
                transfer.shm_paths.append(path)
            frame = KvBlocks(
                transfer_id=transfer.request_id,
                fingerprint=transfer.fingerprint,
                token_ids=transfer.token_ids,
                first_block=start,
                blocks=[] if path is not None else blocks,
                checksums=[xxhash.xxh3_64_intdigest(b) for b in blocks],
                last=start + per_frame >= len(transfer.payloads),
                shm_path=path,
                lora_name=transfer.lora_name,
            )
            self._outgoing.append((transfer.address, transfer.server_key, frame))
        transfer.payloads = []  # in the frames now

    def tick(self, now: float) -> None:
        for transfer in [t for t in self.transfers.values() if now >= t.deadline]:
            self._end(transfer, f"timed out after {self.timeout_s:g} s (kv_transfer_timeout)", failed=True)

    def next_deadline(self) -> float | None:
        return min((t.deadline for t in self.transfers.values()), default=None)

    def end_all(self, reason: str) -> None:
        """End every transfer under way now (a drain's deadline): their requests go back as they stand."""
        for transfer in list(self.transfers.values()):
            self._end(transfer, reason, failed=True)

    def cancel(self, request_id: str) -> None:
        """The request ended here meanwhile (aborted by the coordinator): forget its transfer."""
        self.transfers.pop(request_id, None)

    def _end(self, transfer: Transfer, outcome: str, failed: bool) -> None:
        self.transfers.pop(transfer.request_id, None)
        transfer.outcome = outcome
        transfer.payloads = []  # the bytes are not needed any more
        if self.shm is not None:
            for path in transfer.shm_paths:
                self.shm.remove(path)
        if failed:
            self.failed += 1
            log.warning("KV transfer of %s to %s: %s", safe(transfer.request_id), safe(transfer.address), outcome)
        else:
            self.completed += 1
            log.debug("KV transfer of %s to %s: %s", safe(transfer.request_id), safe(transfer.address), outcome)
        self._done.append(transfer)

    def take_outgoing(self) -> list[tuple[str, str, Message]]:
        out, self._outgoing = self._outgoing, []
        return out

    def take_done(self) -> list[Transfer]:
        done, self._done = self._done, []
        return done


class KvReceiver:
    """A consumer's answers to producers (see the module docstring); no state between frames."""

    def __init__(self, port: KvBlocksPort, shm: SharedMemory | None = None) -> None:
        self.port = port
        self.shm = shm  # set by the shell when shared memory is on

    def on_message(self, msg: Message, fingerprint: bytes) -> Message | None:
        """The answer to a producer's frame; `fingerprint`: this engine's now (its weights may have changed)."""
        if isinstance(msg, KvOffer):
            if msg.fingerprint != fingerprint:
                return KvWant(transfer_id=msg.transfer_id, refusal=_FOREIGN)
            shared = (
                self.shm is not None and msg.shm_probe is not None and self.shm.sees(msg.shm_probe, msg.shm_token or "")
            )
            try:
                first = self.port.first_missing(msg.token_ids, msg.lora_name)
            except ValueError as e:  # an adapter not loaded here
                return KvWant(transfer_id=msg.transfer_id, refusal=str(e))
            return KvWant(transfer_id=msg.transfer_id, first_block=first, shm=shared)
        if isinstance(msg, KvBlocks):
            if msg.fingerprint != fingerprint:
                return KvStored(transfer_id=msg.transfer_id, last=msg.last, refusal=_FOREIGN)
            blocks = self._blocks(msg)
            if blocks is None:
                return KvStored(transfer_id=msg.transfer_id, last=msg.last, refusal="its shared memory is unreadable")
            if any(xxhash.xxh3_64_intdigest(b) != c for b, c in zip(blocks, msg.checksums, strict=True)):
                return KvStored(transfer_id=msg.transfer_id, last=msg.last, refusal="a block's checksum differs")
            try:
                stored = self.port.store(msg.token_ids, msg.first_block, blocks, msg.lora_name)
            except ValueError as e:  # the adapter was unloaded since the offer
                return KvStored(transfer_id=msg.transfer_id, last=msg.last, refusal=str(e))
            refusal = None if stored == len(blocks) else "no free block for the rest (or the prefix was evicted)"
            return KvStored(transfer_id=msg.transfer_id, stored=stored, last=msg.last, refusal=refusal)
        return None

    def _blocks(self, msg: KvBlocks) -> list[bytes] | None:
        """The frame's payloads: its own, or those in its shared-memory file (None: not readable here)."""
        if msg.shm_path is None:
            return list(msg.blocks)
        step = self.port.block_bytes
        size = step * len(msg.checksums)
        data = None if self.shm is None else self.shm.read(msg.shm_path, size)
        if data is None:
            return None
        return [data[i : i + step] for i in range(0, size, step)]


_FOREIGN = "another model, weight version, dtype or block geometry"
