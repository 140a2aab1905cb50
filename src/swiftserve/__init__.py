"""swiftserve: a low-latency LLM inference engine and server."""

from swiftserve.config import EngineConfig
from swiftserve.engine.llm import LLM
from swiftserve.outputs import CompletionOutput, RequestOutput
from swiftserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
