"""Step graphs: a decode step's forward made once per padded batch-size bucket and replayed.

One mechanism, two backends chosen by device:
- CPU: `torch.compile` of the decoder layer (inductor's C++ code fuses the norm, rotary, SiLU * mul and
  residual chains and drops the per-op Python). The layers of a model share one compiled graph per bucket
  (their weights are the graph's inputs), so compiling a bucket costs one layer's trace, not the model's.
  The block-table width is the graph's one dynamic dimension (the twin reads every column it is given).
- CUDA: a CUDA graph per bucket, captured over the eager forward (its Triton kernels) on the persistent
  input buffers, the block table at full width (the kernels stop at each sequence's length).

A speculative verification step (worker/speculative/verification.py) replays the same graphs: a request's last token and
its k drafts are k + 1 decode rows at consecutive positions over its one block table (row j attends to the context up
to its own position, whose K/V the step appends before attending: the eager forward's layout,
model_runner.build_forward_batch), so a graph is made per row count, not per draft shape, and a step of n
requests with d_i drafts each runs in the smallest bucket >= sum(1 + d_i). Where speculation is on, the buckets
reach the rows of its largest verifying batch (`graph_rows`). Steps with a prefill, a row that does not sample, or
more rows than the largest bucket run eagerly (model_runner.py). How rows and tables are padded is worked out,
torch-free, in step_buckets.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from infer.kernels import cpu_kernels
from infer.kernels.paged_attention import decode_split_tokens
from infer.protocol.env import compile_cache_dir
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.engine.scheduler import ScheduledChunk
from infer.worker.engine.step_buckets import DecodeRow, PaddedDecode, batch_buckets, bucket_for, pad_decode, table_width

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from infer.worker.models.llama import LlamaForCausalLM

log = logging.getLogger("infer.step_graphs")

# Buckets up to this size are made when the engine starts; larger ones on their first step (each logged).
WARM_UP_MAX_BUCKET = 8
# The CPU twin reads every column of the table it is given: the width is rounded up to this many blocks, so
# that steps over growing contexts reuse the same shapes (the graph does not recompile; this bounds waste).
CPU_WIDTH_GRANULARITY = 4


class DecodeBuffers:
    """The persistent inputs of step graphs, sized for the largest bucket and the longest block table."""

    def __init__(self, max_rows: int, max_width: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(max_rows, dtype=torch.int64)
        self.positions = zeros(max_rows, dtype=torch.int64)
        self.slot_mapping = zeros(max_rows, dtype=torch.int64)
        self.block_tables = zeros(max_rows, max_width, dtype=torch.int32)
        self.seq_lens = zeros(max_rows, dtype=torch.int32)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        self.device = device

    def fill(self, padded: PaddedDecode) -> None:
        """Copy one padded step in (host lists -> one tensor each -> the buffers' first rows and columns)."""
        rows, width = padded.bucket, padded.width
        for buffer, values, dtype in (
            (self.input_ids, padded.input_ids, torch.int64),
            (self.positions, padded.positions, torch.int64),
            (self.slot_mapping, padded.slot_mapping, torch.int64),
            (self.seq_lens, padded.seq_lens, torch.int32),
        ):
            buffer[:rows].copy_(torch.tensor(values, dtype=dtype), non_blocking=True)
        tables = torch.tensor(padded.block_tables, dtype=torch.int32).view(rows, width)
        self.block_tables[:rows, :width].copy_(tables, non_blocking=True)

    def batch(
        self, rows: int, width: int, block_size: int, pad_slot: int, split_tokens: int | None = None
    ) -> ForwardBatch:
        """The ForwardBatch of a step graph over the buffers' first `rows` rows and `width` columns."""
        return ForwardBatch(
            input_ids=self.input_ids[:rows],
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:rows, :width],
            seq_lens=self.seq_lens[:rows],
            query_start_loc=self.query_start_loc[: rows + 1],
            logits_indices=self.positions[:0],
            num_decodes=rows,
            query_lens=(1,) * rows,
            context_lens=(),
            block_size=block_size,
            step_graph=True,
            pad_slot=pad_slot,
            decode_split_tokens=split_tokens,
        )


class StepGraphs:
    """Runs pure-decode steps of up to `buckets[-1]` sequences through graphs made once per bucket.

    Invariant: the forward a graph runs is the eager model's, on a `ForwardBatch` with `step_graph=True`;
    padding rows never touch a sequence's blocks (slot -1 / the pool's scratch block) and are never sampled.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        block_size: int,
        max_model_len: int,
        max_rows: int,
        max_bucket: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.buckets = batch_buckets(max_rows, max_bucket)
        self.max_width = -(-max_model_len // block_size)
        self.split_tokens = decode_split_tokens(max_model_len)  # the eager steps' too: the same bits
        self.device = device
        self.buffers = DecodeBuffers(self.buckets[-1], max(self.max_width, 2), device)
        self.backend: _Backend = _CudaGraphs(self) if device.type == "cuda" else _CompiledLayers(self)
        self.compile_seconds: dict[int, float] = {}
        self.replays: Counter[int] = Counter()  # steps run per bucket
        self.verification_replays = 0  # of those, speculative verification steps

    # ---- the step -------------------------------------------------------------------------------

    def bucket_for(self, chunks: Sequence[ScheduledChunk]) -> int | None:
        """The bucket this step runs in, or None when it must run eagerly (a prefill, a row that does not
        sample, more rows than the largest bucket: the module docstring)."""
        rows = 0
        for c in chunks:
            # a decode (one new token) or a verification (the last token and its drafts), sampled at every row
            if not c.samples or c.num_new_tokens != 1 + c.num_draft_tokens:
                return None
            rows += c.num_new_tokens
        return bucket_for(rows, self.buckets)

    def run(self, chunks: Sequence[ScheduledChunk], bucket: int) -> torch.Tensor:
        """Logits [rows, V] float32 of a decode or verification step (`bucket` from `bucket_for`), a row per
        token in chunk order: what the eager forward's logits rows are."""
        if bucket not in self.compile_seconds:  # a bucket past the warm-up's, on its first step
            self._make(bucket)
        rows = [
            DecodeRow(token_id, c.start + j, c.request.block_table)
            for c in chunks
            for j, token_id in enumerate(c.token_ids)
        ]
        width = self.backend.width(max(len(r.block_table) for r in rows))
        self.buffers.fill(pad_decode(rows, bucket, width, self.block_size, self.kv_cache.scratch_block))
        self.replays[bucket] += 1
        if len(rows) > len(chunks):
            self.verification_replays += 1
        return self.backend.run(bucket, width)[: len(rows)]

    # ---- making the graphs ----------------------------------------------------------------------

    def warm_up(self, max_bucket: int = WARM_UP_MAX_BUCKET) -> float:
        """Make the graphs of the buckets up to `max_bucket` now (at engine start); returns the seconds."""
        start = time.perf_counter()
        for bucket in sorted((b for b in self.buckets if b <= max_bucket), reverse=True):
            self._make(bucket)
        return time.perf_counter() - start

    @torch.inference_mode()
    def _make(self, bucket: int) -> None:
        """Compile or capture `bucket`, running it once on padding rows only (they write the scratch block). In
        inference mode, as the steps run (model_runner.py): a graph compiled with grad mode on fails the compiled
        code's grad-mode guard at the first step, which then compiles the bucket again on the request's path."""
        start = time.perf_counter()
        self.buffers.fill(
            pad_decode(
                [DecodeRow(0, 0, [self.kv_cache.scratch_block])],
                bucket,
                self.backend.width(1),
                self.block_size,
                self.kv_cache.scratch_block,
            )
        )
        self.backend.make(bucket)
        self.compile_seconds[bucket] = seconds = time.perf_counter() - start
        log.info("step graph for batch bucket %d: %s in %.1f s", bucket, self.backend.verb, seconds)

    def forward(
        self, batch: ForwardBatch, layers: Sequence[Callable[..., tuple[torch.Tensor, torch.Tensor]]] | None = None
    ) -> torch.Tensor:
        """The step's logits [rows, V] float32: the model over `batch`, then the LM head on every row."""
        return self.model.compute_logits(self.model(batch, self.kv_cache, layers))


class _Backend:
    verb = ""

    def width(self, longest: int) -> int:
        """The block-table width a step whose longest table has `longest` blocks runs at."""
        raise NotImplementedError

    def make(self, bucket: int) -> None:
        raise NotImplementedError

    def run(self, bucket: int, width: int) -> torch.Tensor:
        raise NotImplementedError


class _CompiledLayers(_Backend):
    """CPU: each decoder layer through `torch.compile` (one graph per bucket, shared by all layers)."""

    verb = "compiled"

    def __init__(self, graphs: StepGraphs) -> None:
        self.graphs = graphs
        # inductor's FX graph cache, kept across restarts; inductor reads this on every use (and writes its
        # /tmp default there on first use, so the variable is set here rather than defaulted)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
        # The layer's code holds one entry per (model, bucket, first layer or not), shared by every engine
        # of the process; the default limit (8) would silently send the larger buckets back to eager.
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 1024)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
        cpu_kernels.native_ready()  # built (or found missing) now: the compiled layers call it as an operator
        self.layers = [torch.compile(layer, dynamic=False, fullgraph=True) for layer in graphs.model.model.layers]

    def width(self, longest: int) -> int:
        return table_width(longest, max(self.graphs.max_width, 2), CPU_WIDTH_GRANULARITY)

    def make(self, bucket: int) -> None:
        self.run(bucket, self.width(1))

    def run(self, bucket: int, width: int) -> torch.Tensor:
        graphs = self.graphs
        batch = graphs.buffers.batch(bucket, width, graphs.block_size, graphs.kv_cache.pad_slot, graphs.split_tokens)
        torch._dynamo.mark_dynamic(batch.block_tables, 1)
        return graphs.forward(batch, self.layers)


class _CudaGraphs(_Backend):
    """CUDA: one CUDA graph per bucket over the persistent buffers, sharing one memory pool."""

    verb = "captured"

    def __init__(self, graphs: StepGraphs) -> None:
        self.graphs = graphs
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: _POOL_HANDLE | None = None

    def width(self, longest: int) -> int:
        return table_width(longest, max(self.graphs.max_width, 2), 1)  # only the columns that changed

    def make(self, bucket: int) -> None:
        graphs = self.graphs
        batch = graphs.buffers.batch(
            bucket,
            graphs.buffers.block_tables.shape[1],
            graphs.block_size,
            graphs.kv_cache.pad_slot,
            graphs.split_tokens,
        )
        stream = torch.cuda.Stream(device=graphs.device)
        stream.wait_stream(torch.cuda.current_stream(graphs.device))
        with torch.cuda.stream(stream):  # warm-up launches (Triton autotuning, allocator) off the capture
            for _ in range(2):
                graphs.forward(batch)
        torch.cuda.current_stream(graphs.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = graphs.forward(batch)
        self.pool = graph.pool()
        self.captured[bucket] = (graph, logits)

    def run(self, bucket: int, width: int) -> torch.Tensor:
        graph, logits = self.captured[bucket]
        graph.replay()
        return logits


def graph_rows(config: EngineConfig) -> int:
    """The most rows a step graph can be asked for: a decode of `max_num_seqs` sequences, or with speculation a
    verification of as many requests as it runs for (`disable_by_batch_size`), k + 1 rows each."""
    spec = config.speculative_config
    if spec is None:
        return config.max_num_seqs
    verifying = min(config.max_num_seqs, spec.disable_by_batch_size)
    return max(config.max_num_seqs, verifying * (1 + spec.num_speculative_tokens))


def make_step_graphs(
    config: EngineConfig, model: torch.nn.Module, kv_cache: KVCache, max_model_len: int, device: torch.device
) -> StepGraphs | None:
    """The engine's step graphs, their small buckets made now (logged with the time it took), or None:
    `enforce_eager`, a model whose layers do not trace into one graph (on a CPU: native quantized linears), or a
    failure to make them (logged; the engine then runs eagerly)."""
    if config.eager_on(device.type):
        return None
    if not getattr(model, "supports_step_graphs", False):
        log.info("step graphs: off (%s runs eagerly)", type(model).__name__)
        return None
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        log.info("step graphs: off (tensor parallelism runs eagerly: its followers replay no graphs)")
        return None
    if device.type == "cpu" and any(getattr(m, "quant_native", False) for m in model.modules()):
        log.info("step graphs: off (the native quantized matmul is a ctypes call, which torch.compile cannot trace)")
        return None
    # supports_step_graphs: True only on LlamaForCausalLM (and the subclasses that keep its forward)
    graphs = StepGraphs(
        cast("LlamaForCausalLM", model),
        kv_cache,
        config.block_size,
        max_model_len,
        graph_rows(config),
        config.max_graph_batch_size,
        device,
    )
    try:
        seconds = graphs.warm_up()
    except Exception:  # a torch or compiler fault must not take the engine down: it still runs eagerly
        log.exception("step graphs: making them failed; running eagerly")
        return None
    log.info(
        "step graphs: batch buckets %s; %s %s in %.1f s (the rest on first use)",
        ",".join(map(str, graphs.buckets)),
        graphs.backend.verb,
        ",".join(map(str, sorted(graphs.compile_seconds))),
        seconds,
    )
    return graphs
