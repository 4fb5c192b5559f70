"""SamplingParams refuse what the sampler cannot compute: every float is checked as the float32 the sampler
uses (1e-50 is 0 there, 1e39 is inf), and the message names the field. Found by an in-process sweep: a
repetition penalty of 1e-50 passed `> 0`, became 0 in float32 and turned logits into inf / NaN."""

from __future__ import annotations

import math

import msgpack
import pytest

from infer.protocol.messages import PROTOCOL_VERSION, ProtocolError, RequestSpec, Submit, decode
from infer.protocol.sampling import MAX_REPETITION_PENALTY, MAX_TOP_K, MIN_REPETITION_PENALTY, SamplingParams

POISON = dict(temperature=1.0, top_p=0.5, repetition_penalty=1e-50)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (POISON, "repetition_penalty"),
        (dict(repetition_penalty=5e-324), "repetition_penalty"),
        (dict(repetition_penalty=MIN_REPETITION_PENALTY / 2), "repetition_penalty"),
        (dict(repetition_penalty=MAX_REPETITION_PENALTY * 2), "repetition_penalty"),
        (dict(repetition_penalty=math.inf), "repetition_penalty"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature=1e39), "temperature"),  # finite in float64, inf in float32
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=1e-50), "top_p"),  # > 0, but 0 in float32
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=math.inf), "min_p"),
        (dict(presence_penalty=-math.inf), "presence_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(top_k=MAX_TOP_K + 1), "top_k"),
        (dict(top_k=2**64), "top_k"),
    ],
)
def test_values_outside_the_float32_domain_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_poison_cannot_travel_in_a_submit_either():
    frame = msgpack.packb(
        {
            "type": "submit",
            "v": PROTOCOL_VERSION,
            "body": {"request_id": "r", "spec": {"prompt": "x", "sampling": dict(POISON)}},
        }
    )
    with pytest.raises(ProtocolError, match="field 'spec.sampling.repetition_penalty': repetition_penalty must be in"):
        decode(frame)
    with pytest.raises(ProtocolError, match="must be SamplingParams"):
        Submit(request_id="r", spec=RequestSpec(prompt="x", sampling=dict(POISON)))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(repetition_penalty=MIN_REPETITION_PENALTY),
        dict(repetition_penalty=MAX_REPETITION_PENALTY),
        dict(temperature=1e-30),
        dict(temperature=1e30),
        dict(top_p=1e-30),
        dict(min_p=1e-40),
        dict(min_p=1.0),
        dict(top_k=MAX_TOP_K),
        dict(presence_penalty=-2.0, frequency_penalty=2.0),
        dict(temperature=0, repetition_penalty=1.2),
    ],
)
def test_extreme_but_representable_values_are_accepted(kwargs):
    assert SamplingParams.from_dict(SamplingParams(**kwargs).to_dict()) == SamplingParams(**kwargs)
