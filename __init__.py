"""infer: a ZeroMQ LLM serving cluster.

Public API: `from infer import LLM, AsyncLLM, SamplingParams, LoRARequest`.
"""

from infer.client.llm import LLM, AsyncLLM
from infer.protocol.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from infer.protocol.lora import LoRARequest
from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams

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
