"""infer: a ZeroMQ LLM serving cluster.

Public API: `from infer import LLM, AsyncLLM, SamplingParams`; `from infer.client import InferenceClient`.
"""

from infer.protocol.sampling import SamplingParams

__all__ = ["SamplingParams"]
