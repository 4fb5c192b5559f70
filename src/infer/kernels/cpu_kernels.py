"""Native CPU kernels: small C files under kernels/cpu/, built with the system C compiler on first use.

- Paged decode attention (cpu/paged_decode.c): it reads K and V where they sit in the pool, where the PyTorch
  twin gathers each sequence's blocks into a padded copy first and hands it to SDPA. That copy, and SDPA's
  packing of each tiny per-head problem, were most of a CPU decode step's attention time. It and the prefill
  kernel take a sliding window, Gemma 2's logit soft-capping and GPT-OSS's attention sinks, as the twins.
- Paged prefill / mixed-step attention (cpu/paged_prefill.c): causal chunks over the pool in place, 32 keys
  at a time (bf16: packed once per call for vdpbf16ps) for up to 64 query rows sharing a KV head. torch's CPU
  flash attention, which the twin calls per chunk, took 4.8 ms a layer for a 500-token prompt of SmolLM2-135M
  against 1.2 ms here (2-core AMD EPYC, bf16, 2026-11-26). Other pools (fp32, or bf16 without AVX512-BF16)
  take paged_decode.c's arithmetic a few tokens at a time, so a prefill row has the bits of the decode of its
  position (a failover's resumed stream goes on exactly; it costs 25-45% of the fp32 prefill attention).
- Rotary embedding in place and the KV append with K rotated on the way (cpu/elementwise.c): one pass each
  instead of the twins' dozen small ops per layer (casts, index_select, muls, copies), with the twins' bits.
- RMSNorm and SiLU * mul (cpu/elementwise.c), the bf16 linears at every row count (cpu/gemv.c: a GEMV for 1-8
  rows, tiles past that; bf16 weights with fp32 rows on AVX2 builds), and a whole bf16 decode step
  of 1-8 sequences through a dense Llama's layers in one call (cpu/decode_layers.c, driven by
  worker/models/native_decode.py).
- A LoRA decode step's delta for one linear layer, every row by its own adapter, in one call (cpu/lora.c): in place
  of the twin's gather, two batched matmuls and scatter-add (worker/engine/lora.py).

Built with `cc -O3 -fopenmp -shared` once per ISA level (`ISA_LEVELS`): "avx512" (-march=native on a CPU with
AVX-512 F/BW/VL/DQ, so its AVX512-BF16 and VNNI paths come on where the CPU has them), "avx2" (-march=x86-64-v3:
AVX2, FMA, F16C; Zen 3), "generic" (-march=x86-64-v2: the portable C, vectorized by the compiler). Every kernel
has an AVX-512 path and an AVX2 sibling in the same file; rotary, the KV append and the row max are portable C
that the compiler vectorizes for the level. The level that runs is the best this CPU supports (/proc/cpuinfo),
or the one INFER_CPU_ISA names (`selected_isa`; a level the CPU cannot run is refused); `library(isa)` loads any
runnable level's build (the tests run each kernel through each). Each build lives in INFER_COMPILE_CACHE (see
worker/engine/config.py) under a name with its level and a hash of the sources, the flags, the compiler and this CPU's
feature flags, so a shared home directory serves machines of different kinds; a build is written to a temporary
name and renamed, so processes starting together do not read half a file. Loaded after torch, the library's
OpenMP is torch's own runtime (the same soname), so it runs on torch's threads. Where no compiler works, or the
environment sets INFER_CPU_KERNELS=0, `native_ready()` is False and the callers use the twins.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from infer.protocol import env

log = logging.getLogger("infer.kernels")

_CPU_DIR = Path(__file__).resolve().parent / "cpu"
SOURCES = tuple(
    _CPU_DIR / name
    for name in ("paged_decode.c", "paged_prefill.c", "elementwise.c", "gemv.c", "quant.c", "decode_layers.c", "lora.c")
)
KERNELS_H = _CPU_DIR / "kernels.h"  # every entry point, declared once (the bindings are read from it)
HEADERS = (_CPU_DIR / "common.h", KERNELS_H)  # included by the sources: part of the build's hash
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast")  # plus the level's -march
# A build takes seconds on a quiet machine and minutes on a loaded 2-core one (seen: past 120 s beside a test run);
# a timeout leaves the process on the twins for its whole life, so it is generous.
BUILD_TIMEOUT_S = 600
# What the compiled kernel accepts (paged_decode.c's MAX_ROWS: query heads per KV head, MAX_HEAD_DIM, MAX_BLOCK).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256
MAX_HIDDEN = 16384  # the native RMSNorm's widest row (elementwise.c)
NATIVE_DTYPES = (torch.bfloat16, torch.float32)  # what the C kernels compute in (fp32 math inside)


@dataclass(frozen=True)
class IsaLevel:
    """One build of the library: its name, the -march it is compiled with, and the /proc/cpuinfo flags a CPU
    must show to run it. The top level is -march=native, so it also gets what the CPU has beyond its name
    (AVX512-BF16 and VNNI paths come on where the CPU has them)."""

    name: str
    march: str
    needs: frozenset[str]


# Best first. avx2 is x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT as "abm", MOVBE); generic is x86-64-v2.
ISA_LEVELS = (
    IsaLevel("avx512", "-march=native", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    IsaLevel("avx2", "-march=x86-64-v3", frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})),
    IsaLevel("generic", "-march=x86-64-v2", frozenset({"ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"})),
)
_LEVELS = {level.name: level for level in ISA_LEVELS}


def _cache_dir() -> Path:
    return env.compile_cache_dir() / "cpu_kernels"


@functools.cache
def _cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (read once: the linears ask per weight)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16) and the kernels run at the avx512 level
    (INFER_CPU_ISA set below it makes the engine compute as a CPU without them would)."""
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and selected_isa() == "avx512"


def amx_bf16() -> bool:
    """Whether this CPU has AMX-BF16 tiles (Sapphire Rapids and later) and the kernels run at the avx512 level: there
    oneDNN's packed path multiplies a prefill's bf16 rows on the tiles, far beyond what the GEMV's vector tiles
    reach, so the linears keep a packed copy for more than 8 rows (worker/models/layers.py's PackedLinear)."""
    return "amx_bf16" in _cpu_flags().split() and selected_isa() == "avx512"


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def supported_isas(cpu_flags: str | None = None) -> tuple[str, ...]:
    """The levels this CPU (or the given cpuinfo flags line) can run, best first. Not x86: ("generic",) only,
    built with -march=native."""
    if not _is_x86():
        return ("generic",)
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    return tuple(level.name for level in ISA_LEVELS if level.needs <= flags or level.name == "generic")


def selected_isa(environ: Mapping[str, str] | None = None) -> str:
    """The level the kernels run at: INFER_CPU_ISA where set (a level this CPU runs), else the best it runs.
    A level the CPU cannot run, or an unknown name, is a ValueError that says which levels it can."""
    here = supported_isas()
    asked = env.read(env.CPU_ISA, environ)
    if asked is None:
        return here[0]
    if asked not in _LEVELS:
        raise ValueError(f"INFER_CPU_ISA={asked!r} is no level of the CPU kernels: one of {', '.join(_LEVELS)}")
    if asked not in here:
        raise ValueError(
            f"INFER_CPU_ISA={asked!r}: this CPU cannot run that build (it lacks "
            f"{', '.join(sorted(_LEVELS[asked].needs - set(_cpu_flags().split())))}); it runs "
            f"{', '.join(here)}"
        )
    return asked


def isas_at_or_below(isa: str) -> tuple[str, ...]:
    """The levels this CPU runs that are no better than `isa`, best first: what the tests run each kernel at
    (a CPU with AVX-512 forced down to avx2 tests as an AVX2-only CPU would)."""
    here = supported_isas()
    return here[here.index(isa) :] if isa in here else ()


def _march(isa: str) -> str:
    """The level's -march: the table's, but -march=native off x86 and plain x86-64 for a CPU older than v2."""
    if not _is_x86():
        return "-march=native"
    if isa == "generic" and not _LEVELS["generic"].needs <= set(_cpu_flags().split()):
        return "-march=x86-64"
    return _LEVELS[isa].march


def _library_path(compiler: str, isa: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                *(source.read_text() for source in SOURCES + HEADERS),
                " ".join(FLAGS),
                _march(isa),
                version,
                _cpu_flags(),
                platform.machine(),
            ]
        ).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"infer_cpu-{isa}-{key}.so"


def _build(compiler: str, target: Path, isa: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, _march(isa), "-o", tmp, *map(str, SOURCES), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_LOADED = False  # set by the first _library() call; what native_ready() says under torch.compile


def native_ready() -> bool:
    """Whether the native kernels are built and loaded (building them on the first call). Under torch.compile
    it answers what an eager call found before (dynamo reads the flag as a constant, and traces no build)."""
    if torch.compiler.is_compiling():
        return _LOADED
    return _library() is not None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The library of the selected level (`selected_isa`), loaded once; None without a compiler or with
    INFER_CPU_KERNELS=0. Every kernel below calls through it (the tests swap it for another level's)."""
    isa = selected_isa()
    lib = library(isa)
    global _LOADED
    _LOADED = lib is not None
    if lib is not None:
        log.info("native CPU kernels: the %s build (of %s this CPU runs)", isa, ", ".join(supported_isas()))
    return lib


def _native() -> ctypes.CDLL:
    """`_library()` for a kernel's call: callers have checked that it is loaded (each kernel's `*_takes`)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not loaded (native_ready() is False)")
    return lib


def library(isa: str) -> ctypes.CDLL | None:
    """The library built for level `isa` (one this CPU runs: `supported_isas`, checked at every call), loaded once
    per process; None where it cannot be built or INFER_CPU_KERNELS=0."""
    if isa not in supported_isas():
        raise ValueError(f"this CPU cannot run the {isa} build of the CPU kernels (it runs {supported_isas()})")
    return _loaded(isa)


@functools.cache
def _loaded(isa: str) -> ctypes.CDLL | None:
    return _load(isa)


def _compiler() -> str | None:
    """The C compiler that builds the library: $CC, else cc, else gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """One build of `target` at a time across processes (the test processes and the daemons they start all look
    for the library at once): the others wait on the lock, then load what the first built. The wait is bounded by
    the holder's build (its compiler is killed at BUILD_TIMEOUT_S; a holder that dies releases the lock)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(isa: str) -> ctypes.CDLL | None:
    if env.read(env.CPU_KERNELS) == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels run as their PyTorch twins (slower)")
        return None
    try:
        path = _library_path(compiler, isa)
        with _build_lock(path):
            if not path.exists():
                _build(compiler, path, isa)
                log.info("built the native CPU kernels (%s): %s", isa, path)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # a damaged file in the cache: build it again, once
                _build(compiler, path, isa)
                lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the native CPU kernels could not be built (%s): their PyTorch twins run instead", e)
        return None
    declare(lib)
    return lib


# C parameter types -> ctypes (kernels.h uses no others: `entry_points` refuses the rest)
_C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "int32_t": ctypes.c_int32, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^int ([a-z_0-9]+)\(([^)]*)\);", re.M)


@functools.cache
def entry_points() -> dict[str, list[type]]:
    """The exported entry points of kernels/cpu/kernels.h (the part before "internal") and their ctypes argument
    types, read from the header: the one declaration of the C signatures."""
    text = KERNELS_H.read_text()
    exported = text[: text.index("---- internal")]
    points: dict[str, list[type]] = {}
    for name, params in _PROTOTYPE.findall(exported):
        types: list[type] = []
        for param in params.split(","):
            param = " ".join(param.split())
            if param in ("void", ""):
                continue
            if "*" in param:
                types.append(ctypes.c_void_p)
                continue
            c_type = param.rsplit(" ", 1)[0].removeprefix("const ")
            if c_type not in _C_TYPES:
                raise ValueError(f"kernels.h: {name}'s parameter {param!r} has a type the binding does not read")
            types.append(_C_TYPES[c_type])
        points[name] = types
    return points


def declare(lib: ctypes.CDLL, names: Iterable[str] | None = None) -> ctypes.CDLL:
    """Declare the entry points `names` (None: every exported one) on a loaded library, from kernels.h: their
    argument types, and an int result."""
    points = entry_points()
    for name in points if names is None else names:
        fn = getattr(lib, name)
        fn.argtypes = points[name]
        fn.restype = ctypes.c_int
    return lib


def _window(window: int) -> int:
    """A sliding window as the kernels take it (> 0, or 0 for none)."""
    if window < 0:
        raise ValueError(f"a sliding window must be >= 0 (0: none), got {window}")
    return window


def _softcap(softcap: float) -> float:
    """A soft-cap as the kernels take it (> 0, or 0 for none)."""
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"an attention softcap must be a finite number >= 0 (0: none), got {softcap}")
    return float(softcap)


def takes_sinks(sinks: torch.Tensor | None, num_heads: int) -> bool:
    """Whether the native attention kernels take these attention sinks: none, or [num_heads] float32, contiguous,
    on a CPU (the twins take any floating type)."""
    return sinks is None or (
        sinks.device.type == "cpu"
        and sinks.dtype == torch.float32
        and sinks.shape == (num_heads,)
        and sinks.is_contiguous()
    )


def _sinks(sinks: torch.Tensor | None, num_heads: int) -> int | None:
    """The sinks' address for the kernels (None: no sinks), after `takes_sinks`."""
    if not takes_sinks(sinks, num_heads):
        raise ValueError(
            f"the native attention kernels take sinks as a contiguous float32 [{num_heads}] on the CPU, got "
            f"{None if sinks is None else (tuple(sinks.shape), sinks.dtype, sinks.device.type)}"
        )
    return None if sinks is None else sinks.data_ptr()


def paged_decode_takes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether the native kernel takes these arguments (CPU, a type it has, layouts and sizes in its
    limits, sinks as `takes_sinks` says); without it the caller runs the twin."""
    if q.dim() != 3 or k_cache.dim() != 4 or block_tables.dim() != 2 or not takes_sinks(sinks, q.shape[1]):
        return False
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    return (
        q.device.type == "cpu"
        and q.dtype in NATIVE_DTYPES
        and k_cache.dtype == q.dtype
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and k_cache.is_contiguous()
        and block_tables.dtype == torch.int32
        and block_tables.stride(1) == 1
        and seq_lens.dtype == torch.int32
        and seq_lens.is_contiguous()
        and q.shape[1] % num_kv_heads == 0
        and q.shape[1] // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and block_size <= MAX_BLOCK
        and native_ready()
    )


def paged_decode_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    runs: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, H, D] over the pool [Hkv, NB, bs, D] into out [B, H, D] (contiguous), as
    `paged_decode_attention_torch`; the arguments must pass `paged_decode_takes` (and v_cache be shaped
    like k_cache). Every length must be >= 1 and every table entry it reaches a block of the pool.
    `window` > 0: each sequence attends to its last `window` positions only (0: all). `runs` [R] int32
    (contiguous, summing to B): rows of one sequence at consecutive positions each (a speculative verification;
    lengths going up by one within a run), which read their K and V once through the run's first table, with the
    bits of the rows one by one (paged_decode.c's paged_decode_runs). `softcap` > 0: scores s become
    softcap * tanh(s / softcap) (Gemma 2; 0: none); `sinks` [H] float32 (GPT-OSS; see `takes_sinks`): each head's sink
    logit joins its softmax's denominator, as kernels/paged_attention.py's twins define both."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    if not (v_cache.is_contiguous() and v_cache.shape == k_cache.shape and out.is_contiguous()):
        raise ValueError("the native decode kernel needs a contiguous v_cache shaped like k_cache and a contiguous out")
    if runs is not None and not (runs.dtype == torch.int32 and runs.dim() == 1 and runs.is_contiguous()):
        raise ValueError("runs must be a contiguous int32 [num_runs]")
    args = (
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
    )
    shape = (
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        int(q.dtype == torch.bfloat16),
        _window(window),
        _softcap(softcap),
        _sinks(sinks, num_heads),
    )
    if runs is None:
        status = _native().paged_decode(*args, out.data_ptr(), *shape)
    else:
        status = _native().paged_decode_runs(*args, runs.data_ptr(), runs.shape[0], out.data_ptr(), *shape)
    if status == -3:
        raise MemoryError("the native decode kernel could not allocate its plan of runs")
    if status == -1:
        raise ValueError(
            f"the native decode kernel takes no group {num_heads // num_kv_heads}, head_dim "
            f"{head_dim}, block_size {block_size}"
        )
    if status != 0:
        raise ValueError(
            "a sequence length is < 1 or past its block table, or a block table entry is outside "
            f"the pool of {num_blocks} blocks"
            + ("" if runs is None else ", or runs that do not add up to the rows or whose lengths do not go up by one")
        )
    return out


def paged_prefill_takes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> bool:
    """Whether the native prefill kernel takes these arguments (as `paged_decode_takes`, plus a head_dim that
    is a multiple of 16 and int32 query offsets); without it the caller runs the twin."""
    return (
        paged_decode_takes(q, k_cache, block_tables, seq_lens, sinks)
        and k_cache.shape[3] % 16 == 0
        and query_start_loc.dtype == torch.int32
        and query_start_loc.is_contiguous()
    )


def paged_prefill_attention_native(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    decode_from: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (sequence b's chunk: rows query_start_loc[b] .. [b + 1] - 1, the last of its seq_lens[b]
    positions) over the pool [Hkv, NB, bs, D] into out [T, H, D] (contiguous), causal, as
    `paged_prefill_attention_torch`; the arguments must pass `paged_prefill_takes`. Rows of out past
    query_start_loc[B] are left as they are. `decode_from` [B] int32: sequence b's rows at positions from
    decode_from[b] on have the bits the decode kernel gives them (paged_prefill.c: a prompt's rows as its
    prefill, a generated token's as its decode step); without it only the packed bf16 path differs from those.
    `window` > 0: each row attends to its last `window` positions only (all rows then take the decode arithmetic).
    `softcap`, `sinks`: as `paged_decode_attention_native`."""
    if decode_from is not None and not (
        decode_from.dtype == torch.int32
        and decode_from.is_contiguous()
        and decode_from.shape == (block_tables.shape[0],)
    ):
        raise ValueError("decode_from must be a contiguous int32 [num_seqs]")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    if not (
        v_cache.is_contiguous() and v_cache.shape == k_cache.shape and out.is_contiguous() and out.shape == q.shape
    ):
        raise ValueError(
            "the native prefill kernel needs a contiguous v_cache shaped like k_cache and a "
            "contiguous out shaped like q"
        )
    status = _native().paged_prefill(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        num_tokens,
        out.data_ptr(),
        block_tables.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        scale,
        int(q.dtype == torch.bfloat16),
        None if decode_from is None else decode_from.data_ptr(),
        _window(window),
        _softcap(softcap),
        _sinks(sinks, num_heads),
    )
    if status == -3:
        raise MemoryError("the native prefill kernel could not allocate its packed key tiles")
    if status == -1:
        raise ValueError(
            f"the native prefill kernel takes no group {num_heads // num_kv_heads}, head_dim "
            f"{head_dim}, block_size {block_size}"
        )
    if status != 0:
        raise ValueError(
            "a chunk is longer than its context, a context past its block table, a block table entry "
            f"outside the pool of {num_blocks} blocks, or query_start_loc not increasing within "
            f"[0, {num_tokens}]"
        )
    return out


def _takes_rows(x: torch.Tensor) -> bool:
    """[T, heads, D] with contiguous heads (rows may be views into a wider tensor), of a type the kernels take."""
    return (
        x.device.type == "cpu"
        and x.dtype in NATIVE_DTYPES
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and x.shape[2] <= MAX_HEAD_DIM
        and x.shape[2] % 2 == 0
    )


def rotary_takes(positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Whether the native rotary takes these (never under torch.compile: inductor fuses the twin there)."""
    return (
        not torch.compiler.is_compiling()
        and _takes_rows(q)
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and native_ready()
    )


def rotary_native(positions: torch.Tensor, q: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """q [T, H, D] rotated in place at positions [T] (int64), as `rotary_embedding_torch` (checked args)."""
    status = _native().rotary_inplace(
        q.data_ptr(),
        q.stride(0),
        q.shape[0],
        q.shape[1],
        q.shape[2],
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        int(is_neox),
        int(q.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(
            f"head_dim {q.shape[2]} is odd or past {MAX_HEAD_DIM}, or a position is outside the "
            f"cos/sin cache of {cos_sin_cache.shape[0]} positions"
        )


def append_kv_takes(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
) -> bool:
    """Whether the native append takes these (never under torch.compile: inductor fuses the twin there)."""
    return (
        not torch.compiler.is_compiling()
        and _takes_rows(k)
        and _takes_rows(v)
        and v.dtype == k.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and (
            cos_sin_cache is None
            or (
                positions is not None
                and positions.dtype == torch.int64
                and positions.is_contiguous()
                and cos_sin_cache.is_contiguous()
            )
        )
        and native_ready()
    )


def append_kv_native(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    is_neox: bool,
    pad_slot: int | None,
) -> None:
    """As `append_kv_torch` (checked args that pass `append_kv_takes`): k, v [T, Hkv, D] into the pools at
    slot_mapping, K rotated when `cos_sin_cache` is given; slot -1 skipped, or written at `pad_slot`."""
    num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    rope: tuple[int | None, int | None, int] = (None, None, 0)  # positions, cos/sin cache, its rows
    if cos_sin_cache is not None:
        if positions is None:
            raise ValueError("rotating K needs the positions")
        rope = (positions.data_ptr(), cos_sin_cache.data_ptr(), cos_sin_cache.shape[0])
    status = _native().append_kv(
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        num_blocks * block_size,
        slot_mapping.data_ptr(),
        -1 if pad_slot is None else pad_slot,
        k.shape[0],
        num_kv_heads,
        head_dim,
        *rope,
        int(is_neox),
        int(k.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(
            f"a slot is outside [-1, {num_blocks * block_size}) (or pad_slot past the pool), or a "
            f"position outside the cos/sin cache"
        )


def _row_stride(t: torch.Tensor) -> int | None:
    """The row stride of t [..., H] as [N, H] rows with unit column stride: a 2-D tensor's, or H for a
    contiguous one; None for other layouts (the twin takes them). Called per layer: no view is built."""
    if t.dim() == 2:
        return t.stride(0) if t.stride(1) == 1 else None
    return t.shape[-1] if t.is_contiguous() else None


# fp32 rows from which the native RMSNorm runs (bf16 rows always do). Measured on the 2-core dev VM, hidden 576, 2
# threads, 2026-11-26: native 9 / 15 / 28 us at 1 / 16 / 48 bf16 rows with the residual add, the twin 16 / 23 / 37.
# fp32 keeps the twin below a prefill's rows: its bits are transformers' (the native sums the squares in another
# order), which the fp32 parity tests hold decodes to.
RMS_NORM_MIN_ROWS = 64


def rms_norm_takes(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    min_rows: int = RMS_NORM_MIN_ROWS,
) -> bool:
    """Whether the native RMSNorm takes these: bf16 rows, or fp32 rows of a prefill (`min_rows`), on a CPU, never
    under torch.compile (inductor fuses the twin there)."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in NATIVE_DTYPES
        and (x.dtype == torch.bfloat16 or x.numel() >= min_rows * x.shape[-1])
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and 0 < x.shape[-1] <= MAX_HIDDEN
        and _row_stride(x) is not None
        and (residual is None or _row_stride(residual) is not None)
        and (out is None or _row_stride(out) is not None)
        and native_ready()
    )


def rms_norm_native(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """As `rms_norm_torch` (checked args, of a type `rms_norm_takes` takes): residual updated in place to
    x + residual when given, the norm into out (or a new tensor). x, residual and out must each flatten into
    rows of unit column stride without a copy."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if any(t is not None and _row_stride(t) is None for t in (x, residual, out)):
        raise ValueError("the native RMSNorm needs x, residual and out as rows with unit column stride")
    rows = x.numel() // x.shape[-1]
    status = _native().rms_norm(
        x.data_ptr(),
        _row_stride(x),
        residual.data_ptr() if residual is not None else None,
        _row_stride(residual) if residual is not None else 0,
        weight.data_ptr(),
        out.data_ptr(),
        _row_stride(out),
        rows,
        x.shape[-1],
        eps,
        int(x.dtype == torch.bfloat16),
    )
    if status != 0:
        raise ValueError(f"hidden size {x.shape[-1]} is past {MAX_HIDDEN}")
    return out


def silu_and_mul_takes(x: torch.Tensor) -> bool:
    """Whether the native SiLU * mul takes x [N, 2d] (gate | up): bf16 rows of unit column stride on a CPU (from
    one row: 4.9 vs 5.7 us at 1 x 1536, 15 vs 22 at 16; 2-core dev VM, 2026-11-26), never under torch.compile
    (inductor fuses the twin there). fp32 stays with torch, whose bits the fp32 parity tests against
    transformers keep."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.dim() == 2
        and x.shape[1] % 2 == 0
        and x.stride(1) == 1
        and native_ready()
    )


def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    """x [N, 2d] (gate | up) -> silu(gate) * up [N, d] (a new tensor), for x that passes `silu_and_mul_takes`."""
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, d), dtype=x.dtype)
    _native().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), d, rows, d, int(x.dtype == torch.bfloat16))
    return out


# Rows of x that the GEMV streams each weight row once for (past it, gemv.c's tiles, with the same sums), and the
# decode steps that run in one native call (worker/models/native_decode.py). SmolLM2's 120 layer matrices of a
# token, 2-core dev VM, 2026-11-26: 1.5-1.7x oneDNN's packed path at 1-3 rows, 1.0x at 4-6, 0.9x at 8; the whole
# decode step, native against layer by layer on oneDNN: 15 vs 21-23 ms at 4 sequences, 16-20 vs 21-24 at 6, 20-22
# vs 24-25 at 8. The GEMV and the tiles sum each row alone, so a sequence has the same bits in either path, in any
# step.
GEMV_MAX_ROWS = 8
GEMV_BF16_PAIRS, GEMV_BF16_FP32_CORE, GEMV_F32X = 1, 2, 4  # gemv.c's gemv_paths() bits


def gemv_paths() -> int:
    """What the loaded build's GEMV has (gemv.c's `gemv_paths`): GEMV_BF16_PAIRS (AVX512-BF16) or
    GEMV_BF16_FP32_CORE (AVX2: bf16 weights widened to fp32) for `gemv`, GEMV_F32X for `gemv_bf16w_f32x`; 0
    without a native library or in the generic build."""
    lib = _library()
    return lib.gemv_paths() if lib is not None else 0


def gemv_takes(weight: torch.Tensor) -> bool:
    """Whether the native GEMV can multiply by weight [N, K]: contiguous bf16 on a CPU, and a build with a GEMV
    (AVX512-BF16 or AVX2; checked once per weight: the caller then sends it bf16 rows [M >= 1, K] with unit column
    stride, any number of them)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and native_ready()
        and gemv_paths() & (GEMV_BF16_PAIRS | GEMV_BF16_FP32_CORE) != 0
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16, unit column stride, M >= 1) @ weight [N, K]^T (+ bias [N], bf16 contiguous) -> [M, N] bf16 (a
    new tensor), for a weight `gemv_takes`. The bias is added to each fp32 sum before its one rounding, as a fused
    linear adds it (oneDNN's, F.linear's). Each output row is the same bits whatever M (each row's sum is taken
    alone). Past 8 rows it multiplies tiles of rows by tiles of weight rows, with the same sums."""
    if bias is not None and not (
        bias.dtype == torch.bfloat16 and bias.is_contiguous() and bias.shape == (weight.shape[0],)
    ):
        raise ValueError(
            f"the native GEMV takes a contiguous bf16 bias of [{weight.shape[0]}], got {bias.dtype} {list(bias.shape)}"
        )
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16)
    status = _native().gemv_rows_bf16(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        weight.shape[0],
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
        None if bias is None else bias.data_ptr(),
    )
    if status == -3:
        raise MemoryError("the native GEMV could not allocate x's fp32 copy")
    if status != 0:
        raise ValueError(f"the native GEMV takes at least one row (got {x.shape[0]}) and needs AVX512-BF16 or AVX2")
    return out


def gemv_bf16w_f32x(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (unit column stride, M >= 1) @ weight [N, K]^T (bf16, contiguous) -> [M, N] fp32 (a new
    tensor): weights stored in bf16, computed in fp32 (the AVX2 fp32 core, also in AVX-512 builds). Each output is
    the fp32 sum unrounded, the same bits whatever M; needs GEMV_F32X in `gemv_paths()`."""
    if not (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.stride(1) == 1
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[1] == weight.shape[1]
    ):
        raise ValueError("gemv_bf16w_f32x takes fp32 rows [M, K] of unit column stride and a contiguous bf16 [N, K]")
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    status = _native().gemv_rows_bf16w_f32x(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        weight.shape[0],
        x.shape[0],
        weight.shape[0],
        weight.shape[1],
    )
    if status == -3:
        raise MemoryError("the native GEMV could not allocate x's fp32 copy")
    if status != 0:
        raise ValueError(
            f"gemv_bf16w_f32x takes at least one row (got {x.shape[0]}) and needs AVX2 (not the generic build)"
        )
    return out


def decode_layers(
    h: torch.Tensor,
    residual: torch.Tensor,
    weights: ctypes.Array,
    formats: ctypes.Array,
    pools: ctypes.Array,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    scale: float,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_pool: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    scratch: torch.Tensor,
    windows: ctypes.Array | None = None,
    runs: torch.Tensor | None = None,
) -> None:
    """One decode step of B sequences (bf16 or fp32 rows, h's type) through a dense Llama's layers and final norm
    (kernels/cpu/decode_layers.c): h [B, hidden] (the embedding rows in, the final normed rows out, in place), residual
    [B, hidden] and scratch the file's scratch; `weights`, `formats` and `pools` the arrays it describes, `k_pool`
    layer 0's K pool (its shape gives the pools'); positions, slots [B] int64, block_tables [B, width] int32 (unit
    column stride), seq_lens [B] int32, `windows` each layer's sliding window (int32, 0: full; None: all full),
    `runs` [R] int32 the rows of each sequence (a verification's k + 1; None: one row each). The
    caller checks types, layouts and sizes (worker/models/native_decode.py);
    the kernels check positions, slots, lengths and table entries, and a ValueError says which."""
    num_blocks, block_size = k_pool.shape[1], k_pool.shape[2]
    status = _native().decode_layers(
        h.data_ptr(),
        residual.data_ptr(),
        weights,
        formats,
        pools,
        num_layers,
        h.shape[0],
        h.shape[1],
        num_heads,
        num_kv_heads,
        head_dim,
        intermediate,
        eps,
        scale,
        positions.data_ptr(),
        slots.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        num_blocks,
        block_size,
        cos_sin_cache.data_ptr(),
        cos_sin_cache.shape[0],
        int(is_neox),
        scratch.data_ptr(),
        int(h.dtype == torch.bfloat16),
        windows,
        None if runs is None else runs.data_ptr(),
        0 if runs is None else runs.shape[0],
    )
    if status == -3:
        raise MemoryError("the native decode step could not allocate a kernel's buffer")
    if status == -1:
        raise ValueError(
            f"the native decode step takes no head_dim {head_dim}, group {num_heads // num_kv_heads} "
            f"or {h.shape[0]} rows"
        )
    if status != 0:
        raise ValueError(
            f"a position is outside the cos/sin cache of {cos_sin_cache.shape[0]}, a slot outside the "
            f"pool of {num_blocks * block_size} slots, a length < 1 or past its block table, or a table "
            f"entry outside the pool of {num_blocks} blocks, or runs that do not add up to the rows "
            "or whose lengths do not go up by one"
        )


def row_max_takes(x: torch.Tensor) -> bool:
    """Whether the native row max takes x: [B, V] fp32 on a CPU with unit column stride, V >= 1."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] >= 1
        and x.stride(1) == 1
        and not torch.compiler.is_compiling()
        and native_ready()
    )


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B], indices [B] int64) as `x.max(dim=-1)` (first index of the maximum; a NaN wins), for x
    that passes `row_max_takes`."""
    rows = x.shape[0]
    top = torch.empty(rows, dtype=torch.float32)
    index = torch.empty(rows, dtype=torch.int64)
    if rows:
        _native().row_max(x.data_ptr(), rows, x.shape[1], x.stride(0), top.data_ptr(), index.data_ptr())
    return top, index


@torch.library.custom_op("infer::paged_decode_cpu", mutates_args=("out",))
def paged_decode_cpu_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """`paged_decode_attention_native` as a torch operator, so that a compiled step graph (worker/engine/step_graphs.py)
    calls the kernel instead of tracing into it; `out` is written in place."""
    paged_decode_attention_native(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, window, softcap=softcap, sinks=sinks
    )


@paged_decode_cpu_op.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    return None


LORA_MAX_WIDTH = 1024  # lora.c's widest slot (sub-blocks x rank)


def lora_rows_takes(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> bool:
    """Whether `lora_rows` takes these: x [T, in] and y [T, out] rows of unit column stride, a_t [slots, in, width]
    and b_t [slots, width, out] contiguous, all of one type the kernels have, on a CPU, outside torch.compile."""
    return (
        not torch.compiler.is_compiling()
        and x.device.type == "cpu"
        and x.dtype in NATIVE_DTYPES
        and all(t.dtype == x.dtype for t in (y, a_t, b_t))
        and x.dim() == 2
        and y.dim() == 2
        and x.stride(1) == 1
        and y.stride(1) == 1
        and a_t.is_contiguous()
        and b_t.is_contiguous()
        and a_t.shape[2] <= LORA_MAX_WIDTH
        and native_ready()
    )


def lora_rows(
    x: torch.Tensor,
    y: torch.Tensor,
    slots: torch.Tensor,
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    rank: int,
    sub_first: torch.Tensor,
    sub_cols: torch.Tensor,
) -> torch.Tensor:
    """y [T, out] += (x_i a_t[s]) b_t[s] for each row i of slot s = slots[i] >= 0 (int32 [T]; -1: left alone), in
    place, for arguments `lora_rows_takes` takes. sub_first, sub_cols int64 [n]: each sub-block's first output column
    and columns, ranks k * rank ... (k + 1) * rank - 1 of a slot reaching only those (b_t block-diagonal,
    worker/engine/lora.py)."""
    rows, (num_slots, in_features, width), out_features = x.shape[0], a_t.shape, b_t.shape[2]
    if slots.dtype != torch.int32 or not slots.is_contiguous() or slots.shape != (rows,) or y.shape[0] != rows:
        raise ValueError(f"lora_rows: slots must be int32 [{rows}] and y [{rows}, out], got {slots.shape}, {y.shape}")
    subs = sub_first.shape[0]
    if not all(t.dtype == torch.int64 and t.is_contiguous() and t.shape == (subs,) for t in (sub_first, sub_cols)):
        raise ValueError("lora_rows: sub_first and sub_cols must be int64 [n] alike")
    if subs * rank != width:
        raise ValueError(f"lora_rows: {subs} sub-blocks of rank {rank} do not make width {width}")
    if x.shape[1] != in_features or y.shape[1] != out_features or b_t.shape[:2] != (num_slots, width):
        raise ValueError(
            f"lora_rows: x {tuple(x.shape)}, y {tuple(y.shape)}, a_t {tuple(a_t.shape)}, b_t {tuple(b_t.shape)} "
            "do not fit"
        )
    status = _native().lora_rows(
        x.data_ptr(),
        x.stride(0),
        y.data_ptr(),
        y.stride(0),
        slots.data_ptr(),
        rows,
        a_t.data_ptr(),
        b_t.data_ptr(),
        num_slots,
        in_features,
        out_features,
        rank,
        sub_first.data_ptr(),
        sub_cols.data_ptr(),
        subs,
        int(x.dtype == torch.bfloat16),
    )
    if status == -2:
        raise ValueError(f"lora_rows: a slot past the {num_slots} slots")
    if status == -3:
        raise MemoryError("lora_rows: out of memory")
    if status != 0:
        raise ValueError(
            f"lora_rows: width {width} past {LORA_MAX_WIDTH}, or sub-blocks outside {out_features} columns"
        )
    return y
