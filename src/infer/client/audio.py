"""Audio for a model that takes it (Whisper), torch-free: vLLM's prompt form `{"prompt": ..., "multi_modal_data":
{"audio": (samples, sample_rate)}}` taken apart (`split_audio`), audio files decoded (`decode_audio_file`), and samples
made what the wire carries (`wire_audio`: float32 little-endian PCM, mono, at AUDIO_SAMPLE_RATE), within bounds.

Files are decoded with soundfile (libsndfile: WAV, FLAC, OGG / Vorbis / Opus, MP3), resampling is soxr's (its
high-quality setting): a codec or an anti-aliased resampler of our own would be worse and longer.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from infer.protocol.messages import AUDIO_SAMPLE_RATE, MAX_AUDIO_BYTES

MAX_AUDIO_FILE_BYTES = 25 << 20  # an uploaded file (OpenAI's limit for /v1/audio/transcriptions)
MAX_AUDIO_SECONDS = 1800.0  # a decoded file or a prompt's samples (the front transcribes it window by window)
MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 1000, 384000


def split_audio(prompt: Any) -> tuple[Any, np.ndarray | None]:
    """(the prompt without its audio, the audio's samples at AUDIO_SAMPLE_RATE float32, or None) of vLLM's prompt
    dict; any other prompt passes through. ValueError naming what is wrong with the audio."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("multi_modal_data"), dict):
        return prompt, None
    data = dict(prompt["multi_modal_data"])
    if "audio" not in data:
        return prompt, None
    clip = data.pop("audio")
    if isinstance(clip, list):
        if len(clip) != 1:
            raise ValueError(f"multi_modal_data: one audio clip per prompt, got {len(clip)}")
        clip = clip[0]
    rest = {key: value for key, value in prompt.items() if key != "multi_modal_data"}
    if data:
        rest["multi_modal_data"] = data
    return rest, audio_samples(clip)


def audio_samples(clip: Any) -> np.ndarray:
    """A clip given as (samples, sample_rate) (vLLM's form: a 1-D float array in [-1, 1]) or an audio file's bytes,
    as samples at AUDIO_SAMPLE_RATE float32; ValueError naming what is wrong."""
    if isinstance(clip, (bytes, bytearray, memoryview)):
        samples, rate = decode_audio_file(bytes(clip))
    elif isinstance(clip, tuple) and len(clip) == 2:
        samples, rate = clip
    else:
        raise ValueError(f"audio must be (samples, sample_rate) or an audio file's bytes, got {type(clip).__name__}")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)):
        raise ValueError(f"the audio's sample rate must be an integer in Hz, got {rate!r:.40}")
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ValueError(f"the audio's sample rate must be {MIN_SAMPLE_RATE}..{MAX_SAMPLE_RATE} Hz, got {rate}")
    if not isinstance(samples, np.ndarray):
        raise ValueError(f"audio samples must be a numpy array, got {type(samples).__name__}")
    if samples.ndim != 1:
        raise ValueError(f"audio samples must be mono: a 1-D array, got shape {samples.shape}")
    if samples.dtype.kind != "f":
        raise ValueError(
            f"audio samples must be floating point in [-1, 1], got dtype {samples.dtype} (scale integer PCM first)"
        )
    if samples.size == 0:
        raise ValueError("the audio is empty (no samples)")
    seconds = samples.size / rate
    if seconds > MAX_AUDIO_SECONDS:
        raise ValueError(f"the audio lasts {seconds:.1f} s, more than the limit of {MAX_AUDIO_SECONDS:g} s")
    if not np.isfinite(samples).all():
        raise ValueError("the audio holds samples that are NaN or infinite")
    return resample(samples.astype(np.float32), int(rate))


def resample(samples: np.ndarray, rate: int) -> np.ndarray:
    """float32 samples at `rate` -> at AUDIO_SAMPLE_RATE (soxr, high quality)."""
    if rate == AUDIO_SAMPLE_RATE:
        return samples
    import soxr

    return np.asarray(soxr.resample(samples, rate, AUDIO_SAMPLE_RATE, quality="HQ"), dtype=np.float32)


def decode_audio_file(data: bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples, sample rate) of an audio file's bytes (channels averaged); ValueError naming what is
    wrong: too large, not audio soundfile reads, truncated, too long (read from its header before decoding)."""
    if len(data) > MAX_AUDIO_FILE_BYTES:
        raise ValueError(f"the audio file holds {len(data)} bytes, more than the limit of {MAX_AUDIO_FILE_BYTES}")
    if not data:
        raise ValueError("the audio file is empty")
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(data)) as file:
            if file.samplerate <= 0 or file.frames <= 0:
                raise ValueError("the audio file holds no samples")
            seconds = file.frames / file.samplerate
            if seconds > MAX_AUDIO_SECONDS:
                raise ValueError(
                    f"the audio file lasts {seconds:.1f} s, more than the limit of {MAX_AUDIO_SECONDS:g} s"
                )
            frames = file.read(dtype="float32", always_2d=True)
            rate = int(file.samplerate)
    except (soundfile.LibsndfileError, RuntimeError, TypeError) as error:
        raise ValueError(
            f"the file is not audio this server decodes (WAV, FLAC, OGG, MP3), or it is damaged: {error}"
        ) from None
    if frames.shape[0] == 0:
        raise ValueError("the audio file holds no samples (truncated?)")
    return frames.mean(axis=1, dtype=np.float32), rate


def wire_audio(samples: np.ndarray) -> bytes:
    """Samples at AUDIO_SAMPLE_RATE as RequestSpec.audio's bytes; ValueError past the wire's bound."""
    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    if len(data) > MAX_AUDIO_BYTES:
        seconds = len(data) / 4 / AUDIO_SAMPLE_RATE
        raise ValueError(
            f"the audio of one request lasts {seconds:.1f} s ({len(data)} bytes), more than the wire carries "
            f"({MAX_AUDIO_BYTES} bytes): /v1/audio/transcriptions splits long audio into the model's windows"
        )
    return data
