"""Embeddings (worker/engine/pooling.py) through the engine: LLM.embed equals transformers' last hidden states (after the
final norm) pooled the same way, within fp32 tolerance, for last / mean / CLS pooling with and without
normalization, on prompts split over several prefill chunks; mixed in one batch with generation, each output is
what it is alone; options only generation takes are refused."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_model

from infer import LLM, SamplingParams

# 21, 2, 40, 1 and 17 tokens: chunks of 16 (a last chunk of one token, a one-token prompt: rows of a decode's shape)
PROMPTS = [list(range(5, 26)), [3, 4], list(range(100, 140)), [7], list(range(200, 217))]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tiny_model_dir):
    path = tiny_model_dir(request.param)
    llm = LLM(str(path), dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    return llm, hf_model(path)


def _reference(model, ids: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_transformers_hidden_states_pooled_the_same_way(models, pooling, normalize):
    llm, reference = models
    outs = llm.embed(PROMPTS, pooling=pooling, normalize=normalize, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert out.finish_reason == "stop" and out.token_ids == [] and out.prompt_token_ids == ids
        expected = _reference(reference, ids, pooling, normalize)
        torch.testing.assert_close(torch.tensor(out.embedding), expected, atol=2e-5, rtol=1e-4)


def test_embeddings_and_generation_in_one_batch_are_each_what_they_are_alone(models):
    llm, _ = models
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    mixed = llm.generate(PROMPTS + PROMPTS, [SamplingParams(pooling="mean")] * 5 + [greedy] * 5, use_tqdm=False)
    alone = llm.embed(PROMPTS, pooling="mean", use_tqdm=False)
    for m, a in zip(mixed[:5], alone):
        torch.testing.assert_close(torch.tensor(m.embedding), torch.tensor(a.embedding), atol=1e-5, rtol=1e-5)
    assert [m.token_ids for m in mixed[5:]] == [c.token_ids for c in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    again = llm.embed(PROMPTS[:1], use_tqdm=False)[0]  # its prompt's blocks are cached now: not used, the same
    torch.testing.assert_close(
        torch.tensor(again.embedding), torch.tensor(llm.embed(PROMPTS[:1], use_tqdm=False)[0].embedding)
    )


def test_generation_options_and_unknown_poolings_are_refused(models):
    llm, _ = models
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        llm.embed(PROMPTS, pooling="max")
    out = llm.generate(PROMPTS[0], SamplingParams(pooling="last", logprobs=2), use_tqdm=False)[0]
    assert out.finish_reason == "error" and "takes no generation options; got logprobs" in out.error
