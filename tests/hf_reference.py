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
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def assert_bf16_as_close_as_transformers(model_dir: Path, ids: list[int], name: str, **options) -> None:
    """Our bf16 logits of `ids` (one sequence, paged) differ from transformers' fp32 ones no more than 1.5x
    transformers' own bf16 forward does, and pick fp32's next token at 80% of the positions or more (the figures
    are printed). `options` go to transformers' model (e.g. attn_implementation)."""
    import torch
    from model_batches import Pager, new_cache

    from infer.worker.loader import load_model

    with torch.inference_mode():
        reference = hf_model(model_dir, **options)(torch.tensor([ids])).logits[0].float()
        theirs = hf_model(model_dir, torch.bfloat16, **options)(torch.tensor([ids])).logits[0].float()
        model = load_model(model_dir, torch.bfloat16, torch.device("cpu"))
        batch = Pager(num_blocks=32, block_size=4).batch([("s", ids, 0, len(ids))])
        ours = model.compute_logits(model(batch, new_cache(model, 32, 4)))

    def rel_err(logits: torch.Tensor) -> float:
        return ((logits - reference).abs().max() / reference.abs().max()).item()

    same = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    print(
        f"{name} bf16: ours {rel_err(ours):.3g}, transformers' {rel_err(theirs):.3g} of the largest fp32 logit; "
        f"{same:.0%} of the next tokens as fp32"
    )
    assert rel_err(ours) <= 1.5 * rel_err(theirs)
    assert same >= 0.8
