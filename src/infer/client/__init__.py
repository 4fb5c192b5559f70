"""Client side: the LLM / AsyncLLM APIs, InferenceClient and the OpenAI-compatible HTTP front."""

from infer.client.inference_client import ClusterError, InferenceClient, SyncInferenceClient
from infer.client.llm import LLM, AsyncLLM

__all__ = ["LLM", "AsyncLLM", "ClusterError", "InferenceClient", "SyncInferenceClient"]
