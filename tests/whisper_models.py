"""A tiny random Whisper checkpoint (d_model 64, 2 + 2 layers, a 1-s window: max_source_positions 50 and a feature
extractor with chunk_length 1, so 100 mel frames) saved with transformers beside SmolLM2's tokenizer plus Whisper's
special tokens (start of transcript, four languages, the tasks, no-timestamps, start of previous), its
preprocessor_config.json and a generation_config.json as Whisper's name them (lang_to_id, task_to_id,
suppress_tokens, begin_suppress_tokens); transformers' `generate` and WhisperFeatureExtractor on it as the oracle.
Import as `from whisper_models import ...` (tests/ is on the path)."""

from __future__ import annotations

import io
import json
import math
import wave
from pathlib import Path
from typing import Any

import numpy as np
import torch

LANGUAGES = ("en", "de", "fr", "es")
SPECIALS = (
    "<|startoftranscript|>",
    *(f"<|{code}|>" for code in LANGUAGES),
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
)
RATE = 16000
WHISPER: dict[str, Any] = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_source_positions=50,
    max_target_positions=64,
    dropout=0.0,
)


def whisper_checkpoint(path: Path, tokenizer: Any, seed: int = 5, num_mel_bins: int = 80, **overrides: Any) -> Path:
    """The tiny checkpoint in `path` (created), with `overrides` of its config; returns the path."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    tokenizer = _whisper_tokenizer(tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIALS}
    eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=num_mel_bins,
        decoder_start_token_id=ids["<|startoftranscript|>"],
        eos_token_id=eot,
        pad_token_id=eot,
        bos_token_id=eot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        **{**WHISPER, **overrides},
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_positions" in name and "encoder" in name:
                continue  # the sinusoids transformers made
            if "layer_norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, 0.2)
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    file = Path(path) / "generation_config.json"
    saved = {k: v for k, v in json.loads(file.read_text()).items() if k != "_from_model_config"}
    file.write_text(json.dumps({**saved, **generation_config(ids, eot)}, indent=2))
    tokenizer.save_pretrained(path)
    extractor = WhisperFeatureExtractor(feature_size=num_mel_bins, chunk_length=1, sampling_rate=RATE)
    extractor.save_pretrained(path)
    return Path(path)


def generation_config(ids: dict[str, int], eot: int) -> dict[str, Any]:
    """Whisper's generation config fields for the tiny vocabulary (a few ordinary tokens suppressed, as Whisper's
    list suppresses punctuation; the space-like token 220 and EOT banned at the first generated token)."""
    return dict(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        eos_token_id=eot,
        pad_token_id=eot,
        is_multilingual=True,
        lang_to_id={f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        no_timestamps_token_id=ids["<|notimestamps|>"],
        prev_sot_token_id=ids["<|startofprev|>"],
        suppress_tokens=[5, 6, 7, 11, 12, ids["<|startoftranscript|>"], ids["<|startofprev|>"]],
        begin_suppress_tokens=[220, eot],
        max_length=64,
        forced_decoder_ids=None,
    )


def _whisper_tokenizer(tokenizer: Any) -> Any:
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS)})
    return tokenizer


def tone(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    """float32 samples: two tones and a little noise (a clip whose spectrum is not flat)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f1, f2 = 200 + 150 * seed, 1200 + 300 * seed
    wave_ = 0.4 * np.sin(2 * math.pi * f1 * t) + 0.2 * np.sin(2 * math.pi * f2 * t) + 0.05 * rng.standard_normal(t.size)
    return wave_.astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE, channels: int = 1) -> bytes:
    """A 16-bit PCM WAV file of `samples` (float in [-1, 1]), written with the stdlib."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    if channels > 1:
        pcm = np.repeat(pcm[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(pcm.tobytes())
    return out.getvalue()


def hf_whisper(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(str(path), dtype=dtype).eval()


def hf_features(path: Path, samples: np.ndarray) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(str(path))
    return extractor(samples, sampling_rate=RATE, return_tensors="pt").input_features


def transformers_transcribe(
    path: Path,
    clips: list[np.ndarray],
    max_new: int,
    language: str | None = "en",
    task: str = "transcribe",
    model: Any = None,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """transformers' greedy `generate` of each clip (one at a time) with the checkpoint's generation config: the
    generated tokens after Whisper's prefix (start of transcript, language, task, no timestamps)."""
    model = hf_whisper(path, dtype) if model is None else model
    prefix_len = 4
    outs = []
    with torch.inference_mode():
        for clip in clips:
            features = hf_features(path, clip).to(dtype)
            y = model.generate(
                features, language=language, task=task, do_sample=False, num_beams=1, max_new_tokens=max_new
            )
            tokens = y[0].tolist()
            outs.append(tokens[prefix_len:] if tokens[0] == model.generation_config.decoder_start_token_id else tokens)
    return outs


def special_ids(path: Path) -> dict[str, int]:
    """The checkpoint's Whisper special tokens by text."""
    generation = json.loads((Path(path) / "generation_config.json").read_text())
    ids = {token: i for token, i in generation["lang_to_id"].items()}
    ids.update({f"<|{task}|>": i for task, i in generation["task_to_id"].items()})
    ids["<|startoftranscript|>"] = generation["decoder_start_token_id"]
    ids["<|notimestamps|>"] = generation["no_timestamps_token_id"]
    ids["<|startofprev|>"] = generation["prev_sot_token_id"]
    ids["<|endoftext|>"] = generation["eos_token_id"]
    return ids
