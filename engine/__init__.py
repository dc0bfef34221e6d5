"""The model engine both pools share: a paged-KV, continuously batched Llama-family runner.

Free of grpc and ray; servers wrap it.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
