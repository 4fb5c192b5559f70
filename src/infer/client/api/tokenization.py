"""Each model's tokenization on the HTTP front: a cluster may serve models of different vocabularies and chat
templates (docs/architecture.md, many models), and a prompt tokenized with another model's tokenizer runs as the
wrong token ids, silently. So everything the front does with a tokenizer (prompts, chat templates, the size bound
of a text prompt, vocabulary checks, /tokenize and /detokenize, logprob token strings, the tool-call parser a
template calls for) goes through the `Tokenization` of the model a request runs on (an adapter: its base model's).

Where each model's tokenizer comes from (`Tokenizations.of`):
- a cluster of one model: the tokenizer the front's --model gives (with --chat-template), as always;
- a model named by `--tokenizer-for NAME=PATH`: that directory's (or .gguf file's) tokenizer, loaded at startup;
- any other model: where its workers said they read it (ModelStats.tokenizers: their model directories, sent by a
  worker under --served-model-name), else its id when that is a path (a worker's --model), loaded on first use
  from the first place readable on this host (one machine, or a filesystem the nodes share as on Slurm clusters);
  the front's default model (the one it joined: Welcome's, under the front's --served-model-name) falls back to
  --model's tokenizer when none is readable (a front on another host, as before), never another model.
--model and --chat-template describe one tokenizer: every model whose tokenizer directory is --model's shares it,
template included (the default model named by the cluster is the first worker's when no --model-id says, so
which one that is depends on start order: the directory, not the name, decides). --tool-call-parser and
--reasoning-parser, given, hold for every model (they say how the operator's models write their output); without
them each model's tool-call parser is the one its own chat template calls for.

Loading is off the event loop, on a thread of its own per load (a path on a hung network filesystem must hold up
neither tokenizing for other models nor their loads), at most one at a time per model, and waited for at most
`load_timeout`; a request meanwhile gets 503 + Retry-After. A model whose tokenizer cannot be read gets 503
(code "tokenizer_unavailable") naming the model and what is missing, and the failure is remembered for
RETRY_FAILED_LOAD_S (sooner when its workers report another place): never a tokenization with another model's
tokenizer. 503, not 400 (the request is fine) nor 500 (nothing broke in the front: it lacks a file that its
operator can give it, or that appears when a worker with a readable directory joins), so clients retry. Two models
whose tokenizers are one directory share one Tokenization.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer.client.api.schemas import ApiError
from infer.client.api.tools import default_parser
from infer.client.chat_encoding import ChatEncoder
from infer.client.transcription import WhisperPrompts
from infer.protocol.logsafe import safe
from infer.protocol.prompt_limits import max_token_bytes

log = logging.getLogger("infer.api")

RETRY_FAILED_LOAD_S = 30.0  # a model whose tokenizer could not be read is tried again after this long
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEFAULT_LOAD_TIMEOUT_S = 60.0


@dataclass
class Tokenization:
    """One model's tokenizer as the front uses it. `chat_encoder` tokenizes chat prompts (content as plain text),
    `token_bytes` bounds a text prompt's size before tokenizing it; `token_text`
    caches the strings of the tokens logprobs name."""

    tokenizer: Any
    tool_call_parser: str
    reasoning_parser: str | None = None
    chat_encoder: ChatEncoder = field(init=False)
    token_bytes: int | None = field(init=False)  # None: the tokenizer gives no bound
    _token_text: dict[int, str] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.chat_encoder = ChatEncoder(self.tokenizer)
        self.token_bytes = max_token_bytes(self.tokenizer)

    @classmethod
    def of(
        cls,
        tokenizer: Any,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> Tokenization:
        """`tokenizer` with `chat_template` instead of its own (on a copy: the caller's keeps its own); the tool-call
        parser given, else the one its template calls for."""
        if chat_template is not None:
            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = chat_template
        parser = tool_call_parser or default_parser(getattr(tokenizer, "chat_template", None))
        return cls(tokenizer, parser, reasoning_parser)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @functools.cached_property
    def image_token(self) -> tuple[str, int] | None:
        """(text, id) of the token a chat's image parts become: Gemma 3's `<start_of_image>` (`image_sequence`), the
        tokenizer's `image_token` (transformers' name), else an added `<image>` token (LLaVA's) or `<|image_pad|>`
        (Qwen2-VL's, whose chat template writes it between its vision start and end tokens); None: the model takes no
        images."""
        sequence = self.image_sequence
        added = {t.content: i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items()}
        named = sequence[0] if sequence else getattr(self.tokenizer, "image_token", None)
        token = next((t for t in (named, "<image>", "<|image_pad|>") if t is not None and t in added), None)
        return None if token is None else (token, added[token])

    @functools.cached_property
    def image_sequence(self) -> tuple[str, str] | None:
        """(the text that stands for an image, what it becomes before tokenizing) for a model whose prompts hold
        images as Gemma 3's do (its directory's config.json: model_type "gemma3"; the tokenizer's boi / image / eoi
        tokens): transformers' Gemma3Processor makes each `<start_of_image>` "\\n\\n" boi, mm_tokens_per_image image
        tokens, eoi "\\n\\n"; None for any other model."""
        config = Path(str(getattr(self.tokenizer, "name_or_path", "") or "")) / "config.json"
        try:
            raw = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        boi, image, eoi = (getattr(self.tokenizer, name, None) for name in ("boi_token", "image_token", "eoi_token"))
        if not isinstance(raw, dict) or raw.get("model_type") != "gemma3":
            return None
        count = raw.get("mm_tokens_per_image")
        if not (isinstance(boi, str) and isinstance(image, str) and isinstance(eoi, str) and isinstance(count, int)):
            return None
        return boi, f"\n\n{boi}{image * count}{eoi}\n\n"

    @functools.cached_property
    def encoder_decoder(self) -> bool:
        """Whether the model beside the tokenizer (its directory's config.json) is an encoder-decoder model (T5,
        BART): its prompt is the encoder's input, which takes no room in the decoder's context (False when no
        config is there to say)."""
        config = Path(str(getattr(self.tokenizer, "name_or_path", "") or "")) / "config.json"
        try:
            return bool(json.loads(config.read_text()).get("is_encoder_decoder", False))
        except (OSError, ValueError, AttributeError):
            return False

    @functools.cached_property
    def whisper(self) -> WhisperPrompts | None:
        """The prompt tokens and window of a Whisper model beside the tokenizer (its directory's config.json,
        generation_config.json, preprocessor_config.json); None for any other model."""
        return WhisperPrompts.from_dir(Path(str(getattr(self.tokenizer, "name_or_path", "") or "")))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def parse_tokenizer_for(text: str) -> tuple[str, str]:
    """One `--tokenizer-for` entry, NAME=PATH -> (name, path); ValueError saying what is wrong."""
    name, sep, path = str(text).partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(
            f"--tokenizer-for entries are NAME=PATH (a model's name and its tokenizer), got {text[:200]!r}"
        )
    return name.strip(), path.strip()


def tokenizer_dir(source: str) -> Path:
    """The directory holding the tokenizer `source` names: a directory with tokenizer files, a .gguf file (its
    cached conversion, made here if due), or the embedded default model's id; ValueError saying what is missing."""
    from infer.worker.engine.config import DEFAULT_MODEL_ID
    from infer.worker.loading.model_files import resolve_model

    if source == DEFAULT_MODEL_ID:
        return resolve_model(None).resolve()
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_model(path).resolve()
    if not path.is_dir():
        raise ValueError(f"{source!r} is neither a directory nor a .gguf file readable on this host")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{source!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    return path.resolve()


def read_tokenizer(source: str) -> tuple[Path, Any]:
    """(its directory, the tokenizer) of `source` (see tokenizer_dir), read without torch
    (worker/loading/model_files.py)."""
    from infer.worker.loading.model_files import front_tokenizer

    path = tokenizer_dir(source)
    return path, front_tokenizer(path)


def load_tokenizers_for(entries: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """--tokenizer-for's tokenizers, by model name, read now (at startup); ValueError naming the entry that fails."""
    loaded = {}
    for name, path in entries:
        try:
            loaded[name] = read_tokenizer(path)[1]
        except (OSError, ValueError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"--tokenizer-for {name}={path}: cannot load a tokenizer there: {why}") from None
    return loaded


@dataclass
class _Failure:
    message: str
    sources: tuple[str, ...]
    until: float  # monotonic time it is tried again (sooner for other sources)


class Tokenizations:
    """The Tokenization of every model a front serves: the default model's, --tokenizer-for's, and the others
    loaded on first use (module doc), cached by model id and shared by directory."""

    def __init__(
        self,
        default: Tokenization,
        make: Callable[[Any], Tokenization],
        overrides: Mapping[str, Any] | None = None,
        default_dir: Path | None = None,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
        retry_after: int = 1,
    ) -> None:
        """`make`: a loaded tokenizer -> its Tokenization (the front's parser flags applied); `default_dir`: where
        `default` (--model's) was read: a model whose workers read the same directory shares it."""
        self.default = default
        self._make = make
        self._by_model: dict[str, Tokenization] = {name: make(t) for name, t in (overrides or {}).items()}
        self._by_dir: dict[Path, Tokenization] = {} if default_dir is None else {default_dir.resolve(): default}
        self._loading: dict[str, tuple[asyncio.Future[tuple[Path, Any]], float]] = {}
        self._failed: dict[str, _Failure] = {}
        self.load_timeout = load_timeout
        self.retry_after = retry_after

    def cached(self, model_id: str) -> Tokenization | None:
        return self._by_model.get(model_id)

    async def of(
        self, model_id: str, name: str, sources: Sequence[str], fallback: Tokenization | None = None
    ) -> Tokenization:
        """The Tokenization of the cluster's model `model_id` (clients call it `name`; --tokenizer-for may use
        either), whose workers read their tokenizer at `sources`; `fallback` (the default model's: --model's) when
        none of them is readable here, else ApiError 503; 503 too while the load takes longer than load_timeout."""
        known = self._by_model.get(name) or self._by_model.get(model_id)
        if known is not None:
            return known
        tried = tuple(sources) or (model_id,)  # no place said: the id is the worker's --model path, or nothing
        failure = self._failed.get(model_id)
        now = time.monotonic()
        if failure is not None and failure.sources == tried and now < failure.until:
            if fallback is not None:
                return fallback
            raise self._unavailable(failure.message, failure.until - now)
        loading = self._loading.get(model_id)
        if loading is None:
            loading = self._loading[model_id] = (self._start_load(model_id, name, tried, bool(sources)), now)
        future, started = loading
        try:
            path, made = await asyncio.wait_for(asyncio.shield(future), max(0.0, started + self.load_timeout - now))
        except asyncio.TimeoutError:
            raise self._unavailable(
                f"this server is still loading the tokenizer of the model {name[:200]!r} (for more than "
                f"{self.load_timeout:g} s); retry later",
                self.retry_after,
            ) from None
        except _LoadFailed as e:
            if fallback is not None:
                log.warning("model %s: its workers' tokenizer is not readable here: --model's serves it", safe(name))
                return fallback
            raise self._unavailable(e.message, RETRY_FAILED_LOAD_S) from None
        return self._by_model.setdefault(model_id, self._by_dir.setdefault(path, made))

    def _start_load(
        self, model_id: str, name: str, sources: tuple[str, ...], reported: bool
    ) -> asyncio.Future[tuple[Path, Tokenization]]:
        """Read the first of `sources` that loads and make its Tokenization, on a thread of its own; the future ends
        with (directory, Tokenization) or _LoadFailed, and the model leaves `_loading` (a failure is remembered)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[Path, Tokenization]] = loop.create_future()

        def settle(outcome: tuple[Path, Tokenization] | str) -> None:
            self._loading.pop(model_id, None)
            if isinstance(outcome, str):
                self._failed[model_id] = _Failure(outcome, sources, time.monotonic() + RETRY_FAILED_LOAD_S)
                future.set_exception(_LoadFailed(outcome))
                future.exception()  # retrieved: every waiter may have timed out already
            else:
                self._failed.pop(model_id, None)
                future.set_result(outcome)

        def load() -> None:
            outcome = self._load_first(name, sources, reported)
            with contextlib.suppress(RuntimeError):  # the front closed its loop meanwhile
                loop.call_soon_threadsafe(settle, outcome)

        threading.Thread(target=load, name="infer-tokenizer-load", daemon=True).start()
        return future

    def _load_first(self, name: str, sources: tuple[str, ...], reported: bool) -> tuple[Path, Tokenization] | str:
        """(directory, Tokenization) of the first source that loads, else the answer to give; every failure is
        logged with its path and reason (the answer names no path)."""
        reasons = []
        for source in sources:
            try:
                path = tokenizer_dir(source)
                known = self._by_dir.get(path)  # (read on this thread: at worst two models load one directory)
                made = known if known is not None else self._make(read_tokenizer(source)[1])
                log.info("model %s: tokenizer read from %s", safe(name), safe(str(path)))
                return path, made
            except Exception as e:  # a bad directory fails in many ways; each is this source's failure
                reasons.append(f"{source!r}: {safe(str(e) or type(e).__name__, 300)}")
        error_id = uuid.uuid4().hex[:12]
        log.warning("tokenizer unavailable %s: model %s: %s", error_id, safe(name), "; ".join(reasons))
        if reported:
            n = len(sources)
            what = f"the tokenizer its workers read ({n} place{'s' if n > 1 else ''}) is not readable on this host"
        else:
            what = "its workers did not say where its tokenizer is, and its id is no model path on this host"
        return (
            f"this server cannot tokenize for the model {name[:200]!r}: {what} (log entry {error_id}); its operator "
            f"can give it with --tokenizer-for {name[:200]}=PATH"
        )

    def _unavailable(self, message: str, retry_after: float) -> ApiError:
        return ApiError(503, message, code="tokenizer_unavailable", retry_after=max(1, round(retry_after)))


class _LoadFailed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
