"""infer-worker's command line: `infer-worker --coordinator tcp://H:P [--model M] [engine options]`.

Flags -> EngineConfig + WorkerOptions (bad ones: exit 2), the engine built (torch imported only when a model
runs), then the daemon (`worker/service/daemon.py`) until it exits with its code (see `worker/service/core.py`).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any, NoReturn

import zmq

from infer.protocol.logs import add_logging_args, setup_logging
from infer.protocol.options import add_options, add_vllm_flags, given
from infer.worker.distributed.group_sync import EpOptions
from infer.worker.engine.config import EngineConfig
from infer.worker.kv.offload_store import check_offload_dir
from infer.worker.parallel.pp_group import PpOptions
from infer.worker.parallel.tp_group import TpOptions
from infer.worker.service.core import EXIT_FATAL, EXIT_USAGE, EngineLike
from infer.worker.service.daemon import Worker
from infer.worker.service.options import EP_FLAGS, KEY_FLAGS, PP_FLAGS, TP_FLAGS, WorkerFlags, WorkerOptions

log = logging.getLogger("infer.worker")


def build_parser() -> argparse.ArgumentParser:
    """The flags of WorkerOptions, WorkerFlags and EngineConfig (each field declares its own), and logging's."""
    p = argparse.ArgumentParser(
        prog="infer-worker",
        description="An inference worker (one DP rank): runs an "
        "engine for the coordinator and streams token deltas back.",
    )
    add_options(p, WorkerOptions, names=("coordinator",))
    add_options(p.add_argument_group("engine options (vLLM's names)"), EngineConfig)
    add_options(p.add_argument_group("worker options"), WorkerOptions, exclude=("coordinator",))
    add_options(
        p.add_argument_group(
            "tensor parallelism (a DP rank of several processes, each holding a shard of every layer)"
        ),
        WorkerFlags,
        names=TP_FLAGS,
    )
    pp = p.add_argument_group(
        "pipeline parallelism (a DP rank of several processes, each holding a range of the "
        "layers, each stage a TP group with --tp-size; one batch at a time through the stages: "
        "capacity, not speed)"
    )
    add_options(pp, WorkerFlags, names=PP_FLAGS)
    add_options(
        p.add_argument_group("expert parallelism (an EP group of ranks sharing an MoE model's experts)"),
        WorkerFlags,
        names=EP_FLAGS,
    )
    add_options(
        p.add_argument_group("security (CurveZMQ: both flags, when the coordinator has keys)"),
        WorkerFlags,
        names=KEY_FLAGS,
    )
    add_logging_args(p)
    add_vllm_flags(p)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the flags given (the others keep EngineConfig's defaults); ValueError if invalid."""
    return EngineConfig.from_options(**given(EngineConfig, args))


def worker_flags(args: argparse.Namespace) -> WorkerFlags:
    """The EP / TP and key flags given (the others keep WorkerFlags' defaults); ValueError if invalid."""
    return WorkerFlags(**given(WorkerFlags, args))


def worker_options(args: argparse.Namespace, flags: WorkerFlags) -> WorkerOptions:
    """WorkerOptions from the flags given, with the groups and keys of `flags`; the worker id defaults to
    hostname-pid, the group id to the EP group's (else dp<rank> when the rank is given). ValueError if invalid."""
    ep, tp = flags.groups()
    if args.coordinator is None:
        raise ValueError("--coordinator is required (tcp://HOST:PORT)")
    options = given(WorkerOptions, args)
    options["worker_id"] = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    options["group_id"] = args.group_id or (
        ep.default_group_id if ep is not None else None if args.dp_rank is None else f"dp{args.dp_rank}"
    )
    return WorkerOptions(**options, ep=ep, tp=tp, curve=flags.curve_keys())


def make_engine(
    config: EngineConfig,
    benchmark_mode: bool,
    ep: EpOptions | None = None,
    benchmark_step_time: float = 0.0,
    parallel: Any = None,
) -> EngineLike:
    """The engine; with `ep`, after joining the EP group's torch.distributed world (every member must);
    with `parallel` (TP rank 0 of a TP group, world joined), the engine on this rank's shards, connected to
    its followers."""
    if benchmark_mode:
        from infer.worker.service.benchmark_engine import BenchmarkEngine

        return BenchmarkEngine(config, benchmark_step_time)
    from infer.worker.engine.engine import Engine  # torch is imported only when a model runs
    from infer.worker.engine.engine_setup import pick_device

    if parallel is not None:
        from infer.worker.parallel.tp_commands import TpLeader

        engine = Engine(config, parallel.ep, tp=parallel.tp)
        engine.runner.followers = TpLeader(parallel)
        return engine
    if ep is None:
        return Engine(config)
    from infer.worker.distributed.expert_parallel import ExpertParallel

    return Engine(config, ExpertParallel.join(ep, pick_device(config.device)))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        config, flags = engine_config(args), worker_flags(args)
        if config.kv_offload_dir is not None:  # on this host, before anything loads
            check_offload_dir(config.kv_offload_dir)
        ep, tp = flags.groups()
        pp = flags.pipeline()
        if config.enable_lora and pp is not None:
            raise ValueError(
                "--enable-lora is not supported with --pp-size > 1 yet: the pipeline's stages do not "
                "get the adapters' step commands (serve adapters on DP or TP ranks)"
            )
        leads = (tp is None or not tp.rank) and (pp is None or not pp.rank)
        if leads:  # TP ranks and pipeline stages > 0 never talk to the coordinator
            options = worker_options(args, flags)
            if pp is not None and options.benchmark_mode:
                raise ValueError("--benchmark-mode has no model, so no pipeline: leave out --pp-size")
            _check_kv_role(flags, config, options)
            config = role_engine_config(config, options)
    except ValueError as e:
        parser.error(str(e))  # exit 2
    if (tp is not None and tp.rank is None) or (pp is not None and pp.rank is None):  # this DP rank's processes
        from infer.worker.parallel.tp_supervisor import members, supervise

        if pp is not None and tp is not None and (pp.rank is None) != (tp.rank is None):
            parser.error(
                "a pipeline of TP groups: give both --pp-rank and --tp-rank, or neither (then this command "
                "starts every process of the DP rank)"
            )
        dist_init = pp.dist_init if pp is not None else tp.dist_init if tp is not None else None
        sys.exit(
            supervise(
                argv, members(tp.size if tp is not None else 1, pp.size if pp is not None else 1), dist_init, main
            )
        )
    _exit(_run(config, options if leads else None, ep, tp, pp))


def _check_kv_role(flags: WorkerFlags, config: EngineConfig, options: WorkerOptions) -> None:
    """What a worker with a KV port (any role) does not do yet is refused by name (ValueError: exit 2)."""
    if options.kv_transfer_config is None:
        return
    role = options.kv_transfer_config.kv_role
    refused = (
        (flags.tp_size > 1, "--tp-size > 1 (each TP rank's shard of the KV is not sent yet)"),
        (flags.pp_size > 1, "--pp-size > 1 (each stage's layers' KV is not sent yet)"),
        (
            role != "kv_producer" and not config.enable_prefix_caching,
            "prefix caching off (the blocks it receives are kept in its prefix cache)",
        ),
    )
    for bad, why in refused:
        if bad:
            raise ValueError(f"--kv-transfer-config: {role} is not supported with {why}")


def role_engine_config(config: EngineConfig, options: WorkerOptions) -> EngineConfig:
    """`config` on this worker's KV role (EngineConfig.for_kv_role: a producer's default long_prefill_token_threshold),
    logged when the role changed it."""
    resolved = config.for_kv_role(options.kv.kv_role)
    if resolved.long_prefill_token_threshold != config.long_prefill_token_threshold:
        log.info(
            "%s: prefill chunks capped at %d tokens a step, so short prompts are prefilled beside a long one "
            "(--long-prefill-token-threshold N sets it, 0 turns it off)",
            options.kv.kv_role,
            resolved.long_prefill_token_threshold,
        )
    return resolved


def _run(
    config: EngineConfig,
    options: WorkerOptions | None,
    ep: EpOptions | None,
    tp: TpOptions | None,
    pp: PpOptions | None = None,
) -> int:
    """Start the engine (joining its TP group or pipeline first) and serve; the exit code. A TP rank or pipeline
    stage > 0 (`options` None) serves its group's rank 0 instead."""
    parallel: Any = None
    try:
        if options is None or not options.benchmark_mode:
            _load_kernels(config)
        if pp is not None:  # its stages TP groups with --tp-size, one DP rank of an EP group with --ep-size
            from infer.worker.parallel.pp_group import join
            from infer.worker.parallel.pp_stage import leader_engine, run_stage

            parallel, path, config = join(config, pp, tp, ep)
            if not parallel.is_leader:
                return run_stage(config, parallel, path)
        elif tp is not None:
            parallel, path, config = _join_tp_group(config, tp, ep)
            if parallel.tp.rank > 0:
                from infer.worker.parallel.tp_group import run_follower

                return run_follower(config, parallel, path)
        if options is None:
            raise ValueError("only TP rank 0 of stage 0 talks to the coordinator")
        engine: EngineLike
        if pp is not None:
            engine = leader_engine(config, parallel)
        else:
            engine = make_engine(config, options.benchmark_mode, options.ep, options.benchmark_step_time, parallel)
        if options.kv_transfer_config is not None and getattr(
            getattr(engine, "model", None), "is_encoder_decoder", False
        ):
            raise ValueError(
                "--kv-transfer-config is not supported for an encoder-decoder model (its cross-attention blocks are "
                "not sent)"
            )
    except ValueError as e:  # options the engine finds impossible (model path, KV budget, context length)
        log.error("fatal: %s", e)
        return EXIT_USAGE
    except Exception:  # reported with its traceback: exit 1
        log.exception("fatal: the engine failed to start")
        return EXIT_FATAL
    if options.curve is not None:  # the coordinator must hold this key in its workers/ folder
        log.info("CurveZMQ on: this worker's public key %s", options.curve.public_key.decode())
    followers = getattr(getattr(engine, "runner", None), "followers", None)
    code = EXIT_FATAL
    try:
        code = _serve(engine, options, parallel, followers)
        return code
    finally:
        if followers is not None:  # rank 0 of a TP group: the other ranks end with it, with its exit code
            followers.stop(code)


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


def _load_kernels(config: EngineConfig) -> None:
    """On a CPU: the kernel table made (the native library built, a cold cache's tens of seconds, or loaded) before
    this process joins a TP group or pipeline, whose peers bound every wait of a step by --tp-timeout / --pp-timeout:
    none of that should be spent on one member's build. (A GPU's table builds nothing; its device is the join's.)"""
    from infer.kernels.dispatch import kernels_for
    from infer.worker.engine.engine_setup import pick_device

    device = pick_device(config.device)
    if device.type == "cpu":
        kernels_for(device)


def _join_tp_group(config: EngineConfig, tp: TpOptions, ep: EpOptions | None) -> tuple[Any, Any, EngineConfig]:
    """Join the TP group's world: (this process's place there, the model directory, the config with this
    process's own GPU)."""
    from infer.worker.parallel.tp_group import join

    return join(config, tp, ep)


def _serve(engine: EngineLike, options: WorkerOptions, parallel: Any, followers: Any) -> int:
    """Serve the coordinator until the end; the exit code. `followers`: TP rank 0's TpLeader (its `lost` is
    checked while idle)."""
    ctx = zmq.Context()
    group = None
    if options.ep is not None:
        from infer.worker.distributed.group_sync import GroupSync

        try:
            group = GroupSync(
                options.ep, ctx, curve=options.curve, group=None if parallel is None else parallel.ep_leaders_group
            )
        except Exception:
            log.exception("fatal: the EP group's wake channel could not be set up")
            return EXIT_FATAL
    worker = Worker(engine, options, ctx, group, group_lost=None if followers is None else lambda: followers.lost)
    worker.install_signal_handlers()
    code = worker.run()
    ctx.term()
    return code


if __name__ == "__main__":
    main()
