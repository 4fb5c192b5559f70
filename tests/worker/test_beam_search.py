"""Beam search (worker/engine/beam_search.py, worker/engine/beam_groups.py): the best beam equals transformers'
generate(num_beams=k, do_sample=False, length_penalty=...) on tiny random models, beams share KV blocks by
reference count, and the engine stays consistent under chunked prefill, preemption, aborts and stop strings."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from hf_reference import hf_model, transformers_greedy

from infer import SamplingParams
from infer.protocol.beam_search import BeamSearchParams
from infer.worker.engine.beam_groups import BeamGroups
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine

MAX_NEW = 8
PROMPT_LENGTHS = (1, 4, 9, 23)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory, smollm2_tokenizer):
    """The tiny llama with an EOS id the model really emits (a token of its greedy continuations), so that beams
    end at different lengths and the length penalty matters. Returns (model dir, prompts, eos ids)."""
    source = tiny_model_dir("llama")
    prompts = _prompts(len(smollm2_tokenizer))
    seen: dict[int, set[int]] = {}  # token -> the prompts whose greedy continuation has it (not first)
    for i, tokens in enumerate(transformers_greedy(source, prompts, MAX_NEW - 2)):
        for t in tokens[1:]:
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
    options.setdefault("kv_cache_memory", 1 << 20)  # 1024 blocks of 4 tokens
    return Engine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256, **options))


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
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            num_beams=k,
            num_return_sequences=k,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=sorted(eos_ids),
            pad_token_id=sorted(eos_ids)[0],
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist()):
        tokens = seq[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        beams.append((tokens[:end], score))
    return beams


@pytest.mark.parametrize("k,length_penalty", [(2, 1.0), (4, 0.0), (3, 2.0)])
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
    if length_penalty <= 0:  # short beams favoured: some end by EOS
        assert ended_by_eos, "no beam ended by EOS: the length penalty was not exercised"


def test_each_beams_logprobs_are_transformers_log_softmax_of_its_tokens(eos_model, engine, hf):
    """Per output token, a beam reports its step's top K log-probabilities (the search's candidates); the
    token's own equals transformers' log-softmax at that position of the beam's sequence, and they sum to the
    beam's cumulative log-probability."""
    _, prompts = eos_model
    k = 3
    candidates = BeamGroups.num_candidates(k, engine.eos_token_ids)
    assert candidates >= 2 * k
    finals = _run(engine, prompts[1:3], SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=k, n=k))
    for i, prompt in enumerate(prompts[1:3]):
        for beam in finals[f"r{i}"].beams:
            tokens = list(beam.token_ids)
            assert len(beam.logprobs) == len(tokens) and all(len(step) == candidates for step in beam.logprobs)
            with torch.inference_mode():
                logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
            got = [step[t] for step, t in zip(beam.logprobs, tokens)]
            assert got == pytest.approx(expected.tolist(), abs=1e-4)
            assert sum(got) == pytest.approx(beam.cumulative_logprob, abs=1e-4)


def test_early_stopping_true_and_never(eos_model, engine, hf):
    _, prompts = eos_model
    for early_stopping in (True, "never"):
        params = SamplingParams(
            temperature=0, max_tokens=MAX_NEW, beam_width=3, n=3, length_penalty=1.5, early_stopping=early_stopping
        )
        finals = _run(engine, prompts[:2], params)
        for i, prompt in enumerate(prompts[:2]):
            expected = _hf_beams(hf, prompt, 3, 1.5, engine.eos_token_ids, early_stopping=early_stopping)
            assert [list(b.token_ids) for b in finals[f"r{i}"].beams] == [t for t, _ in expected]


def test_beams_share_kv_blocks(eos_model, engine, monkeypatch):
    """Counted during a search: the beams hold far fewer blocks than as many independent sequences would, their
    prompt blocks are one set referenced by every beam, and each round copies at most width - 1 partial blocks."""
    _, prompts = eos_model
    width, prompt = 4, prompts[-1]  # 23 prompt tokens: 5 full blocks of 4 and a partial one
    copies: list[int] = []
    real_copy = engine.kv_cache.copy_blocks
    monkeypatch.setattr(engine.kv_cache, "copy_blocks", lambda pairs: (copies.append(len(pairs)), real_copy(pairs)))
    blocks = engine.scheduler.block_manager
    engine.add_request(
        "shared", prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=width, ignore_eos=True)
    )
    rounds = 0
    while engine.has_unfinished():
        engine.step()
        beams = [r for r in engine.scheduler.running if r.beam_group == "shared"]
        if len(beams) < 2:
            continue
        rounds += 1
        independent = sum(blocks.blocks_for_tokens(r.num_computed_tokens) for r in beams)
        assert blocks.num_used_blocks < independent
        prompt_blocks = {r.block_table[i] for r in beams for i in range(len(prompt) // 4)}
        assert len(prompt_blocks) == len(prompt) // 4  # one copy of the prompt's full blocks
        assert all(blocks.ref_count(b) == len(beams) for b in prompt_blocks)
    assert rounds >= MAX_NEW - 2
    assert copies and max(copies) <= width - 1
    assert blocks.num_used_blocks == 0


def test_same_beams_under_preemption_and_chunked_prefill(eos_model, engine):
    """Ten searches at once with an 8-token step budget (chunked prefill), and in a pool too small for them
    (groups preempted and recomputed as a whole; with the priority policy and speculative decoding on too): the
    same beams as the roomy engine, the pool consistent every step."""
    model_dir, prompts = eos_model
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=3, n=3, length_penalty=0.5)
    rng = random.Random(5)
    batch = prompts + [[rng.randrange(3, 40000) for _ in range(rng.randrange(5, 24))] for _ in range(6)]
    expected = _run(engine, batch, params)
    chunked = _engine(model_dir, block_size=4, max_num_batched_tokens=8)
    tight = _engine(model_dir, block_size=4, max_num_seqs=36, kv_cache_memory=_kv_bytes(model_dir, 27, 4))
    assert tight.num_kv_blocks == 27
    # beams never speculate, and a priority scheduler preempts a group as a whole too
    speculating = _engine(
        model_dir,
        block_size=4,
        scheduling_policy="priority",
        max_num_seqs=36,
        kv_cache_memory=_kv_bytes(model_dir, 27, 4),
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    )
    for other in (chunked, tight, speculating):
        got = _run(other, batch, params)
        for rid, delta in expected.items():
            assert [list(b.token_ids) for b in got[rid].beams] == [list(b.token_ids) for b in delta.beams], rid
    assert tight.scheduler.num_preemptions > 0 and speculating.scheduler.num_preemptions > 0


def test_abort_stop_strings_and_context(eos_model, engine):
    model_dir, prompts = eos_model
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=3, n=3, ignore_eos=True)
    free = _run(engine, prompts[1:2], params)["r0"]
    # an abort mid-search: one final delta, reason "abort", every block back
    engine.add_request("gone", prompts[1], params)
    engine.add_request("kept", prompts[1], params)
    engine.step()
    engine.step()
    assert engine.abort("gone")
    finals = {}
    while engine.has_unfinished():
        finals.update({d.request_id: d for d in engine.step()})
    assert finals["gone"].finish_reason == "abort" and finals["gone"].beams is None
    assert [list(b.token_ids) for b in finals["kept"].beams] == [list(b.token_ids) for b in free.beams]
    assert engine.scheduler.block_manager.num_used_blocks == 0
    # a stop string: a beam whose text reaches it ends there, its text cut before it
    stop = free.beams[0].text[2:5]
    stopped = _run(
        engine,
        prompts[1:2],
        SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=3, ignore_eos=True, stop=[stop]),
    )["r0"]
    assert all(stop not in b.text for b in stopped.beams)
    assert any(b.finish_reason == "stop" for b in stopped.beams)
    # the context: max_model_len caps every beam
    short = Engine(
        EngineConfig(model=str(model_dir), dtype="float32", max_model_len=28, block_size=4, kv_cache_memory=8 << 20)
    )
    capped = _run(short, [prompts[-1]], params)["r0"]
    assert all(len(b.token_ids) <= 28 - len(prompts[-1]) and b.finish_reason == "length" for b in capped.beams)


@pytest.mark.parametrize(
    "options,field",
    [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=33), "beam_width"),
        (dict(beam_width=2, temperature=0.7), "temperature"),
        (dict(beam_width=2, n=3), "n"),
        (dict(beam_width=2, logit_bias={5: 1.0}), "logit_bias"),
        (dict(beam_width=2, structured_outputs={"regex": "a+"}), "structured_outputs"),
        (dict(beam_width=2, repetition_penalty=1.2), "repetition_penalty"),
        (dict(beam_width=2, logprobs=2), "logprobs"),
        (dict(length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_bad_beam_options_refused_by_name(options, field):
    from infer.protocol.sampling import FieldError

    with pytest.raises(FieldError) as error:
        SamplingParams(temperature=options.pop("temperature", 0.0), **options)
    assert error.value.field == field


def test_engine_refusals_keep_it_serving(eos_model, engine):
    _, prompts = eos_model
    small = SamplingParams(temperature=0, max_tokens=4, beam_width=2)
    with pytest.raises(ValueError, match="a beam search cannot continue from delivered tokens"):
        engine.add_request("x", prompts[0], small, resumed_token_ids=[5])
    huge = SamplingParams(temperature=0, max_tokens=200, beam_width=32)
    with pytest.raises(ValueError, match="can never fit in the KV cache"):
        engine.add_request("y", prompts[0], huge)
    assert not engine.has_unfinished()
    assert _run(engine, prompts[:1], small)["r0"].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=1.0)


def _kv_bytes(model_dir, num_blocks: int, block_size: int) -> int:
    from transformers import AutoConfig

    from infer.worker.engine.forward_batch import KVCache

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * KVCache.bytes_per_block(
        cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, head_dim, torch.float32
    )


def test_a_failing_beam_fails_its_search_once(eos_model, engine, monkeypatch):
    """Non-finite logits on the beams' rows (fault isolation): the search fails alone, one final delta with code
    "internal", every block back; a request beside it goes on."""
    import dataclasses

    _, prompts = eos_model
    real = engine.runner.execute
    calls = []

    def spoiled(chunks):
        out = real(chunks)
        calls.append(1)
        if out is None or len(calls) < 3:
            return out
        rows = [i for i, c in enumerate(c for c in chunks if c.samples) if c.request.beam_group == "bad"]
        return dataclasses.replace(out, bad_rows=tuple(rows))

    monkeypatch.setattr(engine.runner, "execute", spoiled)
    engine.add_request("bad", prompts[2], SamplingParams(temperature=0, max_tokens=MAX_NEW, beam_width=3))
    engine.add_request("good", prompts[1], SamplingParams(temperature=0, max_tokens=4))
    finals = {}
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id not in finals
            if delta.finished:
                finals[delta.request_id] = delta
    assert finals["bad"].finish_reason == "error" and finals["bad"].error_code == "internal"
    assert finals["good"].finish_reason == "length"
    assert engine.scheduler.block_manager.num_used_blocks == 0
