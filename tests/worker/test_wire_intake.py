"""Generative tests of the worker's intakes (issue 43): any frame from its coordinator's socket, valid or hostile
(tests/wire_frames.py), between the steps of a request it runs. `on_frame` raises nothing but WorkerExit (a
Refused, a stop: the worker's own decision on what it was told), answers what it cannot use with an Error, and
the request in flight streams exactly the tokens it streams alone."""

from __future__ import annotations

import msgpack
from hypothesis import assume, example, given
from hypothesis import strategies as st

from infer.protocol.messages import (
    Abort,
    CommitWeights,
    Control,
    Dispatch,
    LoraCommand,
    Refused,
    UpdateWeights,
    Welcome,
    decode,
)
from infer.worker.parallel.tp_commands import BadCommand, parse_command
from tests.wire_frames import ISSUE_43_FRAMES, VALUES, frames
from tests.worker_harness import WorkerHarness, deltas, dispatch

# What a coordinator may legitimately tell a worker to change or end: its lifecycle, its registration, its weights
# and adapters, a request's abort. Valid frames of these kinds are instructions, not input to survive.
INSTRUCTIONS = (Control, Refused, Welcome, UpdateWeights, CommitWeights, LoraCommand, Abort, Dispatch)
PROMPT, MAX_TOKENS = [5, 6, 7], 12
ALONE = [(len(PROMPT) + i) % 1000 for i in range(MAX_TOKENS)]  # BenchmarkEngine's tokens for it


def _instruction(frame: bytes) -> bool:
    try:
        return isinstance(decode(frame), INSTRUCTIONS)
    except Exception:  # noqa: BLE001 - a frame decode refuses (by its contract a ProtocolError, but the filter
        # must not be where a codec bug shows up: the intake under test is)
        return False


@given(st.lists(frames(), min_size=1, max_size=3))
@example(ISSUE_43_FRAMES)
def test_no_frame_ends_the_worker_and_a_request_in_flight_streams_exactly(hostile):
    assume(not any(map(_instruction, hostile)))
    h = WorkerHarness()
    h.welcome()
    h.send(dispatch("bystander", PROMPT, max_tokens=MAX_TOKENS))
    streamed = []
    for frame in hostile:
        h.raw([frame])  # raises if anything but a Refused / stop escaped
        streamed += [d for d in deltas(h.step()) if d.request_id == "bystander"]
    streamed += [d for d in h.run_until_finished() if d.request_id == "bystander"]
    assert [t for d in streamed for t in d.token_ids] == ALONE
    assert streamed[-1].finish_reason == "length"


def test_a_nested_frame_is_answered_with_the_bound_it_broke():
    h = WorkerHarness()
    h.welcome()
    answer = h.raw([b"\x83\xa4type\xa8dispatch\xa1v" + b"\x91" * 1000 + b"\x04\xa4body\x80"])
    assert [m.message for m in answer if m.TYPE == "error"] == ["frame refused: nesting deeper than 32 levels"]


@given(st.one_of(frames(), st.builds(msgpack.packb, st.fixed_dictionaries({"op": VALUES}, optional={"x": VALUES}))))
@example(b"\x81\xa2op\x90")  # an op that is a list (found by this test: TypeError, unhashable)
@example(b"\x81\xa2op" + b"\x91" * 5000 + b"\x04")
def test_a_tp_follower_takes_only_commands_from_its_channel(frame):
    """The TP / PP command channel's intake (worker/parallel/tp_commands.py): a frame is a command rank 0 sends (a map with
    a known op) or BadCommand, which the follower drops with a log line; never another error."""
    try:
        command = parse_command(frame)
    except BadCommand:
        return
    assert isinstance(command, dict) and command["op"] in {"forward", "lora_copy_in", "logits", "dummy", "stop", "ping"}
