"""The decode step of 1-8 sequences in one native call (worker/models/native_decode.py, kernels/cpu/decode_layers.c)
gives the tokens and log-probabilities of the layers run one by one, bit for bit: alone, in batches that grow
past eight and shrink back (requests finishing or aborted beside others), under preemption, and after the pools
are released and restored. Speculative verification steps (k + 1 rows a request) run in it too, with the tokens
and log-probabilities of decoding without speculation, alone and in mixed batches.
Models it cannot serve keep the layers; bad positions and slots are refused with a ValueError."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import native_isa_levels, use_native_isa

from infer import SamplingParams
from infer.kernels import cpu_kernels
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.models import native_decode
from infer.worker.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from infer.worker.models.native_decode import NativeDecoder

DENSE = (LlamaDecoderLayer, LlamaAttention, LlamaMLP)  # the classes whose layers the native step runs


@pytest.fixture(autouse=True, params=[isa for isa in native_isa_levels() if isa != "generic"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test once per build this CPU runs that has a GEMV (avx512 with AVX512-BF16 pairs or the fp32 core,
    avx2 with the fp32 core; the generic build has none, and the layers run one by one there)."""
    use_native_isa(request.param, monkeypatch)
    assert cpu_kernels.gemv_paths() & (cpu_kernels.GEMV_BF16_PAIRS | cpu_kernels.GEMV_BF16_FP32_CORE)
    return request.param


def _engine(model_dir, **kwargs) -> Engine:
    """On the CPU also where a GPU is (the native step is the CPU's); bf16 and one thread unless told (two threads,
    where the native step splits its rows, in test_batches_growing_past_eight_and_shrinking_back_with_an_abort: on
    a 2-core machine running the suite, 2-thread engines beside the other tests' work took ~20% more time)."""
    kwargs.setdefault("dtype", "bfloat16")
    kwargs.setdefault("num_threads", 1)
    return Engine(EngineConfig(model=str(model_dir), max_model_len=1024, device="cpu", **kwargs))


def _run(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], abort_after: dict[str, int] | None = None
) -> dict[str, list[tuple[int, dict]]]:
    """Every request's (token, logprobs) in order; `abort_after`: request -> steps after which it is aborted."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[tuple[int, dict]]] = {rid: [] for rid in requests}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(zip(delta.token_ids, delta.logprobs or [], strict=True))
        steps += 1
        for rid, after in (abort_after or {}).items():
            if steps == after:
                engine.abort(rid)
    return out


@pytest.fixture
def calls(monkeypatch) -> list[int]:
    """The rows of each native decode step."""
    seen: list[int] = []
    real = native_decode.decode_layers

    def counting(h, *args, **kwargs):
        seen.append(h.shape[0])
        return real(h, *args, **kwargs)

    monkeypatch.setattr(native_decode, "decode_layers", counting)
    return seen


def _both(model_dir, requests, calls, abort_after=None, **kwargs):
    fused = _run(_engine(model_dir, **kwargs), requests, abort_after)
    native_steps = len(calls)
    layered_engine = _engine(model_dir, **kwargs)
    layered_engine.model.model.native_decode = False
    layered = _run(layered_engine, requests, abort_after)
    assert len(calls) == native_steps, "native_decode = False must keep every step on the layers"
    return fused, layered, native_steps


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_one_request_gets_the_layer_by_layer_tokens_and_logprobs(smollm2_dir, calls, quantization):
    """The embedded model with its GGUF blocks kept (q4 layers, a q8 LM head; kernels/cpu/quant.c), and dense bf16
    (the GEMV): bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    requests = {"a": (list(range(1000, 1100)), params)}
    fused, layered, native_steps = _both(smollm2_dir, requests, calls, quantization=quantization)
    assert native_steps == 15 and set(calls) == {1}  # every decode step; the prefill ran the layers
    assert fused == layered


def test_batches_growing_past_eight_and_shrinking_back_with_an_abort(smollm2_dir, calls):
    """Eleven requests of different lengths: steps of 9-11 decodes run the layers (the GEMV's tiles), then requests finish
    one by one, or are aborted, and the steps of 8 down to 1 run natively."""

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True)

    requests = {f"r{i}": (list(range(500 + 40 * i, 520 + 40 * i + 3 * i)), params(3 + 2 * i)) for i in range(10)}
    requests["aborted"] = (list(range(100, 180)), params(40))
    fused, layered, _ = _both(smollm2_dir, requests, calls, abort_after={"aborted": 5}, num_threads=2)
    assert set(calls) == set(range(1, 9))
    assert [len(fused[f"r{i}"]) for i in range(10)] == [3 + 2 * i for i in range(10)] and len(fused["aborted"]) < 40
    assert fused == layered


def test_preemption_and_released_pools(smollm2_dir, calls):
    """Small blocks and a pool of 24: requests preempt each other; then the engine suspends (weights and pools
    released) and resumes, and a request decodes alone again over the new allocations."""
    from infer.worker.engine.forward_batch import KVCache

    blocks = KVCache.bytes_per_block(30, 4, 3, 64, torch.bfloat16) * 24
    requests = {
        f"r{i}": (
            list(range(900 + 40 * i, 930 + 40 * i)),
            SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True),
        )
        for i in range(3)
    }
    engine = _engine(smollm2_dir, block_size=4, kv_cache_memory=blocks)
    fused = _run(engine, requests)
    assert engine.scheduler.stats.num_preemptions > 0
    engine.suspend()
    engine.resume()
    again = _run(
        engine,
        {"after": (list(range(300, 340)), SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))},
    )
    native_steps = len(calls)
    layered_engine = _engine(smollm2_dir, block_size=4, kv_cache_memory=blocks)
    layered_engine.model.model.native_decode = False
    assert _run(layered_engine, requests) == fused
    assert (
        _run(
            layered_engine,
            {
                "after": (
                    list(range(300, 340)),
                    SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
                )
            },
        )
        == again
    )
    assert native_steps > 11 and len(calls) == native_steps


@pytest.mark.parametrize("arch, serves", [("llama", True), ("qwen2", True), ("qwen3", False)])
def test_which_models_it_serves(arch, serves, tiny_model_dir, calls):
    """A plain Llama is served (here with head_dim 16, off the bf16 dot-product path of the attention kernel),
    and Qwen2 with its qkv biases (5 query heads per KV head); q/k norms (qwen3) keep the layers. The same tokens
    either way."""
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True)
    fused, layered, native_steps = _both(tiny_model_dir(arch), {"a": (list(range(5, 40)), params)}, calls)
    assert (native_steps == 9) if serves else (native_steps == 0)
    assert fused == layered


def test_fp32_and_multi_rank_models_keep_the_layers(smollm2_dir):
    for quantization in ("auto", "none"):
        fp32 = _engine(smollm2_dir, dtype="float32", quantization=quantization)
        assert NativeDecoder.for_model(fp32.model.model, 1, DENSE) is None
    bf16 = _engine(smollm2_dir)
    assert NativeDecoder.for_model(bf16.model.model, 1, DENSE) is not None
    assert NativeDecoder.for_model(bf16.model.model, 2, DENSE) is None


def test_positions_and_slots_out_of_range_are_refused(smollm2_dir):
    engine = _engine(smollm2_dir)
    decoder = NativeDecoder.for_model(engine.model.model, 1, DENSE)
    model, kv = engine.model.model, engine.kv_cache
    weights, formats, pools = decoder.weights, decoder.formats, decoder.pool_addresses(kv)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    cos_sin = model.rotary_emb.cos_sin_cache
    num_blocks, block_size = kv.k[0].shape[1], kv.k[0].shape[2]

    def step(position, slot, seq_len, block=0):
        h = torch.randn(2, decoder.hidden).to(torch.bfloat16)
        table = tables.clone()
        table[1, 0] = block
        cpu_kernels.decode_layers(
            h,
            decoder.residual,
            weights,
            formats,
            pools,
            decoder.num_layers,
            decoder.num_heads,
            decoder.num_kv_heads,
            decoder.head_dim,
            decoder.intermediate,
            decoder.eps,
            decoder.scale,
            torch.tensor([3, position]),
            torch.tensor([3, slot]),
            table,
            torch.tensor([4, seq_len], dtype=torch.int32),
            kv.k[0],
            cos_sin,
            True,
            decoder.scratch,
        )
        return h

    assert torch.isfinite(step(3, 7 * block_size, 4, block=7).float()).all()
    for position, slot, seq_len, block in [
        (cos_sin.shape[0], 3, 4, 0),
        (-1, 3, 4, 0),
        (3, num_blocks * block_size, 4, 0),
        (3, -2, 4, 0),
        (3, 3, 4 * block_size + 1, 0),
        (3, 3, 0, 0),
        (3, 3, 4, num_blocks),
        (3, 3, 4, -1),
    ]:
        with pytest.raises(ValueError, match="outside the cos/sin cache"):
            step(position, slot, seq_len, block)


PASSAGES = (
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. ",
    "Roses are red, violets are blue, sugar is sweet, and so are you. ",
    "Alice was beginning to get very tired of sitting by her sister on the bank. ",
)


def _speculating(model_dir, requests, k, **kwargs):
    """(without, with) speculation (n-gram drafts, k a step), both through the native step, and the decoder of
    the engine that speculated."""
    plain = _run(_engine(model_dir, **kwargs), requests)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = _engine(model_dir, speculative_config=spec, **kwargs)
    out = _run(engine, requests)
    assert engine.stats.spec_decode_num_accepted_tokens > 0
    return plain, out, engine.model.model.native_decode


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_verification_steps_run_natively_with_the_tokens_of_decoding_without_speculation(
    smollm2_dir, calls, quantization
):
    """Three requests verifying 4 drafts each (15 rows: the GEMV past 8 rows, the LM head in pieces of 8), then
    fewer as they finish: greedy tokens and their log-probabilities equal decoding without speculation's, q4 / q8
    blocks and dense bf16 alike. With the GGUF blocks a long prompt is prefilled in chunks beside them too: those
    steps run the layers, whose quantized products sum each row alone as well (as the GEMV's tiles sum dense bf16
    rows)."""

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)

    requests = {
        f"copy{i}": ("Repeat the passage exactly.\n" + passage * 2 + "\nRepeat:", greedy(24))
        for i, passage in enumerate(PASSAGES)
    }
    chunked = {}
    if quantization == "auto":
        requests["long"] = (list(range(2000, 2120)), greedy(6))
        chunked = {"max_num_batched_tokens": 64}
    plain, spec, decoder = _speculating(smollm2_dir, requests, 4, quantization=quantization, **chunked)
    assert spec == plain
    assert isinstance(decoder, NativeDecoder) and decoder.verification_steps > 0
    assert max(calls) > 8  # more rows than a plain step of 8 brings


def test_long_verifications_alone(smollm2_dir, calls):
    """k = 12: 13 rows of one request, its attention in pieces (16 rows a task: 5 tokens of SmolLM2's 3 query
    heads a KV head)."""
    prompt = "Repeat the passage exactly.\n" + PASSAGES[0] * 3 + "\nRepeat:"
    requests = {"rewrite": (prompt, SamplingParams(temperature=0, max_tokens=30, logprobs=1, ignore_eos=True))}
    plain, spec, decoder = _speculating(smollm2_dir, requests, 12, quantization="none")
    assert spec == plain
    assert isinstance(decoder, NativeDecoder) and decoder.verification_steps > 0 and 13 in calls
