"""The KV tier beyond the pool on a real engine (tiny Llama, fp32): with a pool smaller than the working set, prefixes
evicted to disk come back instead of being prefilled, and greedy output equals the engine's without the tier; corrupt,
truncated and foreign files are recomputed, never served; the size bound holds; a restarted engine reuses the files;
the KV events count blocks on disk as held. The host-memory tier (alone, or above the disk): hits come back from it,
blocks pushed out of it move down to disk or are dropped, a corrupt entry is recomputed, the KV events follow the
blocks through every move.

Spills are asynchronous; the tests wait for the writer after each request (`store.flush`) so that what is on disk
when the next request comes is the same on every run."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.engine.forward_batch import KVCache
from infer.worker.kv.offload_store import HEADER_SIZE, iter_spill_files

BS = 16
POOL_BLOCKS = 20
BLOCK_BYTES = KVCache.bytes_per_block(2, BS, 2, 16, torch.float32)  # the tiny Llama: 2 layers, 2 KV heads, dim 16
CONVERSATIONS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def turns() -> tuple[list[list[int]], list[list[int]]]:
    """Turn 1 of every conversation (a 48-token prefix of its own + a question), then turn 2 (turn 1 + another
    question): 8 x 3 cached blocks after turn 1 do not fit a 20-block pool, so the early conversations' blocks are
    evicted by the time their second turn comes."""
    rng = random.Random(45)
    first, second = [], []
    for _ in range(CONVERSATIONS):
        prompt = [rng.randrange(3, 49000) for _ in range(58)]
        first.append(prompt)
        second.append(prompt + [rng.randrange(3, 49000) for _ in range(20)])
    return first, second


def engine(model_dir, tmp_path=None, gb: float | None = None, host_blocks: int | None = None) -> Engine:
    """`tmp_path`: a disk tier there (`gb` GiB, default 1); `host_blocks`: a host-memory tier of that many blocks."""
    offload = {} if tmp_path is None else {"kv_offload_dir": str(tmp_path), "kv_offload_gb": gb or 1.0}
    if host_blocks is not None:
        offload["kv_offload_host_gb"] = host_blocks * BLOCK_BYTES / (1 << 30)
    return Engine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=256,
            block_size=BS,
            kv_cache_memory=POOL_BLOCKS * BLOCK_BYTES,
            **offload,
        )
    )


def run(eng: Engine, prompts: list[list[int]], view: set[int] | None = None) -> list[list[int]]:
    """Each prompt alone, in order; the writer drained after each; `view`: the coordinator's set of held hashes,
    kept by the engine's KV events."""
    outputs = []
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{len(outputs)}-{i}-{id(prompts)}", prompt, PARAMS)
        tokens: list[int] = []
        while eng.has_unfinished():
            for delta in eng.step():
                tokens.extend(delta.token_ids)
        outputs.append(tokens)
        if eng.offload is not None and eng.offload.store is not None:
            assert eng.offload.store.flush(timeout=60)
        if view is not None:
            while (events := eng.take_kv_events()) is not None:
                if events.reset:
                    view.clear()
                view.difference_update(events.removed)
                view.update(events.stored)
    return outputs


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    """Outputs and prefill work of both turns without the tier."""
    eng = engine(tiny_model_dir("llama"))
    assert eng.num_kv_blocks == POOL_BLOCKS
    first, second = turns()
    out1 = run(eng, first)
    before = eng.stats.prefill_tokens_computed
    out2 = run(eng, second)
    return out1, out2, eng.stats.prefill_tokens_computed - before


def test_spilled_prefixes_come_back_from_disk_and_outputs_are_unchanged(tiny_model_dir, tmp_path, baseline):
    out1, out2, prefilled_without = baseline
    eng = engine(tiny_model_dir("llama"), tmp_path)
    eng.publish_kv_events(True)
    view: set[int] = set()
    first, second = turns()
    assert run(eng, first, view) == out1
    spilled = eng.offload.counters.spilled
    assert spilled > 0  # the pool overflowed: evicted blocks went to disk
    before, hits_before = eng.stats.prefill_tokens_computed, eng.load().prefix_cache_hits
    assert run(eng, second, view) == out2
    load = eng.load()
    assert load.kv_offload_loaded_blocks > 0 and load.kv_offload_corrupt_blocks == 0
    assert load.kv_offload_spilled_blocks >= spilled and load.kv_offload_dropped_blocks == 0
    # the loaded blocks' tokens counted as cached, not computed
    prefilled_with = eng.stats.prefill_tokens_computed - before
    assert prefilled_with < prefilled_without
    assert load.prefix_cache_hits - hits_before >= BS * load.kv_offload_loaded_blocks
    # the coordinator's view: the pool's hashes and the disk's
    blocks = eng.scheduler.block_manager
    assert view == set(blocks._cached) | set(eng.offload.store.hashes())
    eng.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_damaged_files_are_recomputed_never_served(tiny_model_dir, tmp_path, baseline, damage):
    out1, out2, _ = baseline
    eng = engine(tiny_model_dir("llama"), tmp_path)
    first, second = turns()
    assert run(eng, first) == out1
    damaged: dict[Path, bytes] = {}
    for file in iter_spill_files(eng.offload.store.path):
        data = bytearray(file.read_bytes())
        if damage == "flip":
            data[HEADER_SIZE + len(data) // 3] ^= 0x40  # one bit of the K/V payload
        elif damage == "truncate":
            data = data[: len(data) // 2]
        else:  # another model's file under this name: its fingerprint differs
            data[20:36] = bytes(16)
        damaged[file] = bytes(data)
        file.write_bytes(damaged[file])
    assert damaged
    assert run(eng, second) == out2
    # every damaged file met was rejected and deleted (blocks spilled during turn 2 load back as usual)
    counters = eng.offload.counters
    still_damaged = [f for f, data in damaged.items() if f.exists() and f.read_bytes() == data]
    assert counters.corrupt > 0 and len(still_damaged) == len(damaged) - counters.corrupt
    eng.close()


def test_the_size_bound_holds(tiny_model_dir, tmp_path, baseline):
    out1, out2, _ = baseline
    max_bytes = 5 * (HEADER_SIZE + BLOCK_BYTES)
    eng = engine(tiny_model_dir("llama"), tmp_path, gb=max_bytes / (1 << 30))
    first, second = turns()
    assert run(eng, first) + run(eng, second) == out1 + out2
    store = eng.offload.store
    assert store.max_bytes == max_bytes
    assert store.counters.evicted > 0 and store.num_bytes <= max_bytes
    assert sum(f.stat().st_size for f in iter_spill_files(store.path)) <= max_bytes
    eng.close()


def test_a_restarted_engine_reuses_the_files_it_left(tiny_model_dir, tmp_path, baseline):
    out1, out2, _ = baseline
    first, second = turns()
    eng = engine(tiny_model_dir("llama"), tmp_path)
    assert run(eng, first) == out1
    path, spilled = eng.offload.store.path, eng.offload.counters.spilled
    eng.close()  # writes what is queued, releases the slot
    again = engine(tiny_model_dir("llama"), tmp_path)
    assert again.offload.store.path == path and len(again.offload.store) == spilled
    assert run(again, second) == out2
    assert again.offload.counters.loaded > 0 and again.offload.counters.corrupt == 0
    again.close()


def test_an_unusable_directory_stops_the_engine_before_it_loads(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        engine(tiny_model_dir("llama"), tmp_path / "missing")


def test_suspend_keeps_the_files_and_new_weights_delete_them(tiny_model_dir, tmp_path, baseline):
    out1, out2, _ = baseline
    model_dir = tiny_model_dir("llama")
    first, second = turns()
    eng = engine(model_dir, tmp_path)
    assert run(eng, first) == out1
    store = eng.offload.store
    on_disk = len(store)
    eng.suspend()  # the pool goes, the weights come back the same: the files stay valid
    eng.resume()
    assert len(store) == on_disk
    assert run(eng, second[:1]) == out2[:1] and eng.offload.counters.loaded > 0
    old_fingerprint = store.fingerprint
    assert eng.update_weights(str(model_dir)) == 1  # the same values, but KV of "other" weights: never reused
    assert len(store) == 0 and not list(iter_spill_files(store.path)) and store.fingerprint != old_fingerprint
    assert run(eng, second) == out2
    eng.close()


def beams(eng: Engine, prompt: list[int]) -> list[list[int]]:
    """A beam search's beams (its forks take free blocks, evicting cached ones: copied out before the fork's copy)."""
    params = SamplingParams(temperature=0, max_tokens=6, beam_width=3, n=3, ignore_eos=True)
    eng.add_request("beams", prompt, params)
    found: list[list[int]] = []
    while eng.has_unfinished():
        for delta in eng.step():
            found.extend(list(beam.token_ids) for beam in delta.beams or ())
    return found


def test_beam_search_over_a_full_pool_spills_and_equals_the_run_without(tiny_model_dir, tmp_path):
    first, second = turns()
    plain = engine(tiny_model_dir("llama"))
    run(plain, first)
    expected = beams(plain, second[0])
    eng = engine(tiny_model_dir("llama"), tmp_path)
    run(eng, first)
    spilled = eng.offload.counters.spilled
    assert beams(eng, second[0]) == expected and len(expected) == 3
    assert eng.offload.store.flush(timeout=60) and eng.offload.counters.spilled > spilled
    assert eng.offload.counters.loaded > 0  # its prompt's prefix came back from disk
    eng.close()


# ---- the host-memory tier ----------------------------------------------------------------------------------------


def held(eng: Engine) -> set[int]:
    """What the worker holds: the pool's cached hashes, the host tier's and the disk's."""
    return set(eng.scheduler.block_manager._cached) | set(eng.offload.hashes())


def test_host_tier_alone_serves_hits_exactly_and_the_events_count_it(tiny_model_dir, baseline):
    out1, out2, prefilled_without = baseline
    eng = engine(tiny_model_dir("llama"), host_blocks=64)  # room for every evicted block
    assert eng.offload.store is None and eng.offload.host.num_slots == 64
    eng.publish_kv_events(True)
    view: set[int] = set()
    first, second = turns()
    assert run(eng, first, view) == out1
    host = eng.offload.host
    assert host.counters.spilled > 0 and view == held(eng) and set(host.hashes()) <= view
    before, hits_before = eng.stats.prefill_tokens_computed, eng.load().prefix_cache_hits
    assert run(eng, second, view) == out2
    load = eng.load()
    assert load.kv_offload_host_loaded_blocks > 0 and load.kv_offload_host_corrupt_blocks == 0
    assert load.kv_offload_host_dropped_blocks == 0 and load.kv_offload_loaded_blocks == 0
    assert eng.stats.prefill_tokens_computed - before < prefilled_without  # hits, not prefills
    assert load.prefix_cache_hits - hits_before >= BS * load.kv_offload_host_loaded_blocks
    assert view == held(eng)
    text = metrics(load)  # the counters reach /metrics beside the disk tier's
    for name in ("spilled", "loaded", "dropped", "corrupt"):
        total = float(getattr(load, f"kv_offload_host_{name}_blocks"))
        assert f'infer:kv_offload_host_{name}_blocks_total{{model_name="m"}} {total}' in text
    eng.close()


def metrics(load) -> str:
    """The HTTP front's /metrics text for a cluster of one worker reporting `load` (sent over the wire)."""
    from infer.client.api.metrics import FrontMetrics
    from infer.protocol.messages import ClusterStats, StepBatch, WorkerStats, decode, encode

    load = decode(encode(StepBatch(deltas=[], load=load))).load
    worker = WorkerStats(
        worker_id="w",
        dp_rank=0,
        group_id="g",
        healthy=True,
        num_kv_blocks=1,
        block_size=BS,
        max_num_seqs=1,
        max_model_len=256,
        requests_routed=1,
        num_in_flight=0,
        seconds_since_heard=0.0,
        load=load,
    )
    counts = dict.fromkeys(
        ("num_clients", "num_in_flight", "num_held", "requests_submitted", "requests_completed", "requests_failed"), 0
    )
    cluster = ClusterStats(
        coordinator_id="c",
        state="running",
        policy="p",
        model_id="m",
        workers=[worker],
        requests_aborted=0,
        requests_redispatched=0,
        frames_rejected=0,
        uptime_s=1.0,
        **counts,
    )
    return FrontMetrics("m").exposition(cluster).decode()


@pytest.mark.parametrize("disk", [True, False], ids=["host+disk", "host only"])
def test_blocks_pushed_out_of_the_host_tier_move_to_disk_or_are_dropped(tiny_model_dir, tmp_path, baseline, disk):
    out1, out2, _ = baseline
    eng = engine(tiny_model_dir("llama"), tmp_path if disk else None, host_blocks=4)
    eng.publish_kv_events(True)
    view: set[int] = set()
    first, second = turns()
    assert run(eng, first, view) == out1
    host, store = eng.offload.host, eng.offload.store
    assert len(host) == 4 and view == held(eng)
    if disk:  # every block pushed out of the host tier is on disk, still held
        assert store.counters.spilled > 0 and set(store.hashes()) <= view
        assert host.counters.dropped == 0 and not set(host.hashes()) & set(store.hashes())
    else:  # dropped: no longer held
        assert host.counters.dropped == host.counters.spilled - 4 > 0
    assert run(eng, second, view) == out2
    assert view == held(eng) and host.counters.corrupt == 0
    if disk:
        assert store.counters.loaded > 0  # came back from disk
    eng.close()


def test_a_corrupt_host_entry_is_recomputed_never_served(tiny_model_dir, baseline):
    out1, out2, _ = baseline
    eng = engine(tiny_model_dir("llama"), host_blocks=64)
    first, second = turns()
    assert run(eng, first) == out1
    host, buffer = eng.offload.host, eng.offload._host_buffer
    damaged = dict(host._index)  # hash -> entry
    for entry in damaged.values():  # one byte of every entry's payload
        buffer[entry.slot].view(-1).view(torch.uint8)[BLOCK_BYTES // 3] ^= 0x40
    assert run(eng, second) == out2
    # every damaged entry met was rejected and forgotten (blocks spilled during turn 2 load back as usual; 64 slots
    # push nothing out, so an entry leaves only by rejection)
    still_damaged = [h for h, entry in damaged.items() if host._index.get(h) is entry]
    assert host.counters.dropped == 0 and host.counters.spilled < 64
    assert host.counters.corrupt > 0 and len(still_damaged) == len(damaged) - host.counters.corrupt
    eng.close()


def test_suspend_keeps_the_host_tier_and_new_weights_clear_it(tiny_model_dir, baseline):
    out1, out2, _ = baseline
    model_dir = tiny_model_dir("llama")
    first, second = turns()
    eng = engine(model_dir, host_blocks=64)
    eng.publish_kv_events(True)
    view: set[int] = set()
    assert run(eng, first, view) == out1
    host = eng.offload.host
    kept = set(host.hashes())
    eng.suspend()  # the pool goes, the weights come back the same: the host copies stay valid
    eng.resume()
    assert set(host.hashes()) == kept
    assert run(eng, second[:1], view) == out2[:1] and host.counters.loaded > 0 and view == held(eng)
    assert eng.update_weights(str(model_dir)) == 1  # KV of "other" weights: never reused
    assert len(host) == 0
    assert run(eng, second[:2], view) == out2[:2] and view == held(eng)
    eng.close()


def test_the_host_tier_is_refused_where_the_disk_tier_is():
    from infer.worker.distributed.tensor_parallel import TensorParallel
    from infer.worker.engine.encoder_decoder import refusals
    from infer.worker.engine.engine import _check_kv_offload

    config = EngineConfig(kv_offload_host_gb=1)
    assert any("kv_offload_host_gb" in r for r in refusals(config, tp_size=1, pipeline=False, ep_size=1))
    with pytest.raises(ValueError, match="^kv_offload_host_gb: not supported with tensor or pipeline parallelism"):
        _check_kv_offload(config, None, TensorParallel(rank=0, size=2), None)
    _check_kv_offload(config, object(), TensorParallel.single(), None)  # a model built in memory: fine


def test_a_host_tier_smaller_than_one_block_is_refused():
    from infer.worker.engine.block_manager import BlockManager
    from infer.worker.kv.offload import KvOffload

    kv = KVCache([torch.zeros(2, POOL_BLOCKS + 1, BS, 16)] * 2, [torch.zeros(2, POOL_BLOCKS + 1, BS, 16)] * 2)
    blocks = BlockManager(POOL_BLOCKS, BS, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=f"kv_offload_host_gb holds no block: {BLOCK_BYTES - 1} bytes"):
        KvOffload.open(kv, blocks, host_bytes=BLOCK_BYTES - 1)
    assert KvOffload.open(kv, blocks, host_bytes=3 * BLOCK_BYTES + 5).host.num_slots == 3
