"""Prefill/decode disaggregation: prompts on one pool of devices, decoding on another (DESIGN.md 12).

A request's life, in order:
 1. `PDEngine` (pd_engine.py) builds two LLMEngines (engine/core/) on two meshes: the prefill
    pool and the decode pool, in this process (`DecodePool`, local_pool.py) or in another one
    (`RemoteDecodePool`, decode_pool.py; that process is started with
    `python -m engine.disaggregation.decode_pool --listen=HOST:PORT` and runs decode_process.py,
    the two ends meeting at the address and key of connection.py).
 2. The prefill engine runs the prompt and samples the first token, which is returned at once.
 3. The prompt's full blocks are gathered from the prefill cache, padded to a bucket of block
    counts (`KVGather`, kv_transfer.py), and moved onto the decode cache's sharding
    (`jax.device_put`, or `jax.experimental.transfer` across processes).
 4. The decode pool registers and pins the blocks under the same hashes, scatters the new ones
    into its cache (`KVScatter`), and resumes the request with its first token; the pins go once
    its scheduler has admitted it.
 5. `PDEngine.step()` keeps one step of each pool in flight and returns whichever finishes first;
    aborts reach the request wherever it is and leave no block held.
 6. If the decode pool is lost (its process killed, say), the engine degrades instead of dying:
    the prefill engine resumes every request in flight from the tokens it has returned and
    serves new ones itself; `degraded_reason` (and /health, /metrics) say so.

The knobs are engine/disaggregation_config.py (EngineConfig holds one). This wing imports the
engine loop (engine/core/), the step (meshes, the runner's cache) and engine's top-level
vocabulary; scale-out (engine/scaleout/dp_engine.py's `make_engine`) builds a PDEngine, never the
other way.
"""
