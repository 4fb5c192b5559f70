"""infer-bench: the serving benchmark against any OpenAI-compatible server (ours, vLLM's, SGLang's, llama.cpp's).

    infer-bench --url http://HOST:8000 [--model NAME] [--num-prompts 100] [--request-rate 4] [--max-concurrency K]
                [--input-len 32 512] [--output-len 32 256] [--vocab-size 32000] [--seed 0] [--result-json F]

The requests, in the style of `vllm bench serve`'s random dataset: token-id prompts of lengths uniform in
--input-len and outputs uniform in --output-len, from a fixed seed (the same requests on every run and every
server), greedy with `ignore_eos`, streamed from POST /v1/completions with `stream_options.include_usage`, sent
on a Poisson schedule of --request-rate requests/s (inf: all at once), at most --max-concurrency in flight.
Token ids are drawn from [100, --vocab-size): keep it at or below the served model's vocabulary.

Per request: TTFT (first non-empty text chunk - send), ITL (gaps between text chunks), TPOT ((last chunk - first
chunk) / (output tokens - 1)), E2E (end of stream - send); output tokens from the usage chunk. A request fails
on a non-200 status, an error event, a transport error or timeout, or a stream without text or usage. The
summary: request and output-token throughput, goodput (requests/s within --slo-ttft and --slo-tpot), and
mean / p50 / p99 of each latency; --result-json writes it with every request's figures. Exit 0 when every
request completed, 1 when some failed or the server could not be reached, 2 for bad options.

benchmarks/serving.py uses the same client to put infer-serve and vLLM's server side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from infer.protocol import env

# ---- the requests: one seeded dataset, one arrival schedule per rate -------------------------------


@dataclass(frozen=True)
class Schedule:
    """The requests of one rate, in sending order, and when each is due (seconds after the start)."""

    rate: float  # requests/s; math.inf sends all at once
    prompts: list[list[int]]
    max_tokens: list[int]
    arrivals: list[float]

    @property
    def label(self) -> str:
        return "inf" if math.isinf(self.rate) else f"{self.rate:g}"


def make_lengths(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randint(*input_len) for _ in range(n)], [rng.randint(*output_len) for _ in range(n)]


def make_schedule(rate: float, lengths: tuple[list[int], list[int]], vocab_size: int, seed: int) -> Schedule:
    """Token ids and arrivals from generators seeded by (seed, rate): the same on every run and server."""
    label = "inf" if math.isinf(rate) else f"{rate:g}"
    ids = random.Random(f"{seed}:prompts:{label}")
    prompts = [[ids.randrange(100, vocab_size) for _ in range(n)] for n in lengths[0]]
    gaps = random.Random(f"{seed}:arrivals:{label}")
    arrivals, t = [], 0.0
    for _ in prompts:
        arrivals.append(t)
        t += 0.0 if math.isinf(rate) else gaps.expovariate(rate)
    return Schedule(rate, prompts, list(lengths[1]), arrivals)


# ---- the client: one streamed completion per request ---------------------------------------------


@dataclass
class Outcome:
    """What one request measured; times in seconds. ok=False carries `error`."""

    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    tpot: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    expected_tokens: int = 0


async def send(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    """One streamed completion to `url` (the full /v1/completions URL)."""
    payload = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = Outcome(expected_tokens=max_tokens)
    chunks: list[float] = []  # arrival times of the non-empty text chunks
    usage = None
    start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                out.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return out
            async for raw in response.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, other fields
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {json.dumps(event['error'])[:200]}"
                    return out
                if event.get("choices") and event["choices"][0].get("text"):
                    chunks.append(time.perf_counter())
                if event.get("usage"):
                    usage = event["usage"]
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
        return out
    out.e2e = time.perf_counter() - start
    if not chunks or usage is None:
        out.error = "stream ended without text" if not chunks else "stream ended without a usage chunk"
        return out
    out.ok = True
    out.output_tokens = int(usage.get("completion_tokens", 0))
    out.ttft = chunks[0] - start
    out.itl = [b - a for a, b in itertools.pairwise(chunks)]
    out.tpot = (chunks[-1] - chunks[0]) / (out.output_tokens - 1) if out.output_tokens > 1 else 0.0
    return out


def _session(max_concurrency: int | None, request_timeout: float, headers: dict[str, str]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=max_concurrency or 0),
        headers=headers,
        timeout=aiohttp.ClientTimeout(total=request_timeout),
    )


async def run_schedule(
    url: str,
    model: str,
    schedule: Schedule,
    max_concurrency: int | None,
    request_timeout: float,
    headers: dict[str, str] | None = None,
) -> tuple[list[Outcome], float]:
    """Sends every request at its arrival offset (waiting for a slot if max_concurrency is reached);
    returns the outcomes in request order and the duration from the start to the last completion."""
    limit = asyncio.Semaphore(max_concurrency or len(schedule.arrivals))
    async with _session(max_concurrency, request_timeout, headers or {}) as session:
        start = time.perf_counter()

        async def one(i: int) -> Outcome:
            await asyncio.sleep(max(0.0, start + schedule.arrivals[i] - time.perf_counter()))
            async with limit:
                return await send(session, url, model, schedule.prompts[i], schedule.max_tokens[i])

        outcomes = await asyncio.gather(*(one(i) for i in range(len(schedule.arrivals))))
        return list(outcomes), time.perf_counter() - start


# ---- metrics ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, o: Outcome) -> bool:
        return o.ok and o.ttft <= self.ttft_s and o.tpot <= self.tpot_s


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarize(outcomes: list[Outcome], duration: float, slo: Slo) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    errors = sorted({o.error for o in outcomes if not o.ok})
    return {
        "completed": len(done),
        "failed": len(outcomes) - len(done),
        "duration_s": duration,
        "short_outputs": sum(o.output_tokens != o.expected_tokens for o in done),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(o.output_tokens for o in done) / duration,
        "goodput": sum(slo.met(o) for o in done) / duration,
        "ttft_ms": _stats_ms([o.ttft for o in done]),
        "tpot_ms": _stats_ms([o.tpot for o in done if o.output_tokens > 1]),
        "itl_ms": _stats_ms([gap for o in done for gap in o.itl]),
        "e2e_ms": _stats_ms([o.e2e for o in done]),
        "errors": errors[:5],
        # per request, in sending order: what the means and percentiles above hide (who met the SLO, when)
        "requests": [
            {
                "ok": o.ok,
                "ttft_ms": round(o.ttft * 1000, 1),
                "tpot_ms": round(o.tpot * 1000, 1),
                "e2e_ms": round(o.e2e * 1000, 1),
                "output_tokens": o.output_tokens,
            }
            for o in outcomes
        ],
    }


# ---- the command --------------------------------------------------------------------------------------


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a request rate is a number of requests/s or inf, got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 or inf, got {text!r}")
    return rate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infer-bench",
        description=__doc__.split("\n\n")[0],
        epilog="See the module documentation (infer.client.bench) for what is measured.",
    )
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name to request (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as a Bearer token (default: $INFER_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="requests/s on a Poisson schedule; inf sends all at once (default)",
    )
    p.add_argument("--max-concurrency", type=int, metavar="K", help="at most K requests in flight (default: no cap)")
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[32, 512],
        metavar=("MIN", "MAX"),
        help="prompt tokens, uniform (default 32 512)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[32, 256],
        metavar=("MIN", "MAX"),
        help="output tokens, uniform (default 32 256)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="prompt token ids are drawn from [100, N): at most the model's vocabulary (default 32000)",
    )
    p.add_argument("--seed", type=int, default=0, help="the dataset's and the schedule's seed (default 0)")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, seconds (default 0.2)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take (default 900)")
    p.add_argument("--result-json", metavar="FILE", help="write the configuration and the summary here")
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    """What is wrong with the options (empty: nothing)."""
    problems = []
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(f"--url must be http(s)://HOST[:PORT], got {args.url!r}")
    for name in ("input_len", "output_len"):
        low, high = getattr(args, name)
        if not 1 <= low <= high:
            problems.append(f"--{name.replace('_', '-')} {low} {high}: need 1 <= MIN <= MAX")
    if args.num_prompts < 1:
        problems.append(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.vocab_size <= 100:
        problems.append(f"--vocab-size must be > 100, got {args.vocab_size}")
    for name in ("slo_ttft", "slo_tpot", "request_timeout"):
        if not getattr(args, name) > 0:
            problems.append(f"--{name.replace('_', '-')} must be > 0 seconds")
    return problems


async def served_model(base: str, headers: dict[str, str], timeout: float) -> str:
    """The first model id of GET /v1/models; RuntimeError saying why when there is none."""
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(f"{base}/v1/models") as response:
            if response.status != 200:
                raise RuntimeError(f"GET {base}/v1/models answered {response.status}: {(await response.text())[:200]}")
            models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"GET {base}/v1/models lists no model: pass --model")
    return str(models[0]["id"])


def print_summary(summary: dict[str, Any], schedule: Schedule, model: str) -> None:
    print(f"model {model}, {len(schedule.arrivals)} requests at rate {schedule.label} req/s")
    print(f"  completed / failed        {summary['completed']} / {summary['failed']}")
    print(f"  request throughput        {summary['request_throughput']:.2f} req/s")
    print(f"  output throughput         {summary['output_throughput']:.1f} tok/s")
    print(f"  goodput                   {summary['goodput']:.2f} req/s")
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        stats = summary[key]
        cells = "  ".join("-" if stats[s] is None else f"{s} {stats[s]:.1f}" for s in ("mean", "p50", "p99"))
        print(f"  {name:5} (ms)                {cells}")
    for error in summary["errors"]:
        print(f"  error: {error}")


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    base = args.url.rstrip("/")
    key = args.api_key or env.read(env.API_KEY) or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = args.model or await served_model(base, headers, 60.0)
    lengths = make_lengths(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed)
    schedule = make_schedule(args.request_rate, lengths, args.vocab_size, args.seed)
    outcomes, duration = await run_schedule(
        f"{base}/v1/completions", model, schedule, args.max_concurrency, args.request_timeout, headers
    )
    summary = summarize(outcomes, duration, Slo(args.slo_ttft, args.slo_tpot))
    print_summary(summary, schedule, model)
    return {"model": model, "slo": asdict(Slo(args.slo_ttft, args.slo_tpot)), **summary}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problems = check_args(args)
    if problems:
        parser.error("; ".join(problems))  # exit 2
    try:
        result = asyncio.run(bench(args))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, RuntimeError) as e:
        print(f"infer-bench: cannot benchmark {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.result_json:
        config = {
            k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items() if k != "api_key"
        }
        with open(args.result_json, "w") as f:
            json.dump({"config": config, **result}, f, indent=2)
            f.write("\n")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
