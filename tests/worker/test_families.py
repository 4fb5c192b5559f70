"""Every family of tests/family_cases.py against transformers on its tiny random checkpoint, the same checks for
each: greedy tokens equal transformers' `generate` in fp32 (direct mode; again from the prefix cache; in prefill
chunks where the row names them; on the native attention kernels where it says so), log-probabilities within 2e-4
of transformers' log_softmax, decode steps in compiled graphs, and bf16 as close to fp32 as transformers' own bf16.
What only one family has is in its own file (test_gemma.py, test_phi3.py, test_gpt_oss.py, ...)."""

from __future__ import annotations

import pytest
import torch
from attention_calls import assert_native_attention, count_attention_kernels
from family_cases import CASES
from family_models import tiny_llm
from hf_reference import assert_bf16_as_close_as_transformers, hf_model
from tiny_models import ONE_BUCKET_OPTIONS

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

LOGPROB_TOLERANCE = 2e-4  # fp32: ours against transformers' log_softmax of its logits


def _greedy(max_new: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **extra)


GREEDY_RUNS = [(name, chunk) for name, case in CASES.items() for chunk in (None, *case.chunks)]


@pytest.mark.parametrize("name, chunk", GREEDY_RUNS, ids=[f"{n}-chunk{c}" if c else n for n, c in GREEDY_RUNS])
def test_greedy_tokens_equal_transformers(family_checkpoint, name, chunk, monkeypatch):
    """Twice in one LLM (whole prompts; with `chunk`, prefill chunks of that many tokens): the second round's prompts
    hit the prefix cache where the engine keeps one for the model."""
    case = CASES[name]
    path, want = family_checkpoint(name)
    calls = count_attention_kernels(monkeypatch) if case.native_attention else None
    llm = tiny_llm(path, **case.llm, **({"max_num_batched_tokens": chunk} if chunk else {}))
    params = _greedy(case.max_new)
    assert [c.token_ids for c in llm.generate(case.prompts, params, use_tqdm=False)] == want
    again = llm.generate(case.prompts, params, use_tqdm=False)
    assert [c.token_ids for c in again] == want
    assert (sum(c.num_cached_tokens for c in again) > 0) == case.prefix_caching
    if calls is not None:
        assert_native_attention(calls)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.logprobs])
def test_logprobs_within_tolerance_of_transformers(family_checkpoint, name):
    """Every generated token's log-probability and the top 3, against transformers' forward over prompt + output."""
    case = CASES[name]
    path, _ = family_checkpoint(name)
    completions = tiny_llm(path, **case.llm).generate(case.prompts, _greedy(case.max_new, logprobs=3), use_tqdm=False)
    hf = hf_model(path, **case.hf_options)
    compared = 0
    for prompt, completion in zip(case.prompts, completions, strict=True):
        if case.logprob_skip is not None and case.logprob_skip(prompt, case.max_new):
            continue
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        for step, entry in enumerate(completion.logprobs):
            for candidate, logprob in entry.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - expected[step, candidate].item()) <= LOGPROB_TOLERANCE, (prompt, step, candidate)
        compared += 1
    assert compared >= 2


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.step_graphs])
def test_step_graphs_give_the_tokens(family_checkpoint, name):
    """Decode steps in a compiled graph (CPU step graphs, batch 1: the requests one after another; the other
    buckets are test_step_graphs's): transformers' tokens, every decode step in the graph."""
    case = CASES[name]
    path, want = family_checkpoint(name)
    engine = Engine(EngineConfig(model=str(path), **ONE_BUCKET_OPTIONS))
    graphs = engine.runner.step_graphs
    assert graphs is not None
    params = _greedy(case.max_new)
    for i, prompt in enumerate(case.prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(case.prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    assert [out[str(i)] for i in range(len(case.prompts))] == want
    assert graphs.buckets == (1,)
    assert graphs.replays[1] >= len(case.prompts) * (case.max_new - 1)  # every decode step ran in the graph


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.bf16])
def test_bf16_is_as_close_to_fp32_as_transformers_bf16(family_checkpoint, name):
    """bf16 logits over one prompt and its fp32 greedy continuation, position by position (greedy runs in bf16 part
    ways at the first near-tie and never meet again): the drift from transformers' fp32 within 1.5x transformers'
    own bf16 forward's, by the row's measure (hf_reference.assert_bf16_as_close_as_transformers), and fp32's next
    token at the row's share of the positions."""
    case = CASES[name]
    assert case.bf16 is not None
    prompt, measure, same = case.bf16
    path, want = family_checkpoint(name)
    ids = case.prompts[prompt] + want[prompt]
    assert_bf16_as_close_as_transformers(path, ids, name, measure=measure, same_at_least=same, **case.hf_options)
