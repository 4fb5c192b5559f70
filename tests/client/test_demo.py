"""The main job (`bash deploy/local/run.sh` runs `python -m infer.client.demo`), as a new user runs it: no flags.

The README promises what it shows: a local cluster of two workers on the embedded model answering four chat
prompts (the first one streamed: "The capital of France is Paris."), every answer ending by itself rather than
looping to max_tokens, then one chat completion streamed through the HTTP front.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in one sentence.",
]


def _answers(output: str) -> dict[str, str]:
    """Each `>>> question` line of the demo's output and the text up to the next blank-line-separated block."""
    answers = {}
    for block in re.split(r"\n(?=>>> )", output):
        if block.startswith(">>> "):
            question, _, answer = block[4:].partition("\n")
            answers[question] = answer.split("\n\n")[0] if question == QUESTIONS[0] else answer
    return answers


def _loops(text: str) -> bool:
    """Words repeated until max_tokens: any 3-word sequence that occurs 8 times or more (the 4-bit path's loop
    repeats "la France," about 30 times in 96 tokens; an answer that says "the most fundamental color" of each of
    three colours, twice each, is repetitive but not a loop)."""
    words = text.split()
    grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    return any(grams.count(g) >= 8 for g in set(grams))


@pytest.fixture(scope="module")
def demo_output() -> str:
    done = subprocess.run(
        [sys.executable, "-m", "infer.client.demo"], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_first_answer_is_paris(demo_output: str) -> None:
    answers = _answers(demo_output)
    assert answers[QUESTIONS[0]].strip() == "The capital of France is Paris.", demo_output


def test_every_answer_ends_by_itself_and_none_loops(demo_output: str) -> None:
    answers = _answers(demo_output)
    assert set(QUESTIONS) <= set(answers), demo_output
    for question in QUESTIONS[1:]:
        text, _, tail = answers[question].strip().rpartition("  [")
        assert tail.startswith("stop]"), (question, answers[question])
        assert text and not _loops(text), (question, text)
    assert not _loops(answers[QUESTIONS[0]])


def test_both_workers_serve_and_the_http_front_answers(demo_output: str) -> None:
    routed = re.search(r"requests per worker: rank 0: (\d+), rank 1: (\d+)", demo_output)
    assert (
        routed is not None and int(routed[1]) + int(routed[2]) == len(QUESTIONS) and min(map(int, routed.groups())) >= 1
    ), demo_output
    http = demo_output.split("POST /v1/chat/completions (stream)\n>>> Name three primary colours.\n", 1)
    assert len(http) == 2 and len(http[1].split()) >= 3 and not _loops(http[1]), demo_output
