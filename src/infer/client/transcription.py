"""Whisper's decoding prompt and windows, torch-free: what /v1/audio/transcriptions
(client/api/routes/transcriptions.py) sends the engine for a clip, as transformers'
WhisperForConditionalGeneration.generate builds it from the checkpoint's generation_config.json.

- The prefix: start of transcript, the language, the task (transcribe / translate), no timestamps; with OpenAI's
  `prompt`, transformers' `prompt_ids` in front (start of previous, then " " + the text, WhisperTokenizer's
  get_prompt_ids).
- Language detection (no `language`): transformers' detect_language, one decoder step from the start of transcript
  whose argmax is taken over the languages of lang_to_id alone: here a one-token greedy request with those ids as
  allowed_token_ids, on the same window's audio.
- Windows: audio longer than the model's window (preprocessor_config.json chunk_length) is cut into consecutive
  windows, each transcribed alone (its own request, all at once) and the texts joined in order. Unlike transformers'
  sequential long-form decoding (timestamp tokens, each window conditioned on the text before it), a window does not
  see the text of the one before, and a word cut by a window's edge is cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from infer.protocol.messages import AUDIO_SAMPLE_RATE
from infer.protocol.sampling import SamplingParams

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class WhisperPrompts:
    """A Whisper checkpoint's prompt tokens (generation_config.json) and window (preprocessor_config.json)."""

    start: int  # <|startoftranscript|>
    no_timestamps: int
    previous: int | None  # <|startofprev|>
    languages: dict[str, int]  # language code ("en") -> its token's id
    tasks: dict[str, int]
    window_s: int
    max_target_positions: int

    @classmethod
    def from_dir(cls, path: Path) -> WhisperPrompts | None:
        """The checkpoint's, or None when the directory holds no Whisper generation config (another model)."""
        try:
            generation = json.loads((Path(path) / "generation_config.json").read_text())
            preprocessor = json.loads((Path(path) / "preprocessor_config.json").read_text())
            config = json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(generation, dict) or "lang_to_id" not in generation or config.get("model_type") != "whisper":
            return None
        return cls(
            start=int(generation["decoder_start_token_id"]),
            no_timestamps=int(generation["no_timestamps_token_id"]),
            previous=generation.get("prev_sot_token_id"),
            languages={token.strip("<|>"): int(i) for token, i in generation["lang_to_id"].items()},
            tasks={task: int(i) for task, i in (generation.get("task_to_id") or {}).items()},
            window_s=int(preprocessor.get("chunk_length", 30)),
            max_target_positions=int(config.get("max_target_positions", 448)),
        )

    def language_id(self, language: str) -> int:
        """The token of an ISO-639-1 code the model knows; ValueError naming them otherwise."""
        code = language.strip().lower()
        if code not in self.languages:
            raise ValueError(f"language {language!r} is not one this model knows: {', '.join(sorted(self.languages))}")
        return self.languages[code]

    def language_of(self, token_id: int) -> str:
        return next(code for code, i in self.languages.items() if i == token_id)

    def task_id(self, task: str) -> int:
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not one this model runs: {', '.join(sorted(self.tasks))}")
        return self.tasks[task]

    def detection(self) -> tuple[list[int], SamplingParams]:
        """The decoder prompt and params of the language-detection request (transformers' detect_language)."""
        allowed = tuple(sorted(self.languages.values()))
        return [self.start], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed)

    def prefix(self, language_id: int, task: str, previous: list[int] | None = None) -> list[int]:
        """The decoder prompt: [start of previous, *previous] when given (the text's tokens), then Whisper's
        prefix."""
        head = [] if not previous or self.previous is None else [self.previous, *previous]
        return [*head, self.start, language_id, self.task_id(task), self.no_timestamps]

    def windows(self, samples: np.ndarray) -> list[np.ndarray]:
        """Consecutive windows of the model's length (the last one shorter)."""
        size = self.window_s * AUDIO_SAMPLE_RATE
        return [samples[i : i + size] for i in range(0, max(len(samples), 1), size)]


def audio_prompt(prompt_ids: list[int], samples: np.ndarray) -> dict[str, Any]:
    """vLLM's prompt form of a decoder prompt and a window's samples (at AUDIO_SAMPLE_RATE)."""
    return {"prompt_token_ids": prompt_ids, "multi_modal_data": {"audio": (samples, AUDIO_SAMPLE_RATE)}}
