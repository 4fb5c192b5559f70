"""Reasoning parsers: a `<think>...</think>` section of a model's output becomes `reasoning_content`, the rest
`content` (vLLM's `--reasoning-parser` names):

- `qwen3`: reasoning only when the output opens with `<think>`; otherwise everything is content.
- `deepseek_r1`: the output starts inside the reasoning (R1's template opens `<think>` in the prompt; a
  `<think>` the model writes itself is dropped) until `</think>`; never closed, it is all reasoning.

`ReasoningSplitter` works on a stream: `feed(delta_text)` returns the (reasoning, content) text it can
release, holding back a suffix that may be the start of a tag split over deltas; `finish()` releases the
rest. The pieces of a stream concatenate to the split of the whole text.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {parser!r}")
        self.parser = parser
        self._mode = "start"  # start (before the first text decides) -> reasoning -> content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._mode == "start":
            head = self._held.lstrip()
            if head.startswith(START):
                self._held, self._mode = head[len(START) :], "reasoning"
            elif START.startswith(head):
                return "", ""  # may still become the opening tag (or nothing has come yet)
            else:
                self._mode = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._mode == "reasoning":
            at = self._held.find(END)
            if at < 0:
                keep = _partial_suffix(self._held, END)
                reasoning, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                return reasoning, ""
            reasoning, self._held, self._mode = self._held[:at], self._held[at + len(END) :], "content"
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning if inside it (a partial end tag is text after all), else content."""
        held, self._held = self._held, ""
        if self._mode == "reasoning" or (self._mode == "start" and self.parser == "deepseek_r1"):
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None for an empty part."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2) or None, (c1 + c2) or None


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
