"""LLM.generate: order, mixed prompt kinds, per-prompt errors that do not stop the batch."""

from __future__ import annotations

import pytest

from infer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir("llama")), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)


def test_results_come_back_in_prompt_order(llm):
    prompts = ["one", [5, 6, 7, 8], "a much longer prompt " * 10, [9]]
    lengths = [3, 7, 1, 5]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == lengths
    assert outs[1].prompt_token_ids == [5, 6, 7, 8]
    assert all(o.finish_reason == "length" for o in outs)
    alone = llm.generate([[5, 6, 7, 8]], params[1], use_tqdm=False)[0]
    assert alone.token_ids == outs[1].token_ids


def test_single_prompt_forms(llm):
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate("hi", params, use_tqdm=False)) == 1
    assert len(llm.generate([1, 2, 3], params, use_tqdm=False)) == 1


def test_bad_prompt_is_an_error_completion_and_others_run(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(["fine", "", [10**8], "x " * 400, "also fine"], params, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "empty" in outs[1].error and "vocabulary" in outs[2].error and "context length" in outs[3].error


def test_params_count_must_match(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_unknown_engine_option_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown engine option.*gpu_memory_utilisation"):
        LLM(model=str(tiny_model_dir("llama")), gpu_memory_utilisation=0.5)


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                   use_tqdm=False)[0]
    assert out.prompt is not None and "<|im_start|>user" in out.prompt and len(out.token_ids) == 2
