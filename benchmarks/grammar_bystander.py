"""A plain request's latency beside hostile grammars on the same worker (the bounds on grammar work).
Not a test.

`infer-serve --workers 1` on the embedded model at its defaults (one worker: every request shares it). Each
round times one plain request (greedy, a fixed number of tokens, through the HTTP front) three ways, in turn:
- alone;
- beside a request whose regex compiles within the bound and then costs seconds a token to follow
  (`([\\s\\S]{0,100}){0,100}`: refused with a 400 once its first steps are measured, --max-grammar-step-ms);
- beside a burst of 24 distinct JSON schemas that are slow to compile, one output token each (past
  --max-grammar-compiles[-per-client] they are refused with 503 `overloaded`; the admitted ones compile on the
  worker's compile thread, which runs at the lowest CPU priority, then end).
Rounds alternate the three cases; the figures are medians over the rounds and each hostile case's ratio to
alone (1.0: the bystander does not notice). Before the bounds the regex case took 59 s instead of 2.

    .venv/bin/python benchmarks/grammar_bystander.py [--rounds 5] [--tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import write_result  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

COSTLY_REGEX = r"([\s\S]{0,100}){0,100}"
SLOW_SCHEMAS = [{"type": "string", "minLength": 1, "maxLength": 10**6 + i} for i in range(24)]


def start_cluster() -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.client.serve", "--workers", "1", "--port", "0", "--log-level", "ERROR"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if m := re.search(r"HTTP at (http://\S+?);", line):
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            raise SystemExit("infer-serve ended before it was ready")
    raise SystemExit("infer-serve was not ready within 300 s")


async def plain(client, tokens: int) -> float:
    started = time.perf_counter()
    done = await client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="A plain request about rivers",
        max_tokens=tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert done.usage.completion_tokens == tokens
    return time.perf_counter() - started


async def hostile(client, case: str) -> list[str]:
    """The hostile requests of `case`, each ending as it ends: "ok", or the HTTP status it got."""
    import openai

    async def one(structured: dict, max_tokens: int) -> str:
        try:
            await client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt="Anything",
                max_tokens=max_tokens,
                temperature=1.0,
                seed=1,
                extra_body={"structured_outputs": structured},
            )
            return "ok"
        except openai.APIStatusError as e:
            return str(e.status_code)

    if case == "costly regex":
        return [await one({"regex": COSTLY_REGEX}, 64)]
    # one token each: the admitted ones end once compiled, so the figure is the compiles' cost, not batching
    return list(await asyncio.gather(*(one({"json": s}, 1) for s in SLOW_SCHEMAS)))


async def one_case(client, case: str, tokens: int) -> tuple[float, list[str]]:
    if case == "alone":
        return await plain(client, tokens), []
    others = asyncio.create_task(hostile(client, case))
    await asyncio.sleep(0.2)  # the hostile requests reach the worker first
    latency = await plain(client, tokens)
    return latency, await asyncio.wait_for(others, 600)


async def run(url: str, rounds: int, tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    await plain(client, tokens)  # warm-up
    cases = ["alone", "costly regex", "24 slow schemas"]
    latencies: dict[str, list[float]] = {c: [] for c in cases}
    endings: dict[str, list[list[str]]] = {c: [] for c in cases}
    for r in range(rounds):
        for case in cases[r % 3 :] + cases[: r % 3]:  # alternate the order round by round
            latency, ended = await one_case(client, case, tokens)
            latencies[case].append(latency)
            endings[case].append(ended)
            print(f"round {r + 1}: {case}: {latency:.2f} s ({', '.join(sorted(set(ended))) or '-'})", flush=True)
    medians = {c: statistics.median(v) for c, v in latencies.items()}
    return {
        "latency_s": latencies,
        "median_s": medians,
        "ratio_to_alone": {c: medians[c] / medians["alone"] for c in cases},
        "hostile_endings": {c: [sorted(set(e)) for e in v] for c, v in endings.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    proc, url = start_cluster()
    try:
        result = asyncio.run(run(url, args.rounds, args.tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    result.update(rounds=args.rounds, tokens=args.tokens, cluster="infer-serve --workers 1, embedded model, defaults")
    print({c: f"{m:.2f} s ({result['ratio_to_alone'][c]:.2f}x)" for c, m in result["median_s"].items()})
    print(write_result("grammar_bystander", result))


if __name__ == "__main__":
    main()
