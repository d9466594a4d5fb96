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
    # How many of this row's last positions are sampled: 0 for a prefill chunk that is not the
    # last, 1 when the chunk reaches the request's last known token (a decode, a final prefill
    # chunk), 1 + k when the row carries k draft tokens to verify (speculative decoding), every
    # position of a prompt chunk whose prompt is scored (Request.prompt_logprobs).
    num_logits: int
    # The first num_prompt_logits of those rows score the prompt's next token (its logprob is
    # reported, nothing is sampled): all of a scored prompt chunk's rows except the last when it
    # reaches the end of the prompt (that one samples the first output token). 0 otherwise.
    num_prompt_logits: int = 0
    # Sliding-window accounting (SchedulerConfig.sliding_window): the sliding layers' live table,
    # as long as block_ids, over their own pool; the entries their window has passed are the null
    # block 0 (scheduler/sliding_window.py). None: every layer reads block_ids.
    sliding_block_ids: list[int] | None = None

    @property
    def sample(self) -> bool:
        """True when the step samples at least one token for this row."""
        return self.num_logits > self.num_prompt_logits

    @property
    def num_sampled(self) -> int:
        """Logit rows that sample (the rest score prompt tokens)."""
        return self.num_logits - self.num_prompt_logits


@dataclasses.dataclass(slots=True)
class NewRequestData:
    """A request that (re)joined the running batch in this step, for the runner's request table.

    Sent once per admission (a preempted request is sent again when it resumes), so the runner
    keeps per-request state and never reads the scheduler's Request objects."""

    req_id: str
    # The prompt (the scheduler's list: read, never mutate).
    prompt_token_ids: list[int]
    # Tokens generated before this admission (non-empty only for a request resumed after
    # preemption); a copy.
    output_token_ids: list[int]
    # Whatever the engine attached to the Request (`Request.sampling`): the scheduler never reads it.
    sampling: object


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
    # Requests admitted by this schedule() (new, or resumed after preemption), in admission order.
    # A runner drops the finished, aborted and preempted ids above, then adds these.
    new_requests: list[NewRequestData] = dataclasses.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclasses.dataclass(slots=True)
class TokenLogprobs:
    """The log-probabilities behind one sampled token (of the raw logits, before penalties)."""

    # Log-probability of the sampled token.
    logprob: float
    # The most likely token ids at that position, best first, and their log-probabilities.
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclasses.dataclass(slots=True)
class StepResult:
    # Ids of the scheduled requests that sampled (num_logits > 0), parallel to the lists below.
    req_ids: list[str]
    # The tokens each request keeps from this step, in order (one for a plain decode; accepted
    # drafts plus a bonus token under speculative decoding), as Python ints; never empty.
    sampled_token_ids: list[list[int]]
    # Per request, one TokenLogprobs per kept token, or None for a request that asked for none;
    # None as a whole when no request asked.
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # Per request, how many of its scheduled positions must be computed again (rejected draft
    # tokens): update() rolls num_computed_tokens back by that much. None: all zero.
    num_rejected_tokens: list[int] | None = None
    # Prompt scoring (ScheduledRequest.num_prompt_logits > 0): req_id -> (p, entries), where
    # entries[j] is the TokenLogprobs of the prompt token at position p + j given the tokens
    # before it. None when no row scored its prompt. The scheduler does not read it.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None


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
    # num_used_blocks / (num_blocks - 1), in [0, 1]; with sliding-window accounting the larger of
    # that and the sliding pool's share.
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
    # Sliding-window accounting: blocks with ref count > 0 in the sliding layers' pool (the four
    # counts above are the global layers' pool); 0 without it.
    num_sliding_used_blocks: int = 0

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
