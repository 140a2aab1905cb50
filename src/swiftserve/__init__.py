"""swiftserve: a low-latency LLM inference engine and server.

``LLM`` is imported lazily so that ``swiftserve.core`` (pure Python) can be used without
pulling in torch.
"""

from typing import TYPE_CHECKING, Any

from swiftserve.config import EngineConfig
from swiftserve.outputs import CompletionOutput, RequestOutput
from swiftserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from swiftserve.engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from swiftserve.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'swiftserve' has no attribute {name!r}")
