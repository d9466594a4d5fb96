"""The compiled step and what feeds it: one scheduler plan in, sampled tokens out (DESIGN.md 2, 5).

One step, in order:
 1. Start-up (engine/core/builder.py calls these): `mesh.py` lays out the device group of a
    replica, `placement.py` puts the weights' shards and the KV cache's sharding on it,
    `kv_cache.py` allocates the paged cache, `buckets.py` lists the padded shapes (T tokens, S
    sequences, L logit rows), and `ModelRunner` (model_runner.py) compiles one executable per
    bucket ahead of time.
 2. When the engine adds a request, `logit_controls.py` folds its logit_bias, allowed_token_ids
    and bad_words into one BiasRow of its RowParams (engine/row_params.py).
 3. `ModelRunner.execute(scheduler_output)`: the request table (request_table.py) drops the
    requests that left and gives the new ones a slot, writing their sampling values once.
 4. The batch builder (step_inputs.py) fills the bucket's flat input buffer (token ids,
    positions, slots, block tables, the joining rows' sampling values, the grammar masks from
    engine/structured_output/); it crosses to the device in one transfer.
 5. The executable runs the model's paged forward over the mixed batch and the sampler
    (sampler.py: penalties, filters, seeded sampling, logprobs, draft verification from
    engine/spec_decode/verify.py), writing the KV cache and the table state in place.
 6. One packed array comes back to the host and becomes a StepResult for the scheduler.

This wing imports engine's top-level vocabulary, engine/spec_decode/ and engine/structured_output/
(their device and mask halves), the models, the kernels and the scheduler's output types; the
engine loop (engine/core/) and everything above it import this wing, never the other way.
"""
