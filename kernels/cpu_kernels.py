"""Native CPU kernels: small C files under kernels/cpu/, built with the system C compiler on first use.

The one kernel today is paged decode attention (cpu/paged_decode.c): it reads K and V where they sit in the
pool, where the PyTorch twin gathers each sequence's blocks into a padded copy first and hands it to SDPA.
That copy, and SDPA's packing of each tiny per-head problem, were most of a CPU decode step's attention time.

Built with `cc -O3 -march=native -fopenmp -shared` into INFER_COMPILE_CACHE (see worker/config.py) under a
name that hashes the source, the flags, the compiler and this CPU's feature flags, so a shared home directory
serves machines of different kinds; a build is written to a temporary name and renamed, so processes starting
together do not read half a file. Loaded after torch, the library's OpenMP is torch's own runtime (the same
soname), so it runs on torch's threads. Where no compiler works, or the environment sets
INFER_CPU_KERNELS=0, `decode_kernel()` is None and the callers use the twins.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from infer.protocol import env

log = logging.getLogger("infer.kernels")

SOURCE = Path(__file__).resolve().parent / "cpu" / "paged_decode.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast")
BUILD_TIMEOUT_S = 120
# What the compiled kernel accepts (the C file's MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK).
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256
_ENTRY = {torch.bfloat16: "paged_decode_bf16", torch.float32: "paged_decode_f32"}


def _cache_dir() -> Path:
    from infer.worker.config import compile_cache_dir

    return compile_cache_dir() / "cpu_kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _library_path(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    return _cache_dir() / f"paged_decode-{key}.so"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _library() -> ctypes.CDLL | None:
    if env.read(env.CPU_KERNELS) == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention runs on the PyTorch twin (slower)")
        return None
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
            log.info("built the CPU decode-attention kernel: %s", path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("the CPU decode-attention kernel could not be built (%s): the PyTorch twin runs instead", e)
        return None
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    for name in _ENTRY.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i32, i32, i32, i32, i32, i64, f32]
        fn.restype = i32
    return lib


def decode_kernel_fits(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor) -> bool:
    """Whether the native kernel takes these arguments (CPU, a type it has, layouts and sizes in its
    limits); without it the caller runs the twin."""
    if q.dim() != 3 or k_cache.dim() != 4 or block_tables.dim() != 2:
        return False
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    return (q.device.type == "cpu" and q.dtype in _ENTRY and k_cache.dtype == q.dtype
            and q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.is_contiguous()
            and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
            and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
            and q.shape[1] % num_kv_heads == 0 and q.shape[1] // num_kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK and _library() is not None)


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                  out: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] over the pool [Hkv, NB, bs, D] into out [B, H, D] (contiguous), as
    `paged_decode_attention_torch`; the arguments must pass `decode_kernel_fits` (and v_cache be shaped
    like k_cache). Every length must be >= 1 and every table entry it reaches a block of the pool."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = k_cache.shape
    if not (v_cache.is_contiguous() and v_cache.shape == k_cache.shape and out.is_contiguous()):
        raise ValueError("the native decode kernel needs a contiguous v_cache shaped like k_cache and a "
                         "contiguous out")
    fn = getattr(_library(), _ENTRY[q.dtype])
    status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), num_seqs,
                num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale)
    if status == -1:
        raise ValueError(f"the native decode kernel takes no group {num_heads // num_kv_heads}, head_dim "
                         f"{head_dim}, block_size {block_size}")
    if status != 0:
        raise ValueError("a sequence length is < 1 or past its block table, or a block table entry is outside "
                         f"the pool of {num_blocks} blocks")
    return out
