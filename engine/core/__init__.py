"""The engine loop: LLMEngine, requests in, tokens out, one scheduler step at a time (DESIGN.md 2).

What happens, in order:
 1. `LLMEngine(config)` builds its parts (builder.py): the model from the loaders, the scheduler,
    the runner with its KV cache and compiled buckets (engine/step/), and the speculative
    proposer (engine/spec_decode/) if asked for.
 2. `add_request` tokenizes the prompt, validates the SamplingParams against the model, computes
    the request's RowParams (its logit controls, its grammar from engine/structured_output/) and
    queues n scheduler requests; request_state.py keeps each one's detokenizer, stop strings and
    logprobs.
 3. `step()`: the spec decoder drafts, `Scheduler.schedule()` plans, `ModelRunner.execute()` runs
    the compiled step, `Scheduler.update()` appends the kept tokens and finishes requests.
 4. The engine advances the grammars, detokenizes incrementally, applies stop strings and returns
    a RequestOutput for every request that advanced; a failed step fails only its requests, a
    runner that lost its device state makes the engine dead (EngineDeadError).
 5. `get_stats()` reports an EngineStats snapshot (engine_stats.py), read by /metrics.

This wing imports engine/step/, engine/spec_decode/, engine/structured_output/ and engine's
top-level vocabulary; disaggregation, scale-out and the frontends build on it, never the other way.
"""
