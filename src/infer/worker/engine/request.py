"""Request: one generation request inside the engine.

State is an explicit status plus a few counters; everything else is derived.
Torch-free (the scheduler and block manager use it and are tested without torch).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from infer.protocol.sampling import SamplingParams

if TYPE_CHECKING:  # worker/engine/structured.py imports torch; the scheduler's tests run without it
    from infer.worker.engine.images import PlacedImage
    from infer.worker.engine.pooling import PoolingState
    from infer.worker.engine.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks (new, or preempted and waiting to recompute)
    RUNNING = "running"  # holds KV blocks; prefilling (chunk by chunk) or decoding
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length reached
    FINISHED_ABORTED = "abort"  # aborted by the caller
    FINISHED_ERROR = "error"  # failed alone (e.g. can never fit in the KV pool)

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """ "stop" / "length" / "abort" / "error" once finished, else None."""
        return self.value if self.finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass(eq=False)
class Request:
    """A prompt, its generated tokens and where it stands.

    Invariants:
    - `token_ids` is prompt followed by output; `num_prompt_tokens` splits them.
    - `num_computed_tokens` tokens of `token_ids` have their KV in the blocks of `block_table`, except leading
      entries RELEASED (block_manager.py): blocks given back once out of every layer's sliding window.
      Preemption (recompute) drops the blocks and resets it to 0; the output tokens are kept and
      recomputed as part of the "prompt" of the next prefill.
    - `block_hashes[i]` is the prefix-cache hash of full block i of `token_ids` (filled lazily).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_order: int = 0
    priority: int = 0  # lower runs first under the "priority" scheduling policy (vLLM's rule)
    arrival_step: int = 0  # the scheduler's step count when it was added (the aging clock)
    max_tokens: int = 16  # resolved: params.max_tokens, capped by the context length
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the latest schedule
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    error: str | None = None
    error_code: str | None = None  # with FINISHED_ERROR: one of protocol.outputs.ERROR_CODES
    arrival_time: float = 0.0  # time.monotonic() at add_request
    queue_time_s: float | None = None  # set when first scheduled; reported once, with the first token
    queue_time_reported: bool = False
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # params.bad_words, tokenized
    grammar: GrammarState | None = None  # params.structured_outputs' matcher, once compiled
    # with params.prompt_logprobs (and not resumed elsewhere: its first output went out there): row j is prompt
    # token j + 1's logprobs, filled as prefill chunks run (worker/engine/sampler.py: record_prompt_logprobs)
    prompt_logprobs: list[dict[int, float]] | None = None
    pooled: PoolingState | None = None  # a pooling request's vector so far (worker/engine/pooling.py)
    # a beam of a beam search (worker/engine/beam_groups.py): the search's request id (the scheduler preempts a group's
    # beams together), and how many top log-probabilities each of its steps reports (its candidates)
    beam_group: str | None = None
    num_beam_candidates: int = 0
    # the engine's id of the LoRA adapter it runs with (worker/engine/lora.py; 0: the base model): its KV blocks are
    # cached apart from every other adapter's (block_manager.py), and it holds the adapter's slot while running
    lora_id: int = 0
    # the root of its prefix-cache hash chain (protocol/prefix_hash.py adapter_salt: its adapter's, by name; None: the
    # base model), which the coordinator computes too to see where its blocks are cached
    cache_salt: int | None = None
    # its images (worker/engine/images.py PlacedImage: prompt tokens, content key, pixels), in prompt order: each is
    # encoded when a prefill chunk first covers its tokens, and its key is mixed into the prefix-cache key of every
    # block that holds any of them (`image_tags`)
    images: tuple[PlacedImage, ...] = ()
    # an encoder-decoder model's request (worker/engine/encoder_decoder.py): the encoder's input (the caller's prompt;
    # then `prompt_token_ids` is the decoder's, its start token first), the blocks that hold each decoder layer's
    # cross-attention K/V over the encoder's output (a second table, allocated with the request's first blocks and
    # freed with them), and whether the encoder has written them since they were allocated
    encoder_token_ids: list[int] | None = None
    # The generation config's forced tokens (encoder-decoder models, worker/loading/model_files.py forced_token_ids):
    # the first generated token when the decoder starts from its start token alone, and the last one `max_tokens`
    # allows
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    cross_block_table: list[int] = field(default_factory=list)
    encoder_computed: bool = False
    # an audio model's request (Whisper, worker/engine/audio.py): its encoder's input, log-mel features [mel bins,
    # frames] (a torch tensor; `encoder_token_ids` then only holds as many placeholders as the encoder's output has
    # positions, and `prompt_token_ids` are what the caller gave: its decoder prompt)
    encoder_features: object | None = None
    # the generation config's suppress_tokens (never sampled) and begin_suppress_tokens (not as the first generated
    # token), as transformers' `generate` applies them (Whisper's)
    suppress_token_ids: tuple[int, ...] = ()
    begin_suppress_token_ids: tuple[int, ...] = ()

    @property
    def num_logprobs(self) -> int | None:
        """The top log-probabilities a sampled row of this request reports: a beam's candidates, else
        params.logprobs."""
        return self.num_beam_candidates if self.beam_group is not None else self.params.logprobs

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must be computed here (prompt logprobs, pooling): no prefix-cache hits."""
        return self.prompt_logprobs is not None or self.pooled is not None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        """The prompt as the caller gave it, tokenized: a text encoder-decoder model's encoder input, else the prompt
        (an audio model's: its decoder prompt)."""
        if self.encoder_token_ids is None or self.encoder_features is not None:
            return self.prompt_token_ids
        return self.encoder_token_ids

    @property
    def num_input_tokens(self) -> int:
        """len(input_token_ids): the prompt tokens outputs report (an encoder-decoder model's: its encoder input's)."""
        return len(self.input_token_ids)

    @property
    def num_encoder_tokens(self) -> int:
        return 0 if self.encoder_token_ids is None else len(self.encoder_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def forced_token(self) -> int | None:
        """The token the next sample must be (transformers' ForcedBOS / ForcedEOS logits processors), or None: the
        forced BOS as the first generated token, the forced EOS as the last one `max_tokens` allows (unless
        ignore_eos)."""
        produced = self.num_output_tokens
        if self.forced_bos_token_id is not None and produced == 0:
            return self.forced_bos_token_id
        if self.forced_eos_token_id is not None and produced == self.max_tokens - 1 and not self.params.ignore_eos:
            return self.forced_eos_token_id
        return None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not in the cache yet (the whole prompt when new, 1 when decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def rope_delta(self) -> int:
        """M-RoPE's position delta (transformers' rope_deltas): a token after the last image, generated ones
        included, has the position its place in the sequence plus this (<= 0; 0 without images on a grid)."""
        return sum(image.rope_shift for image in self.images)

    def image_tags(self, start: int, stop: int) -> tuple[int, ...]:
        """What tokens [start, stop) hold of images, beyond their ids: (key, the image's offset - start) of each image
        they overlap, flattened (empty without images). Two blocks with equal tokens and tags hold the same image
        parts at the same places."""
        return tuple(
            value
            for image in self.images
            if image.offset < stop and image.end > start
            for value in (image.key, image.offset - start)
        )

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


def overdue_message(waited: float, max_queue_time: float) -> str:
    """The error of a request shed after waiting past --max-queue-time without starting."""
    return (
        f"the worker is overloaded: the request waited {waited:.1f} s in its queue without starting "
        f"(--max-queue-time {max_queue_time:g} s); retry later"
    )
