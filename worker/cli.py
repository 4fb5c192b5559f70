"""infer-worker's command line: `infer-worker --coordinator tcp://H:P [--model M] [engine options]`.

Flags -> EngineConfig + WorkerOptions (bad ones: exit 2), the engine built (torch imported only when a model
runs), then the daemon (`worker/daemon.py`) until it exits with its code (see `worker/core.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import zmq

from infer.protocol.keys import CurveKeys
from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.options import add_options, given
from infer.worker.config import EngineConfig
from infer.worker.core import EXIT_FATAL, EXIT_USAGE, EngineLike
from infer.worker.daemon import Worker
from infer.worker.group_sync import EpOptions
from infer.worker.options import WorkerOptions

log = logging.getLogger("infer.worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer-worker", description="An inference worker (one DP rank): runs an "
                                "engine for the coordinator and streams token deltas back.")
    p.add_argument("--coordinator", required=True, help="the coordinator's address, tcp://HOST:PORT")
    add_options(p.add_argument_group("engine options (vLLM's names)"), EngineConfig)
    worker = p.add_argument_group("worker options")
    worker.add_argument("--dp-rank", type=int, help="this worker's DP rank (default: the coordinator assigns the "
                        "lowest free one, and keeps it when the worker registers again)")
    worker.add_argument("--group-id", help="the group of this rank (default: an EP group is named after its "
                        "--dist-init; otherwise dp<rank>)")
    worker.add_argument("--worker-id", help="this worker's identity (default: hostname-pid)")
    worker.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds (default 1)")
    worker.add_argument("--coordinator-timeout", type=float, default=10.0,
                        help="seconds of coordinator silence before registering again (default 10)")
    worker.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM (default 30)")
    worker.add_argument("--connect-timeout", type=float, default=60.0,
                        help="seconds to wait for the first Welcome (default 60)")
    worker.add_argument("--max-waiting-requests", type=int, default=1024, metavar="N",
                        help="requests that may wait beyond the --max-num-seqs running ones; a request past that "
                        "is refused as overloaded (default 1024)")
    worker.add_argument("--max-queue-time", type=float, default=60.0, metavar="S",
                        help="a request that has waited S seconds in this worker's queue without starting fails "
                        "as overloaded, so its client can retry instead of waiting without end (default 60; "
                        "0: no bound)")
    ep = p.add_argument_group("expert parallelism (an EP group of ranks sharing an MoE model's experts)")
    ep.add_argument("--ep-size", type=int, default=1, help="ranks in this EP group (default 1: no group)")
    ep.add_argument("--ep-rank", type=int,
                    help="this rank in the group (default: $RANK, else $SLURM_PROCID %% ep-size)")
    ep.add_argument("--dist-init", help="the group's rendezvous, tcp://HOST:PORT, the same on every member "
                    "(default: tcp://$MASTER_ADDR:$MASTER_PORT)")
    ep.add_argument("--ep-timeout", type=float, default=60.0,
                    help="seconds a group collective waits for a member before giving up (default 60)")
    security = p.add_argument_group("security (CurveZMQ: both flags, when the coordinator has keys)")
    security.add_argument("--curve-key", metavar="FILE",
                          help="this worker's secret key file (infer-keygen NAME writes NAME.key_secret; its "
                          "NAME.key goes into the coordinator's --authorized-keys directory)")
    security.add_argument("--coordinator-key", metavar="FILE",
                          help="the coordinator's public key file (its NAME.key)")
    worker.add_argument("--benchmark-mode", action="store_true",
                        help="no model: each request yields token (prompt_len + i) %% 1000 per step, empty text, "
                        "up to max_tokens (for measuring coordinator overhead)")
    worker.add_argument("--benchmark-step-time", type=float, default=0.0, metavar="S",
                        help="with --benchmark-mode: each engine step lasts S seconds (to test long steps)")
    add_logging_args(p)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags given (the others keep EngineConfig's defaults); ValueError if invalid."""
    return EngineConfig.from_options(**given(EngineConfig, args))


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    if args.ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {args.ep_size}")
    ep = None
    if args.ep_size > 1:
        ep = EpOptions.resolve(args.ep_size, args.ep_rank, args.dist_init, args.ep_timeout)
    elif args.ep_rank not in (None, 0) or args.dist_init is not None:
        raise ValueError("--ep-rank and --dist-init need --ep-size > 1")
    group_id = args.group_id or (ep.default_group_id if ep is not None
                                 else None if args.dp_rank is None else f"dp{args.dp_rank}")
    return WorkerOptions(
        coordinator=args.coordinator, worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        dp_rank=args.dp_rank, group_id=group_id,
        heartbeat_interval=args.heartbeat_interval, coordinator_timeout=args.coordinator_timeout,
        drain_timeout=args.drain_timeout, connect_timeout=args.connect_timeout,
        benchmark_mode=args.benchmark_mode, benchmark_step_time=args.benchmark_step_time, ep=ep,
        max_waiting_requests=args.max_waiting_requests, max_queue_time=args.max_queue_time,
        curve=CurveKeys.from_files(args.curve_key, args.coordinator_key,
                                   flags=("--curve-key", "--coordinator-key")))


def make_engine(config: EngineConfig, benchmark_mode: bool, ep: EpOptions | None = None,
                benchmark_step_time: float = 0.0) -> EngineLike:
    """The engine; with `ep`, after joining the EP group's torch.distributed world (every member must)."""
    if benchmark_mode:
        from infer.worker.benchmark_engine import BenchmarkEngine

        return BenchmarkEngine(config, benchmark_step_time)
    from infer.worker.engine import Engine, pick_device  # torch is imported only when a model runs

    if ep is None:
        return Engine(config)
    from infer.worker.group_sync import init_group

    return Engine(config, init_group(ep, pick_device(config.device)))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config, options = engine_config(args), worker_options(args)
    except ValueError as e:
        parser.error(str(e))   # exit 2
    try:
        engine = make_engine(config, options.benchmark_mode, options.ep, options.benchmark_step_time)
    except ValueError as e:    # options the engine finds impossible (model path, KV budget, context length)
        log.error("fatal: %s", e)
        sys.exit(EXIT_USAGE)
    except Exception:  # reported with its traceback: exit 1
        log.exception("fatal: the engine failed to start")
        sys.exit(EXIT_FATAL)
    if options.curve is not None:   # the coordinator must hold this key in its workers/ folder
        log.info("CurveZMQ on: this worker's public key %s", options.curve.public_key.decode())
    ctx = zmq.Context()
    group = None
    if options.ep is not None:
        from infer.worker.group_sync import GroupSync

        try:
            group = GroupSync(options.ep, ctx, curve=options.curve)
        except Exception:
            log.exception("fatal: the EP group's wake channel could not be set up")
            sys.exit(EXIT_FATAL)
    worker = Worker(engine, options, ctx, group)
    worker.install_signal_handlers()
    code = worker.run()
    ctx.term()
    sys.exit(code)


if __name__ == "__main__":
    main()
