"""The INFER_* environment variables: one registry, read through `read` (and nowhere else in the package).

Each variable is declared once with what it does; README's table and `infer-worker --help`-style listings come
from `VARIABLES`. Reading takes an `environ` mapping (os.environ by default) so that callers and tests can
pass their own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    doc: str


MODEL_CACHE = Variable(
    "INFER_MODEL_CACHE", "where converted models (GGUF -> safetensors) are kept (default ~/.cache/infer/models)"
)
COMPILE_CACHE = Variable(
    "INFER_COMPILE_CACHE", "where compiled step graphs are cached across restarts (default ~/.cache/infer/compile)"
)
GRAMMAR_COMPILE_DELAY = Variable(
    "INFER_TEST_GRAMMAR_COMPILE_DELAY_S",
    "tests only: seconds every grammar compile waits in the compile thread first (a compile slow by construction)",
)
KERNELS = Variable("INFER_KERNELS", "'torch': run the kernels' PyTorch twins even on CUDA")
CPU_KERNELS = Variable("INFER_CPU_KERNELS", "'0': no C kernels on a CPU (kernels/cpu_kernels.py): the twins run")
API_KEY = Variable("INFER_API_KEY", "the HTTP front's API key when neither --api-key nor --api-key-file is given")
COORDINATOR_PORT = Variable(
    "INFER_COORDINATOR_PORT", "SPMD programs: the port of the coordinator rank 0 starts (default $MASTER_PORT + 1)"
)
CPU_ISA = Variable(
    "INFER_CPU_ISA",
    "'avx512', 'avx2' or 'generic': the build of the C kernels to run (default: the "
    "best this CPU runs; one it cannot run is refused)",
)
TP_SUPERVISED = Variable(
    "INFER_TP_SUPERVISED",
    "set by infer-worker --tp-size on the processes it starts: "
    "their TP rank is their --tp-rank, not $RANK / $SLURM_PROCID",
)
FORK_MEMBERS = Variable(
    "INFER_FORK_MEMBERS",
    "'0': infer-worker --tp-size / --pp-size starts each member as a new process (its own command line) instead "
    "of forking it from the supervisor once torch is imported there",
)
FORK_WORKERS = Variable(
    "INFER_FORK_WORKERS",
    "'0': infer-serve and LLM's coordinator mode start each worker as a new interpreter instead of forking it from "
    "one process that has imported torch (client/worker_forks.py)",
)

VARIABLES: tuple[Variable, ...] = (
    MODEL_CACHE,
    COMPILE_CACHE,
    KERNELS,
    CPU_KERNELS,
    CPU_ISA,
    API_KEY,
    COORDINATOR_PORT,
    TP_SUPERVISED,
    FORK_MEMBERS,
    FORK_WORKERS,
)


def read(variable: Variable, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, or None when it is unset or blank (surrounding spaces stripped)."""
    value = (os.environ if environ is None else environ).get(variable.name)
    if value is None or not value.strip():
        return None
    return value.strip()


def read_raw(variable: Variable, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value as set (None when unset): for callers that tell "set but blank" apart."""
    return (os.environ if environ is None else environ).get(variable.name)


def model_cache_dir() -> Path:
    """Where GGUF conversions (config, tokenizer, a link to the file) are kept: $INFER_MODEL_CACHE or
    ~/.cache/infer/models."""
    value = read(MODEL_CACHE)
    return Path(value) if value else Path.home() / ".cache" / "infer" / "models"


def compile_cache_dir() -> Path:
    """Where compiled step graphs (inductor's FX graph cache) and the C kernels' builds are cached across
    restarts: $INFER_COMPILE_CACHE or ~/.cache/infer/compile."""
    value = read(COMPILE_CACHE)
    return Path(value) if value else Path.home() / ".cache" / "infer" / "compile"
