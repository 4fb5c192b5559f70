"""One pipeline stage's share of a Llama-family model (see worker/parallel/pp_group.py for the pipeline itself), and the
processes' entry points: stage 0's engine (`leader_engine`, `pipeline_parallel_engine`), every other process's loop
(`run_stage`).

`StageLoader.load_model` builds our model with deferred weights, keeps only this stage's parts (its layers under
their own names `model.layers.<i>.*`, so the loader's name mapping holds; the embedding on the first stage; the
final norm and the LM head on the last, whose tied head keeps the embedding table as its weight) and reads only
their tensors from the files. `StageModel` is what the engine (stage 0) and the stage loop (the others) run:

- stage 0's `forward` runs the embedding and its layers and sends (hidden, residual) to stage 1; it returns the
  row numbers [T] in place of hidden states, so that the model runner's `hidden[rows]` are the rows whose logits
  `compute_logits` receives from the last stage (which got them from the "logits" command);
- a later stage receives (hidden, residual), runs its layers, and sends on or, on the last stage, sends the logits
  of the batch's `logits_indices` rows to stage 0 at once (`receive_logits` there) and keeps the normed hidden
  states for "logits" commands (prompt logprobs), whose logits it sends too (`compute_logits`), so that the
  later stages (and stage 0's TP ranks > 0) run worker/parallel/tp_commands.py's follower loop as TP followers do. Sends
  are not waited for (micro-batches in flight: worker/parallel/pp_group.py).

PP x TP: each stage is a TP group whose processes hold their shards of the stage's layers (the embedding and LM
head vocabulary-parallel); after a stage's layers every TP rank holds the whole (hidden, residual) (the row-parallel
layers all-reduce), and TP rank t sends it to TP rank t of the next stage. PP with EP: the model's MoE layers hold
this rank's experts (`group.ep`) and exchange tokens with the same stage of the EP group's other pipelines.

Step graphs and the native CPU decode step are not used on stages (every step runs the layers one by one).
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.loading.gguf import close_gguf_files
from infer.worker.loading.loader import (
    build_model,
    file_tensors,
    load_named_tensors,
    materialize,
    pack_weights,
    quant_plan,
    set_weight_prepack,
    weight_files,
)
from infer.worker.models.layers import deferred_weights
from infer.worker.models.llama import LlamaForCausalLM, LlamaModel
from infer.worker.parallel.pp_group import PendingSend, PipelineGroup, PpOptions, agree_min, join

if TYPE_CHECKING:
    from infer.worker.engine.config import EngineConfig
    from infer.worker.engine.engine import Engine

log = logging.getLogger("infer.worker")


class StageModel:
    """This stage's layers of the model (`lm`: our LlamaForCausalLM with the other stages' parts removed), with
    the attributes the engine reads from a model (config, dtype, num_layers: this stage's, KV heads, head_dim,
    vocab_size)."""

    supports_step_graphs: ClassVar[bool] = False

    def __init__(self, lm: LlamaForCausalLM, group: PipelineGroup) -> None:
        self.lm, self.group = lm, group
        self.config, self.dtype = lm.config, lm.dtype
        self.num_layers = len(group.layers)
        self.num_kv_heads, self.head_dim, self.vocab_size = lm.num_kv_heads, lm.head_dim, lm.vocab_size
        self.hidden_size = int(lm.config.hidden_size)
        self._final: torch.Tensor | None = None  # the last stage: the last forward's normed hidden states
        self._sends: deque[PendingSend] = deque()  # hand-offs (or logits) under way, oldest first

    def __call__(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        return self.forward(batch, kv_cache)

    def modules(self) -> Iterator[nn.Module]:
        """This stage's modules (as a model's: the loader re-packs its linears through them)."""
        return self.lm.modules()

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """This stage's part of the forward: from the embedding (stage 0) or the previous stage's (hidden, residual),
        through its layers, to the next stage or (the last) the normed hidden states, whose rows
        `batch.logits_indices` go to stage 0 as logits at once (`receive_logits`) and which are kept for "logits"
        commands. Hand-offs are not waited for: the stage goes on with the next micro-batch. Returns the row
        numbers [T] (stage 0's runner indexes them; see the module doc)."""
        model = cast(LlamaModel, self.lm.model)  # load_stage takes only PIPELINE_MODEL_TYPES: LlamaModel's forward
        layers = cast(nn.ModuleDict, model.layers)  # keep_stage_parts: this stage's layers by global index
        num_tokens = batch.input_ids.shape[0]
        if self.group.is_first:
            hidden, residual = model.embed_tokens(batch.input_ids), None
        else:
            both = self.group.receive((2, num_tokens, self.hidden_size), self.dtype, self.group.stage - 1)
            hidden, residual = both[0], both[1]
        model.rotary_emb.reserve(max(batch.context_lens, default=0))
        batch = model.rotary_emb.rope_batch(batch)  # LongRoPE: the long factors' rows past the original length
        for layer, k_cache, v_cache in zip(layers.values(), kv_cache.k, kv_cache.v, strict=True):
            hidden, residual = layer(batch.positions, hidden, residual, batch, k_cache, v_cache)
        if self.group.is_last:
            self._final = model.norm(hidden, residual)[0]
            if batch.logits_indices.numel():
                logits = self.lm.compute_logits(self._final[batch.logits_indices])
                if logits is not None:  # TP: gathered on TP rank 0
                    self._start_send(logits.float(), 0, tp_rank=0)
        elif residual is None:  # never: each stage has a layer (--pp-layer-partition), and a layer makes it
            raise ValueError("a pipeline stage ran no layer")
        else:
            self._start_send(torch.stack((hidden, residual)), self.group.stage + 1)
        return torch.arange(num_tokens, device=batch.input_ids.device)

    def _start_send(self, tensor: torch.Tensor, stage: int, tp_rank: int | None = None) -> None:
        """Send without waiting; at most `group.size` sends stay under way (the engine has at most that many
        micro-batches in flight, so the oldest was received already, or is about to be)."""
        while len(self._sends) >= self.group.size:
            self._sends.popleft().wait()
        self._sends.append(self.group.start_send(tensor, stage, tp_rank))

    def receive_logits(self, num_rows: int) -> torch.Tensor:
        """On the engine's process: the logits [num_rows, vocab] float32 of a forward's `logits_indices`, which the
        last stage sent when it ran that forward (forwards' logits come in the order of the forwards)."""
        group = self.group
        return group.receive((num_rows, self.vocab_size), torch.float32, group.size - 1, tp_rank=0)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The logits [N, vocab] float32 of the last forward's `rows` (row numbers; prompt logprobs: the engine sends
        this "logits" command only while no later forward is in flight): on the engine's process (stage 0, TP rank
        0), received from the last stage's TP rank 0. The last stage's processes compute them (with TP, gathered on
        its TP rank 0, which sends them to stage 0); the others do nothing. None but on the engine's."""
        group = self.group
        if group.is_leader:
            return group.receive((rows.shape[0], self.vocab_size), torch.float32, group.size - 1, tp_rank=0)
        if group.is_last:
            if self._final is None:
                raise ValueError("a logits command before any forward")
            logits = self.lm.compute_logits(self._final[rows])
            if logits is not None:
                self._start_send(logits.float(), 0, tp_rank=0)
        return None


class StageLoader:
    """What the engine needs to be stage 0 of a pipeline: this stage's model, and the KV block count the stages
    agree on."""

    def __init__(self, group: PipelineGroup) -> None:
        self.group = group

    def load_model(self, path: Path, dtype: torch.dtype, device: torch.device, quantization: str) -> StageModel:
        return StageModel(load_stage(path, dtype, device, self.group, quantization), self.group)

    def agree_min(self, num_blocks: int) -> int:
        return agree_min(self.group, num_blocks)


# The model types whose model forward is LlamaModel's, which StageModel.forward runs a range of layers of (Gemma's
# scaled embedding and per-layer-type ropes, DeepSeek's latent KV pool: not yet).
PIPELINE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"})


def load_stage(
    path: Path, dtype: torch.dtype, device: torch.device, group: PipelineGroup, quantization: str = "auto"
) -> LlamaForCausalLM:
    """Our model of directory `path` with only `group`'s parts, filled from the files' tensors of those parts."""
    from infer.worker.loading.model_config import read_model_config

    files = weight_files(Path(path))
    config = read_model_config(Path(path))
    if config.model_type not in PIPELINE_MODEL_TYPES:
        raise ValueError(
            f"pipeline parallelism does not support model type {config.model_type!r} yet: a stage runs "
            f"the Llama model's forward, which this family's differs from (supported: "
            f"{', '.join(sorted(PIPELINE_MODEL_TYPES))})"
        )
    with deferred_weights():
        # a Llama-family class: PIPELINE_MODEL_TYPES' classes are LlamaForCausalLM or its subclasses
        lm = cast(LlamaForCausalLM, build_model(config, dtype, device, group.ep, group.tp))
    plan = quant_plan(lm, files, quantization)  # of the whole model: the names are the same
    tied = lm.lm_head_tied
    keep_stage_parts(lm, group, tied)
    materialize(lm, plan, device)
    try:
        load_named_tensors(
            lm, ((key, read, where) for key, read, where in file_tensors(files) if holds(key, group, tied))
        )
    finally:
        close_gguf_files()
    pack_weights(lm)
    return lm.eval()


def keep_stage_parts(lm: LlamaForCausalLM, group: PipelineGroup, tied: bool) -> None:
    """Remove from `lm` (built with deferred weights) what other stages hold: other layers, the embedding (kept
    on the last stage as a `tied` LM head's weight), the final norm and LM head. (register_module: the stage's
    model is a Llama model with its parts reshaped, layers keyed by their global index and empty slots None, which
    the Llama classes' attribute types do not say.)"""
    model = lm.model
    model.register_module("layers", nn.ModuleDict({str(i): model.layers[i] for i in group.layers}))
    if not group.is_last:
        lm.register_module("lm_head", None)
        model.register_module("norm", None)
    if not group.is_first and not (group.is_last and tied):
        model.register_module("embed_tokens", None)


def holds(key: str, group: PipelineGroup, tied: bool) -> bool:
    """Whether checkpoint tensor `key` belongs to this stage."""
    parts = key.split(".")
    if "layers" in parts:
        index = parts[parts.index("layers") + 1]
        return index.isdigit() and int(index) in group.layers
    if "embed_tokens" in parts:
        return group.is_first or (group.is_last and tied)
    if parts[0] == "lm_head" or "norm" in parts:
        return group.is_last
    return True


# ---- the processes' entry points ---------------------------------------------------------------------------


def leader_engine(config: EngineConfig, group: PipelineGroup, children: Sequence[Any] = ()) -> Engine:
    """Stage 0's engine (TP rank 0 of stage 0), connected to this DP rank's other processes
    (`engine.runner.followers`: the command channel); with an EP group it steps with the group's other engines."""
    from infer.worker.engine.engine import Engine
    from infer.worker.parallel.tp_commands import TpLeader

    if config.enforce_eager is False:
        log.warning(
            "--no-enforce-eager: step graphs are not made for pipeline stages yet (a stage's layers and its "
            "hand-offs run op by op); the pipeline runs eagerly"
        )
    engine = Engine(config, group.ep, stage=StageLoader(group))
    engine.runner.followers = TpLeader(group, children=children)
    return engine


def run_stage(config: EngineConfig, group: PipelineGroup, path: Path) -> int:
    """The life of any other process of the pipeline (a stage > 0, or a TP rank > 0 of a stage): load its share of
    its stage's layers, size its KV pool with the others, serve stage 0's commands (worker/parallel/tp_commands.py's
    follower loop). Returns the exit code (stage 0's when it said stop: 0 only when the rank was told to stop)."""
    from infer.worker.engine.engine_setup import context_length, num_kv_blocks
    from infer.worker.parallel.tp_commands import FollowerChannel, serve_follower, start_follower

    device, dtype = start_follower(config)
    loader = StageLoader(group)
    model = loader.load_model(path, dtype, device, config.quantization)
    set_weight_prepack(model, config.cpu_weight_prepack)
    max_model_len = context_length(config, model.config)
    blocks = loader.agree_min(num_kv_blocks(config, model, dtype, device, max_model_len))
    kv_cache = KVCache.allocate(
        model.num_layers, blocks, config.block_size, model.num_kv_heads, model.head_dim, dtype, device
    )
    channel = FollowerChannel(group)
    log.info(
        "%s ready on %s: layers %d..%d, %d KV blocks",
        group.member(group.index),
        socket.gethostname(),
        group.layers.start,
        group.layers.stop - 1,
        blocks,
    )
    return serve_follower(model, kv_cache, config.block_size, channel, device)


def pipeline_parallel_engine(
    config: EngineConfig,
    size: int,
    worker_flags: Sequence[str],
    timeout_s: float = 60.0,
    partition: tuple[int, ...] | None = None,
    tp_size: int = 1,
) -> Engine:
    """An engine that is stage 0 of a pipeline of `size` stages (each a TP group of `tp_size` processes), the other
    processes started now as children of this one on this machine (`infer-worker` with `worker_flags`: the same
    engine options); `close()` ends them. (LLM / AsyncLLM's direct mode with pipeline_parallel_size > 1.)"""
    from infer.protocol.ports import reserved_port
    from infer.worker.parallel.tp_group import TpOptions
    from infer.worker.parallel.tp_supervisor import members, start_members

    dist_init = f"tcp://127.0.0.1:{reserved_port()}"
    flags = [*worker_flags, "--pp-size", str(size), "--pp-timeout", str(timeout_s)]
    if tp_size > 1:
        flags += ["--tp-size", str(tp_size), "--tp-timeout", str(timeout_s)]
    if partition is not None:
        flags += ["--pp-layer-partition", ",".join(map(str, partition))]
    children = start_members(members(tp_size, size)[1:], dist_init, flags)
    try:
        tp = TpOptions(size=tp_size, rank=0, dist_init=dist_init, timeout_s=timeout_s) if tp_size > 1 else None
        group, _, config = join(
            config, PpOptions(size=size, rank=0, dist_init=dist_init, timeout_s=timeout_s, partition=partition), tp
        )
        return leader_engine(config, group, children)
    except BaseException:
        for child in children:
            child.kill()
            child.wait(timeout=10)
        import torch.distributed as dist

        if dist.is_initialized():  # so that another pipeline can be made in this process
            dist.destroy_process_group()
        raise
