"""Multi-token results, rolled-back positions, the runner's admission list and discarded steps."""

from __future__ import annotations

import pytest

from scheduler import FinishReason, Request, Scheduler, SchedulerConfig, StepResult


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=4,
                  num_blocks=64)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def start(s: Scheduler, req_id: str = "a", prompt_len: int = 6, **kw) -> Request:
    """Adds a request and runs its prefill, which samples token 50."""
    request = Request(req_id, list(range(1, prompt_len + 1)), kw.pop("max_tokens", 20), **kw)
    s.add_request(request)
    out = s.schedule()
    s.update(out, StepResult([req_id], [[50]]))
    return request


def test_several_tokens_are_appended_in_order_and_then_scheduled_together(check_invariants):
    s = make_scheduler()
    request = start(s)
    out = s.schedule()
    (sr,) = out.scheduled
    assert (sr.num_scheduled_tokens, sr.num_logits) == (1, 1)
    sr.num_logits = 3  # a runner verifying drafts would return up to 1 + k tokens
    assert s.update(out, StepResult(["a"], [[51, 52, 53]])) == []
    assert request.output_token_ids == [50, 51, 52, 53]
    # Only the fed token's K/V is computed: 51 and 52 run next step, with 53 as the last token.
    assert request.num_computed_tokens == 7
    out = s.schedule()
    assert [(r.token_ids, r.num_logits) for r in out.scheduled] == [([51, 52, 53], 1)]
    s.update(out, StepResult(["a"], [[54]]))
    assert request.num_computed_tokens == 10 and request.num_tokens == 11
    check_invariants(s)


def test_rejected_positions_roll_num_computed_tokens_back(check_invariants):
    s = make_scheduler()
    request = start(s)
    out = s.schedule()
    (sr,) = out.scheduled
    # As speculative decoding will: the row feeds its last token plus two drafts (positions 6..8)
    # and keeps the first draft and a bonus token; the second draft's position is rejected.
    sr.token_ids, sr.num_scheduled_tokens, sr.num_logits = [50, 61, 62], 3, 3
    s.update(out, StepResult(["a"], [[61, 70]], num_rejected_tokens=[1]))
    assert request.output_token_ids == [50, 61, 70]
    assert request.num_computed_tokens == 8  # positions 0..7 hold prompt, 50, 61
    out = s.schedule()
    assert [(r.num_computed_tokens, r.token_ids) for r in out.scheduled] == [(8, [70])]
    s.update(out, StepResult(["a"], [[71]]))
    check_invariants(s)


def test_a_stop_inside_a_token_list_drops_the_rest():
    s = make_scheduler()
    request = start(s, eos_token_id=99, max_tokens=10)
    out = s.schedule()
    out.scheduled[0].num_logits = 4
    (done,) = s.update(out, StepResult(["a"], [[51, 99, 52, 53]]))
    assert done is request and request.finish_reason is FinishReason.STOP
    assert request.output_token_ids == [50, 51, 99]
    assert s.kv_cache_manager.pool.num_used_blocks == 0


def test_max_tokens_reached_inside_a_token_list():
    s = make_scheduler()
    request = start(s, max_tokens=3)
    out = s.schedule()
    out.scheduled[0].num_logits = 4
    (done,) = s.update(out, StepResult(["a"], [[51, 52, 53, 54]]))
    assert done.finish_reason is FinishReason.LENGTH and request.output_token_ids == [50, 51, 52]


def test_bad_multi_token_results_change_nothing():
    s = make_scheduler()
    request = start(s)
    out = s.schedule()
    with pytest.raises(ValueError, match="1..num_logits"):
        s.update(out, StepResult(["a"], [[1, 2]]))  # num_logits is 1
    with pytest.raises(ValueError, match="1..num_logits"):
        s.update(out, StepResult(["a"], [[]]))
    with pytest.raises(ValueError, match="1..num_logits"):
        s.update(out, StepResult(["a"], [[1]], num_rejected_tokens=[1]))
    with pytest.raises(ValueError, match="parallel"):
        s.update(out, StepResult(["a"], [[1]], num_rejected_tokens=[]))
    assert request.output_token_ids == [50] and request.num_computed_tokens == 6
    s.update(out, StepResult(["a"], [[1]]))
    assert request.output_token_ids == [50, 1]


def test_new_requests_list_admissions_and_resumptions():
    s = make_scheduler(num_blocks=9, max_model_len=32)  # 8 usable blocks of 4 tokens
    sampling = object()
    s.add_request(Request("a", list(range(1, 13)), 30, sampling=sampling))
    s.add_request(Request("b", list(range(20, 32)), 30))
    out = s.schedule()
    assert [(n.req_id, n.output_token_ids) for n in out.new_requests] == [("a", []), ("b", [])]
    assert out.new_requests[0].sampling is sampling
    assert out.new_requests[0].prompt_token_ids == list(range(1, 13))
    s.update(out, StepResult(["a", "b"], [[7], [8]]))
    preempted = None
    for _ in range(40):
        out = s.schedule()
        scheduled_ids = {r.req_id for r in out.scheduled}
        assert all(n.req_id in scheduled_ids for n in out.new_requests)
        if out.preempted_req_ids:
            preempted = out.preempted_req_ids[0]
        resumed = [n for n in out.new_requests if n.req_id == preempted]
        s.update(out, StepResult([r.req_id for r in out.scheduled if r.sample],
                                 [[9] for r in out.scheduled if r.sample]))
        if resumed:
            # A resumed request brings the tokens it generated before its preemption.
            assert resumed[0].output_token_ids[0] in (7, 8) and len(resumed[0].output_token_ids) > 1
            break
    else:
        pytest.fail(f"no preemption and resumption seen (preempted={preempted})")


def test_discard_step_forgets_the_step_without_advancing(check_invariants):
    s = make_scheduler()
    request = start(s)
    out = s.schedule()
    s.discard_step(out)
    assert request.num_computed_tokens == 6 and request.output_token_ids == [50]
    out = s.schedule()  # allowed again, and the same work is scheduled
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled] == [("a", 6)]
    s.update(out, StepResult(["a"], [[51]]))
    check_invariants(s)
