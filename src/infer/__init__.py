"""infer: a ZeroMQ LLM serving cluster.

Public API: `from infer import LLM, AsyncLLM, SamplingParams, LoRARequest`.

The names are imported on first use (PEP 562): every daemon (`python -m infer.worker.service.daemon`, the coordinator's,
the HTTP front's) loads this package first, and a worker or a coordinator should not import the client
(`infer.client.llm` and what it imports: ~0.3 s of CPU and its modules' memory in every process) to run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.client.llm import LLM, AsyncLLM
    from infer.protocol.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from infer.protocol.lora import LoRARequest
    from infer.protocol.outputs import Completion, RequestOutput
    from infer.protocol.sampling import SamplingParams

_HOMES = {
    "LLM": "infer.client.llm",
    "AsyncLLM": "infer.client.llm",
    "BeamSearchOutput": "infer.protocol.beam_search",
    "BeamSearchParams": "infer.protocol.beam_search",
    "BeamSearchSequence": "infer.protocol.beam_search",
    "Completion": "infer.protocol.outputs",
    "LoRARequest": "infer.protocol.lora",
    "RequestOutput": "infer.protocol.outputs",
    "SamplingParams": "infer.protocol.sampling",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "Completion",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
