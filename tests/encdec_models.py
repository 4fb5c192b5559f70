"""Tiny random encoder-decoder checkpoints (T5 v1.1 / Flan-style with a gated GELU MLP, the original T5 with ReLU and
a tied, scaled head, BART) saved with transformers beside SmolLM2's tokenizer, and transformers' greedy `generate` on
them as the oracle. Import as `from encdec_models import ...` (tests/ is on the path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

T5_V11: dict[str, Any] = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=20,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
    dropout_rate=0.0,
)
T5_ORIGINAL: dict[str, Any] = {**T5_V11, "feed_forward_proj": "relu", "tie_word_embeddings": True, "num_layers": 3}
BART: dict[str, Any] = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    scale_embedding=True,
    dropout=0.0,
    forced_eos_token_id=None,
)
FAMILIES = {"t5": T5_V11, "t5-original": T5_ORIGINAL, "bart": BART}


def encdec_checkpoint(name: str, path: Path, tokenizer: Any, seed: int = 3, **overrides: Any) -> Path:
    """The tiny checkpoint of FAMILIES[name] (with `overrides` of its config) in `path` (created), with `tokenizer`;
    returns the path."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    ids = dict(vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=2)
    if name == "bart":
        config: Any = BartConfig(**ids, bos_token_id=1, decoder_start_token_id=2, **{**BART, **overrides})
        cls: Any = BartForConditionalGeneration
    else:
        config = T5Config(**ids, decoder_start_token_id=0, **{**FAMILIES[name], **overrides})
        cls = T5ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param_name.endswith("weight"):
                param.normal_(1.0, 0.2)
            elif "relative_attention_bias" in param_name:
                param.normal_(0.0, 1.0)
            else:
                param.normal_(0.0, 0.2)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Path(path)


def hf_encdec(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(str(path), dtype=dtype).eval()


def transformers_greedy(
    path: Path,
    prompts: list[list[int]],
    max_new: int,
    decoder_prompts: list[list[int]] | None = None,
    model: Any = None,
) -> list[list[int]]:
    """Exactly `max_new` greedy tokens per encoder prompt (EOS ignored, no forced tokens), one request at a time;
    with `decoder_prompts`, each continues the decoder's start token and that prefix."""
    model = hf_encdec(path) if model is None else model
    start = model.config.decoder_start_token_id
    outs = []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            decoder = [start, *(decoder_prompts[i] if decoder_prompts else [])]
            y = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                decoder_input_ids=torch.tensor([decoder]),
                do_sample=False,
                num_beams=1,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                forced_bos_token_id=None,
                forced_eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(y[0, len(decoder) :].tolist())
    return outs
