"""StreamJournal: what the deltas of one request carried so far, kept at its delta boundaries, so that the stream
can be handed on from wherever a copy of it stops. Torch-free, no I/O.

Four parties keep one: the worker that runs the request (its RequestSnapshot goes out in a re-registration's
Hello), the coordinator for an orphan (a request a worker brought back after a restart, until its client comes
back), the client (what it re-attaches with: the tokens it holds and the length of their text), and the
coordinator's relay for every request it relays (what a re-dispatch resumes from: `lengths_only`, no text).
"""

from __future__ import annotations

from collections.abc import Sequence

from infer.protocol.messages import RequestSnapshot, TokenIds


class StreamJournal:
    """Output tokens and text of one request, with the boundary after each delta.

    `token_ids` holds every output token: the first `resumed` came before this copy began (a failover's resumed
    tokens: their text is the client's already), the rest in deltas. Delta j ended at token `delta_ends[j]` and
    at character `text_ends[j]` of `text` (the text after the resumed tokens). A delta with neither tokens nor
    text leaves no boundary.

    A journal made by `lengths_only` (the coordinator's relay) keeps the tokens and only the length of their text,
    which may be unknown (`text_len` None), and no boundaries; it refuses `text`, `snapshot` and `catch_up`
    (ValueError) rather than answer without the text.
    """

    __slots__ = ("resumed", "token_ids", "delta_ends", "text_ends", "text_len", "_text_parts")

    def __init__(self, resumed_token_ids: Sequence[int] = ()) -> None:
        self.token_ids = TokenIds(resumed_token_ids)
        self.resumed = len(self.token_ids)
        self.delta_ends: list[int] = []
        self.text_ends: list[int] = []
        self.text_len: int | None = 0  # None: unknown (only in a journal that keeps lengths only)
        self._text_parts: list[str] | None = []  # None: lengths only

    @classmethod
    def lengths_only(cls, token_ids: Sequence[int] = (), text_len: int | None = 0) -> StreamJournal:
        """A journal that starts at the output tokens `token_ids`, whose text is `text_len` characters long (None:
        unknown), and keeps the tokens of later deltas and the length of their text, not the text: the
        coordinator's relay, which must know what a re-dispatch resumes from (Dispatch.resumed_token_ids /
        resumed_text_len) but would hold the text of every stream it relays for nothing. It keeps no delta
        boundaries either: they serve only `snapshot` and `catch_up`, which need the text too, and a client that
        re-attaches to a running request is caught up from its worker's journal (coordinator/orphans.py), never
        from the relay's. Recording a delta costs extending a token list and adding a length, nothing more."""
        journal = cls()
        journal.token_ids.extend(token_ids)
        journal.text_len = text_len
        journal._text_parts = None
        return journal

    @property
    def keeps_text(self) -> bool:
        return self._text_parts is not None

    @classmethod
    def from_snapshot(cls, snapshot: RequestSnapshot) -> StreamJournal:
        """The journal a worker's snapshot describes (a coordinator's copy of it)."""
        journal = cls(snapshot.token_ids[: snapshot.resumed])
        journal.token_ids.extend(snapshot.token_ids[snapshot.resumed :])
        journal.delta_ends, journal.text_ends = list(snapshot.delta_ends), list(snapshot.text_ends)
        journal.text_len = len(snapshot.text)
        journal._text_parts = [snapshot.text] if snapshot.text else []
        return journal

    @property
    def text(self) -> str:
        """The text of the tokens after the resumed ones."""
        parts = self._kept_text("text")
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def _kept_text(self, wanted: str) -> list[str]:
        if self._text_parts is None:
            raise ValueError(f"this stream journal keeps the length of its text only, not the text: no {wanted}")
        return self._text_parts

    def record(self, token_ids: Sequence[int], text: str) -> None:
        """One delta's tokens and text, in stream order."""
        parts = self._text_parts
        text_len = self.text_len
        if parts is None or text_len is None:  # lengths only (a journal that keeps its text knows its length)
            self.token_ids.extend(token_ids)
            if text_len is not None:
                self.text_len = text_len + len(text)
            return
        if not token_ids and not text:
            return
        self.token_ids.extend(token_ids)
        if text:
            parts.append(text)
            text_len += len(text)
            self.text_len = text_len
        self.delta_ends.append(len(self.token_ids))
        self.text_ends.append(text_len)

    def snapshot(self, request_id: str, prompt_token_ids: TokenIds, seed: int | None = None) -> RequestSnapshot:
        """This journal on the wire (a re-registering worker's Hello)."""
        self._kept_text("snapshot")
        return RequestSnapshot(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            token_ids=TokenIds(self.token_ids),
            resumed=self.resumed,
            text=self.text,
            delta_ends=list(self.delta_ends),
            text_ends=list(self.text_ends),
            seed=seed,
        )

    def catch_up(self, held: Sequence[int]) -> tuple[TokenIds, str] | None:
        """What a copy holding the output tokens `held` still lacks (tokens, text), or None when `held` is not
        the start of this journal's tokens or stops inside a delta (the stream must then resume from `held`)."""
        self._kept_text("catch-up")
        num_held = len(held)
        if num_held == self.resumed:
            text_start = 0
        elif num_held in self.delta_ends:
            text_start = self.text_ends[self.delta_ends.index(num_held)]
        else:
            return None
        if self.token_ids[:num_held] != list(held):
            return None
        end = self.delta_ends[-1] if self.delta_ends else self.resumed
        text_end = self.text_ends[-1] if self.text_ends else 0
        return TokenIds(self.token_ids[num_held:end]), self.text[text_start:text_end]
