"""DiskStore: the KV tier beyond the pool, one file per spilled prefix-cache block in a local directory (no torch).

A block evicted from the pool (worker/engine/block_manager.py) is written here by a background thread; a later
prefix-cache miss on its hash reads it back (worker/kv/offload.py moves the bytes between the pool and this store).

File: `<hash as 16 hex digits>.kv` in this worker's slot directory, `DIR/<fingerprint[:16]>-<n>` (the first slot
whose lock, an flock on `.lock`, is free: workers of one model on one host share DIR without sharing files; a
restarted worker takes its slot back and reuses what it finds there). Each file is a fixed header and the payload:

    magic b"INFERKV\\0", format version (u32), payload length (u64), fingerprint (16 bytes: model, weights, dtype, block
    geometry: worker/kv/offload.py), block hash (u64: the prefix cache's key, protocol/prefix_hash.py), prefix digest
    (16 bytes: prefix_hash.prefix_digest, blake2b chained over every token of the prefix: the proof that the block
    holds *these* tokens' KV, since a 64-bit hash alone is never trusted), payload checksum (u64: xxh3_64), then the
    payload.

A file that is truncated, fails its checksum, names another hash or digest, or comes from another format, model or
geometry is deleted and counted (`corrupt`), and the block is recomputed: its bytes are never served.

Bounds: at most `max_bytes` of files (the least recently written or read are deleted first: LRU); at most
`max_queue` spills waiting for the writer (past it a spill is dropped and counted: the step loop never waits on the
disk). Thread safety: the index and counters are guarded by one lock; `load` runs on the caller's thread (the engine
step), writes on the writer thread. `take_changes` hands the engine the hashes that arrived on disk or left it, for
the KV events (worker/kv/events.py), on the engine's thread.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import xxhash

log = logging.getLogger("infer.kv_offload")

MAGIC = b"INFERKV\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ16sQ16sQ")  # magic, version, payload length, fingerprint, hash, digest, checksum
HEADER_SIZE = _HEADER.size
SUFFIX = ".kv"
MAX_SLOTS = 64  # slot directories tried per fingerprint before giving up
MAX_QUEUE = 256  # spills waiting for the writer


def payload_checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack_block(fingerprint: bytes, block_hash: int, digest: bytes, payload: bytes | memoryview) -> bytes:
    """A spilled block's file contents: header + payload."""
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, len(payload), fingerprint, block_hash, digest, payload_checksum(payload)
    )
    return header + bytes(payload)


class BadBlock(ValueError):
    """A spill file that must not be served: why, in words (for the log)."""


def unpack_block(data: bytes, fingerprint: bytes, block_hash: int, digest: bytes, payload_size: int) -> memoryview:
    """The payload of a file's `data`, after checking everything its header says against what the reader expects;
    BadBlock (the reason) otherwise."""
    if len(data) < HEADER_SIZE:
        raise BadBlock(f"truncated: {len(data)} bytes, no whole header")
    magic, version, size, file_fp, file_hash, file_digest, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise BadBlock(f"not a format-{FORMAT_VERSION} spill file (magic {magic!r}, version {version})")
    if file_fp != fingerprint:
        raise BadBlock("foreign: written for another model, weights, dtype or block geometry")
    if size != payload_size:
        raise BadBlock(f"foreign geometry: a payload of {size} bytes, blocks here have {payload_size}")
    if file_hash != block_hash or file_digest != digest:
        raise BadBlock("holds another prefix (hash or digest differ)")
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != size:
        raise BadBlock(f"truncated or overlong: {len(payload)} payload bytes, the header says {size}")
    if payload_checksum(payload) != checksum:
        raise BadBlock("checksum mismatch")
    return payload


@dataclass
class OffloadCounters:
    """Since the store opened: blocks written, read back into the pool, not written (queue full, write error),
    rejected files (corrupt, truncated, foreign, unreadable) and files deleted by the size bound."""

    spilled: int = 0
    loaded: int = 0
    dropped: int = 0
    corrupt: int = 0
    evicted: int = 0


@dataclass(frozen=True)
class _Spill:
    generation: int
    block_hash: int
    digest: bytes
    payload: Callable[[], bytes]  # made on the writer thread (the tensor -> bytes copy, off the step loop)


class DiskStore:
    """One worker's spill directory: an LRU index of hash -> file size, the writer thread, the counters."""

    def __init__(self, root: Path, fingerprint: bytes, max_bytes: int, block_bytes: int, max_queue: int = MAX_QUEUE):
        if max_bytes < HEADER_SIZE + block_bytes:
            raise ValueError(
                f"kv_offload_gb holds no block: {max_bytes} bytes, one spilled block takes {HEADER_SIZE + block_bytes}"
            )
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.block_bytes = block_bytes
        self.counters = OffloadCounters()
        self.path, self._lock_file = _take_slot(root, fingerprint)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self._queued: set[int] = set()  # hashes waiting for the writer
        self._changes: list[tuple[int, bool]] = []  # (hash, now on disk) for the KV events
        self._generation = 0  # +1 per clear(): spills queued before it are not written
        self._queue: queue.Queue[_Spill | None] = queue.Queue(maxsize=max_queue)
        self._flush_events: list[threading.Event] = []  # flush() callers, woken when the writer reaches them
        self._stop = False
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    # ---- the engine's side ------------------------------------------------------------------------

    def holds(self, block_hash: int) -> bool:
        """On disk, or queued to be written (for the KV events: a spilled hash stays held)."""
        with self._lock:
            return block_hash in self._index or block_hash in self._queued

    def on_disk(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._index

    def hashes(self) -> list[int]:
        with self._lock:
            return list(self._index) + list(self._queued)

    @property
    def num_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def spill(self, block_hash: int, digest: bytes, payload: Callable[[], bytes]) -> bool:
        """Queue a block for writing (`payload()` is called on the writer thread); False when it was dropped (the
        queue is full) or needs no write (on disk or queued already)."""
        with self._lock:
            if block_hash in self._index or block_hash in self._queued:
                return False
            item = _Spill(self._generation, block_hash, digest, payload)
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.counters.dropped += 1
                return False
            self._queued.add(block_hash)
            return True

    def load(self, block_hash: int, digest: bytes) -> memoryview | None:
        """The payload of the block with this hash and prefix digest, checked (see the module docstring), or None:
        not on disk, or rejected (then deleted and counted). Marks the file recently used."""
        with self._lock:
            if block_hash not in self._index:
                return None
            self._index.move_to_end(block_hash)
        file = self._file(block_hash)
        try:
            with open(file, "rb") as f:
                data = f.read(HEADER_SIZE + self.block_bytes + 1)
            payload = unpack_block(data, self.fingerprint, block_hash, digest, self.block_bytes)
        except FileNotFoundError as e:
            with self._lock:
                if block_hash not in self._index:
                    return None  # the writer deleted it for room meanwhile: a plain miss
            self._reject(block_hash, e)
            return None
        except (OSError, BadBlock) as e:
            self._reject(block_hash, e)
            return None
        with self._lock:
            self.counters.loaded += 1
        return payload

    def _reject(self, block_hash: int, reason: Exception) -> None:
        """A file that must not be served: logged, counted, deleted."""
        log.warning("spilled KV block %016x rejected (recomputed): %s", block_hash, reason)
        with self._lock:
            self.counters.corrupt += 1
            self._forget(block_hash)

    def take_changes(self) -> list[tuple[int, bool]]:
        """(hash, on disk now) since the last call, oldest first: arrivals and departures for the KV events."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def clear(self) -> int:
        """Delete every file (the KV they hold is stale: new weights); spills still queued are not written. Returns
        how many files went."""
        with self._lock:
            self._generation += 1
            hashes = list(self._index)
            for block_hash in hashes:
                self._forget(block_hash, record=False)
            self._queued.clear()
            self._changes.clear()
        return len(hashes)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued spill is written (tests, close); False if `timeout` passed first."""
        done = threading.Event()
        self._flush_events.append(done)
        self._queue.put(None)  # a marker: the writer sets `done` (and those before it) when it reaches it
        return done.wait(timeout)

    def close(self) -> None:
        """Write what is queued, stop the writer, release the slot. Idempotent."""
        if self._writer.is_alive():
            self.flush(timeout=30)
            self._stop = True
            self._queue.put(None)
            self._writer.join(timeout=30)
        if not self._lock_file.closed:
            self._lock_file.close()

    # ---- the writer thread ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                while self._flush_events:
                    self._flush_events.pop(0).set()
                if self._stop:
                    return
                continue
            try:
                self._write(item)
            except Exception as e:  # a full or failing disk loses the spill, never the worker
                log.warning("spilling KV block %016x failed: %s", item.block_hash, e)
                with self._lock:
                    self._queued.discard(item.block_hash)
                    self._changes.append((item.block_hash, False))
                    self.counters.dropped += 1

    def _write(self, item: _Spill) -> None:
        data = pack_block(self.fingerprint, item.block_hash, item.digest, item.payload())
        file = self._file(item.block_hash)
        tmp = file.with_suffix(".tmp")
        with self._lock:
            if item.generation != self._generation:
                return  # cleared meanwhile: stale KV
            self._make_room(len(data))
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, file)
        with self._lock:
            self._queued.discard(item.block_hash)
            if item.generation != self._generation:
                file.unlink(missing_ok=True)
                return
            self._index[item.block_hash] = len(data)
            self._bytes += len(data)
            self._changes.append((item.block_hash, True))
            self.counters.spilled += 1

    # ---- the index (called with the lock held) ---------------------------------------------------

    def _make_room(self, size: int) -> None:
        while self._index and self._bytes + size > self.max_bytes:
            block_hash = next(iter(self._index))
            self._forget(block_hash)
            self.counters.evicted += 1

    def _forget(self, block_hash: int, record: bool = True) -> None:
        self._bytes -= self._index.pop(block_hash, 0)
        try:
            self._file(block_hash).unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete spilled KV block %016x: %s", block_hash, e)
        if record:
            self._changes.append((block_hash, False))

    def _file(self, block_hash: int) -> Path:
        return self.path / f"{block_hash:016x}{SUFFIX}"

    def _scan(self) -> None:
        """Index the files a previous run of this slot left (oldest first, by modification time); half-written
        ones (.tmp) and files of no block's name are deleted. Contents are checked when read (`load`)."""
        found: list[tuple[int, int, int]] = []  # (mtime, hash, size)
        for entry in os.scandir(self.path):
            name = entry.name
            if name == ".lock" or not entry.is_file(follow_symlinks=False):
                continue
            block_hash = _hash_of(name)
            if block_hash is None:
                Path(entry.path).unlink(missing_ok=True)
                continue
            stat = entry.stat(follow_symlinks=False)
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self._bytes += size
        with self._lock:
            self._make_room(0)
            self._changes.clear()
        if found:
            log.info("KV offload: %d spilled block(s) found in %s (%d bytes)", len(self._index), self.path, self._bytes)


def _hash_of(name: str) -> int | None:
    stem, dot, suffix = name.partition(".")
    if "." + suffix != SUFFIX or len(stem) != 16:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def check_offload_dir(path: str) -> Path:
    """The directory `--kv-offload-dir` names, checked: it exists, is a directory, and this process may write there
    (ValueError naming what is wrong)."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"--kv-offload-dir {path}: no such directory")
    if not root.is_dir():
        raise ValueError(f"--kv-offload-dir {path}: not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise ValueError(f"--kv-offload-dir {path}: not writable by this process")
    return root


def _take_slot(root: Path, fingerprint: bytes) -> tuple[Path, IO[bytes]]:
    """This worker's slot directory under `root` and its held lock (see the module docstring)."""
    check_offload_dir(str(root))
    for n in range(MAX_SLOTS):
        path = root / f"{fingerprint.hex()[:16]}-{n}"
        try:
            path.mkdir(exist_ok=True)
            lock = open(path / ".lock", "a+b")
        except OSError as e:
            raise ValueError(f"--kv-offload-dir {root}: cannot use {path}: {e}") from e
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            lock.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                continue  # another worker's slot
            raise ValueError(f"--kv-offload-dir {root}: cannot lock {path}: {e}") from e
        return path, lock
    raise ValueError(f"--kv-offload-dir {root}: all {MAX_SLOTS} slots of this model are taken by other workers")


def iter_spill_files(path: Path) -> Iterable[Path]:
    """The spill files of one slot directory (tests, tools)."""
    return sorted(p for p in path.iterdir() if p.suffix == SUFFIX)
