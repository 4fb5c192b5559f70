"""Sliding-window models against transformers: Mistral (`sliding_window` on every layer), Qwen2
(`use_sliding_window` from `max_window_layers` on), a Qwen3 config with mixed `layer_types`, and Mixtral, with
windows of 8-12 tokens and prompts and generations far longer. Greedy tokens equal transformers' `generate` in fp32
through `LLM` (direct mode), with prefix-cache hits, chunked prefill, preemption, step graphs and the native bf16
decode step; log-probabilities within 2e-4 of transformers' (fp32). Config features the layers do not compute
are refused at load, by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from family_models import tiny_llm
from hf_reference import hf_model, transformers_greedy
from moe_models import save_tiny_model, tiny_mixtral
from tiny_models import ONE_BUCKET_OPTIONS

from infer import LLM, SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.loading.loader import load_model
from infer.worker.models import native_decode
from infer.worker.models.llama import layer_windows

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
LOGPROB_TOLERANCE = 2e-4  # fp32: our log-probabilities vs transformers' log_softmax of its logits


def _prompts(seed: int) -> list[list[int]]:
    """Four prompts of 20-70 tokens (all past the windows), and two sharing a 40-token prefix (cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (20, 33, 51, 70)]
    return prompts + [shared + [7, 8, 9], shared + [10, 11]]


PROMPTS = _prompts(0)

COMMON = dict(
    hidden_size=96,
    intermediate_size=160,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
MODELS = {
    # model type, config fields, each layer's window as transformers reads them
    "mistral": ("mistral", dict(COMMON, num_hidden_layers=2, sliding_window=8), (8, 8)),
    "qwen2": (
        "qwen2",
        dict(COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=12, max_window_layers=1),
        (0, 12, 12),
    ),
    "mixed": (
        "qwen3",
        dict(
            COMMON,
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        (10, 0, 10),
    ),
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, smollm2_tokenizer):
    """Factory: the model directory of MODELS[name] (made once)."""
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            model_type, fields, _ = MODELS[name]
            fields = dict(
                fields,
                vocab_size=len(smollm2_tokenizer),
                bos_token_id=smollm2_tokenizer.bos_token_id,
                eos_token_id=smollm2_tokenizer.eos_token_id,
            )
            made[name] = save_tiny_model(
                model_type, fields, tmp_path_factory.mktemp(f"swa-{name}"), smollm2_tokenizer, seed=1234
            )
        return made[name]

    return make


@pytest.fixture(scope="module")
def want(windowed):
    """transformers' greedy tokens per model (computed once)."""
    cache: dict[str, list[list[int]]] = {}

    def of(name: str) -> list[list[int]]:
        if name not in cache:
            cache[name] = transformers_greedy(windowed(name), PROMPTS, MAX_NEW)
        return cache[name]

    return of


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", list(MODELS))
def test_each_layer_gets_the_window_transformers_gives_it(windowed, name):
    from transformers import AutoConfig

    path = windowed(name)
    config = AutoConfig.from_pretrained(path)
    assert layer_windows(config) == MODELS[name][2]
    hf = hf_model(path)
    hf_windows = tuple(getattr(layer.self_attn, "sliding_window", None) or 0 for layer in hf.model.layers)
    if name != "mistral":  # Mistral's layers read the config's window at run time (no per-layer field)
        assert hf_windows == MODELS[name][2]
    model = load_model(path, torch.float32, torch.device("cpu"))
    assert tuple(layer.self_attn.window for layer in model.model.layers) == MODELS[name][2]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_transformers_past_the_window(windowed, want, name):
    """Twice in one LLM: the second round's prompts hit the prefix cache (blocks of 4: most of each prompt)."""
    llm = tiny_llm(windowed(name))
    first = _tokens(llm)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert first == want(name)
    assert [c.token_ids for c in second] == want(name)
    assert sum(c.num_cached_tokens for c in second) >= sum(len(p) for p in PROMPTS) // 2


def test_chunked_prefill_and_preemption_keep_the_tokens(windowed, want):
    """Prefill chunks of 8 tokens (chunk boundaries inside and at a window's edge) and a pool too small for the
    batch (requests preempted and recomputed)."""
    from infer.worker.engine.forward_batch import KVCache

    pool = KVCache.bytes_per_block(3, 4, 2, 16, torch.float32) * 40
    engine = Engine(
        EngineConfig(
            model=str(windowed("qwen2")),
            dtype="float32",
            max_model_len=128,
            num_threads=1,
            device="cpu",
            block_size=4,
            max_num_batched_tokens=8,
            kv_cache_memory=pool,
        )
    )
    got = _engine_tokens(engine, PROMPTS)
    assert engine.scheduler.stats.num_preemptions > 0
    assert got == want("qwen2")


def test_logprobs_within_tolerance_of_transformers(windowed):
    """Every generated token's log-probability and the top 3, against transformers' forward over prompt +
    generated tokens (fp32, eager attention)."""
    path = windowed("mixed")
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    completions = tiny_llm(path).generate(PROMPTS[:4], params, use_tqdm=False)
    hf = hf_model(path, attn_implementation="eager")
    for prompt, completion in zip(PROMPTS[:4], completions, strict=True):
        ids = prompt + completion.token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
            for candidate, logprob in entry.items():
                value = logprob.logprob if hasattr(logprob, "logprob") else logprob
                assert abs(value - expected[step, candidate].item()) <= LOGPROB_TOLERANCE, (step, candidate)
            assert token in entry


def test_mixtral_with_a_window(tmp_path, smollm2_tokenizer):
    path = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer, sliding_window=8)
    assert _tokens(tiny_llm(path)) == transformers_greedy(path, PROMPTS, MAX_NEW)


def _engine_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list]:
    """Every request's tokens (with logprobs: (token, logprobs) pairs), stepping the engine to the end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            if params.logprobs:
                out[delta.request_id].extend(zip(delta.token_ids, delta.logprobs or [], strict=True))
            else:
                out[delta.request_id].extend(delta.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_step_graphs_give_the_tokens(windowed, want):
    """Decode steps compiled (CPU step graphs: the native decode kernel as an operator, each layer's window a
    constant of its graph), batch 1 (the buckets are test_step_graphs's; a bucket here is three compiles)."""
    engine = Engine(EngineConfig(model=str(windowed("mixed")), **ONE_BUCKET_OPTIONS))
    graphs = engine.runner.step_graphs
    assert graphs is not None and graphs.buckets == (1,)
    assert _engine_tokens(engine, PROMPTS[:4]) == want("mixed")[:4]
    assert graphs.replays[1] >= 4 * (MAX_NEW - 1)  # every decode step ran in the graph


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "step-graphs"])
def test_blocks_out_of_every_window_are_given_back(windowed, want, eager):
    """Mistral (every layer a window of 8, blocks of 4): after each step a request holds its last few blocks
    only (the released entries read as block 0, or the step graphs' scratch block), and the tokens stay
    transformers'. Then the same prompts again: the released blocks were still cached."""
    engine = Engine(
        EngineConfig(
            model=str(windowed("mistral")),
            dtype="float32",
            max_model_len=256,
            num_threads=1,
            device="cpu",
            block_size=4,
            enforce_eager=eager,
            max_graph_batch_size=1,
            # step graphs: one request at a time, every decode step in the one bucket's graph (the buckets are
            # test_step_graphs's); eagerly, two at a time
            max_num_seqs=2 if eager else 1,
        )
    )
    assert engine.scheduler.config.release_window == 8
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    held = []
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
        held.append(engine.scheduler.block_manager.num_used_blocks)
    assert [out[str(i)] for i in range(len(PROMPTS))] == want("mistral")
    # per request: the window's 2 blocks, the one being filled, the last registered one (the cache chain)
    assert max(held) <= 4 * len(PROMPTS) < sum(-(-(len(p) + MAX_NEW) // 4) for p in PROMPTS) // 2
    assert _engine_tokens(engine, PROMPTS) == want("mistral")
    assert engine.scheduler.stats.prefix_cache_hit_tokens > 0
    if not eager:
        assert engine.runner.step_graphs.replays[1] >= len(PROMPTS) * (MAX_NEW - 1)


def test_a_model_with_a_full_layer_keeps_every_block(windowed):
    engine = Engine(
        EngineConfig(
            model=str(windowed("mixed")), dtype="float32", max_model_len=256, num_threads=1, device="cpu", block_size=4
        )
    )
    assert engine.scheduler.config.release_window == 0


def test_native_bf16_decode_step_equals_the_layers(windowed, monkeypatch):
    """bf16: the one-call native decode step (decode_layers.c, each layer's window) gives the tokens and
    log-probabilities of the layers run one by one, bit for bit."""
    calls: list[int] = []
    real = native_decode.decode_layers

    def counting(h, *args, **kwargs):
        calls.append(h.shape[0])
        return real(h, *args, **kwargs)

    monkeypatch.setattr(native_decode, "decode_layers", counting)

    def run(native: bool) -> list[list]:
        engine = Engine(
            EngineConfig(
                model=str(windowed("mistral")),
                dtype="bfloat16",
                max_model_len=256,
                num_threads=2,
                device="cpu",
                block_size=4,
            )
        )
        if not native:
            engine.model.model.native_decode = False
        return _engine_tokens(
            engine, PROMPTS[:4], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
        )

    fused = run(True)
    native_steps = len(calls)
    assert native_steps >= MAX_NEW - 1
    assert run(False) == fused and len(calls) == native_steps


def test_bf16_agrees_with_fp32_on_most_tokens(windowed, want):
    """bf16 rounds differently from fp32 on a random model's near-ties: at least 75% of the greedy tokens agree."""
    got = _tokens(tiny_llm(windowed("mistral"), dtype="bfloat16"))
    pairs = [(a, b) for ours, theirs in zip(got, want("mistral")) for a, b in zip(ours, theirs)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    print(f"bf16 vs fp32 transformers: {agree:.0%} of the greedy tokens agree")
    assert agree >= 0.75


# ---- refusals -------------------------------------------------------------------------------------------------

REFUSED = {
    "attn_logit_softcapping": ("llama", {"attn_logit_softcapping": 50.0}),
    "final_logit_softcapping": ("mistral", {"final_logit_softcapping": 30.0}),
    "query_pre_attn_scalar": ("qwen2", {"query_pre_attn_scalar": 256}),
    "chunked_attention": ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}),
    "partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("feature", list(REFUSED))
def test_an_unimplemented_feature_is_refused_at_load_by_name(tiny_model_dir, tmp_path, feature):
    """A supported family's checkpoint whose config asks for something these layers do not compute: the load
    fails naming it, instead of serving a wrong answer."""
    arch, changes = REFUSED[feature]
    source = tiny_model_dir(arch)
    target = tmp_path / arch
    target.mkdir()
    for item in source.iterdir():
        (target / item.name).symlink_to(item)
    (target / "config.json").unlink()
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config.pop("rope_parameters", None) if "rope_scaling" in changes else None
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises((NotImplementedError, ValueError), match=feature):
        load_model(target, torch.float32, torch.device("cpu"))
