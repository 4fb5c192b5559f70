"""Pooling: an embedding of a prompt from the hidden states that feed the LM head (the last layer's, after the
final norm), the engine's second kind of request beside generation (`SamplingParams.pooling`).

A pooling request runs through the same scheduler, KV cache and model forward as any prompt (chunked prefill,
preemption, failover); `record_pooling` folds each prefill chunk's rows into the request's `PoolingState` as the
model runner computes them, and when the prompt is complete the engine ends the request with the vector
(`Delta.embedding`) instead of a token. Such a request does not use the prefix cache (cached positions have no
hidden states here). Pooling types (vLLM's): "last" (the last prompt token: decoder models), "mean" (every
prompt token), "cls" (the first); `normalize` divides by the L2 norm.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

POOLING_TYPES = ("last", "mean", "cls")


class PoolingState:
    """What one request has pooled so far: positions `0 .. next_position - 1` of its prompt are folded in."""

    def __init__(self, pooling: str, normalize: bool, num_prompt_tokens: int) -> None:
        self.pooling, self.normalize, self.num_prompt_tokens = pooling, normalize, num_prompt_tokens
        self.next_position = 0
        self._acc: torch.Tensor | None = None  # [H] float32: the sum (mean), the first row (cls), the last (last)

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Rows [N, H] are the hidden states of prompt positions start .. start + N - 1; positions already folded
        in (a recompute after a preemption, a step retried alone) are skipped."""
        skip = self.next_position - start
        if skip >= len(rows):
            return
        rows = rows[max(skip, 0) :].float()
        if self.pooling == "mean":
            total = rows.sum(dim=0)
            self._acc = total if self._acc is None else self._acc + total
        elif self.pooling == "cls":
            if self._acc is None:
                self._acc = rows[0].clone()
        else:
            self._acc = rows[-1].clone()
        self.next_position = start + max(skip, 0) + len(rows)

    @property
    def complete(self) -> bool:
        return self.next_position >= self.num_prompt_tokens

    def vector(self) -> list[float]:
        """The embedding (the prompt must be complete)."""
        if self._acc is None:
            raise ValueError("no prompt position was pooled yet")
        vec = self._acc / self.num_prompt_tokens if self.pooling == "mean" else self._acc
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.tolist()


def record_pooling(chunks: Sequence[Any], hidden: torch.Tensor) -> None:
    """Fold the rows of `hidden` ([T, H], the step's chunks flattened in order) into each pooling request's
    state: the prompt positions its chunk computed."""
    offset = 0
    for chunk in chunks:
        state = chunk.request.pooled
        if state is not None:
            last = min(chunk.end, state.num_prompt_tokens)
            if chunk.start < last:
                state.add(chunk.start, hidden[offset : offset + last - chunk.start])
        offset += chunk.num_new_tokens
