"""Audio for a model that takes it (Whisper): a request's samples checked and turned into log-mel features (torch).

On the wire a request's audio is its samples as float32 little-endian PCM, mono, at the model's sampling rate
(protocol/messages.py RequestSpec.audio; client/audio.py decodes files and resamples). `load_audio` checks them:
whole samples, finite, not empty, at most one window of the model (`chunk_length` seconds: Whisper's encoder takes
exactly one; the transcription front splits longer audio into windows).

`LogMel` is transformers' WhisperFeatureExtractor (its torch path) for the checkpoint's preprocessor_config.json:
the samples zero-padded to the window, a centered STFT (periodic Hann window of n_fft, reflect padding) of hop_length,
the power spectrum's last frame dropped, Slaney-normalized mel filters on the Slaney mel scale up to 8 kHz
(`mel_filter_bank`), log10 clamped at 1e-10, floored 8 below the maximum, then (x + 4) / 4.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from infer.protocol.messages import AUDIO_SAMPLE_RATE as CLIENT_SAMPLE_RATE

SAMPLE_BYTES = 4  # float32


@dataclass(frozen=True)
class LogMel:
    """The feature extractor of one checkpoint (preprocessor_config.json's fields); `__call__` makes one window's
    features [feature_size, num_frames] float32."""

    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400

    def __post_init__(self) -> None:
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"preprocessor_config.json: {name} must be a positive integer, got {value!r}")

    @classmethod
    def from_dir(cls, path: Path) -> LogMel:
        """The checkpoint's preprocessor_config.json (WhisperFeatureExtractor's defaults for what it leaves out);
        ValueError naming a file that is missing or wrong."""
        file = Path(path) / "preprocessor_config.json"
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"{file}: an audio model needs its feature extractor's config ({error})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{file}: expected a JSON object")
        names = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft")
        return cls(**{name: raw[name] for name in names if name in raw})

    @property
    def num_samples(self) -> int:
        """Samples of one window (what every clip is padded to)."""
        return self.chunk_length * self.sampling_rate

    @property
    def num_frames(self) -> int:
        return self.num_samples // self.hop_length

    def __call__(self, samples: torch.Tensor) -> torch.Tensor:
        """samples [n] float32 (n <= num_samples) -> log-mel features [feature_size, num_frames] float32."""
        waveform = torch.nn.functional.pad(samples.float(), (0, self.num_samples - samples.shape[0]))
        window = torch.hann_window(self.n_fft)
        stft = torch.stft(waveform, self.n_fft, self.hop_length, window=window, return_complex=True)
        power = stft[..., :-1].abs() ** 2  # [bins, frames]
        mel = self.filters.T @ power
        log_spec = torch.clamp(mel, min=1e-10).log10()
        log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    @functools.cached_property
    def filters(self) -> torch.Tensor:
        """[n_fft // 2 + 1, feature_size] float32 (computed in float64, as transformers does)."""
        bank = mel_filter_bank(1 + self.n_fft // 2, self.feature_size, 0.0, 8000.0, self.sampling_rate)
        return torch.from_numpy(bank).to(torch.float32)


def _hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    min_log_hertz, min_log_mel, logstep = 1000.0, 15.0, 27.0 / math.log(6.4)
    mels = 3.0 * freq / 200.0
    log_region = freq >= min_log_hertz
    mels[log_region] = min_log_mel + np.log(freq[log_region] / min_log_hertz) * logstep
    return mels


def _mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    min_log_hertz, min_log_mel, logstep = 1000.0, 15.0, math.log(6.4) / 27.0
    freq = 200.0 * mels / 3.0
    log_region = mels >= min_log_mel
    freq[log_region] = min_log_hertz * np.exp(logstep * (mels[log_region] - min_log_mel))
    return freq


def mel_filter_bank(
    num_frequency_bins: int, num_mel_filters: int, min_frequency: float, max_frequency: float, sampling_rate: int
) -> np.ndarray:
    """transformers' audio_utils.mel_filter_bank with norm="slaney", mel_scale="slaney": triangular filters
    [num_frequency_bins, num_mel_filters] float64, each scaled by 2 / its width in Hz."""
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    mel_min, mel_max = _hertz_to_mel(np.array([min_frequency, max_frequency], dtype=np.float64))
    filter_freqs = _mel_to_hertz(np.linspace(mel_min, mel_max, num_mel_filters + 2))
    filter_diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / filter_diff[:-1]
    up = slopes[:, 2:] / filter_diff[1:]
    bank = np.maximum(np.zeros(1), np.minimum(down, up))
    return bank * (2.0 / (filter_freqs[2 : num_mel_filters + 2] - filter_freqs[:num_mel_filters]))[None, :]


def load_audio(data: object, features: LogMel) -> torch.Tensor:
    """A request's audio (float32 little-endian PCM at the model's rate, as bytes) as samples [n] float32, checked;
    ValueError naming what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(
            f"audio must be float32 PCM samples as bytes (client/audio.py makes them), got {type(data).__name__}"
        )
    raw = bytes(data)
    if not raw:
        raise ValueError("the audio is empty (no samples)")
    if len(raw) % SAMPLE_BYTES:
        raise ValueError(f"the audio's {len(raw)} bytes are not whole float32 samples (a multiple of {SAMPLE_BYTES})")
    count = len(raw) // SAMPLE_BYTES
    if count > features.num_samples:
        seconds = count / features.sampling_rate
        raise ValueError(
            f"the audio lasts {seconds:.2f} s, longer than the model's window of {features.chunk_length} s "
            f"({features.num_samples} samples at {features.sampling_rate} Hz): a request takes one window; "
            "/v1/audio/transcriptions splits longer audio into windows"
        )
    samples = torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy())
    if not bool(torch.isfinite(samples).all()):
        raise ValueError("the audio holds samples that are NaN or infinite")
    return samples


def audio_features(model: object, path: Path | None) -> LogMel | None:
    """The feature extractor of a model that takes audio (None for another): its checkpoint's preprocessor_config.json
    (an in-memory model: WhisperFeatureExtractor's defaults at its mel bins), checked against the model: its mel bins,
    one window's frames (2 x max_source_positions), and the client's sampling rate. ValueError naming what disagrees."""
    if not getattr(model, "takes_audio", False):
        return None
    bins, frames = int(getattr(model, "num_mel_bins")), int(getattr(model, "num_frames"))
    features = LogMel(feature_size=bins) if path is None else LogMel.from_dir(path)
    if features.feature_size != bins:
        raise ValueError(f"the feature extractor makes {features.feature_size} mel bins, the model takes {bins}")
    if features.num_frames != frames:
        raise ValueError(
            f"the feature extractor pads a window to {features.num_frames} frames (chunk_length {features.chunk_length}"
            f" s, hop_length {features.hop_length}), the encoder takes {frames} (2 x max_source_positions)"
        )
    if features.sampling_rate != CLIENT_SAMPLE_RATE:
        raise ValueError(
            f"the feature extractor's sampling_rate is {features.sampling_rate} Hz; clients send audio at "
            f"{CLIENT_SAMPLE_RATE} Hz (Whisper's)"
        )
    return features
