"""Scale-out: more devices behind LLMEngine's interface (DESIGN.md 12).

What happens, in order:
 1. `make_engine(config)` (dp_engine.py) picks the engine for a config: a multi-host one when
    num_processes > 1 (multihost.py), a PDEngine with disaggregation (engine/disaggregation/), a
    DPEngine when data_parallel_size > 1, else a plain LLMEngine (engine/core/).
 2. Data parallelism: `DPEngine` builds one LLMEngine per replica, each on its own (1, tp) mesh
    (engine/step/mesh.py), from one load of the weights into host memory.
 3. `DPEngine.add_request` asks the router (router.py: prefix affinity, then least outstanding
    tokens) for a replica and remembers it until the request finishes.
 4. `DPEngine.step()` steps every replica with work on its own thread and concatenates their
    outputs; `get_stats()` sums them into one EngineStats with each replica's own inside.
 5. Multi-host: process 0 schedules and publishes each step's SchedulerOutput through
    jax.distributed's key-value store; every other process runs the same compiled step.

This wing imports the disaggregation wing, the engine loop, the step and engine's top-level
vocabulary; the frontends (engine/frontends/) and the server call `make_engine`, never the other
way.
"""
