"""Giving freed heap memory back to the operating system.

Torch's CPU allocator takes tensor memory from malloc. Each engine step allocates activations whose sizes
change with the batch, and glibc keeps what they free in its arenas, fragmented, instead of returning it: a
worker's resident memory then creeps up for hours although nothing leaks (measured on the 2-core dev VM,
2026-11-23: +82 MiB after 20 mixed batches, all of it returned by one malloc_trim). `HeapTrimmer` calls
glibc's `malloc_trim(0)` now and then (when the engine goes idle, or after many busy steps); elsewhere
(another libc, no libc) it does nothing. A trim takes milliseconds, so it runs rarely.

Between trims the freed memory should stay put: `keep_freed_heap()` stops glibc from unmapping it after every
step. By default glibc serves a large block (128 KiB at first, and up to the largest block freed so far) with
a fresh mmap and unmaps it on free, and trims the heap's top whenever free space there passes twice that
size. A prefill step's activations are such blocks (12 MiB for one 2048-token gate_up output in SmolLM2), so
every step touched new pages: 58,000 page faults (230 MiB zeroed by the kernel) per 2048-token step, measured
on the 2-core dev VM on 2026-11-26, where the same step ran in 1.43-1.60 s, and in 1.27-1.30 s with the heap
kept (about as with tcmalloc preloaded; jemalloc's defaults faulted more than glibc's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger("infer.worker")


def _malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0), or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


def trim_heap() -> bool:
    """Give the C heap's free memory back to the operating system now (glibc's malloc_trim(0)); False where the C
    library has no such call. Loading a model leaves tens of MiB freed but resident (the tokenizer's JSON parse,
    conversion buffers: 29 MiB after SmolLM2's tokenizer, measured 2026-11-29), which would otherwise add to the
    worker's peak once the weights and the first steps come on top."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim()
    return True


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # the most glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): larger blocks are mmapped
TRIM_THRESHOLD_BYTES = 1 << 30  # free() leaves up to this much at the heap's top; HeapTrimmer gives it back


def keep_freed_heap() -> bool:
    """Make glibc keep freed blocks up to MMAP_THRESHOLD_BYTES in the heap for reuse, and not trim the heap on
    free() below TRIM_THRESHOLD_BYTES (the engine's HeapTrimmer trims instead, when idle). Process-wide and
    idempotent; returns False where the C library has no mallopt or refuses the values (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


class HeapTrimmer:
    """Trims the heap after `idle_steps` steps or more when a step leaves the engine idle, and after
    `busy_steps` steps in a row otherwise (a server that is never idle still gets its memory back). A
    trickle of single requests does not trim after each one."""

    def __init__(self, idle_steps: int = 100, busy_steps: int = 2000, trim: Callable[[], None] | None = None) -> None:
        if not 1 <= idle_steps <= busy_steps:
            raise ValueError(f"need 1 <= idle_steps <= busy_steps, got {idle_steps} and {busy_steps}")
        self.idle_steps, self.busy_steps = idle_steps, busy_steps
        self._trim = trim if trim is not None else _malloc_trim()
        self._steps = 0  # steps since the last trim
        self.num_trims = 0

    def trim_now(self) -> None:
        """Give free heap memory back at once (after a large release, such as a suspend)."""
        self._steps = 0
        if self._trim is not None:
            self._trim()
            self.num_trims += 1

    def after_step(self, busy: bool) -> None:
        """Called after each engine step that ran a forward; `busy`: requests remain."""
        self._steps += 1
        if self._steps < (self.busy_steps if busy else self.idle_steps):
            return
        self._steps = 0
        if self._trim is not None:
            self._trim()
            self.num_trims += 1
