"""EngineConfig: the engine's options, vLLM's names, validated once.

Each field declares its infer-worker flag (protocol/options.py builds the parsers from it); the INFER_ variables
the engine reads are declared in protocol/env.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from infer.protocol.lora import lora_modules, parse_lora_module
from infer.protocol.options import option
from infer.worker.engine.scheduler import SCHEDULING_POLICIES
from infer.worker.speculative.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
SUSPEND_WEIGHTS = ("auto", "host_copy", "reload")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"  # the model id an engine reports when it serves the embedded model
# A kv_producer's long_prefill_token_threshold when not given: this share of the step's token budget (EngineConfig doc)
PRODUCER_PREFILL_SHARE = 4


@dataclass(frozen=True)
class EngineConfig:
    r"""Options of one engine (one DP rank).

    model: a safetensors directory (HF layout), a .gguf file, or None for the embedded default model.
    max_model_len: None takes the model's `max_position_embeddings`.
    max_num_batched_tokens: the per-step token budget; None picks 2048 (with chunked prefill) or
        max_model_len (without, since a whole prompt must then fit in one step).
    kv_cache_memory: bytes for the KV pool (all layers, K and V); None takes `kv_cache_memory_fraction`
        of the machine's memory (CPU) or of the free device memory (CUDA).
    enforce_eager: no step graphs; every step runs the model op by op (vLLM's name). With False, decode steps
        (speculative verifications' k + 1 rows a request included) of up to `max_graph_batch_size` rows replay
        graphs made per padded row count
        (torch.compile on CPU, CUDA graphs on CUDA; worker/engine/step_graphs.py). None (the default) chooses by
        device: graphs on CUDA, eager on a CPU. On an H100, CUDA graphs measured 9.6x eager at batch 1 and
        3.8x at batch 128 (benchmarks/results/step_graphs-20261124T0148*). On a CPU the eager step with the
        native kernels (kernels/cpu_kernels.py) measured faster than the compiled one (2-core dev VM,
        2026-11-24, batch 48 bf16, 1 thread: 80 vs 93 ms of CPU a step), and the compile costs start-up time
        (seconds with a warm cache, minutes cold).
    scheduling_policy: "fcfs" (arrival order) or "priority" (lower `priority` first, with preemption of worse
        ranked requests and the aging rule of worker/engine/scheduler.py: a request waiting `priority_aging_steps`
        engine steps ranks ahead of every younger one).
    long_prefill_token_threshold: with chunked prefill, the most tokens a request's prefill chunk takes in one step
        (vLLM's name and rule, verification chunks aside; worker/engine/scheduler.py, "Short prefills beside a long
        one"): the budget a long prompt leaves admits the short prompts behind it in the same step. 0: no cap (a chunk
        takes all the budget left). None (the default) is 0, but on a kv_producer worker (`for_kv_role`) a quarter
        (PRODUCER_PREFILL_SHARE) of the step's token budget (512 of the default 2048): a producer prefills for every
        request of its consumers, so a long prompt there would hold back every new request's first token for its whole
        prefill. Its cost: a long prompt takes up to budget / threshold times as many steps, each with its fixed cost,
        so its own time to first token grows; and long prompts that arrive together prefill side by side (each up to the
        threshold a step) instead of one after the other, so the first of them is answered later. Without chunked
        prefill it must be 0 or None.
    max_grammar_step_ms, max_grammar_compiles, max_grammar_compiles_per_client: the bounds on structured outputs'
        grammars (worker/engine/structured.py): the CPU time one request's grammar may take in a step (measured, so that
        a grammar costly to follow fails alone after one step instead of slowing every step of the engine), and
        the compiles in flight, per engine and per client (past them, "overloaded" at once instead of a queue).
        The step bound's default is 5x the costliest mask measured for the test schemas on SmolLM2's 49k-token
        vocabulary (21 ms, Zen 5); nested bounded repeats such as `([\s\S]{0,100}){0,100}` pass it within a few
        tokens and then take seconds a step. The compile bounds' defaults let a burst of 20 distinct schemas through
        one client (the HTTP front is one); the compile thread takes turns between clients, so one client's backlog
        delays another's compile by one compile each, not by the backlog.
    speculative_config: speculative decoding (worker/speculative/verification.py), a dict of vLLM's keys or a
        SpeculativeConfig (worker/speculative/config.py); None: off. A verification chunk is computed as decode rows:
        eagerly (the native CPU decode step takes 1-8 requests' rows), or through the step graphs where they are on.
    suspend_weights: what suspend does with the weights: "host_copy" moves them to pinned host memory (on a
        CPU they stay where they are: nothing of them is freed), "reload" frees them and reloads them on resume
        from the files they came from (or from a spill file, when they came from tensors in memory); "auto"
        is host_copy on a GPU, reload on a CPU. The KV pool is always freed.
    pp_micro_batches: on a pipeline's stage 0 (pipeline_parallel_size P), the micro-batches in flight through the
        stages (worker/engine/micro_batches.py); None: P, one per stage. 1 steps one batch at a time (what the benchmark
        compares against). Ignored without a pipeline and with speculative decoding (one at a time).
    enable_lora, max_loras, max_lora_rank, lora_modules: LoRA adapters (worker/engine/lora.py; vLLM's names): served per
        request (SamplingParams.lora_name), at most `max_loras` of them in one step, ranks up to `max_lora_rank`;
        `lora_modules` are (name, path) pairs loaded at start (a dict, or "name=path" strings, are taken too).
    kv_offload_dir, kv_offload_gb: the KV tier beyond the pool (worker/kv/offload.py): evicted prefix-cache blocks of
        the base model are written to files under the directory by a background thread (at most `kv_offload_gb` GiB,
        least recently used deleted first) and read back into the pool when a waiting request's prefix misses the
        pool but is on disk. Needs prefix caching and a model loaded from files; not with TP / PP yet. The directory
        is checked (exists, writable) when the engine starts, where it is used: a launcher may build this config
        on another host.
    kv_offload_host_gb: the KV tier in host memory (worker/kv/offload.py, worker/kv/host_store.py; vLLM's
        --kv-offloading-size): evicted prefix-cache blocks of the base model are copied into at most this many GiB of
        host memory (pinned when the pool is on a GPU; allocated at start), checksummed, and read back like the disk's
        on a hit. Its least recently used blocks move down to the disk tier when kv_offload_dir is given, else are
        dropped: pool -> host -> disk. Needs prefix caching; not with TP / PP yet.
    """

    model: str | None = option(
        None, "a safetensors model directory or a .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    dtype: str = option(
        "auto", "weights and activations; auto: bfloat16 where the CPU or GPU computes it natively", choices=DTYPES
    )
    quantization: str = option(
        "auto",
        "weights kept quantized: auto keeps a GGUF's blocks as they are (dense "
        "checkpoints dense; an FP8 one dense in --dtype: 2 bytes a weight in bf16, int8 "
        "keeps it near 1); none makes every weight dense in --dtype; int8 / int4 "
        "quantize the linear layers at load (weight-only, blocks of 32)",
        choices=QUANTIZATIONS,
    )
    device: str = option("auto", "auto, cpu, cuda or cuda:N")
    max_model_len: int | None = option(None, "the context length (default: the model's)")
    max_num_seqs: int = option(256, "requests running at once")
    max_num_batched_tokens: int | None = option(None, "tokens per engine step (default 2048 with chunked prefill)")
    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | None = option(None, "bytes for the KV cache pool")
    kv_cache_memory_fraction: float = option(0.1, "share of memory for the KV pool when --kv-cache-memory is not given")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of a shared prompt prefix")
    limit_mm_per_prompt: int = option(
        4,
        "the most images one prompt may hold (a model that takes images): N, or vLLM's JSON '{\"image\": N}'",
        parse=lambda text: parse_mm_limit(text),
        metavar="N",
    )
    mm_encoder_cache_images: int = option(
        64, "images whose vision-encoder features are kept for reuse (a model that takes images; LRU)", metavar="N"
    )
    kv_offload_dir: str | None = option(
        None,
        "spill prefix-cache blocks evicted from the KV pool to files in this local directory, and read them back on "
        "a later hit instead of prefilling (needs --kv-offload-gb; off by default)",
        metavar="DIR",
    )
    kv_offload_gb: float | None = option(
        None,
        "with --kv-offload-dir: the most GiB of spilled blocks kept there (least recently used deleted first)",
        metavar="N",
    )
    kv_offload_host_gb: float | None = option(
        None,
        "spill prefix-cache blocks evicted from the KV pool to at most N GiB of host memory (pinned on a GPU), read "
        "back on a later hit instead of prefilling; its least recently used blocks move down to --kv-offload-dir when "
        "given, else are dropped (vLLM: --kv-offloading-size; off by default)",
        metavar="N",
    )
    enable_chunked_prefill: bool = option(True, "split long prompts over steps, mixed with decodes")
    seed: int = option(0, "the engine's seed (a request's own seed wins)")
    num_threads: int | None = option(None, "torch threads", flag="--threads", metavar="N")
    enforce_eager: bool | None = option(
        None,
        "no step graphs: every step runs op by op; --no-enforce-eager: "
        "decode steps replay graphs compiled (CPU) or captured (CUDA) per "
        "batch size (default: graphs on CUDA, eager on a CPU)",
    )
    cpu_weight_prepack: bool | None = option(
        None,
        "keep a oneDNN-packed copy of every dense bf16 linear weight beside it for steps of more than 8 rows "
        "(prefills, larger batches: 1.25x faster on AVX512-BF16, for twice the weights' memory); "
        "--no-cpu-weight-prepack: never (default: only on AMX-BF16 CPUs, where oneDNN multiplies on AMX tiles)",
    )
    max_graph_batch_size: int = option(
        256, "the most rows (decoding sequences, verification rows) a step graph is made for", metavar="N"
    )
    scheduling_policy: str = option(
        "fcfs", "fcfs, or priority: lower request priority first, with aging", choices=SCHEDULING_POLICIES
    )
    priority_aging_steps: int = option(
        1000,
        "with --scheduling-policy priority: a request that has waited N engine steps ranks ahead of every younger one",
        metavar="N",
    )
    long_prefill_token_threshold: int | None = option(
        None,
        "with chunked prefill: the most tokens one request's prefill chunk takes in an engine step, so that short "
        "prompts are prefilled beside a long one (the long one takes more, smaller steps); vLLM's name; 0: no cap. "
        "Default: 0, but a quarter of the step's token budget on a kv_producer worker (512 of the default 2048)",
        metavar="N",
    )
    max_grammar_step_ms: float = option(
        100.0,
        "CPU milliseconds one request's grammar (its token mask and matcher) "
        "may take in one engine step; a request over it fails "
        "(invalid_request), and a grammar whose first mask takes longer is "
        "refused before it runs",
        metavar="MS",
    )
    max_grammar_compiles: int = option(
        32,
        "grammars compiling or queued to compile at once (a cached spec, or one "
        "compiling already, takes no place); a request past it is refused as "
        "overloaded",
        metavar="N",
    )
    max_grammar_compiles_per_client: int = option(
        24, "of those, at most N for one client; its next is refused as overloaded", metavar="N"
    )
    suspend_weights: str = option(
        "auto",
        "what suspend does with the weights: host_copy (pinned host memory on "
        "a GPU; kept on a CPU), reload (freed, reloaded from their files on "
        "resume); auto: host_copy on a GPU, reload on a CPU. The KV pool is "
        "always freed",
        choices=SUSPEND_WEIGHTS,
    )
    speculative_config: SpeculativeConfig | None = option(
        None,
        'speculative decoding, vLLM\'s keys as JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": K} (optional "disable_by_batch_size": no speculation in a step where '
        "more requests decode, default 8)",
        metavar="JSON",
        parse=SpeculativeConfig.of,
    )
    pp_micro_batches: int | None = option(
        None,
        "with --pp-size P: micro-batches in flight through the stages "
        "(default P, one per stage, so that every stage works at once; 1: one "
        "batch at a time)",
        metavar="N",
    )
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT's format) per request over the base model")
    max_loras: int = option(
        4,
        "with --enable-lora: the adapters one step may mix (weight slots; the least recently "
        "used adapter no running request holds is evicted)",
        metavar="N",
    )
    max_lora_rank: int = option(16, "with --enable-lora: the largest adapter rank accepted", metavar="R")
    lora_modules: tuple[tuple[str, str], ...] = option(
        (),
        "with --enable-lora: adapters loaded at start, each name=path (a PEFT folder) or vLLM's JSON "
        '{"name": N, "path": P}; requests name them (HTTP: the model field)',
        metavar="NAME=PATH",
        parse=parse_lora_module,
        show=lambda pair: f"{pair[0]}={pair[1]}",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", lora_modules(self.lora_modules))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        _positive_int("max_loras", self.max_loras)
        if self.pp_micro_batches is not None:
            _positive_int("pp_micro_batches", self.pp_micro_batches)
        _positive_int("max_lora_rank", self.max_lora_rank)
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a non-empty path string or None, got {self.model!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("block_size", self.block_size)
        if self.block_size > 1024:
            raise ValueError(f"block_size must be <= 1024, got {self.block_size}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory", "num_threads"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if not isinstance(self.kv_cache_memory_fraction, (int, float)) or not (
            0 < self.kv_cache_memory_fraction <= 0.95
        ):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction!r}")
        _positive_int("max_graph_batch_size", self.max_graph_batch_size)
        _positive_int("limit_mm_per_prompt", self.limit_mm_per_prompt)
        _positive_int("mm_encoder_cache_images", self.mm_encoder_cache_images)
        _positive_int("max_grammar_compiles", self.max_grammar_compiles)
        _positive_int("max_grammar_compiles_per_client", self.max_grammar_compiles_per_client)
        if (
            isinstance(self.max_grammar_step_ms, bool)
            or not isinstance(self.max_grammar_step_ms, (int, float))
            or not 0 < self.max_grammar_step_ms <= 60_000
        ):
            raise ValueError(
                f"max_grammar_step_ms must be a number of milliseconds in (0, 60000], got {self.max_grammar_step_ms!r}"
            )
        _positive_int("priority_aging_steps", self.priority_aging_steps)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        for name in ("enable_prefix_caching", "enable_chunked_prefill"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        self._check_kv_offload()
        if self.cpu_weight_prepack is not None and not isinstance(self.cpu_weight_prepack, bool):
            raise ValueError(f"cpu_weight_prepack must be a bool or None (by CPU), got {self.cpu_weight_prepack!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be a bool or None (by device), got {self.enforce_eager!r}")
        if self.suspend_weights not in SUSPEND_WEIGHTS:
            raise ValueError(
                f"suspend_weights must be one of {', '.join(SUSPEND_WEIGHTS)}, got {self.suspend_weights!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self._check_long_prefill()
        if (
            self.max_num_batched_tokens is not None
            and self.max_model_len is not None
            and not self.enable_chunked_prefill
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so a whole prompt fits in one step"
            )

    def _check_long_prefill(self) -> None:
        threshold = self.long_prefill_token_threshold
        if threshold is None:
            return
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: off), got {threshold!r}")
        if threshold and not self.enable_chunked_prefill:
            raise ValueError(
                f"long_prefill_token_threshold ({threshold}) needs chunked prefill (--enable-chunked-prefill): "
                "without it a prompt is computed whole in one step, so there is no chunk to cap"
            )

    def _check_kv_offload(self) -> None:
        gb, path, host = self.kv_offload_gb, self.kv_offload_dir, self.kv_offload_host_gb
        for name, value in (("kv_offload_gb", gb), ("kv_offload_host_gb", host)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf")
            ):
                raise ValueError(f"{name} must be a number of GiB > 0, got {value!r}")
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(f"kv_offload_dir must be a non-empty directory path, got {path!r}")
        if (path is None) != (gb is None):
            raise ValueError(
                "kv_offload_dir (--kv-offload-dir) and kv_offload_gb (--kv-offload-gb) go together: the directory "
                "for spilled KV blocks and the most GiB they may take there"
            )
        if path is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir spills prefix-cache blocks: it needs enable_prefix_caching")
        if host is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_gb spills prefix-cache blocks: it needs enable_prefix_caching")

    @property
    def kv_offload_bytes(self) -> int | None:
        """`kv_offload_gb` in bytes (GiB), or None: no tier beyond the pool."""
        return None if self.kv_offload_gb is None else int(self.kv_offload_gb * (1 << 30))

    @property
    def kv_offload_host_bytes(self) -> int | None:
        """`kv_offload_host_gb` in bytes (GiB), or None: no tier in host memory."""
        return None if self.kv_offload_host_gb is None else int(self.kv_offload_host_gb * (1 << 30))

    @property
    def model_id(self) -> str:
        """The id workers report and clients name: the model path given, or the embedded model's name."""
        return self.model or DEFAULT_MODEL_ID

    @classmethod
    def from_options(cls, **options: Any) -> "EngineConfig":
        """Build from keyword options; an unknown name is a ValueError that names it."""
        unknown = sorted(set(options) - ENGINE_OPTION_NAMES)
        if unknown:
            raise ValueError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(ENGINE_OPTION_NAMES))}"
            )
        return cls(**options)

    def eager_on(self, device_type: str) -> bool:
        """Whether steps run op by op on a device of this type ("cpu", "cuda"): `enforce_eager` when given, else
        eager everywhere but CUDA (see the class doc for the measurements behind that choice)."""
        return self.enforce_eager if self.enforce_eager is not None else device_type != "cuda"

    def budget_tokens(self, max_model_len: int) -> int:
        """The per-step token budget once the model's context length is known."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def for_kv_role(self, kv_role: str) -> "EngineConfig":
        """This config on a worker of `kv_role` (--kv-transfer-config): a kv_producer with chunked prefill whose
        long_prefill_token_threshold was not given takes 1/PRODUCER_PREFILL_SHARE of its step's token budget (the
        class doc says why); any other role, or a threshold given (0 included), keeps the config as it is."""
        if kv_role != "kv_producer" or self.long_prefill_token_threshold is not None or not self.enable_chunked_prefill:
            return self
        budget = self.budget_tokens(self.max_model_len or 1)  # with chunked prefill it does not depend on the context
        return dataclasses.replace(self, long_prefill_token_threshold=max(1, budget // PRODUCER_PREFILL_SHARE))


ENGINE_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def parse_mm_limit(text: str) -> int:
    """--limit-mm-per-prompt: an int, or vLLM's JSON object of modality -> count (only "image" is served)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            limits = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a JSON object: {error}") from None
        others = sorted(set(limits) - {"image"}) if isinstance(limits, dict) else []
        if not isinstance(limits, dict) or others or not isinstance(limits.get("image"), int):
            raise ValueError(f'expected {{"image": N}} (images are the only modality served), got {text!r}')
        return int(limits["image"])
    try:
        return int(text)
    except ValueError:
        raise ValueError(f'expected N or {{"image": N}}, got {text!r}') from None


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
