"""IncrementalDetokenizer: the text of one request, grown token by token, with stop strings.

Decoding uses vLLM's prefix/read offsets over token strings: each step decodes only a short window (the
tokens since the last emitted text plus the ones before it, for context) and emits the part past the
previous window's text, unless it ends in U+FFFD (a character still missing bytes). Per-token cost does not
grow with the output.

Stop strings: a match counts when it ends in text produced by an output token past the first
`params.min_tokens` (as vLLM); it may start earlier, across token boundaries. While stop strings are set,
the last (longest stop - 1) characters are held back from the deltas, since they may start a match.
Invariant: concatenated deltas + held-back text == `text`; after `finish()` nothing is held back.

Resuming (a failover): `resume(tokens, num_delivered_chars)` replays the output tokens another engine already
delivered, which rebuilds exactly the state that engine had at that point (the decode window, bytes of an
unfinished character, the text held back for stop strings), then marks the first `num_delivered_chars`
characters as shown. The continued deltas then equal the uninterrupted ones, and a stop string that began
before the cut is still found. Torch-free.
"""

from __future__ import annotations

from typing import Any, Sequence

from infer.protocol.sampling import SamplingParams

# Prompt tokens decoded ahead of the output, so that tokenizers that strip a leading space at the start of
# a decode (SentencePiece) keep the output's first space (vLLM uses 5 as well).
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns output token ids into text deltas. `tokenizer` is a transformers tokenizer or the engine's RustTokenizer
    (worker/loading/tokenizer.py)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        skip = params.skip_special_tokens
        self._skipped_ids: frozenset[int] = frozenset(tokenizer.all_special_ids) if skip else frozenset()
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        # Decode window: tokens[:read_offset] were decoded into prefix_text already; the rest are pending.
        self._tokens: list[str] = self._token_strings(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        # A prompt ending inside a character (token ids a caller cut there) has its incomplete tail decoded
        # with the output, so the character appears. (A resumed request replays its output instead: resume.)
        while self._read_offset > 0 and self._prefix_text.endswith(_INCOMPLETE):
            self._read_offset -= 1
            self._prefix_text = self._decode(self._tokens[: self._read_offset])
        self._emitted: list[str] = []  # the deltas returned so far
        self._held = ""  # decoded text held back from the deltas (a possible stop start)
        self.num_tokens = 0  # output tokens consumed (ids after a stop are ignored)
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The output text so far (trimmed at a stop string), held-back characters included."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return "".join(self._emitted) + self._held

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Consume output tokens; return the newly visible text. Ids after a stop string are ignored."""
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.add after finish()")
        deltas = []
        for token_id in new_token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            if token_id in self._skipped_ids:
                continue
            self._tokens.append(self._tokenizer.convert_ids_to_tokens(int(token_id)))
            deltas.append(self._append(self._decode_window(final=False)))
        return "".join(deltas)

    def resume(self, delivered_token_ids: Sequence[int], num_delivered_chars: int | None = None) -> None:
        """Replay output tokens already delivered by another engine; their text up to `num_delivered_chars`
        counts as shown (None: as much as this detokenizer would have shown), the rest is owed and comes out
        with the next delta (or `finish`). Call once, before `add`."""
        if self.num_tokens:
            raise RuntimeError("IncrementalDetokenizer.resume after add()")
        self.add(delivered_token_ids)
        if num_delivered_chars is None:
            return
        text = self.text
        shown = min(num_delivered_chars, len(text))
        self._emitted, self._held = [text[:shown]], text[shown:]

    def finish(self) -> str:
        """Release everything held back (the request ended); idempotent. Incomplete trailing bytes come out
        as U+FFFD, as in tokenizer.decode."""
        if self.finished:
            return ""
        delta = "" if self.stopped else self._append(self._decode_window(final=True))
        rest, self._held = self._held, ""
        self._emitted.append(rest)
        self.finished = True
        return delta + rest

    def _decode(self, tokens: list[str]) -> str:
        return self._tokenizer.convert_tokens_to_string(tokens) if tokens else ""

    def _token_strings(self, token_ids: Sequence[int]) -> list[str]:
        convert = self._tokenizer.convert_ids_to_tokens
        return [convert(int(t)) for t in token_ids if t not in self._skipped_ids]

    def _decode_window(self, final: bool) -> str:
        """The text the pending tokens add, or "" while it ends in an incomplete character (unless final)."""
        if self._read_offset == len(self._tokens):
            return ""
        text = self._decode(self._tokens)
        if len(text) <= len(self._prefix_text) or (text.endswith(_INCOMPLETE) and not final):
            return ""
        delta = text[len(self._prefix_text) :]
        # The next window starts where this one's new tokens did; they are its context.
        self._tokens = self._tokens[self._read_offset :]
        self._read_offset = len(self._tokens)
        self._prefix_text = self._decode(self._tokens)
        return delta

    def _append(self, new_text: str) -> str:
        """Add decoded text, look for a stop string ending in it, and return the delta that may be shown."""
        if not new_text:
            return ""
        buffer = self._held + new_text
        if self._stops and self.num_tokens > self._min_tokens:
            match = self._find_stop(buffer, len(self._held))
            if match is not None:
                start, stop = match
                end = start + len(stop) if self._include_stop else start
                self.stopped, self.stop_reason = True, stop
                return self._emit(buffer[:end], held="")
        cut = max(len(buffer) - self._hold, 0)
        return self._emit(buffer[:cut], held=buffer[cut:])

    def _emit(self, delta: str, held: str) -> str:
        self._emitted.append(delta)
        self._held = held
        return delta

    def _find_stop(self, buffer: str, old_len: int) -> tuple[int, str] | None:
        """The earliest stop string in `buffer` that ends past `old_len`."""
        best: tuple[int, str] | None = None
        for stop in self._stops:
            start = buffer.find(stop, max(old_len - len(stop) + 1, 0))
            if start != -1 and (best is None or start < best[0]):
                best = (start, stop)
        return best
