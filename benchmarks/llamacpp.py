"""Batch-1 (and `--batch N`) decoding against llama.cpp, each system on the same GGUF file. Not a test.

    .venv/bin/python benchmarks/llamacpp.py --llama-cpp-bin $LLAMA_CPP_BIN   # Q4_1 Q8_0 BF16, 3 rounds
    .venv/bin/python benchmarks/llamacpp.py --formats Q4_1 --rounds 1        # a quick check
    .venv/bin/python benchmarks/llamacpp.py --batch 64                       # batched decode (see below)

The files: the embedded model's own GGUF (Q4_1) and Q8_0 / BF16 made from it once with
`llama-quantize --allow-requantize SRC DST TYPE` into benchmarks/.peers/models/ (git-ignored; `--models-dir`).

One request, batch 1, 128 random prompt token ids -> 128 generated tokens, greedy, EOS ignored, 2 threads
(`--threads`). Each system runs alone, in its own process, one after the other; `--rounds` rounds alternate the
order (llama.cpp first, then ours first, ...) and the table shows medians (a shared VM drifts 10-20%). Both
systems warm up first on a prompt of the same length (other token ids). Defined identically for both:

    time to first token  the prefill of the 128 prompt tokens, which yields token 1
    decode tok/s         tokens / time of single-token steps at context 128..255 (no prefill in it)
    e2e tok/s            128 generated / (time to first token + the 127 decode steps that yield tokens 2..128)
    peak RSS             the process's high-water mark (ru_maxrss from wait4 on it): weights, caches, runtime
                         (ours: with the KV pool at its default size, reported beside it as kv_pool_mib)
    RSS budget           the bound we hold ours to: the peak RSS of a bare `python -c "import torch"` (measured
                         the same way, once per round, median) + 1.5 x llama.cpp's peak on the same file

llama.cpp: `llama-bench -m F -t 2 -r 1`, twice per round: `-p 0 -n 128 -d 128` (tg128 at depth 128) gives
decode; `-p 128 -n 0 -pg 128,127` gives the first token (pp128) and e2e (pp128 + tg127 in one timed run).
llama-bench does not sample (it feeds random ids): a hair less work per token than a real request.

ours: the engine LLM(model=F, num_threads=2, max_model_len=1024) runs in direct mode, built and stepped on this
process's main thread the way LLM's engine thread builds and steps it (Engine.add_request, then Engine.step until
done: no thread hops), stamping each token as its step returns; sampling and detokenization are in the time.

The bandwidth floor: the bytes one token reads (every 2-D tensor of the GGUF, as stored; token_embd counts
once, as the LM head it is when there is no output.weight, since a lookup reads one row of it; norms are
negligible) over the read bandwidth measured in the same run (throughput.read_bandwidth, after the rounds);
each system's decode is shown as a share of that floor.

A child's ru_maxrss starts from its parent's high-water mark at the spawn (Linux carries it over exec), so this
parent stays small until the rounds are over: no torch here before then (our GGUF conversion, when one is due,
runs in a child of its own), and its own high-water mark is recorded beside the results (parent_hwm_mib).

Batched (`--batch N`, N > 1): N requests at once, each 128 distinct random prompt ids -> 128 tokens, the rest as
above. Defined identically for both:

    prefill s            until every request has its first token (the TTFT of the last one; shown as TTFT ms)
    decode tok/s         tokens / time of the steps after that, every one a decode of all N (context 128..255)
    e2e tok/s            N * 128 generated / the whole time (the prefill + the 127 decode steps)

llama.cpp: `llama-batched-bench -m F -t 2 -c N*256 -npp 128 -ntg 127 -npl N -no-kvu`: N distinct random prompts
(no -pps, which would prefill one prompt and copy its KV to all N) prefilled together (t_pp), then 127 steps of
one token for each of the N sequences (t_tg, its S_TG t/s is decode tok/s); -ntg 127, not 128, because its
prefill already yields each sequence's first token, as ours does (the -pg 128,127 of batch 1). -no-kvu (its
default here, passed to be sure): one KV stream of 256 cells per sequence, whose attention reads its own cells
only, as ours reads its own blocks; a unified KV (-kvu) has every sequence attend over all N*256 cells, masked.
Ours: `max_num_seqs=N`, `max_model_len=256` (a pool of exactly N full sequences' blocks, like llama.cpp's -c;
checked to hold them, so nothing is preempted), the N requests added at once and the engine stepped as above:
chunked prefill (2048 tokens a step) mixes the first decodes of early requests into the prefill steps; those
count in e2e but not in decode tok/s. Both warm up first (ours: N other prompts, 8 tokens each; llama.cpp: its
own 16-token decode). The floor is then N tokens per read of the weights (the KV's reads not counted): a bound
a step of N tokens does not approach, being compute-bound.

Building the peer (outside this tree; the tree vendored in the llama-cpp-python sdist):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d PEERS && cd PEERS
    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=ON
    cmake --build build -j --target llama-bench llama-batched-bench llama-quantize
    export LLAMA_CPP_BIN=$PWD/build/bin
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_workload, write_result  # noqa: E402

# throughput also takes benchmarks/ off sys.path again (transformers would import benchmarks/kernels.py)
from throughput import read_bandwidth  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = HERE / ".peers" / "models"
FORMATS = ("Q4_1", "Q8_0", "BF16")
SYSTEMS = ("llama.cpp", "infer")
PROMPT, GENERATED = 128, 128
MAX_MODEL_LEN = 1024
CPU_FLAGS = (
    "avx2",
    "fma",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "f16c",
)


# ---- the GGUF files -------------------------------------------------------------------------------


def describe(gguf: Path) -> dict:
    """What the table needs of `gguf`: the type most of its 2-D tensors are stored in (Q4_1, Q8_0, BF16, ...)
    and the bytes of weights one decoded token reads: every 2-D tensor as stored, less token_embd when the
    model has its own output.weight (then a lookup reads one row of token_embd; tied, it is the LM head)."""
    from gguf import GGUFReader

    matrices = [t for t in GGUFReader(str(gguf)).tensors if len(t.shape) >= 2]
    sizes = {t.name: int(t.n_bytes) for t in matrices}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return {
        "format": Counter(t.tensor_type.name for t in matrices).most_common(1)[0][0],
        "bytes_per_token": sum(sizes.values()),
    }


def describe_in_child(ggufs: list[Path]) -> list[dict]:
    """describe() of each file, in a child process: GGUFReader's parse of the tokenizer peaks at ~150 MB, which
    would become the floor of every later child's ru_maxrss (see the docstring)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--describe", *map(str, ggufs)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.splitlines()[-1])


def gguf_files(formats: list[str], source: Path, models: Path, bin_dir: Path) -> dict[str, Path]:
    """format -> the GGUF file both systems read: `source` itself for its own format, else a file made from it
    once with llama-quantize into `models`."""
    (own,) = describe_in_child([source])
    files = {}
    for fmt in formats:
        if fmt == own["format"]:
            files[fmt] = source
            continue
        dest = models / f"{source.stem.rsplit('.', 1)[0]}.{fmt}.gguf"
        if not dest.exists():
            models.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".tmp")
            print(f"making {dest.name} from {source.name} (once)", flush=True)
            subprocess.run(
                [str(bin_dir / "llama-quantize"), "--allow-requantize", str(source), str(tmp), fmt],
                check=True,
                capture_output=True,
                timeout=600,
            )
            tmp.rename(dest)
        files[fmt] = dest
    return files


# ---- running one system in its own process ----------------------------------------------------------


def run_process(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """Run `cmd` to its end (killed after `timeout` s): (exit code, stdout, stderr, its peak RSS in KiB)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this child alone
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return (
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage.ru_maxrss,
        )


def llama_bench(bin_dir: Path, gguf: Path, threads: int, test: list[str], timeout: float) -> tuple[list[dict], int]:
    """llama-bench's JSON records of `test` (one repetition, after its own warm-up) and its peak RSS in KiB."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "jsonl", *test]
    code, out, err, rss = run_process(cmd, timeout)
    if code != 0:
        raise RuntimeError(f"llama-bench exited {code}: {err[-2000:]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], rss


def measure_llamacpp(bin_dir: Path, gguf: Path, threads: int, timeout: float) -> dict:
    (decode,), rss_decode = llama_bench(
        bin_dir, gguf, threads, ["-p", "0", "-n", str(GENERATED), "-d", str(PROMPT)], timeout
    )
    (prefill, e2e), rss_e2e = llama_bench(
        bin_dir, gguf, threads, ["-p", str(PROMPT), "-n", "0", "-pg", f"{PROMPT},{GENERATED - 1}"], timeout
    )
    return {
        "decode_tok_s": GENERATED / (decode["avg_ns"] / 1e9),
        "e2e_tok_s": GENERATED / (e2e["avg_ns"] / 1e9),
        "ttft_s": prefill["avg_ns"] / 1e9,
        "peak_rss_mib": max(rss_decode, rss_e2e) / 1024,
        "build": {k: decode[k] for k in ("build_commit", "cpu_info", "backends", "model_type", "flash_attn")},
    }


def measure_llamacpp_batched(bin_dir: Path, gguf: Path, threads: int, batch: int, timeout: float) -> dict:
    """llama-batched-bench on `batch` distinct prompts (see the docstring), one run after its own warm-up."""
    cmd = [
        str(bin_dir / "llama-batched-bench"),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-c",
        str(batch * (PROMPT + GENERATED)),
        "-npp",
        str(PROMPT),
        "-ntg",
        str(GENERATED - 1),
        "-npl",
        str(batch),
        "-no-kvu",
        "--output-format",
        "jsonl",
    ]
    code, out, err, rss = run_process(cmd, timeout)
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if code != 0 or len(records) != 1:
        raise RuntimeError(f"llama-batched-bench exited {code} with {len(records)} records: {err[-2000:]}")
    (r,) = records
    return {
        "decode_tok_s": r["speed_tg"],
        "e2e_tok_s": batch * GENERATED / r["t"],
        "ttft_s": r["t_pp"],
        "peak_rss_mib": rss / 1024,
        "build": {k: r[k] for k in ("n_kv_max", "n_batch", "n_ubatch", "flash_attn", "is_pp_shared", "n_threads")},
    }


def measure_infer(gguf: Path, threads: int, batch: int, timeout: float) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        str(gguf),
        "--threads",
        str(threads),
        "--batch",
        str(batch),
    ]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    code, out, err, rss = run_process(cmd, timeout, env)
    results = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not results:
        raise RuntimeError(f"our child exited {code}: {(out + err)[-2000:]}")
    return {**results[0], "peak_rss_mib": rss / 1024}


def child_main(gguf: str, threads: int, batch: int) -> None:
    """Ours, in this process: load, warm up on `batch` prompts of the same length, then time `batch` requests."""
    from infer import SamplingParams
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

    sizes = (
        dict(max_model_len=MAX_MODEL_LEN)
        if batch == 1  # batch 1: the default pool, as before
        else dict(max_model_len=PROMPT + GENERATED, max_num_seqs=batch)
    )
    # built and stepped on this thread, as LLM's engine thread builds and steps its own (LocalEngine.start)
    engine = Engine(EngineConfig.from_options(model=gguf, num_threads=threads, **sizes))
    if engine.kv_cache.num_blocks * engine.block_size < batch * (PROMPT + GENERATED - 1):
        raise RuntimeError(f"a KV pool of {engine.kv_cache.num_blocks} blocks cannot hold {batch} requests")
    # seed s: other ids for each prompt, no prefix-cache hit between them or with the warm-up's
    prompts = [make_workload("B1", engine.vocab_size, seed=s).prompts[0] for s in range(2 * batch)]
    for i, prompt in enumerate(prompts[batch:]):
        engine.add_request(f"warm-{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts[:batch]):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True))
    first: set[str] = set()  # the requests that have their first token
    prefilled = end = start  # when the last of them got it; the last token's time
    generated = decoded = 0  # all tokens; those of the steps after `prefilled`
    while engine.has_unfinished():
        deltas = [d for d in engine.step() if d.token_ids]
        if deltas:
            end, tokens = time.perf_counter(), sum(len(d.token_ids) for d in deltas)
            generated += tokens
            if len(first) == batch:
                decoded += tokens
            else:
                first.update(d.request_id for d in deltas)
                prefilled = end
    if generated != batch * GENERATED or len(first) != batch:
        raise RuntimeError(f"expected {batch} x {GENERATED} tokens, got {generated} from {len(first)} requests")
    result = {
        "decode_tok_s": decoded / (end - prefilled),
        "e2e_tok_s": generated / (end - start),
        "ttft_s": prefilled - start,
        "rss_after_mib": _status_kib("VmRSS") / 1024,
        "kv_pool_mib": engine.kv_cache.nbytes / 2**20,
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    print("RESULT " + json.dumps(result), flush=True)
    engine.close()


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


# ---- the parent: rounds, medians, the floor, the table ----------------------------------------------


def measure_bare_torch(timeout: float) -> float:
    """The peak RSS (MiB) of a bare `python -c "import torch"`: where any torch process starts (the budget's floor)."""
    code, _, err, rss = run_process([sys.executable, "-c", "import torch"], timeout)
    if code != 0:
        raise RuntimeError(f"python -c 'import torch' exited {code}: {err[-2000:]}")
    return rss / 1024


def run_rounds(
    files: dict[str, Path], bin_dir: Path, threads: int, batch: int, rounds: int, timeout: float
) -> tuple[dict, list[float]]:
    """(format -> system -> the list of per-round results (a dict with "error" where a run failed), the bare
    `import torch` peak RSS of each round)."""
    runs: dict[str, dict[str, list[dict]]] = {fmt: {s: [] for s in SYSTEMS} for fmt in files}
    bare_torch = []
    for i in range(rounds):
        bare_torch.append(measure_bare_torch(timeout))
        print(f"   round {i + 1} bare import torch: peak RSS {bare_torch[-1]:.0f} MiB", flush=True)
        order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
        for fmt, gguf in files.items():
            for system in order:
                try:
                    if system == "infer":
                        r = measure_infer(gguf, threads, batch, timeout)
                    elif batch == 1:
                        r = measure_llamacpp(bin_dir, gguf, threads, timeout)
                    else:
                        r = measure_llamacpp_batched(bin_dir, gguf, threads, batch, timeout)
                except RuntimeError as e:
                    r = {"error": str(e)}
                runs[fmt][system].append(r)
                print(
                    f"   round {i + 1} {fmt} {system}: "
                    + (
                        f"decode {r['decode_tok_s']:.1f} tok/s, e2e "
                        f"{r['e2e_tok_s']:.1f} tok/s, peak RSS {r['peak_rss_mib']:.0f} MiB"
                        if "error" not in r
                        else r["error"][-300:]
                    ),
                    flush=True,
                )
    return runs, bare_torch


def median_row(results: list[dict]) -> dict:
    """Each measure's median over the rounds that ran (and how many did)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return {"error": results[0]["error"]}
    keys = [k for k, v in ok[0].items() if isinstance(v, float) and all(k in r for r in ok)]
    return {**{k: statistics.median(r[k] for r in ok) for k in keys}, "rounds_ok": len(ok)}


def summarize(
    runs: dict, files: dict[str, Path], described: list[dict], bandwidth: float, batch: int, bare_torch_mib: float
) -> list[dict]:
    rows = []
    for (fmt, by_system), facts in zip(runs.items(), described):
        nbytes = facts["bytes_per_token"]
        floor = batch * bandwidth / nbytes  # one read of the weights per step of `batch` tokens
        medians = {s: median_row(r) for s, r in by_system.items()}
        for m in medians.values():
            if "decode_tok_s" in m:
                m["share_of_floor"] = m["decode_tok_s"] / floor
        ours, peer = medians["infer"], medians["llama.cpp"]
        ratios = (
            {k: ours[k] / peer[k] for k in ("decode_tok_s", "e2e_tok_s", "peak_rss_mib")}
            if "error" not in ours and "error" not in peer
            else None
        )
        budget = bare_torch_mib + 1.5 * peer["peak_rss_mib"] if "error" not in peer else None
        rows.append(
            {
                "format": fmt,
                "gguf": str(files[fmt]),
                "stored_as": facts["format"],
                "weight_mb_per_token": nbytes / 1e6,
                "floor_tok_s": floor,
                "median": medians,
                "infer_over_llamacpp": ratios,
                "rss_budget_mib": budget,
                "within_rss_budget": None if budget is None or "error" in ours else ours["peak_rss_mib"] <= budget,
                "rounds": by_system,
            }
        )
    return rows


def print_table(rows: list[dict], bandwidth: float, batch: int) -> None:
    print(
        f"\nbatch {batch}; read bandwidth {bandwidth / 1e9:.1f} GB/s; floor = {batch} x that / weight bytes "
        f"each step reads"
    )
    print(
        f"{'format':6} {'system':10} {'decode tok/s':>12} {'e2e tok/s':>10} {'TTFT ms':>8} {'RSS MiB':>8} "
        f"{'% floor':>8}"
    )
    for row in rows:
        print(
            f"{row['format']:6} {'floor':10} {row['floor_tok_s']:12.1f} {'':>10} {'':>8} {'':>8} {'':>8}"
            f"  ({row['weight_mb_per_token']:.0f} MB/token)"
        )
        for system, m in row["median"].items():
            if "error" in m:
                print(f"{row['format']:6} {system:10} failed: {m['error'][-200:]}")
                continue
            print(
                f"{row['format']:6} {system:10} {m['decode_tok_s']:12.1f} {m['e2e_tok_s']:10.1f} "
                f"{m['ttft_s'] * 1e3:8.0f} {m['peak_rss_mib']:8.0f} {m['share_of_floor']:8.0%}"
                + (f"  (KV pool {m['kv_pool_mib']:.0f} MiB)" if "kv_pool_mib" in m else "")
            )
        r = row["infer_over_llamacpp"]
        if r:
            print(
                f"{row['format']:6} {'ours/l.cpp':10} {r['decode_tok_s']:11.2f}x {r['e2e_tok_s']:9.2f}x "
                f"{'':>8} {r['peak_rss_mib']:7.2f}x"
            )
        if row["rss_budget_mib"] is not None:
            verdict = {True: "within", False: "OVER", None: "?"}[row["within_rss_budget"]]
            print(
                f"{row['format']:6} {'RSS budget':10} {'':>12} {'':>10} {'':>8} {row['rss_budget_mib']:8.0f}"
                f"  (bare torch + 1.5 x llama.cpp; ours {verdict})"
            )


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            present = set(line.split(":", 1)[1].split())
            return [f for f in CPU_FLAGS if f in present] + sorted(
                f for f in present if f.startswith("avx512") and f not in CPU_FLAGS
            )
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=os.environ.get("LLAMA_CPP_BIN"),
        help="folder with llama-bench and llama-quantize (default: $LLAMA_CPP_BIN)",
    )
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="requests at once (> 1: llama-batched-bench)")
    parser.add_argument("--models-dir", type=Path, default=MODELS, help="where the requantized GGUFs are kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for one system's run")
    parser.add_argument("--child", metavar="GGUF", help=argparse.SUPPRESS)
    parser.add_argument("--describe", nargs="+", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.describe:
        print(json.dumps([describe(gguf) for gguf in args.describe]))
        return
    if args.child:
        child_main(args.child, args.threads, args.batch)
        return
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    tool = "llama-bench" if args.batch == 1 else "llama-batched-bench"
    if args.llama_cpp_bin is None or not (args.llama_cpp_bin / tool).exists():
        parser.error(
            f"--llama-cpp-bin (or $LLAMA_CPP_BIN) must name llama.cpp's build/bin, with {tool} (see the docstring)"
        )
    from infer.worker.loading.model_files import default_model_gguf

    files = gguf_files(args.formats, default_model_gguf(), args.models_dir, args.llama_cpp_bin)
    for gguf in files.values():  # our GGUF conversion, when one is due: once, outside any timed run
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from infer.worker.loading.model_files import resolve_model; resolve_model({str(gguf)!r})",
            ],
            check=True,
            timeout=args.timeout,
        )
    described = describe_in_child(list(files.values()))
    load_start = os.getloadavg()
    runs, bare_torch = run_rounds(files, args.llama_cpp_bin, args.threads, args.batch, args.rounds, args.timeout)
    parent_hwm = _status_kib("VmHWM") / 1024
    bandwidth = read_bandwidth(args.threads)
    rows = summarize(runs, files, described, bandwidth, args.batch, statistics.median(bare_torch))
    print_table(rows, bandwidth, args.batch)
    print(f"bare `import torch`: peak RSS {statistics.median(bare_torch):.0f} MiB (median of {len(bare_torch)})")
    print(f"this parent's high-water mark {parent_hwm:.0f} MiB (no child's peak RSS can read below it)")
    out = write_result(
        "llamacpp",
        {
            "model": "SmolLM2-135M-Instruct (the embedded GGUF and llama-quantize's requantizations)",
            "workload": f"batch {args.batch}, {PROMPT} -> {GENERATED}, greedy, ignore EOS",
            "batch": args.batch,
            "threads": args.threads,
            "rounds": args.rounds,
            "cpu_flags": cpu_flags(),
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "llama_cpp_bin": str(args.llama_cpp_bin),
            "load_avg_start": load_start,
            "load_avg_end": os.getloadavg(),
            "parent_hwm_mib": parent_hwm,
            "bare_torch_peak_rss_mib": {"median": statistics.median(bare_torch), "rounds": bare_torch},
            "rows": rows,
        },
    )
    print("wrote", out)


if __name__ == "__main__":
    main()
