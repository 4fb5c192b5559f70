"""Beam search through the APIs (the engine's search itself: tests/worker/test_beam_search.py, against
transformers): vLLM's LLM.beam_search in direct mode and through a coordinator and a worker process (the final
result; nothing streams), and the HTTP front's `use_beam_search` (vLLM's extension, with n / best_of) through the
official openai client's extra_body on /v1/completions and /v1/chat/completions; bad input refused by name, the
front serving on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
from front_harness import ENGINE_OPTIONS, MODEL, error_of, http, local_engine, serving

from infer import LLM, BeamSearchParams, SamplingParams
from infer.client.local_engine import LocalEngine

PROMPTS = [[5, 6, 7, 8, 9], [300, 301, 302]]
PARAMS = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)


@pytest.fixture(scope="module")
def direct(tiny_model_dir):
    with LLM(str(tiny_model_dir("llama")), **ENGINE_OPTIONS) as llm:
        outputs = llm.beam_search(PROMPTS, PARAMS)
        as_dicts = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, {"prompt": "Hello"}], PARAMS)  # vLLM's forms
        assert as_dicts[0].sequences[0].tokens == outputs[0].sequences[0].tokens and as_dicts[1].sequences
        yield outputs, llm.generate(PROMPTS[0], PARAMS.to_sampling_params(), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def local(tiny_model_dir) -> Iterator[LocalEngine]:
    engine = local_engine(tiny_model_dir("llama"))
    yield engine
    asyncio.run(engine.close())


def test_llm_beam_search_has_vllms_shape(direct):
    outputs, completion = direct
    assert [len(o.sequences) for o in outputs] == [3, 3]
    for prompt, out in zip(PROMPTS, outputs):
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for seq in out.sequences:
            assert seq.tokens[: len(prompt)] == prompt and seq.output_token_ids == seq.tokens[len(prompt) :]
            assert 0 < len(seq.output_token_ids) <= 6 and seq.cum_logprob < 0
            assert seq.score == pytest.approx(seq.cum_logprob / len(seq.output_token_ids) ** 0.5)
            # vLLM's per-token logprobs: each step's top 2 * beam_width at least, the token's own summing up
            assert len(seq.logprobs) == len(seq.output_token_ids) and all(len(step) >= 6 for step in seq.logprobs)
            assert sum(step[t] for step, t in zip(seq.logprobs, seq.output_token_ids)) == pytest.approx(seq.cum_logprob)
    # generate with beam_width: one Completion whose outputs are the beams, the flat fields the best one's
    assert [o.token_ids for o in completion.outputs] == [s.output_token_ids for s in outputs[0].sequences]
    assert completion.token_ids == outputs[0].sequences[0].output_token_ids
    assert completion.outputs[1].cumulative_logprob == pytest.approx(outputs[0].sequences[1].cum_logprob)


def test_through_the_cluster_the_same_beams(tiny_model_dir, direct):
    with LLM(str(tiny_model_dir("llama")), use_coordinator=True, **ENGINE_OPTIONS) as llm:
        got = llm.beam_search(PROMPTS, PARAMS)
        with pytest.raises(ValueError, match="temperature must be 0"):
            llm.generate(PROMPTS[0], SamplingParams(beam_width=2, temperature=0.5))
        assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason == "length"
    for want, out in zip(direct[0], got):
        assert [s.tokens for s in out.sequences] == [s.tokens for s in want.sequences]
        assert [s.text for s in out.sequences] == [s.text for s in want.sequences]
        for seq, expected in zip(out.sequences, want.sequences):  # the beams' logprobs came over the wire
            assert [sorted(step) for step in seq.logprobs] == [sorted(step) for step in expected.logprobs]
            assert [step[t] for step in seq.logprobs for t in sorted(step)] == pytest.approx(
                [step[t] for step in expected.logprobs for t in sorted(step)], abs=1e-5
            )


def test_use_beam_search_over_http_with_the_openai_client(local, smollm2_tokenizer, direct):
    outputs, _ = direct
    with serving(local, smollm2_tokenizer) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=6,
            n=2,
            extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5},
        )
        assert [c.index for c in got.choices] == [0, 1, 2, 3]
        for c in got.choices:  # n = 2 of best_of = 3 beams: the best two of each prompt, best first
            want = outputs[c.index // 2].sequences[c.index % 2]
            assert c.text == want.text and c.finish_reason == want.finish_reason
        assert got.usage.completion_tokens == sum(
            len(outputs[i // 2].sequences[i % 2].output_token_ids) for i in range(4)
        )
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            n=2,
            extra_body={"use_beam_search": True},
        )
        assert len(chat.choices) == 2 and all(c.message.content is not None for c in chat.choices)
        for body, param in (
            ({"n": 2, "temperature": 0.8}, "temperature"),
            ({"n": 40}, "n"),
            ({"logprobs": 2}, "logprobs"),
            ({"logit_bias": {"5": 1.0}}, "logit_bias"),
            ({"best_of": 2, "n": 3}, "best_of"),
        ):
            status, _, text = http(
                f"{url}/v1/completions",
                {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **body},
            )
            assert status == 400, (body, text)
            assert param in error_of(text)["message"], (body, text)
        # streamed: nothing before the end, then each choice whole (vLLM does the same)
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5},
        )
        chunks = list(stream)
        streamed = {c.choices[0].index: c.choices[0] for c in chunks if c.choices}
        assert {i: (c.text, c.finish_reason) for i, c in streamed.items()} == {
            c.index: (c.text, c.finish_reason) for c in got.choices
        }
        assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
        chat_stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            n=2,
            stream=True,
            extra_body={"use_beam_search": True},
        )
        text = {0: "", 1: ""}
        for c in chat_stream:
            for choice in c.choices:
                text[choice.index] += choice.delta.content or ""
        assert text == {c.index: c.message.content for c in chat.choices}
        again = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=6,
            extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.5},
        )
        assert again.choices[0].text == outputs[0].sequences[0].text  # still serving, the same answer
