"""What crosses the scheduler boundary: one step's plan, the step's result, and statistics."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(slots=True)
class ScheduledRequest:
    # The request this row belongs to.
    req_id: str
    # Tokens to feed this step: all_token_ids[num_computed_tokens : num_computed_tokens +
    # num_scheduled_tokens]. One token for a decode, a prompt chunk for a prefill.
    token_ids: list[int]
    # Tokens whose K/V is already cached, before this step; the position of token_ids[0].
    num_computed_tokens: int
    # len(token_ids); after the step the request's K/V covers num_computed_tokens + this.
    num_scheduled_tokens: int
    # The request's whole block table after this step's allocation: the token at position p
    # lives in slot block_ids[p // block_size] * block_size + p % block_size. This is the live,
    # append-only table, not a copy (copying 1024 tables of ~100 blocks cost about 1 ms a step):
    # read it before the next schedule(), which may append to it, and never mutate it. A request
    # resumed after preemption (num_computed_tokens restarts at 0 or at its prefix-cache hit)
    # gets a new table.
    block_ids: list[int]
    # True when this step covers the request's last known token, so the engine samples the next
    # token from the last position's logits; False for a prefill chunk that is not the last.
    sample: bool


@dataclasses.dataclass(slots=True)
class SchedulerOutput:
    # Counter of schedule() calls; update() accepts only the latest one.
    step_id: int
    # Requests to run this step: running requests first (decodes, then unfinished prefills, each in
    # admission order), then newly admitted ones in queue order. Each req_id appears at most once.
    scheduled: list[ScheduledRequest]
    # Sum of num_scheduled_tokens over `scheduled`; never more than max_num_batched_tokens.
    num_batched_tokens: int
    # Requests that finished (stop, length, or finish_request) since the last schedule().
    finished_req_ids: list[str]
    # Requests aborted since the last schedule(); their blocks are already free.
    aborted_req_ids: list[str]
    # Requests preempted by this schedule() (blocks freed; they recompute from scratch later). None
    # of them is in `scheduled`.
    preempted_req_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(slots=True)
class StepResult:
    # Ids of the scheduled requests with sample=True, parallel to sampled_token_ids.
    req_ids: list[str]
    # The token sampled for each of req_ids, as Python ints.
    sampled_token_ids: list[int]
    # Anything the engine wants to carry along (logprobs, timings); the scheduler ignores it.
    extras: dict | None = None


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    # Requests admitted and holding blocks.
    num_running: int
    # Requests in the waiting queue (new or preempted).
    num_waiting: int
    # Blocks with ref count 0 and no cached contents.
    num_free_blocks: int
    # Blocks with ref count 0 whose contents stay in the prefix cache (evictable, LRU first).
    num_cached_blocks: int
    # Blocks with ref count > 0.
    num_used_blocks: int
    # num_used_blocks / (num_blocks - 1), in [0, 1].
    kv_cache_usage: float
    # Tokens looked up in the prefix cache at admissions (re-admissions after preemption included).
    prefix_cache_queries: int
    # Of those, tokens found cached.
    prefix_cache_hits: int
    # Preemptions since the scheduler started.
    num_preemptions: int
    # Cached blocks evicted to make room since the scheduler started.
    num_evictions: int
    # schedule() calls so far.
    num_steps: int

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclasses.dataclass(slots=True)
class KVWaste:
    # KV slots held by running requests' block tables (blocks * block_size; a shared block counts
    # once per table).
    num_allocated_slots: int
    # Of those, slots holding a computed token.
    num_token_slots: int
    # Requests measured.
    num_requests: int

    @property
    def num_wasted_slots(self) -> int:
        return self.num_allocated_slots - self.num_token_slots
