"""logit_bias, allowed_token_ids and bad_words through LLM on the tiny Llama: token ids outside the vocabulary
are refused naming the field; bad words are tokenized once per request and never generated."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    with LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=128, kv_cache_memory=4 << 20) as llm:
        yield llm


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **params)


@pytest.mark.parametrize(
    "field, params",
    [
        ("logit_bias", dict(logit_bias={10**6: 1.0})),
        ("allowed_token_ids", dict(allowed_token_ids=[3, 10**6])),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, field, params):
    [done] = llm.generate([[3, 4, 5]], greedy(**params), use_tqdm=False)
    assert done.finish_reason == "error" and done.error_code == "invalid_request"
    assert done.error.startswith(f"{field}: token id 1000000 is outside the vocabulary")


def test_bias_and_allowed_ids_steer_greedy_output(llm):
    [biased, allowed] = llm.generate(
        [[3, 4, 5]] * 2, [greedy(logit_bias={77: 100.0}), greedy(allowed_token_ids=[90, 91])], use_tqdm=False
    )
    assert biased.token_ids == [77] * 8
    assert set(allowed.token_ids) <= {90, 91}


def test_a_bad_word_is_never_generated_however_it_is_tokenized(llm):
    tokenizer = llm.get_tokenizer()
    [plain] = llm.generate([[3, 4, 5]], greedy(), use_tqdm=False)
    word = tokenizer.decode(plain.token_ids[:1]).strip()
    # the Request the engine would make of it (its intake, read here: the engine thread owns the scheduler)
    request, _ = llm.engine.intake.request("probe", [3, 4, 5], greedy(bad_words=[word]), [], 0, [], 0)
    assert tokenizer.encode(word, add_special_tokens=False) in request.bad_words_token_ids
    assert tokenizer.encode(" " + word, add_special_tokens=False) in request.bad_words_token_ids
    [banned] = llm.generate([[3, 4, 5]], greedy(bad_words=[word]), use_tqdm=False)
    assert word not in banned.text and banned.token_ids != plain.token_ids


def test_prompt_logprobs_match_transformers_across_prefill_chunks_and_a_warm_prefix_cache(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dir("llama")
    prompt = [(7 * i + 3) % 900 + 3 for i in range(45)]
    with LLM(
        model=str(model_dir), dtype="float32", max_model_len=128, kv_cache_memory=4 << 20, max_num_batched_tokens=16
    ) as llm:  # the prompt is prefilled in 3 chunks
        warm = llm.generate([prompt], greedy(), use_tqdm=False)[0]  # fills the prefix cache
        [done] = llm.generate([prompt], greedy(prompt_logprobs=3), use_tqdm=False)
    assert warm.prompt_logprobs is None and done.token_ids == warm.token_ids
    reference = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([prompt]))
        .logits[0]
        .log_softmax(-1)
    )
    assert len(done.prompt_logprobs) == len(prompt) and done.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        row = done.prompt_logprobs[j]
        assert row[prompt[j]] == pytest.approx(reference[j - 1, prompt[j]].item(), abs=1e-4)
        top = reference[j - 1].topk(3).indices.tolist()
        assert set(top) <= set(row) and len(row) <= 4


def test_prompt_logprobs_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)
