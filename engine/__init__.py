"""jaxserve's engine: `from engine import LLM, SamplingParams, StructuredOutputsParams`.

The runner (fixed-shape jitted steps over the paged cache), the sampler, LLMEngine, the offline
LLM API and the async engine. The OpenAI-compatible server is in `entrypoints/openai/`
(`python -m entrypoints.openai.serve`).
"""

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams


def __getattr__(name):
    # LLM and LLMEngine import jax and the models; load them on first use so that light users of
    # the package (the protocol layer, configs) stay light.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
