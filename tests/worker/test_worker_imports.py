"""A worker carries only what it needs (issue 47): an engine loaded on the embedded model and stepped, in a process
of its own, has not imported transformers' model code or what it drags in (sympy, accelerate,
torch.distributed.tensor: ~60 MiB), nor torch's compiler with step graphs off, nor transformers at all where the
Rust tokenizer is AutoTokenizer's exactly (worker/loading/tokenizer.py; transformers' import alone is ~1.75 s of CPU). And
the tokenizer it loads without them is the one AutoTokenizer loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from infer.worker.loading.model_files import conversion_dir

# Modules a worker on a Llama-family model must not import (each pulls tens of MiB into every worker process).
HEAVY = (
    "sympy",
    "accelerate",
    "torch.distributed.tensor",
    "torch._dynamo",
    "transformers.activations",
    "transformers.models.llama.configuration_llama",
    "transformers.modeling_utils",
    "transformers",
    "infer.client",  # the client (LLM, InferenceClient, the HTTP front): `import infer` loads none of it
)
# The engine's load sequence and one step on each model of argv[1] (a JSON list), then the heavy modules present.
LOAD_AND_STEP = """
import json, sys
import infer.worker.service.daemon
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

for model in json.loads(sys.argv[1]):
    engine = Engine(EngineConfig(model=model, enforce_eager=True, max_model_len=256, kv_cache_memory=16 << 20))
    engine.add_request("r", "Hello there", SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished():
        engine.step()
print(json.dumps([name for name in sys.argv[2:] if name in sys.modules]))
"""


def test_engine_on_the_embedded_model_imports_no_model_code(smollm2_gguf: Path, tmp_path: Path) -> None:
    """From an empty model cache: the GGUF's conversion (transformers' GGUF and config code) runs in a child."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_STEP, json.dumps([str(smollm2_gguf)]), *HEAVY],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "INFER_MODEL_CACHE": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [conversion_dir(smollm2_gguf).name]


def test_engine_on_tiny_checkpoints_imports_no_transformers(tiny_model_dir) -> None:
    """Checkpoints saved by transformers with SmolLM2's tokenizer (the generic class), a Llama and a Qwen3, each
    loaded and stepped in one process (one interpreter's start for both): no transformers either."""
    models = [str(tiny_model_dir(arch)) for arch in ("llama", "qwen3")]
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_STEP, json.dumps(models), *HEAVY],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_tokenizer_is_autotokenizers(smollm2_dir: Path, tiny_model_dir) -> None:
    """load_tokenizer (a bare config for AutoTokenizer's choice) gives AutoTokenizer's tokenizer: same class, ids,
    special tokens and chat template, on the embedded model and on tiny checkpoints saved by transformers."""
    from transformers import AutoTokenizer

    from infer.worker.loading.model_files import load_tokenizer

    texts = ["Hello world", " leading space", "你好 😀 é", "<|im_start|>user\nhi<|im_end|>"]
    for path in (smollm2_dir, tiny_model_dir("llama"), tiny_model_dir("qwen3")):
        ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
        assert type(ours) is type(theirs)
        assert ours.chat_template == theirs.chat_template
        assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
        for text in texts:
            for special in (True, False):
                assert (
                    ours(text, add_special_tokens=special)["input_ids"]
                    == theirs(text, add_special_tokens=special)["input_ids"]
                )
