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
from typing import Any, NoReturn

import zmq

from infer.protocol.keys import CurveKeys
from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.options import add_options, given
from infer.worker.config import EngineConfig
from infer.worker.core import EXIT_FATAL, EXIT_USAGE, EngineLike
from infer.worker.daemon import Worker
from infer.worker.group_sync import EpOptions
from infer.worker.options import WorkerOptions
from infer.worker.tp_group import TpOptions, resolve_ranks

log = logging.getLogger("infer.worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infer-worker", description="An inference worker (one DP rank): runs an "
                                "engine for the coordinator and streams token deltas back.")
    p.add_argument("--coordinator", help="the coordinator's address, tcp://HOST:PORT (required, except by TP "
                   "ranks > 0: only TP rank 0 talks to the coordinator)")
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
    tp = p.add_argument_group("tensor parallelism (a DP rank of several processes, each holding a shard of "
                              "every layer)")
    tp.add_argument("--tp-size", type=int, default=1,
                    help="processes in this DP rank (default 1). Without --tp-rank, this command starts and "
                    "supervises all of them on this node")
    tp.add_argument("--tp-rank", type=int, help="this process's rank in its TP group (one process per rank, "
                    "with --dist-init; default: from $RANK or $SLURM_PROCID, global rank = ep_rank x tp_size + "
                    "tp_rank; TP rank 0 talks to the coordinator)")
    tp.add_argument("--tp-timeout", type=float, default=60.0,
                    help="seconds a TP collective waits for a member, and a follower waits to hear from TP "
                    "rank 0, before giving up (default 60)")
    ep = p.add_argument_group("expert parallelism (an EP group of ranks sharing an MoE model's experts)")
    ep.add_argument("--ep-size", type=int, default=1, help="ranks in this EP group (default 1: no group)")
    ep.add_argument("--ep-rank", type=int,
                    help="this rank in the group (default: $RANK, else $SLURM_PROCID %% ep-size)")
    ep.add_argument("--dist-init", help="the EP / TP group's rendezvous, tcp://HOST:PORT, the same on every "
                    "member (default: tcp://$MASTER_ADDR:$MASTER_PORT)")
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


def parallel_options(args: argparse.Namespace) -> tuple[EpOptions | None, TpOptions | None]:
    """This process's EP and TP groups from the flags (or torchrun / Slurm variables); None: a group of one."""
    if args.ep_size < 1:
        raise ValueError(f"--ep-size must be >= 1, got {args.ep_size}")
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    tp_rank, ep_rank = resolve_ranks(args.tp_size, args.tp_rank, args.ep_size, args.ep_rank)
    ep = None
    if args.ep_size > 1:
        ep = EpOptions.resolve(args.ep_size, ep_rank, args.dist_init, args.ep_timeout)
    elif args.ep_rank not in (None, 0) or (args.dist_init is not None and args.tp_size == 1):
        raise ValueError("--ep-rank and --dist-init need --ep-size > 1 (or --tp-size > 1)")
    tp = None
    if args.tp_size > 1:
        tp = TpOptions(size=args.tp_size, rank=tp_rank, dist_init=_tp_dist_init(args, ep, tp_rank),
                       timeout_s=args.tp_timeout)
    elif args.tp_rank not in (None, 0):
        raise ValueError("--tp-rank needs --tp-size > 1")
    return ep, tp


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    ep, tp = parallel_options(args)
    if args.coordinator is None:
        raise ValueError("--coordinator is required (tcp://HOST:PORT)")
    group_id = args.group_id or (ep.default_group_id if ep is not None
                                 else None if args.dp_rank is None else f"dp{args.dp_rank}")
    return WorkerOptions(
        coordinator=args.coordinator, worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        dp_rank=args.dp_rank, group_id=group_id,
        heartbeat_interval=args.heartbeat_interval, coordinator_timeout=args.coordinator_timeout,
        drain_timeout=args.drain_timeout, connect_timeout=args.connect_timeout,
        benchmark_mode=args.benchmark_mode, benchmark_step_time=args.benchmark_step_time, ep=ep, tp=tp,
        max_waiting_requests=args.max_waiting_requests, max_queue_time=args.max_queue_time,
        curve=CurveKeys.from_files(args.curve_key, args.coordinator_key,
                                   flags=("--curve-key", "--coordinator-key")))


def _tp_dist_init(args: argparse.Namespace, ep: EpOptions | None, tp_rank: int | None) -> str | None:
    """The TP group's rendezvous: --dist-init, the EP group's, $MASTER_ADDR:$MASTER_PORT, or (a supervisor
    with none of these) None: it picks a local port for the processes it starts."""
    if args.dist_init is not None or ep is not None:
        return args.dist_init if ep is None else ep.dist_init
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return None


def make_engine(config: EngineConfig, benchmark_mode: bool, ep: EpOptions | None = None,
                benchmark_step_time: float = 0.0, parallel: Any = None) -> EngineLike:
    """The engine; with `ep`, after joining the EP group's torch.distributed world (every member must);
    with `parallel` (TP rank 0 of a TP group, world joined), the engine on this rank's shards, connected to
    its followers."""
    if benchmark_mode:
        from infer.worker.benchmark_engine import BenchmarkEngine

        return BenchmarkEngine(config, benchmark_step_time)
    from infer.worker.engine import Engine, pick_device  # torch is imported only when a model runs

    if parallel is not None:
        from infer.worker.tp_commands import TpLeader

        engine = Engine(config, parallel.ep, tp=parallel.tp)
        engine.runner.followers = TpLeader(parallel)
        return engine
    if ep is None:
        return Engine(config)
    from infer.worker.group_sync import init_group

    return Engine(config, init_group(ep, pick_device(config.device)))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config, (ep, tp) = engine_config(args), parallel_options(args)
        if tp is None or not tp.rank:   # TP ranks > 0 never talk to the coordinator
            options = worker_options(args)
    except ValueError as e:
        parser.error(str(e))   # exit 2
    if tp is not None and tp.rank is None:   # this DP rank's processes, on this node
        from infer.worker.tp_supervisor import supervise

        sys.exit(supervise(argv, tp))
    _exit(_run(config, options if tp is None or not tp.rank else None, ep, tp))


def _run(config: EngineConfig, options: WorkerOptions | None, ep: EpOptions | None, tp: TpOptions | None) -> int:
    """Start the engine (joining its TP group first) and serve; the exit code. A TP rank > 0 (`options`
    None) serves its group's rank 0 instead."""
    parallel = None
    try:
        if tp is not None:
            parallel, path, config = _join_tp_group(config, tp, ep)
            if parallel.tp.rank > 0:
                from infer.worker.tp_group import run_follower

                return run_follower(config, parallel, path)
        assert options is not None
        engine = make_engine(config, options.benchmark_mode, options.ep, options.benchmark_step_time, parallel)
    except ValueError as e:    # options the engine finds impossible (model path, KV budget, context length)
        log.error("fatal: %s", e)
        return EXIT_USAGE
    except Exception:  # reported with its traceback: exit 1
        log.exception("fatal: the engine failed to start")
        return EXIT_FATAL
    if options.curve is not None:   # the coordinator must hold this key in its workers/ folder
        log.info("CurveZMQ on: this worker's public key %s", options.curve.public_key.decode())
    followers = getattr(getattr(engine, "runner", None), "followers", None)
    try:
        return _serve(engine, options, parallel)
    finally:
        if followers is not None:   # rank 0 of a TP group: the other ranks end with it
            followers.stop()


def _exit(code: int) -> NoReturn:
    """Exit with `code`. A member of a torch.distributed world leaves at once, skipping the C++ destructors of
    its process groups: with a peer already gone they can abort the process (SIGABRT) instead of exiting."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _join_tp_group(config: EngineConfig, tp: TpOptions, ep: EpOptions | None) -> tuple[Any, Any, EngineConfig]:
    """Join the TP group's world: (this process's place there, the model directory, the config with this
    process's own GPU)."""
    from infer.worker.tp_group import join

    return join(config, tp, ep)


def _serve(engine: EngineLike, options: WorkerOptions, parallel: Any) -> int:
    ctx = zmq.Context()
    group = None
    if options.ep is not None:
        from infer.worker.group_sync import GroupSync

        try:
            group = GroupSync(options.ep, ctx, curve=options.curve,
                              group=None if parallel is None else parallel.ep_leaders_group)
        except Exception:
            log.exception("fatal: the EP group's wake channel could not be set up")
            return EXIT_FATAL
    worker = Worker(engine, options, ctx, group)
    worker.install_signal_handlers()
    code = worker.run()
    ctx.term()
    return code


if __name__ == "__main__":
    main()
