"""Client side: the LLM / AsyncLLM APIs, InferenceClient and the OpenAI-compatible HTTP front."""

from infer.client.inference_client import ClusterError, InferenceClient, SyncInferenceClient
from infer.client.llm import LLM

__all__ = ["LLM", "ClusterError", "InferenceClient", "SyncInferenceClient"]
