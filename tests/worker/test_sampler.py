"""Sampler: exact outcomes for greedy, filters, penalties, min_tokens, seeds and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.request import Request
from infer.worker.engine.sampler import Sampler, SamplingMetadata, apply_penalties

EOS = 2


def request(
    request_id: str = "r0", prompt: list[int] | None = None, output: list[int] | None = None, **params
) -> Request:
    prompt = [5, 6, 7] if prompt is None else prompt
    params.setdefault("max_tokens", None)
    r = Request(
        request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(**params), eos_token_ids=frozenset({EOS})
    )
    for t in output or []:
        r.append_token(t)
    return r


def sample(sampler: Sampler, logits: torch.Tensor, requests: list[Request]):
    return sampler.sample(logits, SamplingMetadata.build(requests, logits.shape[1], "cpu"))


def random_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_is_argmax():
    logits = random_logits(8, 100, seed=0)
    # below 1e-5 a temperature counts as greedy (dividing by it would overflow)
    out = sample(Sampler(), logits, [request(f"r{i}", temperature=0.0 if i % 2 else 1e-6) for i in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.sampled_logprobs is None


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    n = 20000
    logits = probs.log().expand(n, -1).contiguous()
    out = sample(Sampler(seed=1), logits, [request(f"r{i}", temperature=temperature) for i in range(n)])
    target = torch.softmax(probs.log() / temperature, -1)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1e-4; the draw is seeded, so this is deterministic.
    assert chi_square(out.token_ids, target) < 25


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(16, 500, seed=2)
    top_k = sample(Sampler(), logits, [request(f"r{i}", top_k=1) for i in range(16)])
    top_p = sample(Sampler(), logits, [request(f"r{i}", top_p=1e-6) for i in range(16)])
    assert torch.equal(top_k.token_ids, logits.argmax(-1))
    assert torch.equal(top_p.token_ids, logits.argmax(-1))


def test_top_k_and_top_p_sample_only_their_sets():
    probs = torch.tensor([0.35, 0.3, 0.2, 0.1, 0.05])
    n = 6000
    logits = probs.log().expand(n, -1).contiguous()
    third = n // 3
    rows = (
        [request(f"k{i}", top_k=2) for i in range(third)]
        + [request(f"p{i}", top_p=0.8) for i in range(third)]
        + [request(f"kp{i}", top_k=3, top_p=0.7) for i in range(third)]
    )
    tokens = sample(Sampler(seed=3), logits, rows).token_ids
    top_k, top_p, both = tokens[:third], tokens[third : 2 * third], tokens[2 * third :]
    assert set(top_k.tolist()) == {0, 1}
    assert chi_square(top_k, torch.tensor([0.35, 0.3]) / 0.65) < 20
    assert set(top_p.tolist()) == {0, 1, 2}  # 0.35 + 0.3 < 0.8 <= 0.35 + 0.3 + 0.2
    # top-p over the top-3 renormalized: 0.35 / 0.85 < 0.7 <= (0.35 + 0.3) / 0.85
    assert set(both.tolist()) == {0, 1}


def test_min_p_removes_low_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    n = 10000
    logits = probs.log().expand(n, -1).contiguous()
    tokens = sample(Sampler(seed=4), logits, [request(f"r{i}", min_p=0.1) for i in range(n)]).token_ids
    assert set(tokens.tolist()) == {0, 1, 2}  # 0.04 and 0.01 < 0.1 * 0.5
    assert chi_square(tokens, torch.tensor([0.5, 0.3, 0.15]) / 0.95) < 20


def test_penalties_follow_the_formulas():
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0], [0.2, 0.4, -1.0, -3.0, 1.5, 0.0]])
    rows = [
        request(
            "a",
            prompt=[0, 1],
            output=[3, 3, 4],
            repetition_penalty=1.5,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            temperature=0.0,
        ),
        request("b", prompt=[5], output=[2], presence_penalty=-1.0, temperature=0.0),
    ]
    meta = SamplingMetadata.build(rows, 6, "cpu")
    expected = logits.clone().tolist()
    for i, r in enumerate(rows):
        p = r.params
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            x = expected[i][t]
            expected[i][t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(r.output_token_ids):
            count = r.output_token_ids.count(t)
            expected[i][t] -= p.presence_penalty + p.frequency_penalty * count
    assert meta.penalties is not None
    penalized = apply_penalties(logits, meta.penalties)
    torch.testing.assert_close(penalized, torch.tensor(expected), rtol=0, atol=1e-6)
    # by hand for row a: token 3 = 0.5 / 1.5 - 0.5 - 0.25 * 2; token 1 = -2 * 1.5 (prompt only)
    assert penalized[0, 3].item() == pytest.approx(0.5 / 1.5 - 1.0)
    assert penalized[0, 1].item() == pytest.approx(-3.0)
    assert penalized[1, 2].item() == pytest.approx(0.0)  # presence -1 on an output token: -1 + 1
    out = Sampler().sample(logits, meta)
    assert torch.equal(out.token_ids, torch.tensor(expected).argmax(-1))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 10)
    logits[0, EOS], logits[0, 7], logits[0, 4] = 5.0, 4.0, 3.0

    def greedy_token(**kw) -> int:
        return int(sample(Sampler(), logits, [request(temperature=0.0, **kw)]).token_ids[0])

    assert greedy_token(min_tokens=2, stop_token_ids=[7]) == 4
    assert greedy_token(min_tokens=2, stop_token_ids=[7], output=[9, 9]) == EOS  # min_tokens reached
    assert greedy_token(min_tokens=2, stop_token_ids=[7], ignore_eos=True) == EOS  # EOS allowed, 7 still not
    logits[0, EOS] = -1.0
    assert greedy_token(min_tokens=2, stop_token_ids=[7], ignore_eos=True) == 4
    # sampled rows too: with EOS and 7 masked, only token 4 has weight
    many = torch.full((200, 10), -100.0)
    many[:, EOS], many[:, 7], many[:, 4] = 50.0, 50.0, 0.0
    tokens = sample(Sampler(), many, [request(f"r{i}", min_tokens=1, stop_token_ids=[7]) for i in range(200)])
    assert set(tokens.token_ids.tolist()) == {4}


def _mixed_batch(target: Request, position: int, size: int) -> list[Request]:
    """`target` at `position` among seeded, unseeded and greedy requests with assorted filters."""
    others = []
    for i in range(size - 1):
        kind = i % 4
        kw: dict = {"temperature": 0.0} if kind == 0 else {"temperature": 0.7 + 0.1 * kind}
        if kind == 1:
            kw.update(seed=1000 + i, top_p=0.9)
        elif kind == 2:
            kw.update(top_k=20, min_p=0.05)
        elif kind == 3:
            kw.update(seed=2000 + i, frequency_penalty=0.3, logprobs=2)
        others.append(request(f"o{i}", **kw))
    return others[:position] + [target] + others[position:]


@pytest.mark.parametrize(
    "target_params",
    [
        {"seed": 42, "temperature": 0.9},
        {"seed": 7, "temperature": 1.2, "top_k": 50, "top_p": 0.95, "min_p": 0.01, "repetition_penalty": 1.2},
    ],
)
def test_seeded_request_is_batch_invariant(target_params):
    vocab, steps = 300, 25
    alone_sampler, batch_sampler = Sampler(seed=0), Sampler(seed=123)
    alone, in_batch = request("t", **target_params), request("t", **target_params)
    batch = _mixed_batch(in_batch, position=13, size=32)
    for step in range(steps):
        row = random_logits(1, vocab, seed=step)
        t_alone = int(sample(alone_sampler, row, [alone]).token_ids[0])
        logits = random_logits(32, vocab, seed=10_000 + step)
        logits[13] = row[0]
        tokens = sample(batch_sampler, logits, batch).token_ids.tolist()
        assert tokens[13] == t_alone, f"step {step}"
        alone.append_token(t_alone)
        for r, t in zip(batch, tokens):
            r.append_token(t)


def test_seeded_stream_follows_seed_and_output_count():
    """A seeded request's noise is a function of (seed, tokens generated so far): a new request with the
    same seed replays the stream, another seed does not, and the sampler keeps no state for it."""
    vocab, steps = 1000, 20
    logits = torch.zeros(1, vocab)  # uniform: any difference comes from the noise

    def run(sampler: Sampler, r: Request) -> list[int]:
        for _ in range(steps):
            r.append_token(int(sample(sampler, logits, [r]).token_ids[0]))
        return r.output_token_ids

    first = run(Sampler(seed=0), request("a", seed=1))
    assert run(Sampler(seed=99), request("b", seed=1)) == first
    assert run(Sampler(seed=0), request("a", seed=2)) != first
    assert len(set(first)) > steps // 2  # the offset moves the stream on at every token


def test_unseeded_requests_draw_a_seed_until_release():
    vocab, steps = 1000, 20
    logits = torch.zeros(1, vocab)

    def run(sampler: Sampler, request_id: str) -> list[int]:
        r = request(request_id)
        for _ in range(steps):
            r.append_token(int(sample(sampler, logits, [r]).token_ids[0]))
        return r.output_token_ids

    sampler = Sampler(seed=5)
    first = run(sampler, "u")
    assert run(Sampler(seed=5), "u") == first  # the engine's seed makes unseeded runs reproducible
    assert run(sampler, "u") == first  # the drawn seed is kept while the request lives
    sampler.release("u")
    assert run(sampler, "u") != first  # released: a new request under that id draws afresh
    assert run(Sampler(seed=6), "u") != first


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = random_logits(4, 200, seed=5)
    rows = [
        request("a", logprobs=3, temperature=0.8, repetition_penalty=1.3, output=[1, 2]),
        request("b"),
        request("c", logprobs=0, temperature=0.0),
        request("d", logprobs=5, seed=3, presence_penalty=1.0, output=[7]),
    ]
    raw = logits.clone()
    out = sample(Sampler(), logits, rows)
    assert torch.equal(logits, raw)  # the input is left alone
    expected = torch.log_softmax(raw, -1)
    assert out.top_ids is not None and out.top_logprobs is not None and out.sampled_logprobs is not None
    assert out.top_ids.shape == (4, 5)
    for i, n in [(0, 3), (2, 0), (3, 5)]:
        token = int(out.token_ids[i])
        assert out.sampled_logprobs[i].item() == pytest.approx(expected[i, token].item(), abs=1e-5)
        values, ids = expected[i].topk(n)
        assert out.top_ids[i, :n].tolist() == ids.tolist()
        torch.testing.assert_close(out.top_logprobs[i, :n], values)
        assert out.top_logprobs[i].tolist() == sorted(out.top_logprobs[i].tolist(), reverse=True)
    assert math.isnan(out.sampled_logprobs[1].item()) and out.top_ids[1].tolist() == [-1] * 5


def test_all_greedy_fast_path_matches_general_path():
    logits = random_logits(6, 400, seed=6)
    greedy = [request(f"r{i}", temperature=0.0) for i in range(6)]
    meta = SamplingMetadata.build(greedy, 400, "cpu")
    assert meta.fast_greedy and meta.no_penalties
    fast = Sampler().sample(logits, meta).token_ids
    # one row asking for logprobs sends the same batch down the general path
    general_rows = greedy[:5] + [request("r5", temperature=0.0, logprobs=1)]
    general_meta = SamplingMetadata.build(general_rows, 400, "cpu")
    assert not general_meta.fast_greedy and general_meta.all_greedy
    general = Sampler().sample(logits, general_meta).token_ids
    assert torch.equal(fast, general) and torch.equal(fast, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = random_logits(8, 50, seed=8)
    rows = [request(f"r{i}", temperature=0.0 if i % 2 else 1.0, top_k=1 if i % 2 == 0 else -1) for i in range(8)]
    meta = SamplingMetadata.build(rows, 50, "cpu")
    assert not meta.all_greedy and not meta.all_random and meta.num_random_rows == 4
    out = Sampler().sample(logits, meta)
    assert torch.equal(out.token_ids, logits.argmax(-1))  # greedy rows and top_k=1 rows alike
