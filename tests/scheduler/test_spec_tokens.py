"""Draft tokens (Request.spec_token_ids) in the scheduler: budget, clamps, blocks, rollback."""

from __future__ import annotations

from scheduler import Request, Scheduler, SchedulerConfig, StepResult


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                  num_blocks=64)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def start(s: Scheduler, req_id: str = "a", prompt_len: int = 6, **kw) -> Request:
    (request,) = start_all(s, [req_id], prompt_len, **kw)
    return request


def start_all(s: Scheduler, req_ids, prompt_len: int = 6, **kw) -> list[Request]:
    """Adds the requests and runs their prefills together; each samples token 50."""
    requests = [Request(rid, list(range(1, prompt_len + 1)), kw.get("max_tokens", 20),
                        **{k: v for k, v in kw.items() if k != "max_tokens"}) for rid in req_ids]
    for request in requests:
        s.add_request(request)
    out = s.schedule()
    s.update(out, StepResult(list(req_ids), [[50] for _ in req_ids]))
    return requests


def test_a_decode_with_drafts_feeds_them_samples_them_and_allocates_their_slots(check_invariants):
    s = make_scheduler()
    request = start(s)  # 7 tokens, 6 computed, 2 blocks of 4
    request.spec_token_ids = [61, 62, 63]
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.token_ids, sr.num_computed_tokens, sr.num_scheduled_tokens, sr.num_logits) == (
        [50, 61, 62, 63], 6, 4, 4)
    assert out.num_batched_tokens == 4
    assert len(sr.block_ids) == 3  # positions 6..9 reach the third block
    assert request.spec_token_ids == []  # consumed
    # The first draft is accepted, the second is not: the bonus replaces it.
    s.update(out, StepResult(["a"], [[61, 70]], num_rejected_tokens=[2]))
    assert request.output_token_ids == [50, 61, 70]
    assert request.num_computed_tokens == 8
    out = s.schedule()  # no drafts now: a plain decode that reuses the third block
    assert [(r.token_ids, r.num_logits, len(r.block_ids)) for r in out.scheduled] == [([70], 1, 3)]
    s.update(out, StepResult(["a"], [[71]]))
    check_invariants(s)


def test_drafts_take_only_the_budget_every_decode_leaves():
    s = make_scheduler(max_num_batched_tokens=6)
    a, b, c = start_all(s, "abc", prompt_len=2)  # three 2-token prefills fill the budget
    for r in (a, b, c):
        r.spec_token_ids = [61, 62, 63]
    out = s.schedule()
    # Three decode rows need 3 tokens; the 3 spare go to the drafts in admission order.
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [("a", 4), ("b", 1), ("c", 1)]
    assert out.num_batched_tokens == 6


def test_drafts_never_pass_max_tokens_or_max_model_len():
    s = make_scheduler()
    request = start(s, max_tokens=3)  # one output so far: at most 2 more, so 1 draft + bonus
    request.spec_token_ids = [61, 62, 63]
    (sr,) = s.schedule().scheduled
    assert sr.token_ids == [50, 61] and sr.num_logits == 2

    s = make_scheduler(max_model_len=10)
    request = start(s, prompt_len=6)  # 7 tokens: the last draft may sit at position 8 at most
    request.spec_token_ids = [61, 62, 63]
    (sr,) = s.schedule().scheduled
    assert sr.token_ids == [50, 61, 62] and sr.num_computed_tokens + sr.num_scheduled_tokens == 9


def test_a_stop_inside_the_drafts_finishes_and_frees_everything(check_invariants):
    s = make_scheduler()
    request = start(s, eos_token_id=99)
    request.spec_token_ids = [61, 99, 62]
    out = s.schedule()
    (done,) = s.update(out, StepResult(["a"], [[61, 99, 62, 5]], num_rejected_tokens=[0]))
    assert done is request and request.output_token_ids == [50, 61, 99]
    assert s.kv_cache_manager.pool.num_used_blocks == 0
    check_invariants(s)


def test_preemption_drops_the_drafts_and_a_prefill_never_carries_them(check_invariants):
    s = make_scheduler(num_blocks=5, max_model_len=16)  # 4 usable blocks of 4 tokens
    a, b = start_all(s, "ab", prompt_len=7)  # 8 tokens each: 2 blocks each, the pool is full
    a.spec_token_ids = [61, 62]
    b.spec_token_ids = [63, 64]
    out = s.schedule()  # a needs a third block for its drafts: b (the newest) is preempted
    assert out.preempted_req_ids == ["b"] and b.spec_token_ids == []
    assert [(r.req_id, r.num_logits) for r in out.scheduled] == [("a", 3)]
    s.update(out, StepResult(["a"], [[61, 62, 65]], num_rejected_tokens=[0]))
    assert a.num_computed_tokens == 10 and a.output_token_ids == [50, 61, 62, 65]
    check_invariants(s)
