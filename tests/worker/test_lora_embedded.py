"""LoRA on the embedded model (SmolLM2-135M, dense fp32 from its GGUF): greedy output with a PEFT adapter on every
projection, beside the base model in one batch, equals transformers + PEFT. Apart from tests/worker/test_lora.py
because reading the GGUF into transformers costs most of its half minute."""

from __future__ import annotations

import random

import pytest
from lora_cases import ADAPTERS

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

MAX_NEW = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49000) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def _run(engine: Engine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    for rid, (prompt, lora) in requests.items():
        engine.add_request(
            rid, prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, lora_name=lora)
        )
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return out


@pytest.mark.slow
def test_the_embedded_model_with_an_adapter_equals_transformers_and_peft(smollm2_dir, tmp_path):
    """SmolLM2-135M (dense fp32 from its GGUF) with a PEFT adapter on every projection, beside the base model (the
    reference model read once: base outputs first, then the same model wrapped by PEFT)."""
    import torch
    from hf_reference import hf_model
    from peft import LoraConfig, get_peft_model

    prompts = _prompts(2, seed=23)
    model = hf_model(smollm2_dir)

    def greedy(m) -> list[list[int]]:
        with torch.inference_mode():
            return [
                m.generate(
                    input_ids=torch.tensor([p]),
                    attention_mask=torch.ones(1, len(p), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=MAX_NEW,
                    min_new_tokens=MAX_NEW,
                    pad_token_id=0,
                )[0, len(p) :].tolist()
                for p in prompts
            ]

    want_base = greedy(model)
    torch.manual_seed(7)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=ADAPTERS["all-rs"]["target_modules"]),
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.02)
    peft_model.save_pretrained(str(tmp_path / "a"))
    want_adapter = greedy(peft_model.eval())
    assert want_adapter != want_base
    engine = Engine(
        EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            quantization="none",
            max_model_len=128,
            kv_cache_memory=16 << 20,
            enable_lora=True,
            max_lora_rank=8,
            lora_modules={"a": tmp_path / "a"},
        )
    )
    got = _run(engine, {f"{n}-{i}": (p, n) for i, p in enumerate(prompts) for n in (None, "a")})
    assert [got[f"a-{i}"] for i in range(2)] == want_adapter
    assert [got[f"None-{i}"] for i in range(2)] == want_base
