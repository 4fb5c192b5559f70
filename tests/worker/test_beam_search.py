"""Beam search (worker/beam_search.py, worker/beam_groups.py): the best beam equals transformers'
generate(num_beams=k, do_sample=False, length_penalty=...) on tiny random models, beams share KV blocks by
reference count, and the engine stays consistent under chunked prefill, preemption, aborts and stop strings."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from infer import LLM, SamplingParams
from infer.protocol.beam_search import BeamSearchParams
from infer.worker.config import EngineConfig
from infer.worker.engine import Engine
from hf_reference import hf_model

MAX_NEW = 10
PROMPT_LENGTHS = (1, 3, 7, 16, 23)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with an EOS id the model really emits (a token of its greedy continuations), so that beams
    end at different lengths and the length penalty matters. Returns (model dir, prompts, eos ids)."""
    source = tiny_model_dir("llama")
    model = hf_model(source)
    prompts = _prompts(model.config.vocab_size)
    seen: dict[int, set[int]] = {}   # token -> the prompts whose beams generate it (not first, not last)
    for i, prompt in enumerate(prompts):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=4,
                                 num_return_sequences=4, max_new_tokens=MAX_NEW, pad_token_id=0)
        for seq in out.tolist():
            for t in seq[len(prompt) + 1:-1]:
                seen.setdefault(t, set()).add(i)
    eos = max(seen, key=lambda t: (len(seen[t]), -t))
    path = tmp_path_factory.mktemp("beam-eos") / "model"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path, prompts


@pytest.fixture(scope="module")
def engine(eos_model) -> Engine:
    return _engine(eos_model[0], block_size=4)


@pytest.fixture(scope="module")
def hf(eos_model):
    return hf_model(eos_model[0])


def _engine(model_dir, **options) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256,
                               kv_cache_memory=8 << 20, **options))


def _run(engine: Engine, prompts, params: SamplingParams) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.finished, "a beam search streams nothing before its end"
            finals[delta.request_id] = delta
        engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_used_blocks == 0
    return finals


def _hf_beams(model, prompt, k, length_penalty, eos_ids, max_new=MAX_NEW, early_stopping=False):
    x = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=k,
                             num_return_sequences=k, max_new_tokens=max_new, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=sorted(eos_ids),
                             pad_token_id=sorted(eos_ids)[0], output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        tokens = seq[len(prompt):]
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        beams.append((tokens[:end], score))
    return beams


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.0), (3, 2.0), (4, -1.0)])
def test_best_beam_equals_transformers(eos_model, engine, hf, k, length_penalty):
    _, prompts = eos_model
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=k, n=k, length_penalty=length_penalty)
    finals = _run(engine, prompts, params)
    ended_by_eos = 0
    for i, prompt in enumerate(prompts):
        expected = _hf_beams(hf, prompt, k, length_penalty, engine.eos_token_ids)
        got = finals[f"r{i}"]
        assert list(got.token_ids) == expected[0][0], f"prompt {i}"
        assert [list(b.token_ids) for b in got.beams] == [tokens for tokens, _ in expected], f"prompt {i}"
        assert [b.score for b in got.beams] == pytest.approx([s for _, s in expected], abs=1e-4)
        ended_by_eos += sum(b.finish_reason == "stop" for b in got.beams)
    if length_penalty <= 0:   # short beams favoured: some end by EOS
        assert ended_by_eos, "no beam ended by EOS: the length penalty was not exercised"


def test_early_stopping_true_and_never(eos_model, engine, hf):
    _, prompts = eos_model
    for early_stopping in (True, "never"):
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=3, n=3, length_penalty=1.5,
                                early_stopping=early_stopping)
        finals = _run(engine, prompts, params)
        for i, prompt in enumerate(prompts):
            expected = _hf_beams(hf, prompt, 3, 1.5, engine.eos_token_ids, early_stopping=early_stopping)
            assert [list(b.token_ids) for b in finals[f"r{i}"].beams] == [t for t, _ in expected]
