"""Speculative decoding: drafts verified inside the normal ragged step (DESIGN.md section 13).

One step with speculation, in order:
 1. Before `Scheduler.schedule()`, the engine's `SpecDecoder` (controller.py) asks the load switch
    (switch.py) whether this step speculates at all (decode rows and their share of the token
    budget, with hysteresis), picks the decode rows whose acceptance EMA allows drafting (or that
    are due a re-probe), and has the proposer (ngram.py, draft_model.py, draft_head.py; one
    interface, base.py) write up to k drafts into each one's `Request.spec_token_ids`. The draft
    head drafts here from the target's final hidden states of the previous step (kept on the
    device by the runner); the draft model writes placeholders and fills them after schedule().
 2. The scheduler schedules such a row as 1 + d tokens (its last token and d <= k drafts), counts
    them in the token budget, allocates their KV slots, and asks for 1 + d logit rows.
 3. The compiled step samples every logit row exactly as without speculation (same rng step per
    output index) and keeps the longest prefix whose samples equal the drafts, plus the first
    sample that differs (the bonus token): greedy prefix matching, and for point-mass drafts exact
    rejection sampling (verify.py). Penalties see the row's earlier drafts; only kept tokens are
    counted in the request table.
 4. The runner returns the kept tokens and num_rejected_tokens; `Scheduler.update()` rolls
    num_computed_tokens back over the rejected positions (their slots are rewritten next step).
 5. The controller records drafted / accepted / emitted tokens per position and updates the
    request's acceptance EMA.
k is one value per engine, so the compiled buckets (T, S, L = S * (1 + k)) never change.

The knobs (`SpeculativeConfig`) are in engine/speculative_config.py, beside EngineConfig, which
holds one. This wing imports only engine's top-level vocabulary (the config, RowParams), the
scheduler and the models: the step (engine/step/sampler.py calls verify.py) and the engine loop
(engine/core/: builder, LLMEngine, EngineStats) import it, never the other way.
"""
