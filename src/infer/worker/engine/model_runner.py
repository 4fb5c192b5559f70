"""ModelRunner: turns a SchedulerOutput into one model forward and one sampling step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from infer.kernels.cpu_kernels import GEMV_MAX_ROWS
from infer.kernels.paged_attention import decode_split_tokens
from infer.worker.engine.encoder_decoder import EncoderDecoderModel, cross_rows, run_encoders
from infer.worker.engine.forward_batch import ForwardBatch, KVCache
from infer.worker.engine.lora import LoraManager, lora_step
from infer.worker.engine.pooling import record_pooling
from infer.worker.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, record_prompt_logprobs
from infer.worker.engine.scheduler import ScheduledChunk
from infer.worker.engine.step_graphs import StepGraphs
from infer.worker.engine.vision import ImageEncoder, step_image_rows, step_image_spans, with_mrope_positions
from infer.worker.speculative.verification import sampling_rows

if TYPE_CHECKING:
    from infer.worker.models.registry import CausalLM


@dataclass
class Launched:
    """A forward that `ModelRunner.launch` started and `finish` completes: its chunks and either the logits (a
    step graph's replay) or the batch and its hidden states (row numbers on a pipeline's stage 0)."""

    chunks: Sequence[ScheduledChunk]
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Followers(Protocol):
    """The command channel from the engine's process to the other processes of its TP group or pipeline
    (worker/parallel/tp_commands.py TpLeader): each forward, logits computation and dummy step is sent to them first, so
    that they run the same collectives."""

    def forward(self, batch: ForwardBatch, lora_rows: list[tuple[int, int]] | None = None) -> None: ...

    def logits(self, rows: torch.Tensor) -> None: ...

    def dummy(self) -> None: ...

    def lora_copy_in(self, name: str, path: str, lora_id: int, slot: int) -> None: ...

    def stop(self, code: int = 0) -> None: ...


class ModelRunner:
    """Owns the model and the KV pool on one device; stateless between steps otherwise.

    In a TP group (TP rank 0 runs the engine) `followers` is the command channel to the other ranks (`Followers`)."""

    followers: Followers | None = None
    lora: LoraManager | None = None  # the engine's LoRA adapters (worker/engine/lora.py), when enabled
    images: ImageEncoder | None = None  # a vision model's encoder and its cache (worker/engine/vision.py)
    encoder: EncoderDecoderModel | None = None  # an encoder-decoder model (worker/engine/encoder_decoder.py)

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        sampler: Sampler,
        step_graphs: StepGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.split_tokens = decode_split_tokens(max_model_len)
        self.device = device
        self.sampler = sampler
        self.vocab_size = int(model.vocab_size)
        self.step_graphs = step_graphs  # None: every step eager (enforce_eager, or a model without them)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk]) -> SamplerOutput | None:
        """Run one forward over `chunks` (decodes first) and sample one token for each chunk whose
        `samples` is set, in chunk order (a verification chunk: one per position from its last token on,
        `chunk.num_sampled_rows`). Returns None when no chunk samples (all mid-prefill).
        Decode and verification steps whose rows fit a step-graph bucket replay its graph; the others run
        eagerly."""
        return self.finish(self.launch(chunks))

    @torch.inference_mode()
    def launch(self, chunks: Sequence[ScheduledChunk]) -> Launched:
        """The first half of `execute`: start the forward over `chunks`. On a pipeline's stage 0 this runs stage 0's
        layers and hands the batch on; the later stages compute it while the engine launches the next micro-batch
        (worker/parallel/pp_group.py). `finish` completes it (launched forwards finish in launch order)."""
        slot_rows = (
            [] if self.lora is None else self.lora.slot_rows([(c.request.lora_id, c.num_new_tokens) for c in chunks])
        )
        lora = None if self.lora is None else self.lora.step(slot_rows)
        graphs = self.step_graphs
        if graphs is not None and (lora is not None or any(c.request.pooled is not None for c in chunks)):
            graphs = None  # LoRA rows run the layers one by one; pooling needs the hidden states
        if graphs is not None and self.images is not None and any(_computes_images(c) for c in chunks):
            graphs = None  # image rows take their features in the eager forward
        bucket = graphs.bucket_for(chunks) if graphs is not None else None
        if graphs is not None and bucket is not None:
            return Launched(chunks, logits=graphs.run(chunks, bucket))
        if self.encoder is not None:  # each new request's encoder, once: its cross K/V into its cross blocks
            run_encoders([c.request for c in chunks], self.encoder, self.kv_cache, self.block_size)
        batch = build_forward_batch(chunks, self.block_size, self.device, self.split_tokens)
        if getattr(self.model, "uses_mrope", False):  # Qwen2-VL: three positions a token (worker/engine/vision.py)
            batch = with_mrope_positions(batch, chunks)
        if self.images is not None:
            placed = step_image_rows(chunks, self.images)
            if placed is not None:
                rows = torch.tensor(placed[0], dtype=torch.int64, device=self.device)
                batch = replace(batch, image_rows=rows, image_embeds=placed[1])
                if getattr(self.model, "bidirectional_images", False):
                    batch = replace(batch, image_spans=step_image_spans(chunks))
        with lora_step(lora):
            hidden = self._forward(batch, slot_rows if lora is not None else None)
        return Launched(chunks, batch, hidden)

    @torch.inference_mode()
    def finish(self, launched: Launched) -> SamplerOutput | None:
        """The second half of `execute`: the launched forward's logits (a pipeline's: received from its last
        stage), prompt logprobs and pooling, and the sampling."""
        chunks, batch, hidden, logits = launched.chunks, launched.batch, launched.hidden, launched.logits
        if batch is not None and hidden is not None:
            receive = getattr(self.model, "receive_logits", None)  # a pipeline stage (worker/parallel/pp_stage.py)
            if receive is not None and batch.logits_indices.numel():
                logits = receive(batch.logits_indices.shape[0])  # sent first: before any prompt logprobs
            if any(c.request.prompt_logprobs is not None for c in chunks):
                record_prompt_logprobs(
                    chunks, lambda start, stop: self._logits(hidden, torch.arange(start, stop, device=hidden.device))
                )
            if any(c.request.pooled is not None for c in chunks):
                record_pooling(chunks, hidden)
            if batch.logits_indices.numel() == 0:
                return None
            if logits is None:
                logits = (
                    self._verification_logits(hidden, batch)
                    if batch.decode_runs is not None
                    else self._logits(hidden, batch.logits_indices)
                )
        if logits is None:
            return None
        sampling = [row for c in chunks if c.samples for row in sampling_rows(c)]
        meta = SamplingMetadata.build(sampling, self.vocab_size, self.device)
        return self.sampler.sample(logits, meta)

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """A forward of one padding token that belongs to no sequence (nothing is cached, nothing sampled):
        what a rank of an EP group with no work runs so that its MoE layers join the group's collectives."""
        if self.followers is not None:
            self.followers.dummy()
        self.model(dummy_forward_batch(self.block_size, self.device), self.kv_cache)

    def _forward(self, batch: ForwardBatch, lora_rows: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """`lora_rows`: the forward's (LoRA slot, rows) runs (-1: the base model), for the other TP ranks."""
        if self.followers is not None:
            self.followers.forward(batch, lora_rows)
        return self.model(batch, self.kv_cache)

    def _verification_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The logits of a step with verification rows. On a CPU the LM head takes them GEMV_MAX_ROWS at a time: a
        bf16 head on the native GEMV gives each row the bits it has alone at any row count, but a head on oneDNN
        (fp32 weights) sums 1-8 rows as a decode step of 1-8 requests does and more rows otherwise; so each row
        gets the logits its decode step would (1-8 requests decode where speculation runs:
        SpeculativeConfig.disable_by_batch_size)."""
        rows = batch.logits_indices
        if self.device.type != "cpu" or rows.numel() <= GEMV_MAX_ROWS:
            return self._logits(hidden, rows)
        return torch.cat([self._logits(hidden, piece) for piece in rows.split(GEMV_MAX_ROWS)])

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.followers is not None:
            self.followers.logits(rows)
        return self.model.compute_logits(hidden[rows])


def _computes_images(chunk: ScheduledChunk) -> bool:
    """Whether the chunk computes any of its request's image tokens."""
    return any(image.offset < chunk.end and image.end > chunk.start for image in chunk.request.images)


def dummy_forward_batch(block_size: int, device: torch.device) -> ForwardBatch:
    """One padding token (slot -1, never written) and no sequences."""
    return ForwardBatch(
        input_ids=torch.zeros(1, dtype=torch.int64, device=device),
        positions=torch.zeros(1, dtype=torch.int64, device=device),
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((0, 1), dtype=torch.int32, device=device),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
        num_decodes=0,
        query_lens=(),
        context_lens=(),
        block_size=block_size,
    )


def build_forward_batch(
    chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device, decode_split_tokens: int | None = None
) -> ForwardBatch:
    """Flatten the step's chunks into the token-major tensors of ForwardBatch (see its docstring)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    num_decodes = 0
    decode_runs: list[int] = []  # decode rows per request (ForwardBatch.decode_runs)
    prompt_lens: list[int] = []  # of the prefill chunks
    for chunk in chunks:
        req, start, n = chunk.request, chunk.start, chunk.num_new_tokens
        if chunk.num_draft_tokens and num_decodes == len(query_lens):
            # a verification chunk: one decode row per token (row j attends to the context up to its own position,
            # whose K/V the step appends before attending), so each row has its decode step's bits and the native
            # CPU decode step takes them as one run of k + 1 rows (ForwardBatch.decode_runs)
            decode_runs.append(len(chunk.token_ids))
            for j, token_id in enumerate(chunk.token_ids):
                num_decodes += 1
                input_ids.append(token_id)
                positions.append(start + j)
                query_lens.append(1)
                context_lens.append(start + j + 1)
                tables.append(req.block_table)
                logits_indices.append(len(input_ids) - 1)
            continue
        # a decode: one generated token (a prompt's last token alone in its chunk stays a prefill row, computed as
        # its prompt's other rows are, so that it has the same bits whenever the prompt is computed again)
        if n == 1 and num_decodes == len(query_lens) and start >= req.num_prompt_tokens:
            num_decodes += 1
            decode_runs.append(1)
        else:
            prompt_lens.append(req.num_prompt_tokens)
        input_ids.extend(chunk.token_ids)
        positions.extend(range(start, start + n))
        query_lens.append(n)
        context_lens.append(start + n)
        tables.append(req.block_table)
        logits_indices.extend(range(len(input_ids) - chunk.num_sampled_rows, len(input_ids)))

    cross = (
        cross_rows(chunks, query_lens, device) if any(c.request.encoder_token_ids is not None for c in chunks) else None
    )
    max_blocks = max(len(t) for t in tables)
    # released entries (-1: out of every window, never read) name block 0
    table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32).clamp_(min=0)
    pos = torch.tensor(positions, dtype=torch.int64)
    lens = torch.tensor(query_lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
    block_of_token = table[seq_of_token, pos // block_size].to(torch.int64)
    slot_mapping = block_of_token * block_size + pos % block_size
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(lens, 0)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64).to(device),
        positions=pos.to(device),
        slot_mapping=slot_mapping.to(device),
        block_tables=table.to(device),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        query_start_loc=query_start_loc.to(device),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64).to(device),
        num_decodes=num_decodes,
        query_lens=tuple(query_lens),
        context_lens=tuple(context_lens),
        block_size=block_size,
        decode_split_tokens=decode_split_tokens,
        prefill_decode_from=torch.tensor(prompt_lens, dtype=torch.int32).to(device) if prompt_lens else None,
        decode_runs=(torch.tensor(decode_runs, dtype=torch.int32) if len(decode_runs) < num_decodes else None),
        cross_block_tables=None if cross is None else cross[0],
        cross_lens=None if cross is None else cross[1],
    )
