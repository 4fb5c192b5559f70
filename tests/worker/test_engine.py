"""Engine acceptance: greedy output token-identical to transformers in one continuous batch, under
small blocks, forced preemption and chunked prefill; prefix caching; seeded sampling; bad input."""

from __future__ import annotations

import random
import time

import pytest
import torch
from hf_reference import first_layers, hf_model
from prompts import prompt_of_length

from infer import LLM, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.engine.forward_batch import KVCache

MAX_NEW = 12


def _kv_bytes_for_blocks(model_dir, num_blocks: int, block_size: int) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * KVCache.bytes_per_block(
        cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, head_dim, torch.float32
    )


def _reference(model_dir, prompt_ids: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    model = hf_model(model_dir, torch.float32)
    outs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new,
                pad_token_id=model.config.eos_token_id,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


# The embedded model's batch: seven of varied_prompts(16, 780)'s prompts (words, seed), 14 to 923 tokens. The first
# six (987 tokens, under the 2,048-token step budget) are admitted in the first step; the last waits for blocks.
EMBEDDED_PROMPTS = ((2, 0), (3, 1), (31, 3), (124, 6), (280, 9), (346, 10), (780, 15))


def _prompts_for(model_name: str, tokenizer) -> list[list[int]]:
    if model_name == "smollm2":
        texts = [prompt_of_length(words, seed) for words, seed in EMBEDDED_PROMPTS]
        return [tokenizer(t)["input_ids"] for t in texts]
    rng = random.Random(7)
    lengths = [1, 2, 5, 9, 16, 17, 31, 64, 100, 128, 200, 255, 300, 511, 700, 1000]
    return [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in lengths]


def _prompt_blocks(prompts: list[list[int]], block_size: int) -> int:
    """The blocks the prompts fill, every one of them at once."""
    return sum(-(-len(p) // block_size) for p in prompts)


SCENARIOS = {
    # (a) every sequence spans many blocks
    "small-blocks": lambda d, prompts: dict(block_size=4),
    # (b) KV pool far smaller than the batch needs: preemption by recompute must happen
    "preemption": lambda d, prompts: dict(block_size=16, kv_cache_memory=_kv_bytes_for_blocks(d, 80, 16)),
    # (c) chunked prefill at a 64-token step budget
    "chunked-64": lambda d, prompts: dict(block_size=16, max_num_batched_tokens=64),
    # (d) preemption with step graphs (bucket 1: the preempted request, recomputed alone, decodes in a graph; the
    # batch of five before it eagerly; buckets 2 and 4 and their padding under preemption are test_step_graphs's, on
    # tiny checkpoints: each bucket compiled costs ~8 s here). The pool is exactly the blocks of the prompts admitted
    # in the first step (all but the last, EMBEDDED_PROMPTS): it is then full, and the first decode that crosses a
    # block boundary (the 16-token prompt's first) preempts the newest running request, which is recomputed later;
    # the last prompt runs once blocks are free again.
    "preemption-graphs": lambda d, prompts: dict(
        block_size=16,
        kv_cache_memory=_kv_bytes_for_blocks(d, _prompt_blocks(prompts[:-1], 16), 16),
        enforce_eager=False,
        max_graph_batch_size=1,
    ),
}


# The tiny models take every scenario but step graphs (preemption under step graphs on tiny checkpoints is
# tests/worker/test_step_graphs.py's `engines`; a graph compile costs 10-20 s on a 2-core CI machine). The embedded
# model's real weights take preemption under step graphs: its other scenarios take no path that this one and the
# tiny models' runs miss (eager preemption and 64-token chunks cost 40 s each on that machine; 4-token blocks, ~1,000
# token prompts in fp32, ~150 s of a fresh 2-core run: the tiny models take 4-token blocks over the same lengths).
# Its first EMBEDDED_LAYERS layers only (hf_reference.first_layers: real weights, vocabulary and rotary): all 30
# cost 111 s of a cold-cache 2-core run (transformers' reference, a 30-layer graph compile and the steps), and a
# layer past the fourth takes no path the first four do not.
EMBEDDED_LAYERS = 4
EMBEDDED_SCENARIOS = ("preemption-graphs",)
CASES = [("smollm2", s) for s in EMBEDDED_SCENARIOS] + [
    (m, s) for m in ("qwen3", "mistral") for s in SCENARIOS if not s.endswith("graphs")
]


@pytest.fixture(scope="module")
def model_cases(smollm2_dir, tiny_model_dir, smollm2_tokenizer, tmp_path_factory):
    """A model's (path, prompts, transformers' reference), made once per model for all its scenarios (an
    indirect parameter would make it again for every (model, scenario) pair: 16 transformers generations for
    each tiny model)."""
    made: dict[str, tuple] = {}

    def case(name: str) -> tuple:
        if name not in made:
            if name == "smollm2":
                path = first_layers(smollm2_dir, EMBEDDED_LAYERS, tmp_path_factory.mktemp("smollm2-cut"))
            else:
                path = tiny_model_dir(name)
            prompts = _prompts_for(name, smollm2_tokenizer)
            made[name] = path, prompts, _reference(path, prompts, MAX_NEW)
        return made[name]

    return case


@pytest.mark.slow
@pytest.mark.parametrize(("name", "scenario"), CASES)
def test_greedy_matches_transformers_in_one_batch(model_cases, name, scenario):
    path, prompts, expected = model_cases(name)
    options = SCENARIOS[scenario](path, prompts)
    # the embedded model's layers as transformers dequantizes them (quantization none), so that the model code is
    # compared
    llm = LLM(model=str(path), dtype="float32", max_model_len=2048, quantization="none", **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert max(len(p) for p in prompts) >= 900 and min(len(p) for p in prompts) <= 20
    for i, (completion, want) in enumerate(zip(got, expected)):
        assert completion.token_ids == want, f"{name}/{scenario}: prompt {i} ({len(prompts[i])} tokens) differs"
    if scenario.startswith("preemption"):
        assert llm.engine.scheduler.stats.num_preemptions > 0
    if scenario.endswith("graphs"):
        graphs = llm.engine.runner.step_graphs
        assert graphs is not None and sum(graphs.replays.values()) > 0  # some decode steps ran in a graph
    if scenario == "small-blocks":
        assert llm.engine.block_size == 4


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    return Engine(EngineConfig(model=str(smollm2_dir), dtype="float32", max_model_len=1024, kv_cache_memory=64 << 20))


def _run(engine: Engine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return out


def test_prefix_cache_computes_only_the_suffix(smollm2_dir, smollm2_tokenizer):
    prefix = smollm2_tokenizer(prompt_of_length(400, 1))["input_ids"][:256]
    first = prefix + smollm2_tokenizer(" Tell me about lighthouses.")["input_ids"]
    second = prefix + smollm2_tokenizer(" What is the time complexity?")["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = {}
    for caching in (True, False):
        eng = Engine(
            EngineConfig(
                model=str(smollm2_dir),
                dtype="float32",
                max_model_len=1024,
                kv_cache_memory=64 << 20,
                enable_prefix_caching=caching,
            )
        )
        _run(eng, {"a": (first, params)})
        before = eng.stats.prefill_tokens_computed
        outputs[caching] = _run(eng, {"b": (second, params)})["b"]
        computed = eng.stats.prefill_tokens_computed - before
        if caching:
            assert computed == len(second) - 256
        else:
            assert computed == len(second)
    assert outputs[True] == outputs[False]


def test_seeded_sampling_is_batch_independent(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _run(engine, {"solo": ("Once upon a time", params)})["solo"]
    batch = {"solo": ("Once upon a time", params)}
    # 17 others, a batch of 18 (31 before: the same mixture at about a third of the prefill): greedy and sampled,
    # seeded and not (every (i % 2, i % 3) pair at least twice), prompts of 5-117 words, outputs of 8-16 tokens
    for i in range(17):
        other = SamplingParams(temperature=1.0 if i % 2 else 0, seed=i if i % 3 else None, max_tokens=8 + i % 9)
        batch[f"other-{i}"] = (prompt_of_length(5 + 7 * i, i), other)
    together = _run(engine, batch)
    assert together["solo"] == alone
    again = _run(engine, {"solo": ("Once upon a time", SamplingParams(**{**params.to_dict(), "seed": 99}))})
    assert again["solo"] != alone


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", None, "prompt is empty"),
        ([], None, "prompt is empty"),
        ([1, 2, 10**9], None, "outside the vocabulary"),
        ([-1], None, "outside the vocabulary"),
        ("word " * 1100, None, "context length is 1024"),
        ("word " * 200_000, None, "refused without tokenizing"),  # too long to fit, whatever its tokens
        ("hello", "temperature=0", "params must be SamplingParams"),
    ],
)
def test_bad_requests_are_rejected_while_others_complete(engine, prompt, params, message):
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("good", "The sea is", good)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    engine.add_request("good2", "A second good request", good)
    out = {}
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    assert sorted(out) == ["good", "good2"] and all(len(v) == 6 for v in out.values())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), "top_k must be -1"),
        (dict(min_p=2.0), "min_p must be in"),
        (dict(logprobs=99), "logprobs must be in"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(top_k=2**64), "top_k must fit in 64 bits"),
        (dict(stop_token_ids=[1, -(2**63) - 1]), "stop_token_ids must fit in 64 bits"),
        (dict(stop="x" * 20_000_000), "each stop string may be at most 1024 characters, got 20000000"),
        (dict(stop=["a"] * 65), "stop may hold at most 64 strings"),
        (dict(stop_token_ids=[1] * 1025), "stop_token_ids may hold at most 1024 ids"),
    ],
)
def test_bad_sampling_params_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_option_names_are_named():
    with pytest.raises(ValueError, match="unknown sampling option.*temprature"):
        SamplingParams.from_dict({"temprature": 0.5})
    with pytest.raises(ValueError, match="unknown engine option.*max_num_seq\\b"):
        EngineConfig.from_options(max_num_seq=4)


def test_kv_budget_too_small_for_one_block(smollm2_dir):
    with pytest.raises(ValueError, match="too small for one KV block"):
        Engine(EngineConfig(model=str(smollm2_dir), dtype="float32", kv_cache_memory=1000))


def test_request_that_can_never_fit_fails_alone(smollm2_dir):
    llm = LLM(
        model=str(smollm2_dir),
        dtype="float32",
        max_model_len=1024,
        block_size=16,
        kv_cache_memory=_kv_bytes_for_blocks(smollm2_dir, 8, 16),
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    small, huge = "Hello there", prompt_of_length(300, 0)
    got = llm.generate([small, huge, small], params, use_tqdm=False)
    assert [c.finish_reason for c in got] == ["length", "error", "length"]
    assert "KV" in got[1].error and "blocks" in got[1].error
    assert got[0].token_ids == got[2].token_ids


def test_stop_strings_and_streamed_text(engine):
    text_params = SamplingParams(temperature=0, max_tokens=40)
    full = _run(engine, {"full": ("Count: 1, 2, 3, 4,", text_params)})["full"]
    full_text = engine.tokenizer.decode(full, skip_special_tokens=True)
    stop = full_text.strip()[3:6]
    assert stop
    engine.add_request("s", "Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    pieces, final = [], None
    while engine.has_unfinished():
        for d in engine.step():
            pieces.append(d.text)
            if d.finished:
                final = d
    streamed = "".join(pieces)
    assert final.finish_reason == "stop"
    assert stop not in streamed and full_text.startswith(streamed)


def test_abort_running_and_waiting(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_of_length(20, i), params)
    engine.step()
    assert engine.abort("r0") and engine.abort("r2") and not engine.abort("missing")
    reasons = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    assert reasons == {"r0": "abort", "r1": "length", "r2": "abort"}
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kv_blocks


def test_shed_overdue_fails_only_requests_that_never_started(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("started", prompt_of_length(20, 1), params)
    engine.step()
    engine.scheduler.preempt_all()  # back in the queue, but it has started: it is not shed
    engine.add_request("queued", prompt_of_length(20, 2), params)
    time.sleep(0.02)
    assert engine.shed_overdue(0.01) == 1 and engine.shed_overdue(0.01) == 0
    finals = {}
    while engine.has_unfinished():
        finals.update({d.request_id: d for d in engine.step() if d.finished})
    shed = finals["queued"]
    assert (shed.finish_reason, shed.error_code, shed.token_ids) == ("error", "overloaded", [])
    assert "--max-queue-time 0.01 s" in shed.error and shed.queue_time_s >= 0.02
    assert finals["started"].finish_reason == "length"
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kv_blocks


def test_logprobs_are_returned(engine):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    llm_like = _collect_logprobs(engine, params)
    assert len(llm_like) == 4
    for row in llm_like:
        assert 3 <= len(row) <= 4 and all(v <= 0 for v in row.values())


def _collect_logprobs(engine, params):
    engine.add_request("lp", "The capital of France is", params)
    rows = []
    while engine.has_unfinished():
        for d in engine.step():
            rows.extend(d.logprobs or [])
    return rows


@pytest.mark.parametrize("prepack", [None, True, False, "yes"])
def test_cpu_weight_prepack_keeps_a_packed_copy_only_when_asked(tiny_model_dir, prepack, caplog):
    """A bf16 engine on a CPU with a native GEMV keeps one copy of its dense linear weights (the packed twin only on
    AMX-BF16, by default); --cpu-weight-prepack keeps oneDNN's packed copy beside them (twice the weights' bytes),
    and it survives a re-pack (a refit), where oneDNN packs bf16 (AVX-512 or AVX-NE-CONVERT: on an AVX2-only CPU the
    option keeps one copy, with a warning); anything but a bool or None is refused by name."""
    from infer.kernels.cpu_kernels import amx_bf16, gemv_paths
    from infer.worker.loading.loader import pack_weights
    from infer.worker.loading.weights import packed_bytes
    from infer.worker.models.layers import onednn_packs_bf16

    options = dict(model=str(tiny_model_dir("llama")), dtype="bfloat16", max_model_len=128, kv_cache_memory=4 << 20)
    if prepack == "yes":
        with pytest.raises(ValueError, match="cpu_weight_prepack must be a bool or None"):
            EngineConfig.from_options(**options, cpu_weight_prepack=prepack)
        return
    if not gemv_paths() & 3 or not torch.backends.mkldnn.is_available():
        pytest.skip("no native GEMV or no oneDNN: the linears keep oneDNN's copy whatever the option")
    engine = Engine(EngineConfig.from_options(**options, cpu_weight_prepack=prepack))
    try:
        twin = (amx_bf16() if prepack is None else prepack) and onednn_packs_bf16()
        assert ("--cpu-weight-prepack has no effect on this CPU" in caplog.text) == bool(prepack and not twin)
        assert (packed_bytes(engine.model) > 0) == twin
        pack_weights(engine.model)
        assert (packed_bytes(engine.model) > 0) == twin
        engine.add_request("r", list(range(5, 40)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        tokens = [t for _ in range(20) if engine.has_unfinished() for d in engine.step() for t in d.token_ids]
        assert len(tokens) == 4
    finally:
        engine.close()
