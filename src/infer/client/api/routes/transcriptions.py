"""POST /v1/audio/transcriptions (OpenAI's): a multipart upload transcribed by a Whisper model through the same
admission, cluster and failover as generation.

The file is decoded and resampled to 16 kHz (client/audio.py), cut into the model's windows, and each window is one
engine request with Whisper's prefix (client/transcription.py); without `language`, a one-token detection request on
the first window picks it first, as transformers' detect_language does. Form fields: file (required), model,
language (ISO-639-1), prompt (the previous text, as transformers' prompt_ids), response_format (json, text,
verbose_json, srt, vtt), temperature. verbose_json / srt / vtt give one segment per window, its start and end the
window's bounds: we decode without timestamp tokens, so there are no finer segments. Everything wrong with the input
is a 400 naming it; the server keeps serving.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import UploadFile

from infer.client.api.admission import authorize
from infer.client.api.front import Front, cancel_on_disconnect
from infer.client.api.jobs import Job
from infer.client.api.schemas import ApiError
from infer.client.audio import MAX_AUDIO_FILE_BYTES, audio_samples
from infer.protocol.messages import AUDIO_SAMPLE_RATE
from infer.protocol.sampling import SamplingParams

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "timestamp_granularities[]")


class Transcriptions:
    """POST /v1/audio/transcriptions (and /v1/audio/translations: the same with task translate)."""

    def __init__(self, front: Front) -> None:
        self.front = front

    async def transcriptions(self, request: Request) -> Response:
        return await self._run(request, "transcribe")

    async def translations(self, request: Request) -> Response:
        return await self._run(request, "translate")

    async def _run(self, request: Request, task: str) -> Response:
        authorize(request, self.front.config.api_key)
        form = await self._form(request)
        model_name = _text(form, "model") or self.front.config.served_model_name
        body = _Body(model_name)
        if model_name != self.front.config.served_model_name:
            await self.front._check_model(model_name)  # 404 naming the models served
        fmt = _text(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise ApiError(
                400, f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}", param="response_format"
            )
        temperature = _temperature(_text(form, "temperature"))
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(400, "the form needs 'file': the audio to transcribe (multipart/form-data)", param="file")
        data = await upload.read(MAX_AUDIO_FILE_BYTES + 1)
        try:
            samples = await self.front.off_loop(audio_samples, data)
        except ValueError as error:
            raise ApiError(400, f"file: {error}", param="file") from None
        tok = await self.front.tokenization(body)
        whisper = tok.whisper
        if whisper is None:
            raise ApiError(400, f"model {model_name!r} does not transcribe audio: it takes text", param="model")
        language = _text(form, "language")
        text_prompt = _text(form, "prompt")
        try:
            language_id = None if not language else whisper.language_id(language)
            whisper.task_id(task)
        except ValueError as error:
            raise ApiError(400, str(error), param="language") from None
        previous = None if not text_prompt else tok.encode(" " + text_prompt.strip(), add_special_tokens=False)
        windows = whisper.windows(samples)
        model = self.front.model_of(body)
        base_id = f"trsc-{uuid.uuid4().hex}"
        tracker = functools.partial(self.front.metrics.tracker, self.front.metrics_label(body))
        self.front.admission.reserve(len(windows) + 1, param="file")
        try:
            await self.front.admission.admit(model)
            if language_id is None:
                ids, params = whisper.detection()
                detect = Job(0, 0, ids, params, f"{base_id}-lang", tracker(), audio=windows[0], model=model)
                await cancel_on_disconnect(request, self.front.run_to_end([detect]))
                language_id = detect.token_ids[0]
            params = SamplingParams(temperature=temperature, max_tokens=None)  # up to EOS or the decoder's context
            prefix = whisper.prefix(language_id, task, previous)
            jobs = [
                Job(i, 0, prefix, params, f"{base_id}-{i}", tracker(), audio=window, model=model)
                for i, window in enumerate(windows)
            ]
            await cancel_on_disconnect(request, self.front.run_to_end(jobs))
        finally:
            self.front.admission.release(len(windows) + 1)
        texts = [job.text for job in jobs]
        return _respond(fmt, task, whisper.language_of(language_id), samples, whisper.window_s, texts, jobs)

    async def _form(self, request: Request) -> Any:
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise ApiError(400, "the body must be multipart/form-data with the audio in 'file'", param="file")
        try:
            form = await request.form(max_files=1, max_fields=len(FIELDS), max_part_size=MAX_AUDIO_FILE_BYTES)
        except Exception as error:  # noqa: BLE001 - starlette's parser errors: a malformed or oversized form
            raise ApiError(400, f"the form could not be read: {error}", param="file") from None
        unknown = sorted(set(form.keys()) - set(FIELDS))
        if unknown:
            raise ApiError(400, f"unknown form fields {unknown}; taken: {', '.join(FIELDS)}", param=unknown[0])
        return form


class _Body:
    """What Front.model_of / tokenization read of a request: its model."""

    def __init__(self, model: str) -> None:
        self.model = model


def _text(form: Any, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"form field {name!r} must be text", param=name)
    return value


def _temperature(text: str | None) -> float:
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        raise ApiError(400, f"temperature must be a number, got {text!r}", param="temperature") from None
    if not 0.0 <= value <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {value}", param="temperature")
    return value


def _respond(
    fmt: str, task: str, language: str, samples: np.ndarray, window_s: int, texts: list[str], jobs: list[Job]
) -> Response:
    text = "".join(texts).strip()
    duration = len(samples) / AUDIO_SAMPLE_RATE
    bounds = [(i * window_s, min((i + 1) * window_s, duration)) for i in range(len(texts))]
    if fmt == "json":
        return JSONResponse({"text": text})
    if fmt == "text":
        return PlainTextResponse(text)
    if fmt == "verbose_json":
        segments = [
            {"id": i, "seek": int(start * 100), "start": start, "end": end, "text": t.strip(), "tokens": job.token_ids}
            for i, ((start, end), t, job) in enumerate(zip(bounds, texts, jobs))
        ]
        body = {"task": task, "language": language, "duration": duration, "text": text, "segments": segments}
        return JSONResponse(body)
    cues = [(start, end, t.strip()) for (start, end), t in zip(bounds, texts)]
    if fmt == "srt":
        lines = [f"{i + 1}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t}\n" for i, (a, b, t) in enumerate(cues)]
        return PlainTextResponse("\n".join(lines))
    lines = [f"{_clock(a, '.')} --> {_clock(b, '.')}\n{t}\n" for a, b, t in cues]
    return PlainTextResponse("WEBVTT\n\n" + "\n".join(lines), media_type="text/vtt")


def _clock(seconds: float, mark: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"
