"""The draft-model proposer: a smaller model that shares the target's tokenizer drafts k tokens
per row, greedily, as its own compiled steps over its own paged KV cache.

The draft runs in a second ModelRunner (same buckets, its own request table and KV cache). Its
cache is indexed by the target's block tables: the scheduler's block ids and slots mean the same
positions in both caches, so the draft needs no block manager of its own. Per engine step:
 1. Before schedule(), `propose` gives each chosen row k placeholder drafts: the scheduler counts
    them in the budget and allocates their slots (clamped like any drafts).
 2. After schedule(), `fill(output, scheduler)` runs the draft over the step's rows (sub-step 0):
    prefill chunks and plain decodes as scheduled (so the draft cache follows every request),
    and a drafting row's tokens from the draft's own progress up to its last real token (one
    token, or two when the previous step accepted every draft, whose last one the draft never
    fed). Sub-steps 1 .. k-1 feed each drafting row its previous draft. The drafts replace the
    placeholders in the rows' token_ids, and the target verifies them in its normal step.
 3. A rejected draft's slots in the draft cache are rewritten when the draft catches up again
    (its progress is min(own progress, the target's num_computed_tokens)).
Greedy drafts are point masses, so verification is the exact, coupled rejection sampling of
verify.py: outputs are the target's own, token for token, seeded or greedy. Prefix-cache hits
reuse the draft's K/V of the shared blocks too (the request that computed them ran the draft).
"""

from __future__ import annotations

import dataclasses

from engine.row_params import RowParams
from scheduler import NewRequestData, ScheduledRequest, SchedulerOutput

GREEDY = RowParams(0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0, 0, False)
PLACEHOLDER = 0  # a draft slot reserved before schedule(), filled after it


class DraftModelProposer:
    method = "draft_model"

    def __init__(self, runner, num_speculative_tokens: int):
        self.runner = runner  # a ModelRunner over the draft model (logits_per_seq = 1)
        self.k = num_speculative_tokens
        self.computed: dict[str, int] = {}  # tokens of each request whose K/V the draft holds

    def propose(self, requests) -> list[list[int]]:
        return [[PLACEHOLDER] * self.k for _ in requests]

    def fill(self, out: SchedulerOutput, scheduler) -> None:
        computed = self.computed
        for ids in (out.finished_req_ids, out.aborted_req_ids, out.preempted_req_ids):
            for req_id in ids:
                computed.pop(req_id, None)
        for new in out.new_requests:
            computed.pop(new.req_id, None)  # a resumed request starts over from its prefix hit
        rows, drafting = [], []
        for sr in out.scheduled:
            num_drafts = sr.num_logits - 1 if sr.num_logits > 1 and not sr.num_prompt_logits else 0
            end = sr.num_computed_tokens + (1 if num_drafts else sr.num_scheduled_tokens)
            start = min(computed.get(sr.req_id, sr.num_computed_tokens), sr.num_computed_tokens)
            if start == sr.num_computed_tokens:
                tokens = sr.token_ids[: end - start]
            else:  # catching up: the positions before this row's first token
                tokens = scheduler.requests[sr.req_id].token_slice(start, end)
            rows.append(ScheduledRequest(sr.req_id, tokens, start, end - start, sr.block_ids,
                                         1 if num_drafts else 0))
            computed[sr.req_id] = end
            if num_drafts:
                drafting.append((sr, num_drafts))
        joins = [NewRequestData(n.req_id, n.prompt_token_ids, n.output_token_ids, GREEDY)
                 for n in out.new_requests]
        step = SchedulerOutput(out.step_id, rows, sum(r.num_scheduled_tokens for r in rows),
                               out.finished_req_ids, out.aborted_req_ids, out.preempted_req_ids, joins)
        result = self.runner.execute(step)
        last = dict(zip(result.req_ids, (t[0] for t in result.sampled_token_ids)))
        for sr, _ in drafting:
            sr.token_ids[1] = last[sr.req_id]
        for j in range(1, self.k):
            live = [(sr, n) for sr, n in drafting if n > j]
            if not live:
                break
            rows = [ScheduledRequest(sr.req_id, [sr.token_ids[j]], sr.num_computed_tokens + j, 1,
                                     sr.block_ids, 1) for sr, _ in live]
            result = self.runner.execute(dataclasses.replace(
                step, scheduled=rows, num_batched_tokens=len(rows), finished_req_ids=[],
                aborted_req_ids=[], preempted_req_ids=[], new_requests=[]))
            for (sr, _), tokens in zip(live, result.sampled_token_ids):
                sr.token_ids[j + 1] = tokens[0]
                computed[sr.req_id] = sr.num_computed_tokens + j + 1
