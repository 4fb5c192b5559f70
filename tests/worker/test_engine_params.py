"""logit_bias, allowed_token_ids and bad_words through LLM on the tiny Llama: token ids outside the vocabulary
are refused naming the field; bad words are tokenized once per request and never generated."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=128,
             kv_cache_memory=4 << 20) as llm:
        yield llm


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **params)


@pytest.mark.parametrize("field, params", [
    ("logit_bias", dict(logit_bias={10**6: 1.0})),
    ("allowed_token_ids", dict(allowed_token_ids=[3, 10**6])),
])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, field, params):
    [done] = llm.generate([[3, 4, 5]], greedy(**params), use_tqdm=False)
    assert done.finish_reason == "error" and done.error_code == "invalid_request"
    assert done.error.startswith(f"{field}: token id 1000000 is outside the vocabulary")


def test_bias_and_allowed_ids_steer_greedy_output(llm):
    [biased, allowed] = llm.generate([[3, 4, 5]] * 2, [greedy(logit_bias={77: 100.0}),
                                                       greedy(allowed_token_ids=[90, 91])], use_tqdm=False)
    assert biased.token_ids == [77] * 8
    assert set(allowed.token_ids) <= {90, 91}


def test_a_bad_word_is_never_generated_however_it_is_tokenized(llm):
    tokenizer = llm.get_tokenizer()
    [plain] = llm.generate([[3, 4, 5]], greedy(), use_tqdm=False)
    word = tokenizer.decode(plain.token_ids[:1]).strip()
    request = llm.engine.add_request("probe", [3, 4, 5], greedy(bad_words=[word]))
    assert tokenizer.encode(word, add_special_tokens=False) in request.bad_words_token_ids
    assert tokenizer.encode(" " + word, add_special_tokens=False) in request.bad_words_token_ids
    llm.engine.abort("probe")
    llm.engine.step()
    [banned] = llm.generate([[3, 4, 5]], greedy(bad_words=[word]), use_tqdm=False)
    assert word not in banned.text and banned.token_ids != plain.token_ids
