"""Step graphs against eager steps: the same tokens at every bucket boundary, through preemption and aborts.

Buckets 1, 2, 4 (max_graph_batch_size=4) on tiny fp32 models keep the compile to seconds. Batches shrink
from 5 sequences (past the largest bucket: eager) through 4, 3, 2 and 1 as requests finish, are aborted or
are preempted (a pool too small for the workload), and regrow as preempted ones come back, so every
boundary (bucket - 1, bucket, bucket + 1) is crossed in both directions.
"""

from __future__ import annotations

import random

import pytest
import torch
from moe_models import tiny_mixtral
from tiny_models import ONE_BUCKET_OPTIONS, STEP_GRAPH_OPTIONS
from torch._dynamo.utils import counters

from infer import SamplingParams
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.engine.forward_batch import KVCache

GRAPH_OPTIONS = {**STEP_GRAPH_OPTIONS, "max_num_seqs": 5}  # the five requests of the workload at once


def _kv_bytes(path: str, num_blocks: int) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * KVCache.bytes_per_block(
        cfg.num_hidden_layers, GRAPH_OPTIONS["block_size"], cfg.num_key_value_heads, head_dim, torch.float32
    )


def _workload(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Five requests of different lengths (so the batch shrinks one by one), greedy, EOS ignored."""
    rng = random.Random(3)
    lengths, outputs = [3, 9, 17, 30, 6], [40, 8, 23, 31, 14]
    return {
        f"r{i}": (
            [rng.randrange(3, vocab) for _ in range(n)],
            SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
        )
        for i, (n, m) in enumerate(zip(lengths, outputs))
    }


def _drive(engine: Engine, requests: dict, abort_at: dict[int, str]) -> dict[str, list[int]]:
    """Add all requests, step to the end, aborting abort_at[step] before that step. Returns tokens per id."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    step = 0
    while engine.has_unfinished():
        if step in abort_at:
            assert engine.abort(abort_at[step])
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
        step += 1
    return out


# One model: what this file checks (bucket boundaries, padding, preemption, aborts, verification rows) is the
# graphs' and the scheduler's, not a family's, and each bucket compiled costs 10-20 s on a 2-core CI machine. The
# families' own layers (Qwen 3's and Gemma 3's q/k norms, Gemma's soft-capping, Phi-3's partial rotary, sliding
# windows) run in a graph in tests/worker/test_families.py and test_sliding_window_models.py, one bucket each.
GRAPH_MODEL = "llama"


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(eager, compiled) engines over a pool of 24 blocks of 4 slots: the workload's ~180 tokens of context
    do not fit, so requests are preempted and recomputed, shrinking and regrowing the batch."""
    path = str(tiny_model_dir(GRAPH_MODEL))
    budget = _kv_bytes(path, 24)
    return tuple(
        Engine(EngineConfig(**{**GRAPH_OPTIONS, "model": path, "enforce_eager": eager, "kv_cache_memory": budget}))
        for eager in (True, False)
    )


def test_graphs_are_made_for_the_small_buckets_at_start(engines):
    eager, compiled = engines
    assert eager.runner.step_graphs is None
    graphs = compiled.runner.step_graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4)
    assert set(graphs.compile_seconds) == {1, 2, 4}


@pytest.mark.parametrize("abort_at", [{}, {6: "r3", 9: "r0"}], ids=["no-abort", "aborts"])
def test_compiled_steps_match_eager_across_bucket_boundaries(engines, abort_at):
    eager, compiled = engines
    requests = _workload(eager.vocab_size)
    replays_before = dict(compiled.runner.step_graphs.replays)
    preemptions_before = [e.scheduler.stats.num_preemptions for e in engines]
    want = _drive(eager, requests, abort_at)
    graphs_before = counters["stats"]["unique_graphs"]
    got = _drive(compiled, requests, abort_at)
    assert got == want
    # nothing compiled on the requests' path: the start made every bucket they use, in the steps' inference mode
    assert counters["stats"]["unique_graphs"] == graphs_before
    replays = {b: n - replays_before.get(b, 0) for b, n in compiled.runner.step_graphs.replays.items()}
    assert all(replays.get(b, 0) > 0 for b in (1, 2, 4)), replays  # 3 sequences ran in bucket 4
    if not abort_at:  # (aborts free blocks early enough that nothing needs preempting)
        assert all(e.scheduler.stats.num_preemptions > before for e, before in zip(engines, preemptions_before))


def test_a_model_without_step_graph_support_runs_eagerly(tmp_path, smollm2_tokenizer):
    path = tiny_mixtral(tmp_path / "mixtral", tokenizer=smollm2_tokenizer)
    engine = Engine(EngineConfig(model=str(path), **GRAPH_OPTIONS))
    assert engine.runner.step_graphs is None
    out = _drive(engine, {"a": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))}, {})
    assert len(out["a"]) == 3


def test_native_quantized_linears_run_eagerly_and_say_why(smollm2_gguf, caplog):
    """On a CPU the quantized matmul is a ctypes call torch.compile cannot trace: asked for step graphs, the engine
    says so at start and runs eagerly, instead of failing inside the compiler."""
    with caplog.at_level("INFO", logger="infer"):
        engine = Engine(EngineConfig(model=str(smollm2_gguf), **GRAPH_OPTIONS))
    assert engine.runner.step_graphs is None
    assert "native quantized matmul" in caplog.text and "making them failed" not in caplog.text
    out = _drive(engine, {"a": ([5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))}, {})
    assert len(out["a"]) == 3


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _repetitive(vocab: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Two prompts that repeat a short cycle, so that n-gram drafts are found every step (some accepted, some not,
    on a random model), greedy, EOS ignored, with logprobs."""
    cycles = ([7, 11, 5, 9], [13, 6, 12])
    return {
        f"s{i}": (
            [t % vocab for t in cycle * 6],
            SamplingParams(temperature=0, max_tokens=m, logprobs=1, ignore_eos=True),
        )
        for i, (cycle, m) in enumerate(zip(cycles, (30, 19)))
    }


def _drive_logprobs(engine: Engine, requests: dict) -> dict[str, list[tuple[int, float]]]:
    """Every request's (token, its logprob) in order."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, list[tuple[int, float]]] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(
                (t, lp[t]) for t, lp in zip(delta.token_ids, delta.logprobs or [], strict=True)
            )
    return out


def test_verification_steps_replay_the_graphs_with_the_tokens_of_decoding_without_speculation(tiny_model_dir):
    """A verification step's k + 1 rows a request run as decode rows of the graphs (the buckets reach 2 requests x
    4 rows): greedy tokens equal decoding without speculation, compiled and eager alike."""
    path = str(tiny_model_dir(GRAPH_MODEL))
    # the pool of the `engines` fixture: a graph is specialized on the pool's size, so these engines replay the
    # buckets that fixture's engine compiled in this process instead of compiling them again (10-20 s each on a
    # 2-core CI machine); the longer request may be preempted and recomputed, which must change no token either
    options = {**GRAPH_OPTIONS, "max_num_seqs": 2, "max_graph_batch_size": 256, "kv_cache_memory": _kv_bytes(path, 24)}

    def engine(eager: bool, spec: dict | None) -> Engine:
        return Engine(EngineConfig(**{**options, "model": path, "enforce_eager": eager, "speculative_config": spec}))

    requests = _repetitive(engine(True, None).vocab_size)
    want = _drive_logprobs(engine(True, None), requests)
    plain = engine(False, None)
    assert plain.runner.step_graphs is not None and plain.runner.step_graphs.buckets == (1, 2)
    speculating = engine(False, SPEC)
    graphs = speculating.runner.step_graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4, 8)  # 2 requests x (1 + 3) rows
    got_plain, got = _drive_logprobs(plain, requests), _drive_logprobs(speculating, requests)
    for rid, pairs in want.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in got_plain[rid]] == [t for t, _ in pairs]
        assert [lp for _, lp in got[rid]] == pytest.approx([lp for _, lp in pairs], abs=1e-4)
    stats = speculating.stats
    assert graphs.verification_replays > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens  # rejections too
    assert set(graphs.replays) & {4, 8}  # rows past the 2 sequences' buckets
    # verification steps replay the graphs, never the native decode step (which a graph's steps never reach)
    decoder = speculating.model.model.native_decode  # made on the first step it could take: none came
    assert decoder is None or decoder.verification_steps == 0


def test_image_requests_decode_in_the_graphs(tmp_path, smollm2_tokenizer):
    """Gemma 3 with images (tests/gemma3_vision_models.py): the image's prefill runs eagerly (its features and two-way
    attention), every decode step after it replays the graph, and the tokens are transformers'."""
    import io

    from gemma3_vision_models import BOI, gemma3_vision_checkpoint, transformers_gemma3_greedy
    from llava_models import png
    from PIL import Image
    from transformers import AutoProcessor

    path = gemma3_vision_checkpoint(tmp_path / "gemma3", smollm2_tokenizer)
    image, text = png(40, 30, seed=1), f"Describe {BOI} now."
    processed = AutoProcessor.from_pretrained(str(path))(
        text=text, images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )
    want = transformers_gemma3_greedy(path, processed["input_ids"][0].tolist(), processed["pixel_values"], 8)
    engine = Engine(EngineConfig(model=str(path), **ONE_BUCKET_OPTIONS))
    graphs = engine.runner.step_graphs
    assert graphs is not None
    engine.add_request("a", text, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=[image])
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for delta in engine.step() for t in delta.token_ids]
    assert out == want and graphs.replays[1] == 7


def test_idefics3_image_requests_decode_in_the_graphs(tmp_path, smollm2_tokenizer):
    """Idefics3 with images (tests/idefics3_models.py): the tiles' prefill runs eagerly (their features), every decode
    step after it replays the graph, and the tokens are transformers'."""
    import io

    from idefics3_models import IMAGE_TOKEN, idefics3_checkpoint, transformers_idefics3_greedy
    from llava_models import png
    from PIL import Image
    from transformers import AutoProcessor

    path = idefics3_checkpoint(tmp_path / "idefics3", smollm2_tokenizer)
    image, text = png(40, 30, seed=1), f"Describe {IMAGE_TOKEN} now."
    processed = AutoProcessor.from_pretrained(str(path))(
        text=text, images=[Image.open(io.BytesIO(image))], return_tensors="pt"
    )
    ids, pixels, mask = processed["input_ids"][0].tolist(), processed["pixel_values"], processed["pixel_attention_mask"]
    want = transformers_idefics3_greedy(path, ids, pixels, mask, 8)
    engine = Engine(EngineConfig(model=str(path), **ONE_BUCKET_OPTIONS))
    graphs = engine.runner.step_graphs
    assert graphs is not None
    engine.add_request("a", text, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=[image])
    out: list[int] = []
    while engine.has_unfinished():
        out += [t for delta in engine.step() for t in delta.token_ids]
    assert out == want and graphs.replays[1] == 7
