"""StreamJournal: what the deltas of one request carried so far, kept at its delta boundaries, so that the stream
can be handed on from wherever a copy of it stops. Torch-free, no I/O.

Three parties keep one: the worker that runs the request (its RequestSnapshot goes out in a re-registration's
Hello), the coordinator for an orphan (a request a worker brought back after a restart, until its client comes
back) and the client (what it re-attaches with: the tokens it holds and the length of their text).
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
    """

    __slots__ = ("resumed", "token_ids", "delta_ends", "text_ends", "text_len", "_text_parts")

    def __init__(self, resumed_token_ids: Sequence[int] = ()) -> None:
        self.token_ids = TokenIds(resumed_token_ids)
        self.resumed = len(self.token_ids)
        self.delta_ends: list[int] = []
        self.text_ends: list[int] = []
        self.text_len = 0
        self._text_parts: list[str] = []

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
        if len(self._text_parts) > 1:
            self._text_parts = ["".join(self._text_parts)]
        return self._text_parts[0] if self._text_parts else ""

    def record(self, token_ids: Sequence[int], text: str) -> None:
        """One delta's tokens and text, in stream order."""
        if not token_ids and not text:
            return
        self.token_ids.extend(token_ids)
        if text:
            self._text_parts.append(text)
            self.text_len += len(text)
        self.delta_ends.append(len(self.token_ids))
        self.text_ends.append(self.text_len)

    def snapshot(self, request_id: str, prompt_token_ids: TokenIds, seed: int | None = None) -> RequestSnapshot:
        """This journal on the wire (a re-registering worker's Hello)."""
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
