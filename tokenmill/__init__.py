"""tokenmill: a small, clear LLM inference and serving engine."""

from tokenmill.config import EngineConfig
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "PoolingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM and LLMEngine pull in torch and transformers: import them only when asked for.
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    if name == "LLMEngine":
        from tokenmill.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
