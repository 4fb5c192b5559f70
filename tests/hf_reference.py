"""transformers as the oracle: greedy continuations of token-id prompts on a model directory's weights."""

from __future__ import annotations

from pathlib import Path


def hf_model(model_dir: Path, dtype=None, **options):
    """transformers' own model of a model directory: its safetensors, or the GGUF a conversion directory links to
    (worker/model_files.py; transformers dequantizes it)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = Path(model_dir) / "model.gguf"
    if gguf.exists():
        options["gguf_file"] = gguf.name
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype or torch.float32, **options).eval()


def transformers_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Exactly `max_new` greedy tokens per prompt (EOS ignored), one prompt at a time (no padding effects)."""
    import torch

    model = hf_model(model_dir)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                               min_new_tokens=max_new, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
