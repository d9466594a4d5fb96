"""Frontends: how callers drive an engine (any of LLMEngine, DPEngine, PDEngine; engine/scaleout/).

What happens, in order:
 1. Offline (llm.py): `LLM(model=..., **knobs)` builds an EngineConfig and `make_engine`s it;
    `generate` / `chat` validate every prompt and its SamplingParams first, add them all, and
    step the engine until each has finished, with a progress bar.
 2. Online (async_engine.py): `AsyncLLMEngine` owns the one step thread that calls the engine.
    A handler on the event loop puts an `AddCommand` on its queue (request_stream.py holds what
    crosses the two threads) and awaits the add.
 3. Before each step the step thread drains the queue (add, abort, stop), then steps the engine
    and hands the outputs to the event loop in one `call_soon_threadsafe`.
 4. The event loop records latency metrics (engine/metrics.py) and puts each output on its
    request's `RequestStream`, which the HTTP handler (entrypoints/openai/) reads.
 5. A failed step fails its requests; a dead engine fails everything in flight and refuses
    later adds (EngineDeadError), so the server answers 503.

The top of engine's house: this wing imports scale-out and engine's top-level vocabulary (the
async engine only the vocabulary: the server loads it without jax); nothing in engine imports it
but `engine/__init__.py`'s lazy `LLM`.
"""
