"""What the codec's shape bounds cost: `decode` of normal frames against main's way of decoding them
(the frame read with its body as msgspec.Raw, then the body's decoder), and what the shape pre-scan alone
(`check_shape`, the path of frames that are not as `encode` writes them, or that fail) would cost on them.

Interleaved rounds (the machine may be shared): per frame, the best time per call of each, and the median ratio
of this decode to main's over the rounds.

    .venv/bin/python benchmarks/wire_codec.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import write_result  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from infer.protocol import messages  # noqa: E402
from infer.protocol.bounds import check_shape  # noqa: E402
from infer.protocol.messages import (  # noqa: E402
    Delta,
    DeltaBatch,
    Load,
    RequestSpec,
    StepBatch,
    Submit,
    TokenIds,
    decode,
    encode,
)
from infer.protocol.sampling import SamplingParams  # noqa: E402


def mains_decode(frame: bytes) -> object:
    """Before the bounds: the whole frame through msgspec (its body skipped as Raw), then the body's decoder."""
    outer = messages._FRAME_DECODER.decode(frame)
    return messages._DECODERS[outer.type].decode(outer.body)


def normal_frames() -> dict[str, bytes]:
    rng = random.Random(0)
    prompt = TokenIds(rng.randrange(49152) for _ in range(2048))
    sampling = SamplingParams(temperature=0.7, max_tokens=256, seed=3)
    deltas = [
        Delta(request_id=f"req-{i:08d}", token_ids=TokenIds([rng.randrange(49152)]), text=" word") for i in range(64)
    ]
    load = Load(num_waiting=3, num_running=64, num_free_blocks=1000, num_total_blocks=4000, num_queued_tokens=12345)
    return {
        "Submit, 2048 token ids": encode(
            Submit(request_id="r-123456", spec=RequestSpec(prompt_token_ids=prompt, sampling=sampling))
        ),
        "StepBatch, 64 deltas": encode(StepBatch(deltas=deltas, load=load)),
        "DeltaBatch, 64 deltas": encode(DeltaBatch(deltas=deltas)),
    }


def per_call_us(fn: Callable[[bytes], object], frame: bytes, calls: int = 100) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn(frame)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = []
    print(f"{'frame':24s} {'bytes':>6s} {'main us':>8s} {'this us':>8s} {'ratio':>6s} {'pre-scan us':>12s}")
    for name, frame in normal_frames().items():
        times: dict[str, list[float]] = {"main": [], "this": [], "scan": []}
        for _ in range(args.rounds):
            for key, fn in (("main", mains_decode), ("this", decode), ("scan", check_shape)):
                times[key].append(per_call_us(fn, frame))
        ratio = statistics.median(t / m for t, m in zip(times["this"], times["main"]))
        row = {"frame": name, "bytes": len(frame), **{f"{k}_us": min(v) for k, v in times.items()}, "ratio": ratio}
        rows.append(row)
        print(
            f"{name:24s} {len(frame):6d} {row['main_us']:8.1f} {row['this_us']:8.1f} {ratio:6.2f} {row['scan_us']:12.1f}"
        )
    print(f"wrote {write_result('wire_codec', {'rounds': args.rounds, 'rows': rows})}")


if __name__ == "__main__":
    main()
