"""Exactly-once resumption at the engine: a request cut after k tokens and resumed on a fresh engine from
(prompt, its first k tokens, the text delivered with them, its seed) gives exactly the uninterrupted tokens
and text, for every k: sampled at temperature 1 with a given seed or with the one the engine assigned,
with stop strings whose match straddles the cut, and with multi-byte characters split at the cut. The model
is the word-chain model (tests/conftest.py): random words of emoji, CJK and Latin-1 text."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import msgspec
import pytest

from infer import LLM, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

PROMPT = "Words:"
MAX_TOKENS = 40
NUM_RANDOM_CUTS = 10


def _engine(model, seed: int) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model), dtype="float32", max_model_len=256, kv_cache_memory=16_000_000, seed=seed, num_threads=1
        )
    )


@pytest.fixture(scope="module")
def engines(word_chain_model) -> tuple[Engine, Engine]:
    """The uninterrupted runs' engine and the one requests resume on (another engine seed)."""
    return _engine(word_chain_model, seed=1), _engine(word_chain_model, seed=2)


@dataclass
class Stream:
    """One request's outputs: per-delta tokens and text, the seed reported, how it ended."""

    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # one per delta
    ends: list[int] = field(default_factory=list)  # token count after each delta
    seed: int | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def delivered_text(self, k: int) -> str:
        """The text a client held once it had the first k tokens (deltas up to that boundary)."""
        return "".join(t for t, end in zip(self.texts, self.ends) if end <= k)


def _run(engine: Engine, requests: dict[str, tuple]) -> dict[str, Stream]:
    """requests: id -> (prompt, params, resumed token ids, resumed text length); all run in one batch."""
    for rid, (prompt, params, resumed, text_len) in requests.items():
        engine.add_request(rid, prompt, params, resumed, text_len)
    streams = {rid: Stream() for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            s = streams[out.request_id]
            s.token_ids += out.token_ids
            s.texts.append(out.text)
            s.ends.append(len(s.token_ids))
            s.seed = out.seed if out.seed is not None else s.seed
            s.finish_reason = out.finish_reason
    return streams


def _redispatched(params: SamplingParams, seed: int | None) -> SamplingParams:
    """What a re-dispatch sends (coordinator/state.py RequestRecord.dispatch): the request's own params with its
    seed; the engine counts the resumed tokens toward max_tokens and min_tokens."""
    return msgspec.structs.replace(params, seed=seed)


def _cuts_inside_a_character(tokenizer, tokens: list[int]) -> list[int]:
    """Cut points k where the first k tokens end inside a multi-byte character."""
    return [
        k for k in range(1, len(tokens)) if tokenizer.decode(tokens[:k], skip_special_tokens=True).endswith("\ufffd")
    ]


def _cuts(tokenizer, reference: Stream, seed: int) -> list[int]:
    """Random cut points, plus the first few inside a multi-byte character and the first few where text is
    held back (for a stop string)."""
    n = len(reference.token_ids)
    inside = _cuts_inside_a_character(tokenizer, reference.token_ids)
    held = [
        k
        for k in range(1, n)
        if len(reference.delivered_text(k))
        < len(tokenizer.decode(reference.token_ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
    ]
    chosen = random.Random(seed).sample(range(1, n), min(NUM_RANDOM_CUTS, n - 1))
    return sorted(set(chosen + inside[:3] + held[:3]))


def _check_cuts(
    engines, params: SamplingParams, cut_seed: int = 0, extra_cuts: tuple[int, ...] = ()
) -> tuple[Stream, list[int]]:
    """Run `params` uninterrupted, then resume it from cut points k (random ones, interesting ones and
    `extra_cuts`) on the other engine: each resumed stream completes the uninterrupted one exactly."""
    first, second = engines
    reference = _run(first, {"ref": (PROMPT, params, (), None)})["ref"]
    assert reference.seed is not None, "a sampled request reports its seed (assigned when none was given)"
    if params.seed is not None:
        assert reference.seed == params.seed
    cuts = sorted(set(_cuts(first.tokenizer, reference, cut_seed)) | set(extra_cuts))
    resumed = _run(
        second,
        {
            f"cut{k}": (
                PROMPT,
                _redispatched(params, reference.seed),
                reference.token_ids[:k],
                len(reference.delivered_text(k)),
            )
            for k in cuts
        },
    )
    for k in cuts:
        got = resumed[f"cut{k}"]
        assert reference.token_ids[:k] + got.token_ids == reference.token_ids, f"tokens differ after a cut at {k}"
        assert reference.delivered_text(k) + got.text == reference.text, f"text differs after a cut at {k}"
        assert got.finish_reason == reference.finish_reason
    return reference, cuts


@pytest.mark.parametrize("seed", [12345, None], ids=["seeded", "unseeded"])
def test_sampled_stream_resumes_exactly_at_random_cuts(engines, smollm2_tokenizer, seed):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
    reference, _ = _check_cuts(engines, params)
    assert _cuts_inside_a_character(smollm2_tokenizer, reference.token_ids), (
        "the test needs cuts inside a multi-byte character"
    )
    assert reference.finish_reason == "length" and len(reference.token_ids) == MAX_TOKENS


def _straddling_stop(engines, tokenizer, seed: int) -> tuple[str, Stream]:
    """A stop string of the run with `seed` (no stop) that holds a multi-byte character and spans a token
    boundary wherever it first occurs; and that run."""
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed)
    plain = _run(engines[0], {"plain": (PROMPT, params, (), None)})["plain"]
    text = plain.text
    boundaries = {
        len(tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True))
        for k in range(1, len(plain.token_ids))
        if not tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True).endswith("\ufffd")
    }
    for start in range(len(text) // 3, len(text) - 4):
        stop = text[start : start + 4]
        first = text.find(stop)
        if any(ord(c) > 127 for c in stop) and any(first < b < first + len(stop) for b in boundaries):
            return stop, plain
    raise AssertionError(f"no straddling stop string in {text!r}")


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "reported-seed"])
def test_stop_string_straddling_the_cut_is_found_after_a_resume(engines, smollm2_tokenizer, seeded, include_stop):
    """Text held back for a possible stop string at the cut is neither lost nor repeated, and a match that
    began before the cut is found after it (the text truncated as without a cut)."""
    seed = 777
    if not seeded:  # the seed the engine assigned to an unseeded run (a stop string of it is known after)
        seed = _run(engines[0], {"u": (PROMPT, SamplingParams(temperature=1.0, max_tokens=2), (), None)})["u"].seed
    stop, plain = _straddling_stop(engines, smollm2_tokenizer, seed)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        stop=[stop, "\U0001f4a4never"],
        include_stop_str_in_output=include_stop,
        seed=seed,
    )
    # The cuts inside the match: what came before them was held back, not delivered, and must still be found.
    start = plain.text.find(stop)
    inside = tuple(
        k
        for k in range(1, len(plain.token_ids))
        if start
        < len(smollm2_tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
        < start + len(stop)
    )
    assert inside
    reference, cuts = _check_cuts(engines, params, cut_seed=seed, extra_cuts=inside)
    assert reference.finish_reason == "stop"
    assert reference.text == plain.text[: start + (len(stop) if include_stop else 0)]


def test_min_tokens_counts_the_delivered_tokens_when_a_stop_string_is_searched(engines, smollm2_tokenizer):
    """A stop string within the first min_tokens is ignored before and after a cut alike."""
    stop, plain = _straddling_stop(engines, smollm2_tokenizer, 4242)
    first_end = next(
        k
        for k in range(1, len(plain.token_ids) + 1)
        if stop in smollm2_tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True)
    )
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, min_tokens=first_end, stop=[stop], seed=4242)
    reference, _ = _check_cuts(engines, params)
    assert len(reference.token_ids) > first_end


def test_the_engine_counts_the_resumed_tokens_toward_max_tokens(engines):
    """A re-dispatch carries the request's own max_tokens: k resumed tokens leave max_tokens - k to generate;
    resumed tokens that reach max_tokens leave nothing, and the request is refused saying so."""
    first, second = engines
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = _run(first, {"ref": (PROMPT, params, (), None)})["ref"]
    assert len(reference.token_ids) == 6 and reference.finish_reason == "length"
    got = _run(second, {"r": (PROMPT, params, reference.token_ids[:4], None)})["r"]
    assert got.token_ids == reference.token_ids[4:] and got.finish_reason == "length"
    with pytest.raises(ValueError, match=r"the resumed tokens \(6\) reach max_tokens \(6\)"):
        second.add_request("spent", PROMPT, params, reference.token_ids)
    assert not second.has_unfinished()


def test_llm_reports_the_assigned_seed_and_replays_with_it(word_chain_model):
    llm = LLM(model=str(word_chain_model), dtype="float32", max_model_len=256, kv_cache_memory=8_000_000)
    params = SamplingParams(temperature=1.0, max_tokens=24)
    first, second = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert first.seed is not None and second.seed is not None and first.seed != second.seed
    replay = llm.generate([PROMPT], msgspec.structs.replace(params, seed=first.seed), use_tqdm=False)[0]
    assert (replay.token_ids, replay.text, replay.seed) == (first.token_ids, first.text, first.seed)
    greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert greedy.seed is None


def test_a_request_given_back_mid_stream_resumes_exactly_elsewhere(engines, smollm2_tokenizer):
    """A worker that gives a request back (drain, a broken EP group) aborts it without releasing the text it
    holds back; the engine that resumes it from the delivered tokens produces that text, once."""
    first, second = engines
    stop, plain = _straddling_stop(engines, smollm2_tokenizer, 31337)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, stop=[stop], seed=31337)
    reference = _run(first, {"ref": (PROMPT, params, (), None)})["ref"]
    start = plain.text.find(stop)
    cut = next(
        k
        for k in range(1, len(plain.token_ids))
        if start < len(smollm2_tokenizer.decode(plain.token_ids[:k], skip_special_tokens=True).rstrip("\ufffd"))
    )  # inside the match
    first.add_request("given-back", PROMPT, params)
    delivered = Stream()
    while len(delivered.token_ids) < cut:
        for out in first.step():
            delivered.token_ids += out.token_ids
            delivered.texts.append(out.text)
    first.abort("given-back", release_text=False)
    (final,) = first.step()
    assert final.finish_reason == "abort" and final.text == "" and not final.token_ids
    resumed = _run(second, {"r": (PROMPT, _redispatched(params, 31337), delivered.token_ids, len(delivered.text))})["r"]
    assert delivered.token_ids + resumed.token_ids == reference.token_ids
    assert delivered.text + resumed.text == reference.text and resumed.finish_reason == "stop"


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_embedded_model_kept_quantized_resumes_a_greedy_stream_exactly(smollm2_gguf, dtype):
    """The cluster's failover on the embedded model, its Q4_1 blocks kept quantized (float32 as the Slurm job runs
    it, and the default dtype: bf16 on a CPU with AVX2 or AVX512-BF16): the resumed stream is its prompt and
    delivered tokens prefilled, then decoded, so a delivered token's prefill row must have the bits its decode
    step gave it, and a prompt row those of the first prefill. The activations' int8 rounding turns the smallest
    difference into a different token: before the prefill kernel computed those rows with the decode kernel's
    arithmetic, this prompt parted from the uninterrupted stream at token 59 or 71 after every one of these cuts
    in float32 (and bf16's packed prefill path, on AVX512-BF16, at 11-31 of 48 in a cluster). All cuts resume in
    one batch, beside an uninterrupted copy of the request."""
    engines = [
        Engine(EngineConfig(dtype=dtype, max_model_len=256, kv_cache_memory=16_000_000, num_threads=1))
        for _ in range(2)
    ]
    prompt = [1, 504, 3458, 282, 4649, 314, 101, 101, 101, 101]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    reference = _run(engines[0], {"ref": (prompt, params, (), None)})["ref"].token_ids
    cuts = (8, 23, 29, 41)
    resumed = _run(
        engines[1],
        {"whole": (prompt, params, (), None)} | {f"cut{k}": (prompt, params, reference[:k], None) for k in cuts},
    )
    assert resumed["whole"].token_ids == reference
    for k in cuts:
        assert reference[:k] + resumed[f"cut{k}"].token_ids == reference, f"tokens differ after a cut at {k}"
