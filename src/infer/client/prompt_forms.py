"""vLLM's explicit encoder-decoder prompt, torch-free: `{"encoder_prompt": E, "decoder_prompt": D}` with E text, token
ids or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`, and D the same or None (absent: the decoder starts
from its start token alone). `split_encoder_decoder` takes it apart; any other prompt passes through unchanged (for
an encoder-decoder model a plain prompt is its encoder's input)."""

from __future__ import annotations

from typing import Any

KEYS = ("encoder_prompt", "decoder_prompt")


def split_encoder_decoder(prompt: Any) -> tuple[Any, str | list[int] | None]:
    """(the prompt, the decoder prompt or None); ValueError naming what is wrong with an encoder-decoder dict."""
    if not isinstance(prompt, dict) or not any(key in prompt for key in KEYS):
        return prompt, None
    unknown = sorted(set(prompt) - set(KEYS))
    if unknown:
        raise ValueError(f"an encoder-decoder prompt takes 'encoder_prompt' and 'decoder_prompt', got also {unknown}")
    if "encoder_prompt" not in prompt:
        raise ValueError("an encoder-decoder prompt needs 'encoder_prompt'")
    encoder = _single(prompt["encoder_prompt"], "encoder_prompt")
    decoder = prompt.get("decoder_prompt")
    return encoder, None if decoder is None else _single(decoder, "decoder_prompt")


def _single(part: Any, name: str) -> str | list[int]:
    if isinstance(part, dict):
        if set(part) == {"prompt"}:
            part = part["prompt"]
        elif set(part) == {"prompt_token_ids"}:
            part = part["prompt_token_ids"]
        else:
            raise ValueError(f"{name}: a dict takes exactly one of 'prompt' and 'prompt_token_ids', got {sorted(part)}")
    if isinstance(part, str):
        return part
    if isinstance(part, (list, tuple)):
        return list(part)
    raise ValueError(f"{name} must be text, token ids or a prompt dict, got {type(part).__name__}")
