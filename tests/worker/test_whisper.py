"""Whisper against transformers on a tiny random checkpoint (tests/whisper_models.py): our log-mel features equal
WhisperFeatureExtractor's (80 and 128 mel bins, the window's padding); greedy tokens equal transformers' `generate`
in fp32 through `LLM.generate` with vLLM's audio prompt form, clips of different lengths batched, the decoder prompt
as ids or as text with Whisper's special tokens, transcribe and translate; the generation config's suppress_tokens
and begin_suppress_tokens apply as transformers applies them; bf16 agrees within a bound; hostile audio is refused
by name and the engine goes on serving."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llava_models import png
from whisper_models import hf_features, hf_whisper, special_ids, tone, transformers_transcribe, whisper_checkpoint

from infer import LLM, SamplingParams
from infer.worker.engine.audio import LogMel

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
OPTIONS = dict(dtype="float32", max_model_len=64, kv_cache_memory=4_000_000, num_threads=1, block_size=4)
CLIPS = [tone(0.7, 1), tone(1.0, 2), tone(0.3, 3)]
PREFIX_TEXT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@pytest.fixture(scope="module")
def whisper(tmp_path_factory, smollm2_tokenizer):
    """(checkpoint, transformers' tokens for CLIPS in English)."""
    path = whisper_checkpoint(tmp_path_factory.mktemp("whisper"), smollm2_tokenizer)
    return path, transformers_transcribe(path, CLIPS, MAX_NEW, model=hf_whisper(path))


def _prefix(path, language: str = "en", task: str = "transcribe") -> list[int]:
    ids = special_ids(path)
    return [ids["<|startoftranscript|>"], ids[f"<|{language}|>"], ids[f"<|{task}|>"], ids["<|notimestamps|>"]]


def _audio(prompt, clip: np.ndarray, rate: int = 16000) -> dict:
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    return {key: prompt, "multi_modal_data": {"audio": (clip, rate)}}


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    completions = llm.generate(prompts, params, use_tqdm=False)
    assert all(c.finish_reason in ("length", "stop") for c in completions), [c.error for c in completions]
    return [c.token_ids for c in completions]


@pytest.mark.parametrize("bins", [80, 128])
def test_log_mel_equals_the_feature_extractor(bins):
    from transformers import WhisperFeatureExtractor

    for chunk, seconds in ((1, 0.4), (1, 1.0), (2, 1.3)):
        extractor = WhisperFeatureExtractor(feature_size=bins, chunk_length=chunk)
        ours = LogMel(feature_size=bins, chunk_length=chunk)
        clip = tone(seconds, 4)
        want = extractor(clip, sampling_rate=16000, return_tensors="pt").input_features[0]
        got = ours(torch.from_numpy(clip))
        assert got.shape == want.shape == (bins, 100 * chunk)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_greedy_equals_transformers(whisper):
    path, want = whisper
    with LLM(model=str(path), **OPTIONS) as llm:
        prefix = _prefix(path)
        assert _tokens(llm, [_audio(prefix, clip) for clip in CLIPS]) == want  # three clip lengths, one batch
        assert _tokens(llm, [_audio(PREFIX_TEXT, CLIPS[0])]) == want[:1]  # the special tokens as text
        assert _tokens(llm, [_audio(prefix[1:], CLIPS[1])]) == want[1:2]  # the start token put in front
        completion = llm.generate(_audio(prefix, CLIPS[2]), GREEDY, use_tqdm=False)[0]
        assert completion.prompt_token_ids == prefix  # the decoder prompt, as given
        # 44.1 kHz audio is resampled to 16 kHz first: close to the 16-kHz clip, not necessarily equal tokens
        assert len(_tokens(llm, [_audio(prefix, tone(0.5, 1, rate=44100), 44100)])[0]) >= 1
        translated = _tokens(llm, [_audio(_prefix(path, "de", "translate"), CLIPS[0])])
        load = llm.stats().workers[0].load
        assert load.num_free_blocks == load.num_total_blocks  # every self and cross block came back
    assert translated == transformers_transcribe(path, CLIPS[:1], MAX_NEW, language="de", task="translate")


def test_suppressed_tokens_as_transformers_applies_them(whisper, tmp_path, smollm2_tokenizer):
    """The checkpoint's suppress_tokens made the tokens transformers liked most (and begin_suppress_tokens its first
    one): both stop producing them, and still agree."""
    path, want = whisper
    ckpt = whisper_checkpoint(tmp_path / "suppressed", smollm2_tokenizer)
    favourite = max(set(want[0]), key=want[0].count)
    file = ckpt / "generation_config.json"
    generation = json.loads(file.read_text())
    generation["suppress_tokens"] = [*generation["suppress_tokens"], favourite]
    generation["begin_suppress_tokens"] = [*generation["begin_suppress_tokens"], want[1][0]]
    file.write_text(json.dumps(generation))
    reference = transformers_transcribe(ckpt, CLIPS[:2], MAX_NEW)
    with LLM(model=str(ckpt), **OPTIONS) as llm:
        got = _tokens(llm, [_audio(_prefix(ckpt), clip) for clip in CLIPS[:2]])
    assert got == reference
    assert favourite not in got[0] + got[1] and got[1][0] != want[1][0]


def test_bf16_agreement(whisper):
    """bf16 against transformers' bf16 on the same weights: the share of greedy tokens equal before the first
    difference (random tiny weights make near-ties common; the fp32 test is the exact one)."""
    path, _ = whisper
    reference = transformers_transcribe(path, CLIPS, MAX_NEW, dtype=torch.bfloat16)
    with LLM(model=str(path), **{**OPTIONS, "dtype": "bfloat16"}) as llm:
        got = _tokens(llm, [_audio(_prefix(path), clip) for clip in CLIPS])
    same = sum(_common_prefix(a, b) for a, b in zip(got, reference)) / sum(map(len, reference))
    print(f"whisper bf16: {same:.0%} of greedy tokens equal transformers' bf16 before the first difference")
    assert same >= 0.5


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_hostile_audio_refused_by_name(whisper, tiny_model_dir):
    path, want = whisper
    prefix = _prefix(path)
    with LLM(model=str(path), **OPTIONS) as llm:
        cases = [
            (_audio(prefix, tone(1.5, 1)), "longer than the model's window of 1 s"),
            (prefix, "transcribes audio: give the audio with the prompt"),
            ({"prompt_token_ids": prefix, "multi_modal_data": {"image": png(8, 8, 1)}}, "takes audio, not images"),
            (_audio(prefix, np.zeros(0, dtype=np.float32)), "the audio is empty"),
            (_audio(prefix, (CLIPS[0] * 1000).astype(np.int16)), "must be floating point in [-1, 1], got dtype int16"),
            (_audio(prefix, np.stack([CLIPS[0], CLIPS[0]])), "must be mono: a 1-D array, got shape (2, 11200)"),
            (_audio(prefix, np.full(100, np.nan, dtype=np.float32)), "NaN or infinite"),
            (_audio(prefix, CLIPS[0], rate=0), "sample rate must be 1000..384000 Hz, got 0"),
            (_audio([10**6], CLIPS[0]), "prompt token id 1000000 is outside the vocabulary"),
        ]
        outs = llm.generate([prompt for prompt, _ in cases], GREEDY, use_tqdm=False)
        for (_, named), out in zip(cases, outs, strict=True):
            assert out.finish_reason == "error" and named in (out.error or ""), (named, out.error)
        assert _tokens(llm, [_audio(prefix, CLIPS[0])]) == want[:1]  # still serving
    with LLM(model=str(tiny_model_dir("llama")), **OPTIONS) as text_only:
        out = text_only.generate(_audio([5, 6, 7], CLIPS[0]), GREEDY, use_tqdm=False)[0]
        assert out.finish_reason == "error" and "takes no audio: it is a text-only model" in (out.error or "")
        assert len(_tokens(text_only, [[5, 6, 7]])[0]) == MAX_NEW  # still serving


def test_features_of_the_checkpoint_equal_transformers(whisper):
    path, _ = whisper
    features = LogMel.from_dir(path)
    for clip in CLIPS:
        torch.testing.assert_close(features(torch.from_numpy(clip)), hf_features(path, clip)[0], atol=1e-5, rtol=1e-5)


def test_audio_on_the_wire_is_bounded():
    """RequestSpec.audio: carried as bytes through a Submit's encoding; past MAX_AUDIO_BYTES a frame is refused by
    name when decoded, and the client refuses to build one."""
    from infer.client.audio import wire_audio
    from infer.protocol.messages import MAX_AUDIO_BYTES, ProtocolError, RequestSpec, Submit, decode, encode

    data = wire_audio(CLIPS[0])
    submit = Submit(request_id="r", spec=RequestSpec(prompt_token_ids=[1, 2], audio=data))
    assert decode(encode(submit)).spec.audio == data
    too_big = Submit(request_id="r", spec=RequestSpec(prompt_token_ids=[1], audio=b"\0" * (MAX_AUDIO_BYTES + 4)))
    with pytest.raises(ProtocolError, match="audio"):
        decode(encode(too_big))
    with pytest.raises(ValueError, match="more than the wire carries"):
        wire_audio(np.zeros(MAX_AUDIO_BYTES // 4 + 1, dtype=np.float32))
