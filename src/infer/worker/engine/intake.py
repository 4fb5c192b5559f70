"""Intake: a request's input validated and its Request built, before anything is queued.

Owns every check of add_request's input past the request id: the SamplingParams (n, pooling, a seed drawn for a
sampled request without one, token lists, beam-search limits), the prompt (a text prompt bounded before it is
tokenized, token ids in the vocabulary, room left in the context), its images (decoded, checked, preprocessed and
placed: worker/engine/images.py), resumed tokens (a failover), and max_tokens resolved against the context and the pool.
Invalid input raises ValueError with the reason; nothing is queued and no engine state changes (but the seed drawn).
The engine queues the Request it returns (scheduler, beam searches, grammar queue).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import msgspec

from infer.protocol.messages import MAX_ID_LEN
from infer.protocol.prefix_hash import adapter_salt
from infer.protocol.prompt_limits import prompt_size_error
from infer.protocol.sampling import SamplingParams
from infer.worker.engine.audio import LogMel, load_audio
from infer.worker.engine.beam_groups import BeamGroups
from infer.worker.engine.config import EngineConfig
from infer.worker.engine.encoder_decoder import EncoderDecoderModel, takes_audio
from infer.worker.engine.images import (
    Gemma3ImagePrompt,
    Idefics3ImagePrompt,
    ImageLimits,
    PlacedImage,
    load_image,
    place_images,
    tile_key,
)
from infer.worker.engine.pooling import PoolingState
from infer.worker.engine.request import Request
from infer.worker.engine.scheduler import Scheduler
from infer.worker.engine.vision import Preprocessor, VisionModel


def check_request_id(request_id: object) -> None:
    """ValueError unless `request_id` is a non-empty string of at most MAX_ID_LEN characters."""
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_ID_LEN:
        raise ValueError(
            f"request_id must be a non-empty string of at most {MAX_ID_LEN} characters (every "
            f"delta carries it), got {request_id!r:.80}"
        )


class Intake:
    """Validates a request's input and builds its Request (module docstring). Reads the scheduler's config and
    block geometry; queues nothing."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        prompt_token_bytes: int | None,
        eos_token_ids: frozenset[int],
        model_id: str,
        scheduler: Scheduler,
        num_kv_blocks: int,
        block_size: int,
        draw_seed: Callable[[], int],
        lora_id: Callable[[str | None], int],
        vision: VisionModel | None,
        preprocess: Preprocessor | None,
        image_limits: ImageLimits,
        speculative: str | None,
        pipeline: bool,
        model_parallel: bool,
        encoder_decoder: EncoderDecoderModel | None = None,
        forced_tokens: tuple[int | None, int | None] = (None, None),
        audio_features: LogMel | None = None,
        suppressed_tokens: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
    ) -> None:
        """`draw_seed`: a seed for a sampled request without one; `lora_id`: an adapter name's id (0: none;
        ValueError for an unknown one); `vision` / `preprocess`: a model that takes images and its preprocessing;
        `speculative`: the method that proposes drafts (None: no speculative decoding; a draft model takes no
        images); `pipeline`: this is a pipeline's stage 0 (no
        pooling); `model_parallel`: tensor or pipeline parallel (no beam search); `encoder_decoder`: the model when it
        is one (worker/engine/encoder_decoder.py): the prompt is then its encoder's input; `forced_tokens`: its
        generation config's (forced BOS, forced EOS), worker/engine/request.py's forced_token; `audio_features`: an
        audio model's feature extractor (worker/engine/audio.py); `suppressed_tokens`: its generation config's
        (suppress_tokens, begin_suppress_tokens)."""
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prompt_token_bytes = prompt_token_bytes
        self.eos_token_ids = eos_token_ids
        self.model_id = model_id
        self.scheduler = scheduler
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.draw_seed = draw_seed
        self.lora_id = lora_id
        self.vision = vision
        self.preprocess = preprocess
        self.image_limits = image_limits
        self.speculative = speculative
        self.pipeline = pipeline
        self.model_parallel = model_parallel
        self.encoder_decoder = encoder_decoder
        self.forced_bos, self.forced_eos = forced_tokens
        self.audio_features = audio_features
        self.suppress, self.begin_suppress = suppressed_tokens
        make_prompt = getattr(vision, "image_prompt", None)  # a prompt form of its own (Gemma 3's boi / eoi)
        self.image_prompt: Gemma3ImagePrompt | Idefics3ImagePrompt | None = (
            None if make_prompt is None else make_prompt(tokenizer)
        )

    def request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        resumed_token_ids: Sequence[int],
        priority: int,
        images: Sequence[object],
        arrival_order: int,
        decoder_prompt: str | Sequence[int] | None = None,
        audio: object | None = None,
    ) -> tuple[Request, list[int]]:
        """The Request (status WAITING; a beam search's first beam) and its resumed tokens; ValueError naming what
        is wrong (Engine.add_request says what each argument means)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1 and not params.beam_search:
            raise ValueError(
                f"n={params.n}: an engine runs one sample per request; LLM / AsyncLLM and the HTTP "
                f"front run n > 1 as n requests (SamplingParams.samples())"
            )
        if params.pooling is not None:
            if self.pipeline:
                raise ValueError(
                    "embeddings (pooling) are not supported with pipeline parallelism yet: the hidden "
                    "states stay on the last stage, which sends stage 0 only logits"
                )
            params = _pooling_params(params)
        if params.seed is None and params.temperature > 0:
            params = params.with_seed(self.draw_seed())
        lora_id = self.lora_id(params.lora_name)
        encoder_ids = None
        placed: tuple[PlacedImage, ...] = ()
        features = None
        if takes_audio(self.encoder_decoder):
            prompt_ids, encoder_ids, features = self._audio_input(prompt, params, images, audio, decoder_prompt)
        elif audio is not None:
            kind = "an encoder-decoder text model" if self.encoder_decoder is not None else "a text-only model"
            raise ValueError(f"model {self.model_id!r} takes no audio: it is {kind}")
        elif self.encoder_decoder is not None:
            encoder_ids = self._encoder_token_ids(prompt, params, images)
            prompt_ids = self._decoder_prompt_ids(decoder_prompt)
        elif decoder_prompt is not None:
            raise ValueError(
                f"decoder_prompt is for encoder-decoder models; model {self.model_id!r} is decoder-only: give the "
                "whole prompt as 'prompt'"
            )
        else:
            if isinstance(self.image_prompt, Idefics3ImagePrompt) and _some_images(images):
                prompt_ids, placed = self._place_tiles(self.image_prompt, prompt, images)
            else:
                if (
                    isinstance(self.image_prompt, Gemma3ImagePrompt)
                    and isinstance(prompt, str)
                    and _some_images(images)
                ):
                    self._check_image_count(len(images))  # before the text grows by each image's tokens
                    prompt = self.image_prompt.expand_text(prompt, len(images))
                prompt_ids = self._prompt_token_ids(prompt)
                prompt_ids, placed = self._place_images(prompt_ids, images)
        self._check_token_lists(params)
        resumed = self._resumed_token_ids(len(prompt_ids), resumed_token_ids, params.max_tokens)
        if params.beam_search:
            self._check_beam_search(params, len(prompt_ids), resumed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            params=params,
            arrival_order=arrival_order,
            eos_token_ids=self.eos_token_ids,
            max_tokens=self._resolve_max_tokens(len(prompt_ids), params),
            token_ids=prompt_ids + resumed,
            arrival_time=time.monotonic(),
            priority=priority,
            bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
            prompt_logprobs=[] if params.prompt_logprobs is not None and not resumed else None,
            pooled=None if params.pooling is None else PoolingState(params.pooling, params.normalize, len(prompt_ids)),
            lora_id=lora_id,
            cache_salt=adapter_salt(params.lora_name),
            images=placed,
            encoder_token_ids=encoder_ids,
            encoder_features=features,
            suppress_token_ids=self.suppress,
            begin_suppress_token_ids=self.begin_suppress,
            # transformers forces BOS where the decoder's input is its start token alone (a decoder prompt given:
            # not), and EOS as the last token a length limit allows
            forced_bos_token_id=self.forced_bos if len(prompt_ids) == 1 else None,
            forced_eos_token_id=self.forced_eos,
        )
        if params.beam_search:  # its prompt's request is its first beam (worker/engine/beam_groups.py)
            request.beam_group = request.request_id
            request.num_beam_candidates = BeamGroups.num_candidates(params.beam_width or 1, self.eos_token_ids)
            if params.min_tokens:  # the candidates min_tokens bans are left out: K more make up for them
                request.num_beam_candidates += len(self.eos_token_ids) + len(params.stop_token_ids)
        return request, resumed

    def _place_images(
        self, prompt_ids: list[int], images: Sequence[object]
    ) -> tuple[list[int], tuple[PlacedImage, ...]]:
        """The prompt's ids with its images' tokens in place, and the images decoded, checked, preprocessed and
        placed; ValueError naming what is wrong (worker/engine/images.py). Without images the prompt must hold no image
        token either."""
        if isinstance(images, (bytes, str)) or not isinstance(images, Sequence):
            raise ValueError(f"images must be a list of encoded images or PIL images, got {type(images).__name__}")
        model = self.vision
        video = getattr(model, "video_token_id", None)
        if video is not None and video in prompt_ids:
            raise ValueError(f"the prompt holds video tokens (id {video}): video inputs are not supported, only images")
        if not images:
            if model is not None and model.image_token_id in prompt_ids:
                raise ValueError(
                    f"the prompt holds image tokens (id {model.image_token_id}) but no image was given with it"
                )
            return prompt_ids, ()
        model, preprocessed = self._preprocessed(images)
        prepared = [(key, pixels, model.image_placement(pixels)) for key, pixels in preprocessed]
        counts = [tokens for _, _, (tokens, _) in prepared]
        budget = self.scheduler.config.max_num_batched_tokens
        if self.scheduler.config.whole_images and max(counts) > budget:
            raise ValueError(
                f"an image takes {max(counts)} tokens, more than max_num_batched_tokens ({budget}): "
                f"model {self.model_id!r} computes an image's tokens in one step (they attend to each other both ways)"
            )
        if isinstance(self.image_prompt, Gemma3ImagePrompt):
            ids, places = self.image_prompt.place(prompt_ids, len(images))
        else:
            ids, places = place_images(prompt_ids, model.image_token_id, counts)
        placed = [
            PlacedImage(offset, length, key, pixels, grid)
            for (offset, length), (key, pixels, (_, grid)) in zip(places, prepared, strict=True)
        ]
        return ids, tuple(placed)

    def _preprocessed(self, images: Sequence[object]) -> tuple[VisionModel, list[tuple[int, Any]]]:
        """The model's vision side and (key, preprocessed pixels) of each image, decoded and checked; ValueError naming
        what is wrong (a model that takes no images among it)."""
        if self.vision is None or self.preprocess is None:
            raise ValueError(f"model {self.model_id!r} takes no images: it is a text-only model")
        if self.speculative == "draft_model":
            raise ValueError(
                "images with a draft model are not supported: the draft model reads text only (speculative_config "
                "method 'ngram' takes images)"
            )
        self._check_image_count(len(images))
        prepared = []
        for index, item in enumerate(images):
            image, key = load_image(item, self.image_limits, index)
            try:
                prepared.append((key, self.preprocess(image)))
            except ValueError as error:
                raise ValueError(f"image {index}: {error}") from None
        return self.vision, prepared

    def _place_tiles(
        self, form: Idefics3ImagePrompt, prompt: str | Sequence[int], images: Sequence[object]
    ) -> tuple[list[int], tuple[PlacedImage, ...]]:
        """Idefics3's `form` (worker/engine/images.py `Idefics3ImagePrompt`): the images preprocessed first (an image's
        tiles make its prompt text), the prompt expanded and tokenized, each tile placed as an image of its own."""
        _, prepared = self._preprocessed(images)
        grids = [(pixels.rows, pixels.cols) for _, pixels in prepared]
        if isinstance(prompt, str):
            prompt = form.expand_text(prompt, grids)
        ids, places = form.place(self._prompt_token_ids(prompt), grids)
        placed = [
            PlacedImage(offset, length, tile_key(key, index), pixels.tiles[index])
            for (key, pixels), tiles in zip(prepared, places, strict=True)
            for index, (offset, length) in enumerate(tiles)
        ]
        return ids, tuple(placed)

    def _check_image_count(self, count: int) -> None:
        if count > self.image_limits.max_images:
            raise ValueError(
                f"{count} images exceed the limit of {self.image_limits.max_images} per prompt (--limit-mm-per-prompt)"
            )

    def _encoder_token_ids(
        self, prompt: str | Sequence[int], params: SamplingParams, images: Sequence[object]
    ) -> list[int]:
        """An encoder-decoder model's encoder input from the request's prompt; ValueError naming what such a model
        does not take (worker/engine/encoder_decoder.py) or a prompt it cannot encode."""
        model = self.encoder_decoder
        if model is None:
            raise ValueError("not an encoder-decoder model")
        refused = [
            name
            for name, given in (
                ("beam search", params.beam_search),
                ("images", bool(images)),
                ("pooling (embeddings)", params.pooling is not None),
                ("prompt_logprobs", params.prompt_logprobs is not None),
            )
            if given
        ]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported for encoder-decoder model {self.model_id!r}")
        limit = self.max_model_len if model.max_encoder_len is None else min(self.max_model_len, model.max_encoder_len)
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the encoder prompt is empty")
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise ValueError("the encoder prompt is empty (no tokens)")
        return self._prompt_token_ids(prompt, encoder_limit=limit)

    def _audio_input(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        images: Sequence[object],
        audio: object | None,
        decoder_prompt: object,
    ) -> tuple[list[int], list[int], Any]:
        """An audio model's request (Whisper): (its decoder prompt's ids, the encoder's placeholder ids, the audio's
        log-mel features); ValueError naming what is wrong. The prompt is the decoder's (vLLM's form: text tokenized
        without special tokens added, or ids); one without the decoder's start token gets it in front."""
        model, features = self.encoder_decoder, self.audio_features
        if model is None or features is None or model.max_encoder_len is None:
            raise ValueError("not an audio model")
        if _some_images(images):
            raise ValueError(f"model {self.model_id!r} takes audio, not images")
        if audio is None:
            raise ValueError(
                f"model {self.model_id!r} transcribes audio: give the audio with the prompt "
                "(multi_modal_data={'audio': (samples, sample_rate)})"
            )
        if decoder_prompt is not None:
            raise ValueError(
                f"model {self.model_id!r} takes its decoder prompt as 'prompt' beside its audio (vLLM's form), "
                "not as 'decoder_prompt'"
            )
        refused = [
            name
            for name, given in (
                ("beam search", params.beam_search),
                ("pooling (embeddings)", params.pooling is not None),
                ("prompt_logprobs", params.prompt_logprobs is not None),
            )
            if given
        ]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not supported for audio model {self.model_id!r}")
        samples = load_audio(audio, features)
        if isinstance(prompt, str):
            too_long = prompt_size_error(prompt, self.max_model_len, self.prompt_token_bytes) if prompt else None
            if too_long is not None:
                raise ValueError(too_long)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        bad = next(
            (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if model.decoder_start_token_id not in ids:
            ids = [model.decoder_start_token_id, *ids]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the decoder prompt has {len(ids)} tokens (its start token included), but the decoder's context "
                f"length is {self.max_model_len}"
            )
        return ids, [0] * model.max_encoder_len, features(samples)

    def _decoder_prompt_ids(self, decoder_prompt: str | Sequence[int] | None) -> list[int]:
        """The decoder's prompt: its start token, then `decoder_prompt` (text tokenized without special tokens, or
        ids)."""
        model = self.encoder_decoder
        if model is None:
            raise ValueError("not an encoder-decoder model")
        if decoder_prompt is None:
            prefix: list[int] = []
        elif isinstance(decoder_prompt, str):
            prefix = self.tokenizer.encode(decoder_prompt, add_special_tokens=False) if decoder_prompt else []
        elif isinstance(decoder_prompt, (list, tuple)):
            prefix = list(decoder_prompt)
        else:
            raise ValueError(
                f"decoder_prompt must be a string or a list of token ids, got {type(decoder_prompt).__name__}"
            )
        bad = next(
            (t for t in prefix if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise ValueError(f"decoder prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        ids = [model.decoder_start_token_id, *prefix]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the decoder prompt has {len(ids)} tokens (its start token included), but the decoder's context "
                f"length is {self.max_model_len}"
            )
        return ids

    def _check_beam_search(self, params: SamplingParams, num_prompt_tokens: int, resumed: list[int]) -> None:
        """ValueError unless this engine can run a beam search of `params` (worker/engine/beam_groups.py)."""
        width = params.beam_width or 1
        if self.model_parallel:
            raise ValueError(
                "beam search is not supported with tensor or pipeline parallelism yet (a fork copies "
                "KV blocks, which the other ranks' shards do not do yet)"
            )
        if self.scheduler.config.release_window:
            raise ValueError(
                "beam search is not supported on a model whose every layer has a sliding window yet "
                "(its beams give blocks back, which forks cannot share)"
            )
        if resumed:
            raise ValueError("a beam search cannot continue from delivered tokens: it delivers none before its end")
        if width > self.config.max_num_seqs:
            raise ValueError(
                f"beam_width {width} is more than max_num_seqs ({self.config.max_num_seqs}): every beam "
                f"is a sequence of the batch"
            )
        needed = width * self.scheduler.block_manager.blocks_for_tokens(
            num_prompt_tokens + self._resolve_max_tokens(num_prompt_tokens, params)
        )
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"a beam search of {width} beams can never fit in the KV cache: {width} x (prompt + "
                f"max_tokens) need up to {needed} KV blocks, the pool has {self.num_kv_blocks}"
            )

    def _check_token_lists(self, params: SamplingParams) -> None:
        """ValueError naming the field if logit_bias or allowed_token_ids names a token outside the vocabulary."""
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias or ()]),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _bad_words_token_ids(self, bad_words: Sequence[str]) -> list[list[int]]:
        """Each bad word's token ids as it starts the text and as it follows a space (vLLM keeps the second
        only when it is as long as the first, which lets " word" through when "word" splits differently)."""
        out: list[list[int]] = []
        for word in bad_words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            variants = [plain]
            if spaced != plain:
                variants.append(spaced)
            out += [ids for ids in variants if ids and max(ids) < self.vocab_size]
        return out

    def _prompt_token_ids(self, prompt: str | Sequence[int], encoder_limit: int | None = None) -> list[int]:
        """The prompt's ids, checked: shorter than the context length, or with `encoder_limit` (an encoder's input)
        at most that many tokens."""
        limit = self.max_model_len if encoder_limit is None else encoder_limit + 1
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            too_long = prompt_size_error(prompt, limit, self.prompt_token_bytes)
            if too_long is not None:  # before tokenizing: that is linear in the prompt, and this loop's time
                raise ValueError(too_long)
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:  # the model directory's tokenizer knows more tokens than the model
                raise ValueError(
                    f"the tokenizer turned the prompt into token id {bad}, outside the model's "
                    f"vocabulary [0, {self.vocab_size}): the tokenizer does not match the model"
                )
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = next(
                (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size), None
            )
            if bad is not None:
                raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if encoder_limit is not None and len(ids) > encoder_limit:
            raise ValueError(f"the encoder prompt has {len(ids)} tokens, more than the encoder takes ({encoder_limit})")
        if len(ids) >= limit:
            raise ValueError(
                f"prompt has {len(ids)} tokens, but the context length is {limit}: "
                f"it must be shorter to leave room for at least one generated token"
            )
        return ids

    def _resumed_token_ids(self, num_prompt_tokens: int, resumed: Sequence[int], max_tokens: int | None) -> list[int]:
        ids = list(resumed)
        bad = next(
            (t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size), None
        )
        if bad is not None:
            raise ValueError(f"resumed token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if num_prompt_tokens + len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + resumed tokens ({len(ids)}) reach the "
                f"context length {self.max_model_len}: nothing is left to generate"
            )
        if max_tokens is not None and len(ids) >= max_tokens:
            raise ValueError(
                f"the resumed tokens ({len(ids)}) reach max_tokens ({max_tokens}): nothing is left to generate"
            )
        return ids

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if params.max_tokens is not None:
            return min(params.max_tokens, self.max_model_len - num_prompt_tokens)
        # "Up to the context length": the context a lone request can really have is also bounded by the pool.
        usable = min(self.max_model_len, self.num_kv_blocks * self.block_size)
        return max(1, usable - num_prompt_tokens)


def _pooling_params(params: SamplingParams) -> SamplingParams:
    """A pooling request's params (worker/engine/pooling.py): what only generation takes is refused (ValueError); it
    runs its prompt and one greedy step, whose token is dropped."""
    names = ("structured_outputs", "prompt_logprobs", "logprobs", "bad_words", "logit_bias", "allowed_token_ids")
    given = [name for name in names if getattr(params, name) not in (None, ())]
    if given:
        raise ValueError(f"pooling (an embedding) takes no generation options; got {', '.join(given)}")
    return msgspec.structs.replace(params, temperature=0.0, max_tokens=1, min_tokens=0, seed=None)


def _some_images(images: object) -> bool:
    """Whether `images` is a non-empty list of images (not bytes or a str: those are checked by _place_images)."""
    return isinstance(images, Sequence) and not isinstance(images, (bytes, str)) and len(images) > 0
