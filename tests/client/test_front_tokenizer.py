"""The HTTP front's tokenizer (issue 18, the front's boundary): read without importing torch (infer-serve's front
process and infer-api never load a model), and tokenizing, rendering chat and decoding as the engines' does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infer.worker.loading.model_files import front_tokenizer, load_tokenizer

# The front's imports and its tokenizer (argv[1]: a model directory; none: the embedded model), then the torch
# modules loaded by then.
FRONT = """
import sys
import infer.client.serve
from infer.client.api.server import load_front_tokenizer
tokenizer = load_front_tokenizer(sys.argv[1] if len(sys.argv) > 1 else None, None)
assert tokenizer.encode("hello")
print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
"""
TEXTS = ["hello world", "  leading spaces", "émoji 😀 你好", "a\n\nb\tc", "<|im_start|>user hi", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\n\nthere"}]


def front_torch_modules(*argv: str) -> str:
    out = subprocess.run([sys.executable, "-c", FRONT, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_the_front_reads_a_model_directorys_tokenizer_without_torch(tiny_model_dir):
    assert front_torch_modules(str(tiny_model_dir("llama"))) == "[]"


def test_the_front_reads_the_embedded_models_tokenizer_without_torch(smollm2_dir):
    assert front_torch_modules() == "[]"  # its conversion is cached (smollm2_dir made it)


def assert_tokenizes_alike(front, engine) -> None:
    assert [front.encode(t) for t in TEXTS] == [engine.encode(t) for t in TEXTS]
    assert front.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == engine.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=True
    )
    ids = engine.encode("émoji 😀 你好 ok")
    assert front.decode(ids) == engine.decode(ids)
    assert front.convert_ids_to_tokens(ids) == engine.convert_ids_to_tokens(ids)
    assert (front.eos_token_id, front.bos_token_id, len(front)) == (
        engine.eos_token_id,
        engine.bos_token_id,
        len(engine),
    )


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_the_front_tokenizes_as_the_engines_do(tiny_model_dir, model_type):
    path = tiny_model_dir(model_type)
    assert_tokenizes_alike(front_tokenizer(path), load_tokenizer(path))


def test_the_embedded_model(smollm2_dir):
    assert_tokenizes_alike(front_tokenizer(smollm2_dir), load_tokenizer(smollm2_dir))


def test_a_checkpoint_that_names_its_model_specific_tokenizer_gets_it(tiny_model_dir, tmp_path: Path):
    # A Qwen2 checkpoint's tokenizer files name Qwen2Tokenizer (AutoTokenizer's pick for the model type, saved):
    # the front loads that class, not the generic backend.
    engine = load_tokenizer(tiny_model_dir("qwen2"))
    engine.save_pretrained(tmp_path)
    shutil.copy(tiny_model_dir("qwen2") / "config.json", tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == type(engine).__name__
    front = front_tokenizer(tmp_path)
    assert type(front) is type(engine)
    assert_tokenizes_alike(front, engine)
