"""infer: a ZeroMQ LLM serving cluster.

Public API: `from infer import LLM, SamplingParams`.
"""

from infer.client.llm import LLM
from infer.protocol.outputs import Completion
from infer.protocol.sampling import SamplingParams

__all__ = ["LLM", "Completion", "SamplingParams"]
