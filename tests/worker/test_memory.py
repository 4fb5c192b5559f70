"""HeapTrimmer: when the engine gives freed heap memory back (worker/engine/memory.py), and that the trim is real."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from infer.worker.engine.memory import HeapTrimmer, _malloc_trim


def trimmer(**options) -> tuple[HeapTrimmer, list[int]]:
    calls: list[int] = []
    return HeapTrimmer(trim=lambda: calls.append(1), **options), calls


def test_it_trims_when_the_engine_goes_idle_after_enough_steps():
    heap, calls = trimmer(idle_steps=3, busy_steps=10)
    heap.after_step(busy=False)  # a trickle of single requests: not after each one
    heap.after_step(busy=True)
    assert calls == []
    heap.after_step(busy=False)
    assert calls == [1] and heap.num_trims == 1
    heap.after_step(busy=False)
    assert calls == [1]  # counting starts again


def test_a_never_idle_engine_trims_every_busy_steps():
    heap, calls = trimmer(idle_steps=2, busy_steps=5)
    for _ in range(12):
        heap.after_step(busy=True)
    assert len(calls) == 2


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="idle_steps <= busy_steps"):
        HeapTrimmer(idle_steps=10, busy_steps=5)


def _rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


@pytest.mark.skipif(_malloc_trim() is None, reason="no glibc malloc_trim here")
def test_glibc_trim_returns_freed_heap_pages():
    """Many freed blocks below the mmap threshold stay resident until trimmed (what a worker's steps leave)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # 128 MiB of 64 KiB blocks
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    keep = blocks[-1]  # the top block stays in use: free() alone cannot shrink the heap
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_kb()
    _malloc_trim()()
    assert before - _rss_kb() > 64 << 10  # more than 64 MiB given back
    libc.free(keep)


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc")
def test_kept_heap_serves_a_step_sized_block_again_without_page_faults():
    """A 12 MiB block (a 2048-token prefill's gate_up output) freed and allocated again: glibc's default maps it
    anew (every page faults again); after keep_freed_heap() it comes back from the heap, its pages resident."""
    script = """
import ctypes, resource, sys
from infer.worker.engine.memory import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 12 << 20
def touch():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    return block
libc.free(touch())
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.free(touch())
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    pages = (12 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert faults("keep") < pages // 10
    assert faults("default") >= pages // 2  # glibc's own behaviour, which the worker changes
