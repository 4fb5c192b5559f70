"""Whisper (tests/whisper_models.py's tiny checkpoint) through real clusters: InferenceClient's audio prompt on the
wire answers as direct mode does, through kill -9 of the worker streaming it (the failover's Dispatch carries the
audio and the decoder prompt the first worker tokenized), and hostile audio is refused by name while the cluster
serves on; `infer-serve`'s POST /v1/audio/transcriptions answers the official `openai` client: with a language, with
the language detected as transformers detects it (its tokens equal transformers' `generate`), audio longer than the
model's window transcribed window by window, each response format, and 400s naming what is wrong with the input."""

from __future__ import annotations

import json

import numpy as np
import openai
import pytest
from fault_streams import kill9_the_busiest_worker, streams_through_a_fault
from serve_harness import Served
from whisper_models import special_ids, tone, transformers_transcribe, wav_bytes, whisper_checkpoint

from infer import LLM, SamplingParams
from infer.client.audio import decode_audio_file

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory=8_000_000, num_threads=1, block_size=4)
ENGINE_FLAGS = (
    *("--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "8000000"),
    *("--threads", "1", "--block-size", "4"),
)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
CLIP = tone(0.8, 6)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory, smollm2_tokenizer):
    path = whisper_checkpoint(tmp_path_factory.mktemp("whisper"), smollm2_tokenizer, max_target_positions=256)
    ids = special_ids(path)
    prefix = [ids["<|startoftranscript|>"], ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]
    return path, prefix


def _audio(prefix: list[int], clip: np.ndarray) -> dict:
    return {"prompt_token_ids": prefix, "multi_modal_data": {"audio": (clip, 16000)}}


async def test_kill_9_of_the_worker_streaming_a_transcription(model_cluster, whisper):
    path, prefix = whisper
    with LLM(model=str(path), **ENGINE) as llm:
        want = llm.generate(_audio(prefix, CLIP), LONG, use_tqdm=False)[0]
    assert want.finish_reason == "length" and len(want.token_ids) == 200
    cluster = model_cluster(workers=2, model=path, engine_flags=ENGINE_FLAGS)
    (stream,), stats = await streams_through_a_fault(
        cluster,
        [_audio(prefix, CLIP)],
        LONG,
        lambda client: kill9_the_busiest_worker(cluster, client),
        finish_timeout=240,
    )
    assert stats.requests_redispatched == 1, stream[-1]
    assert stream[-1].finish_reason == "length", stream[-1].error
    assert [t for delta in stream for t in delta.token_ids] == want.token_ids  # the audio encoded again, same tokens
    async with cluster.client() as client:
        text_prompt = {
            "prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
            "multi_modal_data": {"audio": (CLIP, 16000)},
        }
        again = await client.generate(text_prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert again.token_ids == want.token_ids[:8] and again.prompt_token_ids == prefix
        too_long = await client.generate(_audio(prefix, tone(1.2, 1)), LONG)
        assert too_long.finish_reason == "error" and "longer than the model's window of 1 s" in (too_long.error or "")
        no_audio = await client.generate(prefix, LONG)
        assert no_audio.finish_reason == "error" and "transcribes audio" in (no_audio.error or "")
        with pytest.raises(ValueError, match="must be mono"):
            await client.generate(_audio(prefix, np.zeros((2, 10), dtype=np.float32)), LONG)
        fine = await client.generate(_audio(prefix, CLIP), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert fine.token_ids == want.token_ids[:4]  # still serving


@pytest.fixture(scope="module")
def served(tmp_path_factory, whisper):
    path, _ = whisper
    server = Served(path, tmp_path_factory.mktemp("serve") / "serve.log", "whisper", list(ENGINE_FLAGS))
    yield server
    server.stop()


def _no_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] == eos else tokens


def test_openai_client_transcribes(served, whisper):
    path, prefix = whisper
    eos = special_ids(path)["<|endoftext|>"]
    clip_wav = wav_bytes(CLIP)
    samples, _ = decode_audio_file(clip_wav)  # what the front hears: the WAV's 16-bit samples
    long_wav = wav_bytes(tone(2.5, 7))
    long_samples, _ = decode_audio_file(long_wav)
    windows = [long_samples[i : i + 16000] for i in range(0, len(long_samples), 16000)]
    free = SamplingParams(temperature=0, max_tokens=None)
    with LLM(model=str(path), **ENGINE) as llm:
        want = llm.generate(_audio(prefix, samples), free, use_tqdm=False)[0]
        want_windows = llm.generate([_audio(prefix, w) for w in windows], free, use_tqdm=False)
    detected = transformers_transcribe(path, [samples], 252, language=None)[0]  # the language transformers detects

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.audio.transcriptions.create(model="whisper", file=("clip.wav", clip_wav), language="en")
    assert answer.text == want.text.strip()
    verbose = client.audio.transcriptions.create(
        model="whisper", file=("clip.wav", clip_wav), response_format="verbose_json"
    )
    assert _no_eos(verbose.segments[0].tokens, eos) == _no_eos(detected, eos)
    assert verbose.duration == pytest.approx(0.8)
    long = client.audio.transcriptions.create(
        model="whisper", file=("long.wav", long_wav), language="en", response_format="verbose_json"
    )
    assert [s.tokens for s in long.segments] == [c.token_ids for c in want_windows]  # three 1-s windows, in order
    assert [(s.start, s.end) for s in long.segments] == [(0, 1), (1, 2), (2, 2.5)]
    assert long.text == "".join(c.text for c in want_windows).strip()
    srt = client.audio.transcriptions.create(
        model="whisper", file=("long.wav", long_wav), language="en", response_format="srt"
    )
    assert srt.startswith("1\n00:00:00,000 --> 00:00:01,000\n") and "3\n00:00:02,000 --> 00:00:02,500\n" in srt
    vtt = client.audio.transcriptions.create(
        model="whisper", file=("clip.wav", clip_wav), language="en", response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:00.800\n")
    text = client.audio.transcriptions.create(
        model="whisper", file=("clip.wav", clip_wav), language="en", response_format="text"
    )
    assert text.strip() == want.text.strip()


def test_hostile_uploads_get_a_400_naming_what_is_wrong(served, whisper):
    import requests

    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    clip_wav = wav_bytes(CLIP)
    cases = [
        (dict(file=("notes.txt", b"this is not audio at all")), "is not audio this server decodes"),
        (dict(file=("cut.wav", clip_wav[:30])), "file:"),
        (
            dict(file=("long.wav", wav_bytes(np.zeros(1801 * 1000, dtype=np.float32), rate=1000))),
            "more than the limit of 1800 s",
        ),
        (dict(file=("clip.wav", clip_wav), language="xx"), "language 'xx' is not one this model knows: de, en, es, fr"),
        (dict(file=("clip.wav", clip_wav), response_format="tsv"), "response_format must be one of"),
    ]
    for kwargs, named in cases:
        with pytest.raises(openai.BadRequestError, match=named):
            client.audio.transcriptions.create(model="whisper", **kwargs)
    missing = requests.post(
        f"{served.url}/v1/audio/transcriptions", data={"model": "whisper"}, files={"x": ("a", b"")}, timeout=60
    )
    assert missing.status_code == 400 and "unknown form fields" in missing.text
    missing = requests.post(
        f"{served.url}/v1/audio/transcriptions", data={"model": "whisper"}, files={"file": ("a", b"")}, timeout=60
    )
    assert missing.status_code == 400 and "empty" in missing.text
    not_form = requests.post(f"{served.url}/v1/audio/transcriptions", json={"model": "whisper"}, timeout=60)
    assert not_form.status_code == 400 and "multipart/form-data" in not_form.text
    ok = client.audio.transcriptions.create(model="whisper", file=("clip.wav", clip_wav), language="en")
    assert ok.text is not None  # still serving
    image_chat = requests.post(
        f"{served.url}/v1/chat/completions",
        json={
            "model": "whisper",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ],
        },
        timeout=60,
    )
    assert image_chat.status_code == 400, image_chat.text
    assert "takes no images" in json.loads(image_chat.text)["error"]["message"]
