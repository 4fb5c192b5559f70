"""Speculative decoding (n-gram / prompt lookup): output with speculation equals output without it, token for
token (greedy, and seeded sampling: each verification row draws the noise of its position), on tiny models and
the embedded model, at batch 1 and in mixed batches, under preemption, chunked prefill, prefix caching, aborts,
stop strings, logprobs, penalties and structured outputs; drafts are really accepted (the counters say how
many), rejected drafts' blocks go back to the pool; a chi-square test on a 16-token model shows the sampled
distribution is the target's. The proposer and the options are checked on their own."""

from __future__ import annotations

import json
import math

import pytest
import torch
from structured_cases import MAX_TOKENS, SCHEMAS

from infer import SamplingParams
from infer.protocol.structured import StructuredOutputsParams as Spec
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.engine import Engine
from infer.worker.engine.request import Request
from infer.worker.speculative.config import SpeculativeConfig
from infer.worker.speculative.proposers import NgramProposer, ngram_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PASSAGE = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. "


def make_engine(model: str | None, spec: dict | None, **options) -> Engine:
    config = dict(model=model, max_model_len=1024, kv_cache_memory=32 << 20, speculative_config=spec)
    if model is not None:
        config["dtype"] = "float32"
    config.update(options)
    return Engine(EngineConfig(**config))


def run(engine: Engine, requests: dict[str, tuple], abort_after: dict[str, int] | None = None) -> dict[str, dict]:
    """All requests in one batch; id -> tokens, text, finish reason, logprobs. `abort_after`: abort a request
    once it has that many tokens."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: {"ids": [], "text": "", "reason": None, "logprobs": []} for rid in requests}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            o = out[delta.request_id]
            o["ids"] += delta.token_ids
            o["text"] += delta.text
            o["logprobs"] += delta.logprobs or []
            if delta.finished:
                o["reason"] = delta.finish_reason
        for rid, n in (abort_after or {}).items():
            if len(out[rid]["ids"]) >= n and out[rid]["reason"] is None:
                engine.abort(rid)
    assert not engine.has_unfinished()
    engine.scheduler.check_invariants()
    assert engine.scheduler.block_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked
    return out


def both(model: str | None, requests: dict[str, tuple], spec: dict = NGRAM, **options):
    """(without, with) speculation, and the engine that speculated."""
    plain = run(make_engine(model, None, **options), requests)
    engine = make_engine(model, spec, **options)
    return plain, run(engine, requests), engine


def repetitive(n: int, seed: int = 0) -> list[int]:
    """A prompt whose tokens repeat (so that n-gram drafts can be right)."""
    unit = [(seed * 7 + i * 13) % 500 + 3 for i in range(5)]
    return (unit * (n // 5 + 1))[:n]


def accepted(engine: Engine) -> int:
    return engine.stats.spec_decode_num_accepted_tokens


# ---- the proposer and the options ------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_earliest_match():
    assert ngram_drafts([1, 2, 3, 4, 1, 2], 1, 3, 3) == [3, 4, 1]
    assert ngram_drafts([1, 2, 3, 4, 1, 2], 1, 3, 1) == [3]
    # the 2-gram [5, 2] occurs, so the longer match wins over the earlier 1-gram [2]
    assert ngram_drafts([2, 9, 5, 2, 7, 5, 2], 1, 3, 2) == [7, 5]
    # the earliest occurrence of the suffix wins among equal lengths
    assert ngram_drafts([7, 1, 7, 2, 7], 1, 1, 1) == [1]
    assert ngram_drafts([1, 2, 3], 1, 3, 2) == []  # no earlier occurrence
    assert ngram_drafts([1, 2, 3, 1, 2], 3, 3, 2) == []  # only shorter matches: below min_n
    assert ngram_drafts([4, 4, 4], 1, 2, 5) == [4]  # overlapping match; only the tokens there are
    assert ngram_drafts([1, 2, 1, 2], 1, 2, 0) == []
    # tokens as 4-byte ints: a byte-level coincidence is not a match
    assert ngram_drafts([256, 1, 0, 1], 1, 1, 1) == [0]


def test_ngram_takes_the_last_token_as_an_insertion_when_nothing_matches():
    passage = [10, 11, 12, 13, 14, 15]
    # the copy added a token (99) after [11, 12]: no suffix n-gram occurs, [11, 12] before it does
    assert ngram_drafts(passage + [0, 10, 11, 12, 99], 2, 4, 3) == [13, 14, 15]
    assert ngram_drafts(passage + [0, 10, 11, 12, 99], 2, 4, 9) == [13, 14, 15, 0, 10, 11, 12]  # not the 99
    assert ngram_drafts(passage + [0, 10, 12, 99], 2, 4, 3) == []  # neither matches
    assert ngram_drafts(passage + [0, 12, 13, 14], 2, 4, 2) == [15, 0]  # a match needs no fallback
    assert ngram_drafts([5, 6, 7], 2, 2, 2) == []  # too short to skip a token


def test_ngram_proposer_reads_prompt_and_output():
    request = Request("r", [5, 6, 7, 8], SamplingParams(), token_ids=[5, 6, 7, 8, 5, 6])
    assert NgramProposer(2, 2).propose([request], [2]) == [[7, 8]]


def test_speculative_config_validation():
    config = SpeculativeConfig.of(NGRAM)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 3)
    assert SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert (
        SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min
        == 3
    )
    assert SpeculativeConfig.of(str(config)) == config  # JSON round trip (a config into argv)
    cases = [
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in"),
        ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min must"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown key(s) 'lookahead'"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported yet"),
        ({"method": "magic", "num_speculative_tokens": 2}, "method must be one of ngram"),
        ("{not json", "not valid JSON"),
        ([1], "must be a dict"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.of(value)
        assert message in str(e.value), (value, str(e.value))
    with pytest.raises(ValueError, match="unknown key"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 1, "k": 2})
    assert EngineConfig(speculative_config=NGRAM).speculative_config == config


def test_per_request_opt_out_is_validated():
    with pytest.raises(ValueError, match="disable_speculative_decoding must be a bool"):
        SamplingParams(disable_speculative_decoding="yes")
    from infer.protocol.messages import Dispatch, RequestSpec, decode, encode

    sent = Dispatch(
        request_id="a", spec=RequestSpec(sampling=SamplingParams(disable_speculative_decoding=True), prompt="x")
    )
    assert decode(encode(sent)).spec.sampling.disable_speculative_decoding is True  # it travels on the wire


# ---- greedy: the same tokens with and without speculation -----------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tiny_models_batch_one_and_mixed(tiny_model_dir, arch):
    model = str(tiny_model_dir(arch))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = {"a": (repetitive(30), greedy)}
    plain, spec, engine = both(model, alone)
    assert spec == plain
    assert accepted(engine) > 0
    # a mixed batch: prompts of several lengths, one still prefilling in chunks while others verify
    mixed = {
        f"m{i}": (repetitive(n, i), SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        for i, (n, m) in enumerate([(7, 30), (40, 25), (300, 20), (3, 33), (120, 1)])
    }
    plain, spec, engine = both(model, mixed, max_num_batched_tokens=64)
    assert spec == plain
    assert accepted(engine) > 0


def test_greedy_embedded_model():
    prompt = "Repeat the passage exactly.\n" + PASSAGE * 2 + "\nRepeat:"
    requests = {
        "rewrite": (prompt, SamplingParams(temperature=0, max_tokens=48)),
        "count": ("Count: 1, 2, 3, 4, 5, 6, 7,", SamplingParams(temperature=0, max_tokens=30)),
        "short": ("Hi", SamplingParams(temperature=0, max_tokens=8)),
    }
    plain, spec, engine = both(None, requests, max_model_len=2048)
    assert spec == plain
    assert accepted(engine) >= 10  # the passage is copied: most drafts are right
    assert engine.stats.num_steps < make_engine_steps(plain)


def make_engine_steps(outputs: dict[str, dict]) -> int:
    """Steps a run without speculation needs at least: one per token of its longest output."""
    return max(len(o["ids"]) for o in outputs.values())


def test_greedy_under_preemption_and_prefix_caching(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    shared = repetitive(64, 3)
    requests = {f"p{i}": (shared + repetitive(10 + 7 * i, i), greedy) for i in range(6)}
    # 24 blocks of 8 tokens for six requests of 110-150 tokens each: preemptions happen
    options = dict(block_size=8, kv_cache_memory=_kv_bytes(model, 24, 8))
    plain, spec, engine = both(model, requests, **options)
    assert spec == plain
    assert engine.scheduler.num_preemptions > 0
    assert accepted(engine) > 0
    assert engine.scheduler.block_manager.num_hit_tokens > 0


def _kv_bytes(model_dir: str, num_blocks: int, block_size: int) -> int:
    from transformers import AutoConfig

    from infer.worker.engine.forward_batch import KVCache

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * KVCache.bytes_per_block(
        cfg.num_hidden_layers, block_size, cfg.num_key_value_heads, head_dim, torch.float32
    )


def test_prefix_cache_holds_only_accepted_tokens(tiny_model_dir):
    """A second request whose prompt is the first one's prompt + output hits the blocks the first computed,
    and gets the same continuation as without speculation: no rejected draft's KV was ever cached."""
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = make_engine(model, NGRAM, block_size=4)
    first = run(engine, {"a": (repetitive(21), greedy)})["a"]["ids"]
    again = run(engine, {"b": (repetitive(21) + first, greedy)})["b"]["ids"]
    assert engine.scheduler.block_manager.num_hit_tokens >= 56
    plain = run(make_engine(model, None, block_size=4), {"b": (repetitive(21) + first, greedy)})["b"]["ids"]
    assert again == plain


def test_stop_strings_eos_and_max_tokens_cut_an_accepted_run():
    prompt = "Repeat the passage exactly.\n" + PASSAGE * 2 + "\nRepeat:"
    requests = {
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=60, stop=["lazy dog"])),
        "stop-incl": (
            prompt,
            SamplingParams(temperature=0, max_tokens=60, stop=["jumps"], include_stop_str_in_output=True),
        ),
        "max": (prompt, SamplingParams(temperature=0, max_tokens=7)),
        "ids": (prompt, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[4413])),
    }
    plain, spec, engine = both(None, requests, max_model_len=2048)
    assert spec == plain
    assert spec["stop"]["reason"] == "stop" and "lazy dog" not in spec["stop"]["text"]
    assert spec["stop-incl"]["text"].endswith("jumps") and spec["stop-incl"]["reason"] == "stop"
    assert len(spec["max"]["ids"]) == 7 and spec["max"]["reason"] == "length"
    assert accepted(engine) > 0


def test_abort_mid_stream_frees_everything(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    requests = {"keep": (repetitive(20), greedy), "drop": (repetitive(25, 1), greedy)}
    engine = make_engine(model, NGRAM)
    out = run(engine, requests, abort_after={"drop": 9})
    assert out["drop"]["reason"] == "abort" and 9 <= len(out["drop"]["ids"]) < 60
    plain = run(make_engine(model, None), {"keep": requests["keep"]})
    assert out["keep"]["ids"] == plain["keep"]["ids"]


def test_logprobs_and_penalties_as_without_speculation(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    requests = {
        "lp": (repetitive(30), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)),
        "pen": (
            repetitive(30, 1),
            SamplingParams(
                temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.3, repetition_penalty=1.1
            ),
        ),
        "bias": (
            repetitive(30, 2),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={20: 5.0}, min_tokens=10),
        ),
        "off": (
            repetitive(30, 3),
            SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, disable_speculative_decoding=True),
        ),
    }
    plain, spec, engine = both(model, requests)
    for rid in requests:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
        for a, b in zip(spec[rid]["logprobs"], plain[rid]["logprobs"]):
            assert a.keys() == b.keys() and all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a), rid
    assert len(spec["lp"]["logprobs"]) == 30
    assert accepted(engine) > 0


def test_opt_out_and_large_batches_do_not_speculate(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine = make_engine(model, NGRAM)
    run(
        engine,
        {
            "a": (
                repetitive(30),
                SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, disable_speculative_decoding=True),
            )
        },
    )
    assert engine.stats.spec_decode_num_drafts == 0
    engine = make_engine(model, {**NGRAM, "disable_by_batch_size": 2})
    run(engine, {f"r{i}": (repetitive(30, i), greedy) for i in range(3)})  # 3 decode together: no drafts
    assert engine.stats.spec_decode_num_drafts == 0
    run(engine, {"alone": (repetitive(30), greedy)})
    assert engine.stats.spec_decode_num_drafts > 0


def test_structured_outputs_with_speculation(tiny_model_dir):
    # (the 21 grammars queue at once on each engine's one compile thread: the time queued does not count against a
    # compile's bound, so on a loaded machine the last ones are late, not failed)
    model = str(tiny_model_dir("llama"))
    requests = {
        name: (
            [3, 17, 42, 99],
            SamplingParams(temperature=t, seed=7, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=schema)),
        )
        for name, schema in SCHEMAS.items()
        for t in (0.0,)
    }
    requests["choice"] = (
        [3, 17, 42, 99],
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=Spec(choice=["yes yes yes", "no"])),
    )
    requests["sampled"] = (
        [3, 17, 42, 99],
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=MAX_TOKENS, structured_outputs=Spec(json=SCHEMAS[next(iter(SCHEMAS))])
        ),
    )
    plain, spec, engine = both(
        model, requests, max_num_seqs=64, max_model_len=512, spec={**NGRAM, "disable_by_batch_size": 64}
    )
    assert spec == plain
    for name, schema in SCHEMAS.items():
        assert spec[name]["reason"] == "stop", (name, spec[name])
        json.loads(spec[name]["text"])
    assert engine.stats.spec_decode_num_drafts > 0


# ---- sampling ----------------------------------------------------------------------------------------


def test_seeded_sampling_is_the_same_with_and_without_speculation(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    requests = {
        f"s{i}": (
            repetitive(25, i % 3),
            SamplingParams(temperature=t, top_p=p, seed=100 + i, max_tokens=30, ignore_eos=True),
        )
        for i, (t, p) in enumerate([(0.3, 1.0), (0.7, 0.9), (1.0, 1.0), (0.2, 0.8)])
    }
    plain, spec, engine = both(model, requests)
    again = run(make_engine(model, NGRAM), requests)
    assert spec == plain == again
    assert accepted(engine) > 0


VOCAB = 16


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory, smollm2_tokenizer):
    """A Llama with 16 tokens (SmolLM2's tokenizer, of which it uses ids 0-15) whose next token depends on the
    last one alone (attention and MLP add nothing): after token a, a + 1 (mod 16) has logit 2.5 above a random
    spread over the others, so drafts copied from a counting prompt are right about half the time."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=VOCAB,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))  # RMSNorm makes row a 4 * one-hot(a)
        head = torch.rand(VOCAB, VOCAB, generator=generator) * 0.4  # head[b, a]: logit of b after a, / 4
        for a in range(VOCAB):
            head[(a + 1) % VOCAB, a] += 2.5 / 4
        model.lm_head.weight.copy_(head)
    path = tmp_path_factory.mktemp("vocab16")
    model.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    return path, model


def test_sampled_distribution_is_the_targets(small_vocab_model):
    """Chi-square over the joint (t1, t2, t3) of 3000 seeded samples with speculation on, against the exact
    target distribution from transformers' forward. Seeds are fixed, so the statistic is one number: no flake;
    the bound is the 1e-6 tail of the chi-square distribution. A broken verifier (one that accepts every draft)
    moves mass to the drafts; the same statistic is checked to reject that."""
    path, hf = small_vocab_model
    prompt = list(range(3, 16)) + list(range(16)) + [0]
    n, num_new = 3000, 4
    engine = make_engine(
        str(path),
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 2,
            "prompt_lookup_min": 1,
            "disable_by_batch_size": 4096,
        },
        max_num_seqs=512,
        max_model_len=64,
        kv_cache_memory=16 << 20,
    )
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=num_new, ignore_eos=True) for s in range(n)]
    out = run(engine, {f"r{s}": (prompt, p) for s, p in enumerate(params)})
    assert engine.stats.spec_decode_num_drafts > n // 2 and accepted(engine) > n // 4
    observed: dict[tuple, int] = {}
    for o in out.values():
        observed[tuple(o["ids"])] = observed.get(tuple(o["ids"]), 0) + 1
    expected = _joint(_transitions(hf), prompt[-1], num_new)
    stat, dof = _chi_square(observed, expected, n)
    assert stat < _chi_square_bound(dof), (stat, dof)
    # the statistic has power: all-accepting drafts would be far off
    biased = {k: v for k, v in observed.items()}
    drafted = tuple(ngram_drafts(prompt, 1, 2, num_new))
    biased[drafted] = biased.get(drafted, 0) + n // 5
    assert _chi_square(biased, expected, n + n // 5)[0] > _chi_square_bound(dof)


def _transitions(hf) -> list[list[float]]:
    """P(b | last token a) from transformers' float32 forward (the model looks at the last token alone)."""
    with torch.inference_mode():
        return [hf(torch.tensor([[a]])).logits[0, -1].double().softmax(-1).tolist() for a in range(VOCAB)]


def _joint(transitions: list[list[float]], last: int, num_new: int) -> dict[tuple, float]:
    """P(t1..t_num_new) after a context ending in `last`, for every sequence."""
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(num_new):
        probs = {
            seq + (b,): p * q for seq, p in probs.items() for b, q in enumerate(transitions[seq[-1] if seq else last])
        }
    return probs


def _chi_square(observed: dict[tuple, int], expected: dict[tuple, float], n: int) -> tuple[float, int]:
    """Pearson's statistic over cells of expected count >= 5, the rest pooled into one cell."""
    stat, cells, rest_obs, rest_exp = 0.0, 0, 0, 0.0
    for key, p in expected.items():
        e, o = p * n, observed.get(key, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            cells += 1
        else:
            rest_obs, rest_exp = rest_obs + o, rest_exp + e
    stat += (rest_obs - rest_exp) ** 2 / rest_exp
    return stat, cells


def _chi_square_bound(dof: int) -> float:
    """An upper bound on the chi-square(dof) quantile at 1 - 1e-6 (Wilson-Hilferty with z = 4.9)."""
    z = 4.9
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# ---- the option reaches every launcher's workers -----------------------------------------------------------


def test_speculative_config_flag_on_worker_serve_llm_and_slurm():
    import importlib.util
    import sys
    from pathlib import Path

    from infer.client.llm import LLMOptions
    from infer.client.serve import build_parser as serve_parser
    from infer.client.serve import worker_args
    from infer.worker.service.cli import build_parser as worker_parser
    from infer.worker.service.cli import engine_config

    text = json.dumps(NGRAM)
    expected = SpeculativeConfig.of(NGRAM)

    def worker_config(argv: list[str]) -> EngineConfig:
        return engine_config(worker_parser().parse_args(["--coordinator", "tcp://h:1", *argv]))

    assert worker_config(["--speculative-config", text]).speculative_config == expected
    with pytest.raises(SystemExit):  # argparse: exit 2, with the precise message on stderr
        worker_parser().parse_args(["--coordinator", "tcp://h:1", "--speculative-config", '{"method": "x"}'])
    served = worker_args(serve_parser().parse_args(["--speculative-config", text]), [])
    assert worker_config(served).speculative_config == expected
    options = LLMOptions(engine_options={"speculative_config": NGRAM})  # LLM(use_coordinator=True, ...)
    assert worker_config(options.engine_flags()).speculative_config == expected
    path = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "launch.py"
    spec = importlib.util.spec_from_file_location("infer_slurm_launch_spec", path)
    launch = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = launch  # its dataclasses look their module up
    spec.loader.exec_module(launch)

    own, extra = launch.split_extra(["--model", "/m", "--speculative-config", text])
    args, unknown = launch.head_parser().parse_known_args(own)
    env = launch.SlurmEnv.from_environ(
        {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "localhost", "SLURMD_NODENAME": "localhost"}
    )
    plan = launch.plan_head(args, unknown + extra, ["localhost"], env)
    worker = plan.srun[plan.srun.index("worker") + 1 :]
    own, extra = launch.split_extra(worker)
    wargs, unknown = launch.worker_parser().parse_known_args(own)
    command = launch.worker_argv(wargs, unknown + extra, 0, ["localhost"], [1])
    assert worker_config(command[5:]).speculative_config == expected


def test_counters_travel_in_the_load_and_reach_metrics(tiny_model_dir):
    from infer.client.api.metrics import FrontMetrics
    from infer.protocol.messages import ClusterStats, StepBatch, WorkerStats, decode, encode

    engine = make_engine(str(tiny_model_dir("llama")), NGRAM)
    run(engine, {"a": (repetitive(30), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))})
    stats = engine.stats
    load = decode(encode(StepBatch(deltas=[], load=engine.load()))).load
    assert load.spec_decode_num_drafts == stats.spec_decode_num_drafts > 0
    assert load.spec_decode_num_accepted_tokens == stats.spec_decode_num_accepted_tokens > 0
    per_pos = load.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == load.spec_decode_num_accepted_tokens and per_pos == sorted(per_pos, reverse=True)
    worker = WorkerStats(
        worker_id="w",
        dp_rank=0,
        group_id="g",
        healthy=True,
        num_kv_blocks=1,
        block_size=16,
        max_num_seqs=1,
        max_model_len=64,
        requests_routed=1,
        num_in_flight=0,
        seconds_since_heard=0.0,
        load=load,
    )
    cluster = ClusterStats(
        coordinator_id="c",
        state="running",
        policy="p",
        model_id="m",
        workers=[worker],
        num_clients=0,
        num_in_flight=0,
        num_held=0,
        requests_submitted=0,
        requests_completed=0,
        requests_failed=0,
        requests_aborted=0,
        requests_redispatched=0,
        frames_rejected=0,
        uptime_s=1.0,
    )
    text = FrontMetrics("m").exposition(cluster).decode()
    assert f'infer:spec_decode_num_drafts_total{{model_name="m"}} {float(load.spec_decode_num_drafts)}' in text
    assert (
        f'infer:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(load.spec_decode_num_accepted_tokens)}'
    ) in text
    assert (
        f'infer:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(per_pos[0])}'
        in text
    )


def test_llm_takes_speculative_config_and_the_context_bounds_drafts(tiny_model_dir):
    """LLM(speculative_config=...) (AsyncLLM shares its options) gives the same output as without; requests
    that end at the context length draft only what fits."""
    from infer import LLM

    model = str(tiny_model_dir("llama"))
    prompts = [repetitive(40, i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to the context (64)
    options = dict(dtype="float32", max_model_len=64, kv_cache_memory=8 << 20)
    plain = LLM(model=model, **options).generate(prompts, params, use_tqdm=False)
    llm = LLM(model=model, speculative_config=NGRAM, **options)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for c in spec)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=model, speculative_config={"method": "ngram"}, **options)


# ---- a draft model ----------------------------------------------------------------------------------------


def test_draft_model_greedy_and_seeded_equal_without_speculation(tiny_model_dir, tiny_weights_b):
    """A draft model of the target's own weights drafts (almost) only right tokens; one of other weights mostly
    wrong ones: either way the output is the target's, greedy and seeded, at batch 1 and mixed; the draft's
    pool is empty once the requests end."""
    model = str(tiny_model_dir("llama"))
    requests = {
        f"g{i}": (repetitive(n, i), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        for i, n in enumerate([5, 40, 130])
    }
    requests["s"] = (repetitive(20, 4), SamplingParams(temperature=0.8, seed=11, max_tokens=30, ignore_eos=True))
    plain = run(make_engine(model, None, max_num_batched_tokens=64), requests)
    for draft, min_rate in ((model, 0.8), (str(tiny_weights_b("llama")), 0.0)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        engine = make_engine(model, spec, max_num_batched_tokens=64)
        assert run(engine, requests) == plain
        stats = engine.stats
        drafted, accepted_before = stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens
        assert drafted > 0
        assert run(engine, {"alone": requests["g1"]})["alone"] == plain["g1"]  # greedy: drafts are its argmax
        alone_drafted = stats.spec_decode_num_draft_tokens - drafted
        assert alone_drafted > 0 and stats.spec_decode_num_accepted_tokens - accepted_before >= min_rate * alone_drafted
        proposer = engine.proposer
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks and not proposer._seqs


def test_draft_model_config_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.of({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'prompt_lookup_max' is an option of method 'ngram'"):
        SpeculativeConfig.of(
            {"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
        )
    with pytest.raises(ValueError, match="'model' is an option of method 'draft_model'"):
        SpeculativeConfig.of({"method": "ngram", "model": "/m", "num_speculative_tokens": 2})
    config = SpeculativeConfig.of({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2})
    assert SpeculativeConfig.of(str(config)) == config
    with pytest.raises(ValueError, match="vocabulary"):  # the 16-token model cannot draft for a 49k one
        make_engine(
            str(tiny_model_dir("llama")),
            {"method": "draft_model", "num_speculative_tokens": 2, "model": str(_vocab16_dir(tiny_model_dir))},
        )


def _vocab16_dir(tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_model_dir("llama").parent / "draft-vocab16"
    if not path.exists():
        config = AutoConfig.for_model(
            "llama",
            vocab_size=16,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
        )
        AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    return path


def test_tensor_parallel_group_verifies_in_lockstep(tiny_model_dir):
    """TP rank 0 schedules and verifies; its follower runs the same verification forwards (the ForwardBatch it
    is sent): the output equals one process without speculation."""
    from infer import LLM

    path = str(tiny_model_dir("llama"))
    prompts = [repetitive(30, i) for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(dtype="float32", max_model_len=128, kv_cache_memory=4_000_000, num_threads=1)
    want = [c.token_ids for c in LLM(model=path, **options).generate(prompts, params, use_tqdm=False)]
    with LLM(model=path, tensor_parallel_size=2, speculative_config=NGRAM, **options) as llm:
        assert [c.token_ids for c in llm.generate(prompts, params, use_tqdm=False)] == want
        assert llm.engine.stats.spec_decode_num_accepted_tokens > 0
