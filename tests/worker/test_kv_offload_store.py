"""DiskStore (worker/kv/offload_store.py), no torch: the file format and its checks (corrupt, truncated, foreign,
another prefix: rejected, deleted, counted), the size bound (LRU), the bounded writer queue (a full queue drops),
a restarted store reusing its slot, slots kept apart by their locks, the directory's checks and the config's.
HostStore (worker/kv/host_store.py), no torch: slots over a bytearray, LRU departures (their payload checked on the
way down), checksum and prefix checks on load."""

from __future__ import annotations

import argparse
import os
import threading

import pytest

from infer.protocol.options import add_options, given, to_argv
from infer.protocol.prefix_hash import prefix_digest
from infer.worker.engine.config import EngineConfig
from infer.worker.kv.host_store import HostStore
from infer.worker.kv.offload_store import (
    HEADER_SIZE,
    DiskStore,
    check_offload_dir,
    iter_spill_files,
    pack_block,
    unpack_block,
)

FP = bytes(range(16))
BLOCK = 64  # payload bytes


def payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(BLOCK))


def digest(i: int) -> bytes:
    return prefix_digest(None, [i] * 4)


def store_of(tmp_path, max_blocks: int = 100, **kw) -> DiskStore:
    return DiskStore(tmp_path, FP, max_blocks * (HEADER_SIZE + BLOCK), BLOCK, **kw)


def spill(store: DiskStore, *ids: int) -> None:
    for i in ids:
        assert store.spill(i, digest(i), lambda i=i: payload(i))
    assert store.flush(timeout=30)


def test_a_block_round_trips_and_every_header_field_is_checked():
    data = pack_block(FP, 5, digest(5), payload(5))
    assert bytes(unpack_block(data, FP, 5, digest(5), BLOCK)) == payload(5)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    cases = {
        "checksum mismatch": bytes(flipped),
        "no whole header": data[: HEADER_SIZE - 1],
        "truncated or overlong": data[:-1],
        "not a format-1 spill file": b"X" + data[1:],
    }
    for reason, bad in cases.items():
        with pytest.raises(ValueError, match=reason):
            unpack_block(bad, FP, 5, digest(5), BLOCK)
    with pytest.raises(ValueError, match="foreign: written for another model"):
        unpack_block(data, bytes(16), 5, digest(5), BLOCK)
    with pytest.raises(ValueError, match="foreign geometry"):
        unpack_block(data, FP, 5, digest(5), BLOCK * 2)
    with pytest.raises(ValueError, match="another prefix"):
        unpack_block(data, FP, 6, digest(5), BLOCK)
    with pytest.raises(ValueError, match="another prefix"):
        unpack_block(data, FP, 5, digest(6), BLOCK)


def test_spilled_blocks_load_back_and_report_their_arrival(tmp_path):
    store = store_of(tmp_path)
    spill(store, 1, 2)
    assert store.on_disk(1) and store.holds(2) and not store.holds(3)
    assert bytes(store.load(1, digest(1))) == payload(1)
    assert store.take_changes() == [(1, True), (2, True)]
    assert (store.counters.spilled, store.counters.loaded) == (2, 1)
    assert not store.spill(1, digest(1), lambda: payload(1))  # on disk already: no second write
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "empty", "unreadable"])
def test_a_damaged_file_is_rejected_deleted_and_counted(tmp_path, damage):
    store = store_of(tmp_path)
    spill(store, 1)
    store.take_changes()
    (file,) = iter_spill_files(store.path)
    data = bytearray(file.read_bytes())
    if damage == "flip":
        data[HEADER_SIZE + 3] ^= 0x10
    elif damage == "truncate":
        data = data[: HEADER_SIZE + BLOCK // 2]
    elif damage == "foreign":
        data = bytearray(pack_block(bytes(16), 1, digest(1), payload(1)))
    elif damage == "empty":
        data = bytearray()
    if damage == "unreadable":
        file.unlink()
        file.mkdir()  # opening it for reading fails
    else:
        file.write_bytes(bytes(data))
    assert store.load(1, digest(1)) is None
    assert store.counters.corrupt == 1 and store.counters.loaded == 0
    assert not store.on_disk(1) and store.take_changes() == [(1, False)]
    if damage != "unreadable":
        assert not file.exists()
    store.close()


def test_the_size_bound_holds_by_deleting_the_least_recently_used(tmp_path):
    store = store_of(tmp_path, max_blocks=3)
    spill(store, 1, 2, 3)
    assert store.load(1, digest(1)) is not None  # 1 is now the most recently used
    spill(store, 4)
    assert not store.on_disk(2) and all(store.on_disk(i) for i in (1, 3, 4))
    assert store.num_bytes <= store.max_bytes
    assert sum(f.stat().st_size for f in iter_spill_files(store.path)) <= store.max_bytes
    assert store.counters.evicted == 1
    store.close()


def test_a_full_queue_drops_the_spill_and_counts_it(tmp_path):
    store = store_of(tmp_path, max_queue=1)
    release = threading.Event()

    def slow() -> bytes:
        release.wait(30)
        return payload(1)

    assert store.spill(1, digest(1), slow)  # the writer takes it and waits in slow()
    # the writer may not have taken the first yet: then the second fills the queue; either way one of the next two
    # finds it full
    results = [store.spill(i, digest(i), lambda i=i: payload(i)) for i in (2, 3)]
    assert not all(results) and store.counters.dropped == results.count(False)
    release.set()
    assert store.flush(timeout=30)
    assert store.counters.spilled == 1 + results.count(True)
    store.close()


def test_a_restarted_store_reuses_its_slot_and_cleans_half_written_files(tmp_path):
    store = store_of(tmp_path)
    spill(store, 1, 2)
    path = store.path
    store.close()
    (path / "0000000000000003.tmp").write_bytes(b"half")
    (path / "junk").write_bytes(b"?")
    again = store_of(tmp_path)
    assert again.path == path and len(again) == 2
    assert bytes(again.load(2, digest(2))) == payload(2)
    assert sorted(p.name for p in path.iterdir() if p.name != ".lock") == [f"{i:016x}.kv" for i in (1, 2)]
    again.close()


def test_workers_sharing_a_directory_get_slots_of_their_own(tmp_path):
    first, second = store_of(tmp_path), store_of(tmp_path)
    assert first.path != second.path and first.path.parent == second.path.parent == tmp_path
    spill(first, 1)
    assert not second.on_disk(1)
    first.close()
    second.close()


def test_clear_deletes_everything_and_skips_what_was_queued(tmp_path):
    store = store_of(tmp_path)
    spill(store, 1, 2)
    assert store.clear() == 2
    assert len(store) == 0 and not list(iter_spill_files(store.path)) and store.num_bytes == 0
    store.close()


def test_the_directory_and_the_bound_are_checked(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        check_offload_dir(str(tmp_path / "missing"))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        check_offload_dir(str(tmp_path / "file"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_offload_dir(str(locked))
    with pytest.raises(ValueError, match="holds no block"):
        DiskStore(tmp_path, FP, HEADER_SIZE + BLOCK - 1, BLOCK)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_offload_host_gb": 0}, "kv_offload_host_gb must be a number of GiB > 0"),
        ({"kv_offload_host_gb": -2}, "kv_offload_host_gb must be a number of GiB > 0"),
        ({"kv_offload_host_gb": "4"}, "kv_offload_host_gb must be a number of GiB > 0"),
        ({"kv_offload_host_gb": float("nan")}, "kv_offload_host_gb must be a number of GiB > 0"),
        ({"kv_offload_host_gb": True}, "kv_offload_host_gb must be a number of GiB > 0"),
        (
            {"kv_offload_host_gb": 1, "enable_prefix_caching": False},
            "kv_offload_host_gb .* needs enable_prefix_caching",
        ),
        ({"kv_offload_dir": "/tmp", "kv_offload_gb": 0}, "kv_offload_gb must be a number of GiB > 0"),
        ({"kv_offload_dir": "/tmp", "kv_offload_gb": -1.5}, "kv_offload_gb must be a number of GiB > 0"),
        ({"kv_offload_dir": "/tmp"}, "go together"),
        ({"kv_offload_gb": 1}, "go together"),
        ({"kv_offload_dir": "", "kv_offload_gb": 1}, "non-empty directory path"),
        ({"kv_offload_dir": "/tmp", "kv_offload_gb": 1, "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ],
)
def test_the_engine_options_are_validated(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    assert EngineConfig(kv_offload_dir="/tmp", kv_offload_gb=0.5).kv_offload_bytes == 1 << 29
    assert EngineConfig(kv_offload_host_gb=0.25).kv_offload_host_bytes == 1 << 28
    both = EngineConfig(kv_offload_host_gb=2, kv_offload_dir="/tmp", kv_offload_gb=8)
    assert (both.kv_offload_host_bytes, both.kv_offload_bytes) == (2 << 30, 8 << 30)


def test_the_flags_parse_and_survive_argv(tmp_path):
    parser = argparse.ArgumentParser()
    add_options(parser, EngineConfig)
    args = parser.parse_args(["--kv-offload-dir", str(tmp_path), "--kv-offload-gb", "2.5"])
    config = EngineConfig.from_options(**given(EngineConfig, args))
    assert (config.kv_offload_dir, config.kv_offload_gb) == (str(tmp_path), 2.5)
    assert to_argv(EngineConfig, config) == ["--kv-offload-dir", str(tmp_path), "--kv-offload-gb", "2.5"]


@pytest.mark.parametrize("flag", ["--kv-offload-host-gb", "--kv-offloading-size"])  # ours, vLLM's
def test_the_host_tier_flag_parses_and_survives_argv(flag):
    parser = argparse.ArgumentParser()
    add_options(parser, EngineConfig)
    config = EngineConfig.from_options(**given(EngineConfig, parser.parse_args([flag, "1.5"])))
    assert config.kv_offload_host_gb == 1.5
    assert to_argv(EngineConfig, config) == ["--kv-offload-host-gb", "1.5"]
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "lots"])


# ---- HostStore ----------------------------------------------------------------------------------


def host_of(slots: int) -> tuple[HostStore, bytearray]:
    """A host store over a bytearray of `slots` blocks (the engine's is a tensor's bytes)."""
    memory = bytearray(slots * BLOCK)
    view = memoryview(memory)
    return HostStore(slots, lambda slot: view[slot * BLOCK : (slot + 1) * BLOCK]), memory


def host_put(store: HostStore, memory: bytearray, i: int, below: bool = True):
    """Copy block `i` in as the engine does (take a slot, write it, put); returns the block pushed out, if any
    (`below`: the tier below wants it)."""
    taken = store.take_slot(lambda block_hash: below)
    assert taken is not None
    slot, departed = taken
    memory[slot * BLOCK : (slot + 1) * BLOCK] = payload(i)
    store.put(i, digest(i), slot)
    return departed


def test_host_blocks_load_back_and_the_least_recently_used_leaves_with_its_payload():
    store, memory = host_of(2)
    assert host_put(store, memory, 1) is None and host_put(store, memory, 2) is None
    slot = store.load(1, digest(1))  # 1 is now the most recently used
    assert slot is not None and bytes(memory[slot * BLOCK : (slot + 1) * BLOCK]) == payload(1)
    departed = host_put(store, memory, 3)
    assert (departed.block_hash, departed.digest, departed.payload) == (2, digest(2), payload(2))
    assert store.hashes() == [1, 3] and not store.holds(2)
    assert host_put(store, memory, 4, below=False).payload is None  # no disk below (or it has it): not copied
    assert store.take_changes() == [(1, True), (2, True), (2, False), (3, True), (1, False), (4, True)]
    assert (store.counters.spilled, store.counters.loaded, store.counters.corrupt) == (4, 1, 0)
    assert store.clear() == 2 and len(store) == 0 and store.take_changes() == []
    assert (
        all(store.take_slot(lambda h: True) is not None for _ in range(2)) and store.take_slot(lambda h: True) is None
    )


def test_a_corrupt_host_entry_is_rejected_forgotten_and_counted():
    store, memory = host_of(3)
    for i in (1, 2, 3):
        host_put(store, memory, i)
    store.take_changes()
    memory[0 * BLOCK + 5] ^= 0x40  # one bit of block 1's payload (slot 0)
    assert store.load(1, digest(1)) is None  # checksum mismatch
    assert store.load(2, digest(3)) is None  # the hash's entry proves another prefix
    assert store.counters.corrupt == 2 and store.counters.loaded == 0
    assert store.take_changes() == [(1, False), (2, False)] and store.hashes() == [3]
    memory[2 * BLOCK] ^= 1  # block 3's (slot 2), then pushed out towards the disk: not copied down
    host_put(store, memory, 4)
    host_put(store, memory, 5)
    departed = host_put(store, memory, 6)
    assert departed.block_hash == 3 and departed.payload is None and store.counters.corrupt == 3
    with pytest.raises(ValueError, match="holds no block"):
        HostStore(0, lambda slot: memoryview(b""))
