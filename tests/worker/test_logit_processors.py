"""Per-request logit processors in the sampler: logit_bias, allowed_token_ids and bad_words, exact outcomes in
mixed batches (greedy and sampled rows), and their validation in SamplingParams."""

from __future__ import annotations

import pytest
import torch

from infer.protocol.sampling import SamplingParams
from infer.worker.engine.request import Request
from infer.worker.engine.sampler import Sampler, SamplingMetadata

V = 12


def request(rid: str, output: list[int] = (), bad_words: list[list[int]] = (), **params) -> Request:
    r = Request(
        request_id=rid,
        prompt_token_ids=[5, 6],
        params=SamplingParams(max_tokens=None, **params),
        bad_words_token_ids=[list(w) for w in bad_words],
    )
    for t in output:
        r.append_token(t)
    return r


def tokens(requests: list[Request], logits: torch.Tensor | None = None) -> list[int]:
    logits = torch.arange(V, dtype=torch.float32).repeat(len(requests), 1) if logits is None else logits
    return Sampler().sample(logits, SamplingMetadata.build(requests, V)).token_ids.tolist()


def test_logit_bias_moves_the_argmax_per_row_and_leaves_other_rows_alone():
    rows = [
        request("a", temperature=0, logit_bias={3: 100.0}),
        request("b", temperature=0),
        request("c", temperature=0, logit_bias={11: -100.0, 10: -100.0}),
    ]
    assert tokens(rows) == [3, 11, 9]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    rows = [request("a", temperature=0, allowed_token_ids=[1, 4]), request("b", temperature=0)]
    rows += [request(f"s{i}", temperature=1.0, seed=i, allowed_token_ids=[0, 2]) for i in range(40)]
    out = tokens(rows)
    assert out[:2] == [4, 11] and set(out[2:]) <= {0, 2} and set(out[2:]) == {0, 2}


def test_bad_words_ban_a_single_token_always_and_a_sequence_only_after_its_prefix():
    single = request("a", temperature=0, bad_words=[[11]])
    prefix_absent = request("b", temperature=0, output=[3], bad_words=[[7, 11]])
    prefix_present = request("c", temperature=0, output=[1, 7], bad_words=[[7, 11], [8, 9, 10]])
    assert tokens([single, prefix_absent, prefix_present]) == [10, 11, 10]


def test_processors_compose_with_min_tokens_and_keep_rows_without_them_on_the_fast_path():
    meta = SamplingMetadata.build([request("a", temperature=0)], V)
    assert meta.fast_greedy
    r = request(
        "a", temperature=0, min_tokens=1, stop_token_ids=[10], logit_bias={11: -50.0}, allowed_token_ids=[9, 10, 11]
    )
    assert tokens([r]) == [9]


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(logit_bias={1: 100.5}), r"logit_bias values must be in \[-100, 100\]"),
        (dict(logit_bias={-2: 1}), "logit_bias token ids must be >= 0"),
        (dict(logit_bias={"x": 1}), "logit_bias must be an integer"),
        (dict(logit_bias={i: 1 for i in range(1025)}), "logit_bias may hold at most 1024 entries"),
        (dict(logit_bias={1: float("nan")}), "logit_bias must be a number"),
        (dict(allowed_token_ids=[]), "allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=[1, -1]), "allowed_token_ids token ids must be >= 0"),
        (dict(allowed_token_ids="12"), "allowed_token_ids must be a list"),
        (dict(bad_words=["ok", " "]), "bad_words must hold non-blank strings"),
        (dict(bad_words=["x" * 257]), "each bad word may be at most 256 characters"),
    ],
)
def test_invalid_processor_options_are_refused_naming_the_field(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_processor_options_round_trip_the_wire_form_and_stay_hashable():
    params = SamplingParams(logit_bias={"7": 2.5, 3: -1.0}, allowed_token_ids=[3, 7], bad_words=["no"])
    assert params.logit_bias == ((3, -1.0), (7, 2.5))
    again = SamplingParams.from_dict(params.to_dict())
    assert again == params and hash(again) == hash(params)
