"""Engine: continuous batching over a paged KV cache. One engine is one DP rank.

The step loop reads in four lines: schedule, run the model, advance the scheduler, post-process. The engine holds
the step core (construction, add_request's outline, step, abort, load) and hands each other concept to a
collaborator of its own: worker/engine/intake.py checks a request's input and builds its Request,
worker/engine/grammar_queue.py holds structured-output requests while their grammar compiles,
worker/engine/output_processor.py turns a step's rows into Deltas (and makes every final one),
worker/engine/engine_weights.py suspends, resumes and updates the weights.

Fault isolation: a failure while computing one request fails that request alone (finish_reason "error",
error_code "internal", its KV blocks freed) and the engine goes on with the others:
- a row whose logits are not finite (NaN / inf: the sampler reports it) fails its request; its token is not
  used (failing is the honest choice: a sanitized row would be sampled from numbers that mean nothing);
- a step that raises is run again one request at a time (the KV slots each rewrites are its own, and the
  scheduler has not moved yet); requests that fail alone fail, the others get their tokens. When every
  request fails alone and a forward with no request fails too, the engine itself is broken: step() raises
  the first error (the worker exits; the coordinator moves its requests). EP and TP group ranks raise at
  once: a retry would call collectives their peers do not;
- post-processing that raises for one request (detokenizing, stop checks) fails that request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch

from infer.protocol.messages import Delta, KvEvents, Load, UpdateWeights
from infer.protocol.prompt_limits import max_token_bytes
from infer.protocol.sampling import SamplingParams
from infer.worker.distributed.expert_parallel import ExpertParallel
from infer.worker.distributed.tensor_parallel import TensorParallel
from infer.worker.engine.audio import audio_features
from infer.worker.engine.beam_groups import BeamGroups
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.encoder_decoder import check_engine as check_encoder_decoder
from infer.worker.engine.encoder_decoder import is_encoder_decoder
from infer.worker.engine.engine_setup import (
    context_length,
    kept_quantized,
    num_kv_blocks,
    pick_device,
    pick_dtype,
    release_window,
    shares_kv,
)
from infer.worker.engine.engine_weights import EngineWeights
from infer.worker.engine.forward_batch import KVCache
from infer.worker.engine.grammar_queue import GrammarQueue
from infer.worker.engine.images import ImageLimits
from infer.worker.engine.intake import Intake, check_request_id
from infer.worker.engine.lora import LoraManager
from infer.worker.engine.memory import HeapTrimmer, keep_freed_heap, trim_heap
from infer.worker.engine.micro_batches import MicroBatches
from infer.worker.engine.model_runner import ModelRunner
from infer.worker.engine.output_processor import EngineStats, OutputProcessor, StepRow, step_rows
from infer.worker.engine.request import Request, RequestStatus, overdue_message
from infer.worker.engine.sampler import Sampler
from infer.worker.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from infer.worker.engine.step_graphs import make_step_graphs
from infer.worker.engine.vision import ImageEncoder, Preprocessor, VisionModel
from infer.worker.kv.offload import KvOffload, ModelFiles
from infer.worker.kv.offload_store import check_offload_dir
from infer.worker.kv.port import KvPort
from infer.worker.loading.in_memory import in_memory_model
from infer.worker.loading.loader import load_model, set_weight_prepack, weight_files
from infer.worker.loading.model_files import eos_token_ids, forced_token_ids, resolve_model, suppressed_token_ids
from infer.worker.loading.tokenizer import engine_tokenizer
from infer.worker.loading.weights import WeightUpdate
from infer.worker.speculative.proposers import Proposer, make_proposer

log = logging.getLogger("infer.engine")


class PipelineSize(Protocol):
    @property
    def size(self) -> int: ...


class Stage(Protocol):
    """Stage 0 of a pipeline, as the engine sees it (worker/parallel/pp_stage.py StageLoader): its layers' model, the KV
    block count agreed with the other stages, the pipeline's size."""

    @property
    def group(self) -> PipelineSize: ...

    def load_model(self, path: Path, dtype: torch.dtype, device: torch.device, quantization: str) -> Any: ...

    def agree_min(self, num_blocks: int) -> int: ...


class Engine:
    """Accepts requests, steps the model over all of them together, returns per-step deltas.

    Thread-unsafe by design: one thread owns an engine (the worker loop or LLM).
    """

    def __init__(
        self,
        config: EngineConfig,
        ep: ExpertParallel | None = None,
        *,
        model: object = None,
        tokenizer: object = None,
        tp: TensorParallel | None = None,
        stage: Stage | None = None,
    ) -> None:
        """`model` / `tokenizer`: build the engine around weights already in memory (a transformers
        PreTrainedModel, whose weights are copied into our implementation, or one of our own model objects,
        used as is) instead of `config.model`'s files; the tokenizer is then required (see worker/loading/in_memory.py).
        `tp`: this is TP rank 0 of a TP group (worker/parallel/tp_group.py); the KV pool's size is agreed with the
        group, and `self.runner.followers` must be set before the first step. `stage`: this is stage 0 of a
        pipeline (a worker/parallel/pp_stage.py StageLoader: this stage's layers, the KV block count agreed with the
        others); `self.runner.followers` must be set too (worker/parallel/pp_group.py)."""
        self.config = config
        self.stage = stage
        self.ep = ExpertParallel.single() if ep is None else ep  # this rank's share of an MoE model's experts
        self.tp = TensorParallel.single() if tp is None else tp  # this rank's shard of every layer
        if config.kv_offload_dir is not None or config.kv_offload_host_gb is not None:  # before the weights load
            _check_kv_offload(config, model, self.tp, stage)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device, model is None and kept_quantized(config))
        if model is not None:
            if self.tp.size > 1 or stage is not None:
                raise ValueError("an in-memory model cannot be tensor- or pipeline-parallel: give a model path")
            loaded = in_memory_model(model, tokenizer, self.dtype, self.device, self.ep)
            self.model_path: Path | None = None
            self.model_id = config.model or loaded.model_id
            # our model class (an nn.Module meeting models.registry.CausalLM), or on a pipeline's stage 0 a
            # StageModel, which has the same attributes and calls for the forward path: no one static type
            self.model: Any
            self.tokenizer, self.eos_token_ids, self.model = loaded.tokenizer, loaded.eos_token_ids, loaded.model
            self.prompt_token_bytes = max_token_bytes(self.tokenizer)
            files: list[list[Path]] | None = None  # nothing to reload them from: spill on suspend
        else:
            if tokenizer is not None:
                raise ValueError("tokenizer= goes with model=<an in-memory model>; a model path brings its own")
            self.model_path = resolve_model(config.model)
            self.model_id = config.model_id
            # Rust tokenizers where exact: worker/loading/tokenizer.py
            self.tokenizer = engine_tokenizer(self.model_path)
            self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer)
            # bounds text prompts before tokenizing; read before the weights, which reuse the heap it frees
            self.prompt_token_bytes = max_token_bytes(self.tokenizer)
            if stage is None:
                self.model = load_model(self.model_path, self.dtype, self.device, self.ep, self.tp, config.quantization)
            else:  # this stage's layers only
                self.model = stage.load_model(self.model_path, self.dtype, self.device, config.quantization)
            files = [weight_files(self.model_path)]
        set_weight_prepack(self.model, config.cpu_weight_prepack)
        trim_heap()  # what loading freed (tokenizer files, weight conversion), before the KV pool and the first steps
        # an encoder-decoder model (worker/engine/encoder_decoder.py): what it does not run is refused here, by name
        check_encoder_decoder(
            config, self.model, tp_size=self.tp.size, pipeline=stage is not None, ep_size=self.ep.size
        )
        encdec = self.model if is_encoder_decoder(self.model) else None
        self.vocab_size = int(self.model.vocab_size)
        forced = (None, None) if encdec is None or self.model_path is None else forced_token_ids(self.model_path)
        if any(t is not None and t >= self.vocab_size for t in forced):
            raise ValueError(f"the generation config's forced tokens {forced} are outside the vocabulary")
        self.max_model_len = context_length(config, self.model.config)
        self.block_size = config.block_size
        num_blocks = self._num_kv_blocks()
        num_blocks = self.tp.agree_min(num_blocks)  # every TP member's pool holds the same block ids
        if stage is not None:
            num_blocks = stage.agree_min(num_blocks)  # every stage's pool holds the same block ids
        self.kv_cache = KVCache.allocate(
            self.model.num_layers,
            num_blocks,
            self.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
            shared_kv=shares_kv(self.model),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.budget_tokens(self.max_model_len),
                max_model_len=self.max_model_len,
                block_size=self.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=config.enable_prefix_caching
                and not _rope_depends_on_length(self.model)
                and encdec is None,  # a decoder block's keys depend on the encoder's input, which hashes omit
                enable_chunked_prefill=config.enable_chunked_prefill,
                policy=config.scheduling_policy,
                priority_aging_steps=config.priority_aging_steps,
                release_window=release_window(self.model),
                max_loras=config.max_loras if config.enable_lora else 0,
                whole_images=bool(getattr(self.model, "bidirectional_images", False)),
                long_prefill_token_threshold=config.long_prefill_token_threshold or 0,  # None: 0 (EngineConfig doc)
            )
        )
        self.offload: KvOffload | None = None  # the KV tiers beyond the pool (worker/kv/offload.py)
        on_disk = config.kv_offload_dir is not None and self.model_path is not None
        if on_disk or config.kv_offload_host_bytes is not None:
            self.offload = KvOffload.open(
                self.kv_cache,
                self.scheduler.block_manager,
                host_bytes=config.kv_offload_host_bytes,
                root=None if config.kv_offload_dir is None else Path(config.kv_offload_dir),
                disk_bytes=config.kv_offload_bytes,
                model=None
                if self.model_path is None
                else ModelFiles(self.model_path, tuple(weight_files(self.model_path)), config.quantization),
            )
        # the pool as blocks of bytes, for KV transfers between workers (worker/kv/port.py)
        self.kv_port = KvPort(
            self.kv_cache, self.scheduler, self.model_id, config.quantization, self.offload, self._lora_id
        )
        self.sampler = Sampler(seed=config.seed, device=self.device)
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model" and self.tp.size > 1:
            raise ValueError("speculative_config: a draft model is not supported with tensor parallelism yet")
        self.proposer: Proposer | None = (
            None
            if spec is None
            else make_proposer(
                spec,
                dtype=self.dtype,
                device=self.device,
                block_size=self.block_size,
                num_blocks=num_blocks,
                max_model_len=self.max_model_len,
                vocab_size=self.vocab_size,
            )
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            self.block_size,
            self.max_model_len,
            self.device,
            self.sampler,
            make_step_graphs(config, self.model, self.kv_cache, self.max_model_len, self.device),
        )
        self.runner.encoder = encdec
        self.lora = self._lora_manager()
        self.runner.lora = self.lora
        # a model that takes images (worker/engine/vision.py): its encoder cache and preprocessing
        self.image_limits = ImageLimits(max_images=config.limit_mm_per_prompt)
        self.preprocess: Preprocessor | None = None
        if isinstance(self.model, VisionModel):
            self.runner.images = ImageEncoder(self.model, config.mm_encoder_cache_images)
            self.preprocess = self.model.image_preprocessor(self.model_path)
        self.heap = HeapTrimmer()  # freed activations go back to the OS now and then (worker/engine/memory.py)
        if self.device.type == "cpu" and not keep_freed_heap():  # ... and stay mapped between steps
            log.info("could not tune the C library's malloc: large activations are mapped anew every step")
        self.stats = EngineStats()
        self._pending: list[Delta] = []  # final outputs of aborts, returned by the next step
        self.beams = BeamGroups(self.scheduler, self.tokenizer)  # beam searches (worker/engine/beam_groups.py)
        # a step's rows into Deltas, each request's detokenizer (worker/engine/output_processor.py)
        self.outputs = OutputProcessor(
            self.scheduler, self.beams, self.sampler, self.proposer, self.tokenizer, self.stats, self.max_model_len
        )
        # structured-output requests while their grammar compiles (worker/engine/grammar_queue.py)
        self.grammars = GrammarQueue(
            config, self.tokenizer, self.vocab_size, self.eos_token_ids, self.scheduler, self.outputs
        )
        # suspend / resume and weight updates (worker/engine/engine_weights.py)
        self.weights = EngineWeights(
            config,
            self.model,
            self.device,
            files,
            max_model_len=self.max_model_len,
            kv_cache=self.kv_cache,
            scheduler=self.scheduler,
            runner=self.runner,
            offload=self.offload,
            outputs=self.outputs,
            tp_size=self.tp.size,
            pp_size=None if stage is None else stage.group.size,
            give_memory_back=self._give_memory_back,
        )
        # add_request's input checked and its Request built (worker/engine/intake.py)
        self.intake = Intake(
            config,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            prompt_token_bytes=self.prompt_token_bytes,
            eos_token_ids=self.eos_token_ids,
            model_id=self.model_id,
            scheduler=self.scheduler,
            num_kv_blocks=self.kv_cache.num_blocks,
            block_size=self.block_size,
            draw_seed=self.sampler.draw_seed,
            lora_id=self._lora_id,
            vision=self.model if isinstance(self.model, VisionModel) else None,
            preprocess=self.preprocess,
            image_limits=self.image_limits,
            speculative=None if spec is None else spec.method,
            pipeline=stage is not None,
            model_parallel=self.tp.size > 1 or stage is not None,
            encoder_decoder=encdec,
            forced_tokens=forced,
            audio_features=audio_features(self.model, self.model_path),
            suppressed_tokens=((), ())
            if encdec is None or self.model_path is None
            else suppressed_token_ids(self.model_path),
        )
        # a pipeline's stage 0: a micro-batch per stage in flight (worker/engine/micro_batches.py) unless told
        # otherwise; speculative decoding steps one batch at a time (its proposals read the tokens of the step before)
        depth = 1 if stage is None or spec is not None else config.pp_micro_batches or stage.group.size
        self.in_flight = MicroBatches(depth)
        self._arrivals = 0
        log.info(
            "engine ready: model=%s dtype=%s device=%s max_model_len=%d kv_blocks=%d x %d tokens",
            self.model_id,
            str(self.dtype).removeprefix("torch."),
            self.device,
            self.max_model_len,
            num_blocks,
            self.block_size,
        )

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        resumed_token_ids: Sequence[int] = (),
        resumed_text_len: int | None = None,
        priority: int = 0,
        client: str | None = None,
        images: Sequence[object] = (),
        decoder_prompt: str | Sequence[int] | None = None,
        audio: bytes | None = None,
    ) -> Request:
        """Queue a request. Invalid input raises ValueError with the reason; the engine is unchanged.

        An encoder-decoder model's `prompt` is its encoder's input; `decoder_prompt` (text, tokenized without special
        tokens, or ids) follows the decoder's start token (worker/engine/encoder_decoder.py). A decoder-only model
        refuses a `decoder_prompt`.

        `images`: the prompt's images, in order (encoded bytes or PIL images), for a model that takes them; the
        prompt holds one image token per image (expanded here to the image's tokens) or each image's tokens already
        expanded (worker/engine/images.py `place_images`).

        A sampled request without a seed gets one here (drawn from the engine's `seed`), reported with its
        first output: the request's randomness is then a function of that seed and its token count.

        `resumed_token_ids` continue a request another engine started (failover): they are output tokens
        already delivered, so they count as output (penalties, min_tokens, stop ids, the place in the seed's
        noise) and the detokenizer replays them, so that the text comes out as if it had never stopped:
        `resumed_text_len` is how much of their text the client has (None: what our detokenizer would have
        shown); the rest (bytes of an unfinished character, text held back for a stop string) comes with the
        next output. `params` are the request's own: the resumed tokens count toward `max_tokens` and
        `min_tokens` here (the one place that counts them). With the same seed, the output continues exactly
        where the first engine stopped, tokens and text.

        `audio`: an audio model's (Whisper's) input, float32 little-endian PCM at its sampling rate, one window at
        most (worker/engine/audio.py); its `prompt` is then the decoder's. A model that takes no audio refuses it.

        `priority` (a 64-bit integer, lower first) matters under `scheduling_policy="priority"`. `client` tags
        the client it came from (Dispatch.client): a structured-output request's compile counts against it.
        """
        check_request_id(request_id)
        if self.scheduler.get(request_id) is not None or request_id in self.grammars:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, resumed = self.intake.request(
            request_id, prompt, params, resumed_token_ids, priority, images, self._arrivals, decoder_prompt, audio
        )
        prompt_ids, params = request.prompt_token_ids, request.params
        if params.beam_search:
            return self._add_beam_search(request)
        detok = self.outputs.detokenizer(prompt_ids, params, resumed, resumed_text_len)
        if params.structured_outputs is None:
            self.scheduler.add(request)  # raises ValueError if it can never fit in the KV pool
        else:
            self.scheduler.check_new(request)
        self._arrivals += 1
        self.outputs.track(request_id, detok)
        self.stats.prompt_tokens += len(prompt_ids)
        if params.structured_outputs is not None:
            refused = self.grammars.compile(request, resumed, client)
            if refused is not None:  # past the compile bounds: its final delta comes with the next step
                self._pending.append(refused)
        return request

    def _add_beam_search(self, request: Request) -> Request:
        """Queue a beam search: its prompt's request is its first beam (worker/engine/beam_groups.py)."""
        self.scheduler.add(request)
        self.beams.start(request)
        self._arrivals += 1
        self.stats.prompt_tokens += request.num_prompt_tokens
        return request

    def _advance_beams(self) -> list[Delta]:
        """Advance the beam searches whose beams all reported this step; the final outputs of those done."""
        if not len(self.beams):
            return []
        copies, done = self.beams.advance()
        if self.offload is not None:  # a fork's new block may have evicted a cached one: copy it out first
            self.offload.spill_evicted()
        self.kv_cache.copy_blocks(copies)
        return [self.outputs.beam_final(group, RequestStatus.FINISHED_STOPPED) for group in done]

    def step(self) -> list[Delta]:
        """One engine step: schedule, run, advance, post-process. Returns this step's deltas."""
        self.weights.check_not_suspended("step()")
        outputs, self._pending = self._pending, []
        if self.grammars:
            outputs.extend(self.grammars.admit_ready())
        if self.in_flight.depth > 1:
            return outputs + self._step_micro_batches()
        if self.offload is not None:  # waiting prefixes in host memory or on disk back into the pool, as cached blocks
            self.offload.restore(self.scheduler.waiting, self.config.max_num_seqs - self.scheduler.num_running)
        scheduled = self.scheduler.schedule(self._propose_drafts())
        if self.offload is not None:  # the blocks scheduling evicted, copied out before the forward writes there
            self.offload.spill_evicted()
        if scheduled.is_empty:
            if self.ep.size > 1:  # the group steps together: this rank's MoE layers must join in
                self.runner.execute_dummy()
            elif self.grammars:  # only grammars to wait for: a bounded wait instead of a busy loop
                self.grammars.wait()
            return outputs
        _stamp_queue_time(scheduled)
        outputs.extend(self._after_forward(scheduled, self._execute(scheduled.chunks)))
        if self.lora is not None and self.lora.collect(self._lora_ids_held()):
            self._give_memory_back()
        self.heap.after_step(busy=self.scheduler.has_unfinished())
        return outputs

    def _after_forward(self, scheduled: SchedulerOutput, rows: list[StepRow]) -> list[Delta]:
        """Advance the scheduler over a finished forward and post-process its rows."""
        outputs = self._fail_rows(scheduled.chunks, rows)
        self.scheduler.update_after_step(scheduled)
        outputs.extend(self.outputs.process(scheduled, rows))
        outputs.extend(self._advance_beams())
        outputs.extend(self.grammars.fail_costly(scheduled.chunks))
        return outputs

    def _step_micro_batches(self) -> list[Delta]:
        """A pipeline's step (worker/engine/micro_batches.py): finish the oldest micro-batch when it must, then launch
        the next over the requests not in flight (or, with nothing to launch, finish the oldest). In the steady state
        one finishes and one is launched per step, while the later stages compute those in flight."""
        outputs: list[Delta] = []
        while self.in_flight.must_finish():
            outputs.extend(self._finish_oldest())
        unfinished = self.scheduler.num_running + self.scheduler.num_waiting
        scheduled = self.scheduler.schedule(busy=self.in_flight.busy, max_seqs=self.in_flight.seats(unfinished))
        if not scheduled.is_empty:
            _stamp_queue_time(scheduled)
            self.in_flight.add(scheduled, self.runner.launch(scheduled.chunks))
        else:
            if self.ep.size > 1:  # the group steps together: this rank's MoE layers must join in
                self.runner.execute_dummy()
            if len(self.in_flight):
                outputs.extend(self._finish_oldest())
            elif self.grammars:
                self.grammars.wait()
        self.heap.after_step(busy=self.has_unfinished())
        return outputs

    def _finish_oldest(self) -> list[Delta]:
        """Receive the oldest micro-batch's logits, sample and post-process it; the chunks of requests finished
        meanwhile (aborted, shed) are dropped (their KV slots were written by a forward of their own: harmless)."""
        flight = self.in_flight.pop_oldest()
        rows = step_rows(flight.scheduled.chunks, self.runner.finish(flight.launched))
        kept = [(c, row) for c, row in zip(flight.scheduled.chunks, rows) if not c.request.is_finished]
        scheduled = replace(flight.scheduled, chunks=tuple(c for c, _ in kept))
        return self._after_forward(scheduled, [row for _, row in kept])

    # ---- LoRA adapters (worker/engine/lora.py) -------------------------------------------------------

    def add_lora(self, name: str, path: str, int_id: int | None = None) -> dict[str, object]:
        """Load a PEFT LoRA adapter under `name` (the same name and path again: a no-op); ValueError naming what is
        wrong (LoRA not enabled, missing files, a rank above max_lora_rank, a target this model lacks). Returns its
        listing entry."""
        manager = self._require_lora()
        if self.weights.suspended:  # the layers' shapes are read from their (released) weights
            raise ValueError("add_lora on a suspended engine: resume() first")
        adapter = manager.add(name, path, int_id)
        return {"name": adapter.name, "int_id": adapter.int_id, "path": adapter.path, "rank": adapter.rank}

    def remove_lora(self, name: str) -> bool:
        """Unload `name`: requests that name it from now on are refused; those that hold it finish with it (its
        weights go after the last; at once when none does, the freed heap given back to the system: an idle engine
        that loads and unloads adapters stays flat). False if no adapter has that name."""
        manager = self._require_lora()
        if not manager.remove(name):
            return False
        if manager.collect(self._lora_ids_held()):
            self._give_memory_back()
        return True

    def list_loras(self) -> list[dict[str, object]]:
        return [] if self.lora is None else self.lora.listing()

    def _lora_manager(self) -> LoraManager | None:
        if not self.config.enable_lora:
            return None
        if self.stage is not None:
            raise ValueError(
                "enable_lora is not supported with pipeline parallelism yet: the stages would need the "
                "adapters' step commands"
            )
        manager = LoraManager(
            self.model,
            self.config.max_loras,
            self.config.max_lora_rank,
            self.dtype,
            self.device,
            base_names=(self.model_id,),
        )
        for name, path in self.config.lora_modules:
            manager.add(name, path)
        return manager

    def _require_lora(self) -> LoraManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled on this engine (enable_lora / --enable-lora)")
        return self.lora

    def _lora_id(self, name: str | None) -> int:
        return 0 if name is None else self._require_lora().lora_id(name)

    def _lora_ids_held(self) -> set[int]:
        requests = [*self.scheduler.waiting, *self.scheduler.running, *self.grammars.requests]
        return {r.lora_id for r in requests if r.lora_id}

    def _propose_drafts(self) -> dict[str, list[int]]:
        """Draft tokens for the running requests that decode (speculative decoding; none when it is off, when
        more requests decode than `disable_by_batch_size`, or for a request that opted out). A request gets at
        most what is left before its max_tokens (minus the token sampled after the drafts) and the context."""
        spec = self.config.speculative_config
        if self.proposer is None or spec is None:  # together: the proposer is made from the spec
            return {}
        decoding = [r for r in self.scheduler.running if r.num_tokens_to_compute == 1 and r.beam_group is None]
        if len(decoding) > spec.disable_by_batch_size:
            return {}
        wanted = [
            (
                r,
                min(
                    spec.num_speculative_tokens,
                    r.max_tokens - r.num_output_tokens - 1,
                    self.max_model_len - r.num_tokens,
                ),
            )
            for r in decoding
            if not r.params.disable_speculative_decoding
        ]
        wanted = [(r, k) for r, k in wanted if k > 0]
        if not wanted:
            return {}
        drafts = self.proposer.propose([r for r, _ in wanted], [k for _, k in wanted])
        return {r.request_id: d[:k] for (r, k), d in zip(wanted, drafts) if d}

    def dummy_step(self) -> list[Delta]:
        """The step of an EP-group rank with nothing to run (paused, or no requests): one forward of a
        padding token so the group's collectives complete; returns the deltas ready without a step (and, on a
        pipeline's stage 0, those of micro-batches in flight that must finish before another forward)."""
        self.weights.check_not_suspended("dummy_step()")
        outputs = self.take_pending()
        while self.in_flight.must_finish():  # a micro-batch that runs alone reads the last stage's latest forward
            outputs.extend(self._finish_oldest())
        self.runner.execute_dummy()
        return outputs

    def abort(self, request_id: str, release_text: bool = True) -> bool:
        """Abort a waiting or running request; its final delta comes with the next step(). With
        `release_text` False the final delta leaves out the text still held back (for a request that goes
        on elsewhere from its delivered tokens: that text is produced there)."""
        group = self.beams.end(request_id, RequestStatus.FINISHED_ABORTED)
        if group is not None:
            self._pending.append(self.outputs.beam_final(group, RequestStatus.FINISHED_ABORTED))
            return True
        request = self.scheduler.abort(request_id)
        if request is None:
            request = self.grammars.pop(request_id)
            if request is not None:
                request.status = RequestStatus.FINISHED_ABORTED
        if request is None:
            return False
        self._pending.append(self.outputs.final(request, "", [], release_text=release_text))
        return True

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished() or bool(self._pending) or bool(self.grammars) or bool(len(self.in_flight))
        )

    def close(self) -> None:
        """End what the engine started outside itself: the other ranks of its TP group, the grammar compile
        thread (after the compile it runs). Idempotent; the engine steps no more after it (with tensor
        parallelism)."""
        if self.runner.followers is not None:
            self.runner.followers.stop()
        self.grammars.close()
        if self.offload is not None:
            self.offload.close()

    def shed_overdue(self, max_queue_time: float) -> int:
        """Fail, with error code "overloaded", each request that has waited more than `max_queue_time` seconds
        since add_request without being scheduled once (a preempted request has started: it stays). Their
        final deltas, with `queue_time_s`, come with the next step(). Returns how many were shed."""
        now = time.monotonic()
        overdue = [
            r for r in self.scheduler.waiting if r.queue_time_s is None and now - r.arrival_time > max_queue_time
        ]
        for request in overdue:
            waited = now - request.arrival_time
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR, overdue_message(waited, max_queue_time))
            request.error_code = "overloaded"
            request.queue_time_s = waited
            self._pending.append(self.outputs.final(request, "", [], queue_time_s=waited))
        if overdue:
            log.warning(
                "shed %d request(s) that waited over %g s without starting (overloaded)", len(overdue), max_queue_time
            )
        return len(overdue)

    def take_pending(self) -> list[Delta]:
        """The deltas ready without a model step (final deltas of aborts), which step() would return
        first. For a caller that does not step now (a paused worker)."""
        outputs, self._pending = self._pending, []
        return outputs

    def load(self) -> Load:
        """This engine's load now (the worker reports it for routing; protocol/messages.py's Load says what each
        count means)."""
        requests = self.scheduler.waiting + self.scheduler.running
        queued = sum(r.num_tokens_to_compute + r.max_tokens - r.num_output_tokens for r in requests)
        blocks = self.scheduler.block_manager
        return Load(
            num_waiting=self.scheduler.num_waiting + len(self.grammars),
            num_running=self.scheduler.num_running,
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=self.num_kv_blocks,
            num_queued_tokens=queued,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=blocks.num_queried_tokens,
            prefix_cache_hits=blocks.num_hit_tokens,
            weight_version=self.weight_version,
            suspended=self.suspended,
            bytes_released=self.weights.released_bytes,
            spec_decode_num_drafts=self.stats.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=self.stats.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.stats.spec_decode_num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.stats.spec_decode_num_accepted_tokens_per_pos),
            **self._offload_counts(),
            **self.kv_port.counters(),
            **self._image_counts(),
        )

    def _image_counts(self) -> dict[str, int]:
        """The vision encoder's counters as Load's fields (none for a text-only model: the defaults, 0)."""
        images = self.runner.images
        return {} if images is None else {"mm_images_encoded": images.encoded, "mm_encoder_cache_hits": images.hits}

    def _offload_counts(self) -> dict[str, int]:
        """The KV tiers' counters as Load's fields (none without a tier: the defaults, 0)."""
        if self.offload is None:
            return {}
        c, h = self.offload.counters, self.offload.host_counters
        return {
            "kv_offload_spilled_blocks": c.spilled,
            "kv_offload_loaded_blocks": c.loaded,
            "kv_offload_dropped_blocks": c.dropped,
            "kv_offload_corrupt_blocks": c.corrupt,
            "kv_offload_host_spilled_blocks": h.spilled,
            "kv_offload_host_loaded_blocks": h.loaded,
            "kv_offload_host_dropped_blocks": h.dropped,
            "kv_offload_host_corrupt_blocks": h.corrupt,
        }

    def publish_kv_events(self, on: bool) -> None:
        """Start (again: from a snapshot) or stop logging the prefix cache's changes for the coordinator
        (worker/kv/events.py; nothing without prefix caching)."""
        self.scheduler.block_manager.publish_events(on)

    def take_kv_events(self) -> KvEvents | None:
        """The prefix cache's next KvEvents (bounded), or None: nothing changed, or not publishing."""
        events = self.scheduler.block_manager.events
        if events is not None and self.offload is not None:
            self.offload.publish_changes()
        return None if events is None else events.take()

    # ---- suspend / resume, weight refit -------------------------------------------------------

    @property
    def weight_version(self) -> int:
        """+1 (or the coordinator's number) per update_weights; every output carries it."""
        return self.outputs.weight_version

    @property
    def suspended(self) -> bool:
        return self.weights.suspended

    def suspend(self) -> int:
        """Release the KV pool and the weights; the bytes released (worker/engine/engine_weights.py says what stays)."""
        return self.weights.suspend()

    def resume(self) -> int:
        """Restore the weights and a fresh KV pool after suspend(); the bytes restored."""
        return self.weights.resume()

    def update_weights(self, source: object, version: int | None = None) -> int:
        """Load new weights, all or nothing (worker/engine/engine_weights.py); returns the new weight version."""
        return self.weights.update_weights(source, version)

    def prepare_update(self, msg: UpdateWeights) -> WeightUpdate:
        """The staged, checked WeightUpdate of an UpdateWeights message, nothing changed yet."""
        return self.weights.prepare_update(msg)

    def check_prepared(self, update: WeightUpdate) -> None:
        """ValueError if the files of a prepared (staged) update changed since they were read: what would be
        applied is then not what the files hold (a later reload would read other values)."""
        update.check_unchanged()

    def _give_memory_back(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            self.heap.trim_now()

    # ---- running a step, one request's failure isolated -------------------------------------

    def _execute(self, chunks: Sequence[ScheduledChunk]) -> list[StepRow]:
        """One forward and sampling step over `chunks`: one StepRow per chunk (module docstring: a step that
        raises is retried one request at a time)."""
        if self.lora is not None:
            self.lora.followers = self.runner.followers  # TP: the other ranks copy what goes into a slot
            self.lora.activate(
                [c.request.lora_id for c in chunks if c.request.lora_id], self.scheduler.running_lora_ids()
            )
        try:
            return step_rows(chunks, self.runner.execute(chunks))
        except Exception as error:
            if self.ep.size > 1 or self.tp.size > 1 or self.stage is not None:
                raise
            log.exception("an engine step over %d request(s) failed; running them one at a time", len(chunks))
            return self._execute_one_by_one(chunks, error)

    def _execute_one_by_one(self, chunks: Sequence[ScheduledChunk], error: Exception) -> list[StepRow]:
        rows = [self._execute_alone(chunk) for chunk in chunks]
        if all(row.error is not None for row in rows):
            self._raise_unless_healthy(error)
        return rows

    def _execute_alone(self, chunk: ScheduledChunk) -> StepRow:
        try:
            return step_rows([chunk], self.runner.execute([chunk]))[0]
        except Exception as e:
            log.exception("request %r fails on its own", chunk.request.request_id)
            return StepRow(error=f"the engine failed while computing it: {type(e).__name__}: {e}")

    def _raise_unless_healthy(self, error: Exception) -> None:
        """Every request of the step failed alone: the engine is healthy if a forward with no request runs."""
        try:
            self.runner.execute_dummy()
        except Exception:
            log.exception("a forward with no request fails too: the engine is broken")
            raise error from None

    def _fail_rows(self, chunks: Sequence[ScheduledChunk], rows: list[StepRow]) -> list[Delta]:
        failed = [self.outputs.fail(c.request, row.error) for c, row in zip(chunks, rows) if row.error is not None]
        return [delta for delta in failed if delta is not None]

    # ---- sizing ------------------------------------------------------------------------------

    def _num_kv_blocks(self) -> int:
        return num_kv_blocks(self.config, self.model, self.dtype, self.device, self.max_model_len)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks


def _check_kv_offload(config: EngineConfig, model: object, tp: TensorParallel, stage: object) -> None:
    """ValueError when a KV tier beyond the pool cannot run here (the directory, or what is not supported yet)."""
    if config.kv_offload_dir is not None:
        check_offload_dir(config.kv_offload_dir)
        if model is not None:
            raise ValueError(
                "kv_offload_dir needs a model loaded from files: an in-memory model has nothing a later process could "
                "check spilled blocks against"
            )
    if tp.size > 1 or stage is not None:
        names = [n for n in ("kv_offload_dir", "kv_offload_host_gb") if getattr(config, n) is not None]
        raise ValueError(f"{' and '.join(names)}: not supported with tensor or pipeline parallelism yet")


def _rope_depends_on_length(model: Any) -> bool:
    """Whether the model's keys at a position depend on the sequence's length (LongRoPE past its original length):
    a cached prefix block would then be wrong for a sequence of another length, so prefix caching stays off."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return bool(getattr(rotary, "length_dependent", False))


def _stamp_queue_time(scheduled: SchedulerOutput) -> None:
    """Record how long each request scheduled for the first time waited since add_request."""
    now = None
    for chunk in scheduled.chunks:
        request = chunk.request
        if request.queue_time_s is None:
            now = now or time.monotonic()
            request.queue_time_s = now - request.arrival_time
