"""jaxserve's engine: `from engine import LLM, SamplingParams, StructuredOutputsParams`.

The house, lowest first; arrows point down only (tests/test_layering.py checks them):
- here, the shared vocabulary: EngineConfig (config.py, with speculative_config.py and
  disaggregation_config.py), SamplingParams (sampling_params.py, structured_params.py),
  RequestOutput (outputs.py), ParamError (errors.py), RowParams (row_params.py) and the server's
  metrics (metrics.py);
- spec_decode/ and structured_output/: the two features' proposers, grammars and masks;
- lora/: LoRA adapters (host cache and manager, device slots; knobs in lora_config.py);
- step/: the compiled step and what feeds it (runner, request table, buckets, sampler, cache);
- core/: the engine loop (LLMEngine, its builder, request state, stats);
- disaggregation/: prefill and decode on two pools (PDEngine, the decode pool process);
- scaleout/: replicas, the router, multi-host, and `make_engine`;
- frontends/: the offline LLM API and the async engine the server drives.
The OpenAI-compatible server is in `entrypoints/openai/` (`python -m entrypoints.openai.serve`).
"""

from engine.config import EngineConfig
from engine.lora_config import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_params import StructuredOutputsParams


def __getattr__(name):
    # LLM and LLMEngine import jax and the models; load them on first use so that light users of
    # the package (the protocol layer, configs) stay light.
    if name == "LLM":
        from engine.frontends.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.core.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams"]
