"""Structured output: a grammar per request (llguidance), compiled off the step loop, and the
packed token bitmask it fills on the host for each constrained logit row of a step.

1. `StructuredOutputsParams` (engine/structured_params.py, beside SamplingParams, which carries
   one; no llguidance, no jax) is what a caller asks for: a JSON schema, any JSON object, a
   regex, a choice of strings, or a Lark/GBNF grammar.
2. `GrammarCompiler` (compiler.py) turns it into a `CompiledGrammar` on the caller's thread (the
   server's prepare threads; the offline LLM's thread pool), through an LRU keyed by the request's
   grammar; a bad one is a `ParamError` naming the field.
3. Each sequence gets its own `GrammarState` (a matcher copied from the compiled template). The
   runner's request table holds it by slot; each step the batch builder fills one packed
   int32[ceil(V/32)] row per constrained logit row (masks.py, llguidance's parallel fill) into the
   step's flat input buffer, and the sampler sets the disallowed logits to -inf.
4. After `Scheduler.update` the engine feeds the kept tokens to the state; a grammar that can take
   no more tokens finishes its sequence ("stop").

This wing imports only engine's top-level vocabulary (SamplingParams, StructuredOutputsParams,
ParamError): the step (engine/step/step_inputs.py fills the masks) and the engine loop
(engine/core/llm_engine.py) import it, never the other way.
"""
