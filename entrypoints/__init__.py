"""jaxserve's entry points over the engine: `openai/`, the OpenAI-compatible HTTP server.

No jax here: the engine package is imported for its light modules (configs, outputs, the async
engine), and LLMEngine only when a server actually builds one.
"""
