"""IncrementalDetokenizer against the real SmolLM2 tokenizer: streamed text equals decoded text."""

from __future__ import annotations

import random

import pytest

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.detokenizer import IncrementalDetokenizer

PROMPT_TEXT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"
PIECES = [
    "hello",
    " world",
    "é",
    "ü",
    "ñ",
    "ç",
    "Å",
    "naïve",
    "世界",
    "你好",
    "中文字符",
    "日本語",
    "🎉",
    "👍🏽",
    "🚀",
    "👨‍👩‍👧",
    "😀",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    " ",
    "x",
    "42",
    ".",
    "e\u0301",
    "ß",
    "Ω",
    "—",
]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Feed ids (one at a time, or in the given chunk sizes); return every delta, finish() included."""
    deltas = []
    i = 0
    for size in chunk_sizes or [1] * len(ids):
        deltas.append(detok.add(ids[i : i + size]))
        i += size
    deltas.append(detok.finish())
    return deltas


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_texts_stream_exactly(tok, skip_special_tokens):
    rng = random.Random(0)
    prompt = encode(tok, PROMPT_TEXT)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    special = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")]
    for _ in range(60):
        ids = encode(tok, random_text(rng))
        if rng.random() < 0.3:  # a special token in the middle of the output, between two characters
            at = rng.choice([i for i in range(len(ids) + 1) if "\ufffd" not in tok.decode(ids[:i])])
            ids.insert(at, rng.choice(special))
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        detok = IncrementalDetokenizer(tok, prompt, params)
        deltas = stream(detok, ids)
        assert "".join(deltas) == expected == detok.text
        assert deltas[-1] == ""  # complete text: nothing was left for finish()
        assert not any("\ufffd" in d for d in deltas)
        # the same ids in random chunks (several tokens per step) give the same text
        sizes = []
        while sum(sizes) < len(ids):
            sizes.append(rng.randint(1, 4))
        detok = IncrementalDetokenizer(tok, prompt, params)
        assert "".join(stream(detok, ids, sizes)) == expected


def test_multibyte_characters_split_across_tokens_are_held_back(tok):
    ids = encode(tok, "a🎉世")
    assert len(ids) > 3  # the emoji and the CJK character take several byte-level tokens
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == "a🎉世"
    assert all(d in ("", "a", "🎉", "世") for d in deltas)


def test_truncated_character_comes_out_on_finish_like_decode(tok):
    ids = encode(tok, "ok 🎉")[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    deltas = stream(detok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tok.decode(ids) == detok.text


def test_prompt_ending_inside_a_character(tok):
    """A resubmitted prompt (prompt + delivered tokens) can end inside a character whose bytes the stream
    held back: the continuation emits that character."""
    ids = encode(tok, "Hello ok 🎉 done")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    first = IncrementalDetokenizer(tok, [], SamplingParams())
    delivered = "".join(first.add([t]) for t in ids[:cut])  # then the worker dies
    assert delivered == "Hello ok"  # the space went with the emoji's first bytes, in one token
    detok = IncrementalDetokenizer(tok, ids[:cut], SamplingParams())
    assert delivered + "".join(stream(detok, ids[cut:])) == "Hello ok 🎉 done"


def boundary_stop(tok, text: str, stop: str) -> list[int]:
    """ids of text, checking that `stop` spans a token boundary (no single token holds it)."""
    ids = encode(tok, text)
    assert stop in text and not any(stop in tok.decode([t]) for t in ids)
    return ids


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(tok, include):
    text, stop = "The quick brown fox jumps over the lazy dog. The end.", "own fox ju"
    ids = boundary_stop(tok, text, stop)
    params = SamplingParams(stop=["never there", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, [], params)
    deltas = [detok.add([t]) for t in ids]
    end = text.index(stop) + (len(stop) if include else 0)
    assert detok.stopped and detok.stop_reason == stop
    assert detok.text == text[:end]
    assert "".join(deltas) == detok.text  # on a stop everything up to the cut is released at once
    assert detok.add(ids[:3]) == ""  # ids after the stop are ignored
    assert detok.finish() == "" and detok.text == text[:end]
    consumed = next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1])) + 1
    assert detok.num_tokens == consumed


def test_earliest_of_several_stop_strings_wins(tok):
    text = "alpha beta gamma delta"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["a delta", "ta gam"]))
    delta = detok.add(ids)  # all at once, as a multi-token step would
    assert detok.stop_reason == "ta gam" and detok.text == "alpha be" == delta


def test_deltas_hold_back_a_possible_stop_start(tok):
    text, stop = "abc xy", "xyz!"
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stop))
    before = "".join(detok.add([t]) for t in ids)
    assert before == text[: len(text) - (len(stop) - 1)]  # "xy" (and the space) might start "xyz!"
    assert detok.text == text and not detok.stopped
    assert before + detok.finish() == text == detok.text


def test_min_tokens_delays_stop_detection(tok):
    text, stop = "x cat y cat z", "cat"
    ids = encode(tok, text)
    first_cat = next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1])) + 1
    early = IncrementalDetokenizer(tok, [], SamplingParams(stop=stop))
    early_deltas = stream(early, ids)
    assert early.text == "x " == "".join(early_deltas)
    late = IncrementalDetokenizer(tok, [], SamplingParams(stop=stop, min_tokens=first_cat, max_tokens=None))
    late_deltas = stream(late, ids)
    assert late.stopped and late.text == "x cat y " == "".join(late_deltas)


def test_per_token_work_does_not_grow_with_the_output(tok):
    """The decode window stays short however long the output is."""
    windows: list[int] = []

    class Counting:
        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def convert_tokens_to_string(self, tokens):
            windows.append(len(tokens))
            return self._inner.convert_tokens_to_string(tokens)

    text = "Streaming 世界 and emoji 🎉 text " * 200
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(Counting(tok), encode(tok, PROMPT_TEXT), SamplingParams(stop=["<END>"]))
    assert "".join(stream(detok, ids)) == text
    assert len(ids) > 1500 and max(windows) <= 8


@pytest.mark.parametrize("case", range(6))
def test_resumed_detokenizer_continues_the_text_exactly_at_every_cut(tok, case):
    """A detokenizer resumed from the first k ids and the text delivered with them (as after a failover)
    produces exactly the rest: bytes of a character split at the cut, text held back for a stop string, a
    stop string straddling the cut."""
    rng = random.Random(100 + case)
    text = random_text(rng) + "".join(rng.choice(PIECES) for _ in range(12))
    ids = encode(tok, text)
    middle = len(text) // 2
    stops = (text[middle - 2 : middle + 2],) if case % 2 else ()
    params = SamplingParams(stop=stops, include_stop_str_in_output=case % 3 == 0)
    whole = stream(IncrementalDetokenizer(tok, encode(tok, PROMPT_TEXT), params), ids)
    for k in range(1, len(ids)):
        delivered = "".join(whole[:k])
        for shown in {len(delivered), max(0, len(delivered) - 2)}:  # less: text a dying worker never sent
            detok = IncrementalDetokenizer(tok, encode(tok, PROMPT_TEXT), params)
            detok.resume(ids[:k], shown)
            rest = stream(detok, ids[k:])
            assert delivered[:shown] + "".join(rest) == "".join(whole), (k, shown)
