"""EngineLoad: an engine's own account of its work and memory. The engine returns it; the worker core turns it
into the wire `Load` it reports to the coordinator (protocol/messages.py: the coordinator's type, which the engine
does not import), and LocalEngine into the stats of its one-engine "cluster"."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineLoad:
    """What one engine has to do and what it holds, now.

    num_queued_tokens: over its unfinished requests, tokens whose KV is not computed yet (prompt, or prompt +
        output after a preemption) + tokens still to generate (up to max_tokens): an upper bound on the work left.
    num_preemptions, prefix_cache_queries, prefix_cache_hits: counters since the engine started (prompt tokens
        looked up in the prefix cache / found there).
    weight_version: the weights it serves (update_weights); suspended, bytes_released: its KV pool and weights
        are released (suspend), and what that gave back.
    spec_decode_*: speculative decoding's counters since the engine started (vLLM's names): verification chunks,
        their draft tokens, the drafts accepted, and accepted drafts by position (index j: position j + 1).
    """

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    num_queued_tokens: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    weight_version: int = 0
    suspended: bool = False
    bytes_released: int = 0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
