"""The main job: a local cluster on the embedded default model, answering a few chat prompts.

    python -m infer.client.demo [--workers 2] [--model M] [--offline]

Starts a coordinator and N workers as child processes (as `infer-serve` does), waits until every worker
has joined, streams the first answer token by token through `InferenceClient`, sends the other prompts
concurrently, prints the answers and which worker served how many, then puts the OpenAI-compatible HTTP
front on the cluster and streams one chat completion through it over HTTP, and shuts everything down.
`--offline` runs the same prompts through the in-process `LLM` instead.

The answers are greedy, and the weights run dense (`--quantization none`: the embedded Q4_1 GGUF dequantized at
load): the 4-bit path quantizes each row of activations to int8 per block of 32, as llama.cpp does, and on this
135M-parameter model that small error is enough to turn "The capital of France is Paris." into a loop of French
words (llama.cpp answers the same loop on the same file). `--quantization auto` shows the 4-bit path as the daemons
run it by default.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import cast

from infer.protocol.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for writing clear code.",
    "Explain what a KV cache is in one sentence.",
]
HTTP_QUESTION = "Name three primary colours."


def chat_prompts(model: str | None) -> list[str]:
    from infer.worker.loading.model_files import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    return [  # the casts: with tokenize=False the template's text (transformers types every return form)
        cast(
            str,
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
        )
        for q in QUESTIONS
    ]


async def run_cluster(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> None:
    from infer.client.inference_client import InferenceClient
    from infer.client.serve import LocalCluster

    worker_args = ["--dtype", args.dtype, "--threads", str(args.threads), "--max-model-len", "2048"]
    worker_args += ["--quantization", args.quantization]
    if args.model:
        worker_args += ["--model", args.model]
    cluster = LocalCluster(num_workers=args.workers, worker_args=worker_args)
    await cluster.start()
    try:
        await cluster.wait_ready(timeout=600)
        print(f"cluster ready: coordinator {cluster.address}, {args.workers} worker(s)\n", flush=True)
        async with InferenceClient(cluster.address) as client:
            start = time.perf_counter()
            others = [asyncio.create_task(client.generate(p, params)) for p in prompts[1:]]
            print(f">>> {QUESTIONS[0]}", flush=True)
            async for delta in client.stream(prompts[0], params):
                print(delta.text, end="", flush=True)
            print()
            for question, completion in zip(QUESTIONS[1:], await asyncio.gather(*others)):
                print(f"\n>>> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
            elapsed = time.perf_counter() - start
            stats = await client.stats()
            routed = ", ".join(f"rank {w.dp_rank}: {w.requests_routed}" for w in stats.workers)
            print(f"\n{len(prompts)} answers in {elapsed:.1f} s; requests per worker: {routed}")
            await ask_over_http(client, args)
    finally:
        await cluster.shutdown()


async def ask_over_http(client, args: argparse.Namespace) -> None:
    """The HTTP front on this cluster (a free port), and one streamed chat completion through it."""
    from infer.client.api.config import FrontConfig
    from infer.client.api.server import HttpFront, load_front_tokenizer

    front = HttpFront(
        client, load_front_tokenizer(args.model, client.model_id), FrontConfig(served_model_name="default"), port=0
    )
    front.bind()
    serving = asyncio.create_task(front.serve())
    try:
        body = {
            "model": "default",
            "stream": True,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": HTTP_QUESTION}],
        }
        print(f"\nHTTP front at {front.url}: POST /v1/chat/completions (stream)\n>>> {HTTP_QUESTION}", flush=True)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        reading = asyncio.create_task(
            asyncio.to_thread(
                _read_sse,
                f"{front.url}/v1/chat/completions",
                body,
                lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text),
            )
        )
        while (text := await pieces.get()) is not None:
            print(text, end="", flush=True)
        await reading
        print()
    finally:
        front.shutdown()
        await asyncio.wait([serving], timeout=10)


def _read_sse(url: str, body: dict, emit) -> None:
    """POST `body` and hand every content piece of the event stream to `emit` (None at the end)."""
    import json
    import urllib.request

    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    for choice in json.loads(line[6:]).get("choices", []):
                        emit(choice["delta"].get("content") or "")
    finally:
        emit(None)


def run_offline(args: argparse.Namespace, prompts: list[str], params: SamplingParams) -> None:
    from infer.client.llm import LLM

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
    start = time.perf_counter()
    completions = llm.generate(prompts, params, use_tqdm=False)
    for question, completion in zip(QUESTIONS, completions):
        print(f"\n>>> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    print(f"\n{len(prompts)} answers in {time.perf_counter() - start:.1f} s (in-process engine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="safetensors dir or .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument(
        "--quantization",
        default="none",
        choices=["none", "auto"],
        help="none (default): the GGUF dequantized at load, answers at full precision; auto: its 4-bit blocks",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--offline", action="store_true", help="in-process LLM instead of a local cluster")
    args = parser.parse_args()
    if args.workers < 1 or args.threads < 1 or args.max_tokens < 1:
        parser.error("--workers, --threads and --max-tokens must be >= 1")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    prompts = chat_prompts(args.model)
    if args.offline:
        run_offline(args, prompts, params)
    else:
        asyncio.run(run_cluster(args, prompts, params))


if __name__ == "__main__":
    main()
