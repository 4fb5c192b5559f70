"""Wire types shared by every part: message schemas, codec, validation. Torch-free."""

from infer.protocol.outputs import Completion, RequestOutput
from infer.protocol.sampling import SamplingParams

__all__ = ["Completion", "RequestOutput", "SamplingParams"]
