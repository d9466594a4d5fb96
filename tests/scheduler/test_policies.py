"""The priority policy and the two research baselines (static batching, contiguous KV)."""

from __future__ import annotations

from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(
        max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, block_size=16, num_blocks=256
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def req(req_id: str, prompt_len: int, max_tokens: int = 100, offset: int = 0, **kw) -> Request:
    return Request(req_id, list(range(offset, offset + prompt_len)), max_tokens, **kw)


def test_priority_admits_lower_values_first(fake_step):
    s = make_scheduler(policy="priority", max_num_seqs=2)
    s.add_request(req("low", 4, priority=5, arrival_time=0.0))
    s.add_request(req("high", 4, offset=100, priority=0, arrival_time=1.0))
    s.add_request(req("mid", 4, offset=200, priority=1, arrival_time=2.0))
    out, _ = fake_step(s)
    assert [r.req_id for r in out.scheduled] == ["high", "mid"]
    assert [r.req_id for r in s.waiting] == ["low"]


def test_priority_waiting_request_preempts_a_lower_priority_one(fake_step, check_invariants):
    s = make_scheduler(policy="priority", max_num_seqs=2)
    s.add_request(req("a", 4, priority=3, arrival_time=0.0))
    s.add_request(req("b", 4, offset=100, priority=5, arrival_time=1.0))
    fake_step(s)
    s.add_request(req("urgent", 4, offset=200, priority=1, arrival_time=2.0))
    out, _ = fake_step(s)
    check_invariants(s)
    assert out.preempted_req_ids == ["b"]  # the lowest priority, not the newest
    assert [r.req_id for r in out.scheduled] == ["a", "urgent"]
    assert s.get_request("b").status is RequestStatus.WAITING
    # An equal-priority newcomer does not preempt.
    s.add_request(req("peer", 4, offset=300, priority=3, arrival_time=3.0))
    out, _ = fake_step(s)
    assert out.preempted_req_ids == [] and {r.req_id for r in out.scheduled} == {"a", "urgent"}


def test_priority_preempts_lowest_priority_when_blocks_run_out(fake_step, check_invariants):
    # 6 usable blocks of 4 tokens; "vip" arrives last but outranks the others.
    s = make_scheduler(
        policy="priority", block_size=4, num_blocks=7, max_model_len=24, max_num_batched_tokens=64
    )
    s.add_request(req("x", 8, max_tokens=12, priority=2, arrival_time=0.0, ignore_eos=True))
    s.add_request(req("vip", 8, max_tokens=12, offset=100, priority=0, arrival_time=1.0))
    seen_preempted = []
    for _ in range(100):
        out, _ = fake_step(s)
        check_invariants(s)
        seen_preempted += out.preempted_req_ids
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests()
    assert seen_preempted and set(seen_preempted) == {"x"}


def test_static_admits_no_newcomer_while_its_batch_runs(fake_step, check_invariants):
    s = make_scheduler(policy="static", max_num_seqs=4)
    s.add_request(req("a", 10, max_tokens=3))
    s.add_request(req("b", 10, max_tokens=6, offset=100))
    out, _ = fake_step(s)
    assert [r.req_id for r in out.scheduled] == ["a", "b"]
    s.add_request(req("late", 10, max_tokens=2, offset=200))
    steps_until_late = 0
    while True:
        # There is room (max_num_seqs=4, blocks, budget) but the batch must finish first.
        assert "late" not in s.running
        out, _ = fake_step(s)
        check_invariants(s)
        steps_until_late += 1
        if "late" in [r.req_id for r in out.scheduled]:
            break
        assert "b" in s.running or not s.running
    assert s.get_request("a") is None and s.get_request("b") is None  # both finished first
    assert steps_until_late == 6  # b's 6 outputs: 1 came with the prefill, 5 decodes, then late
    assert [r.req_id for r in out.scheduled] == ["late"]


def test_static_prefills_a_whole_batch_over_several_steps(fake_step):
    s = make_scheduler(policy="static", max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(f"r{i}", 40, max_tokens=2, offset=100 * i))
    out, _ = fake_step(s)
    # All three joined the batch at once; the budget spreads their prompts over steps.
    assert set(s.running) == {"r0", "r1", "r2"}
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [("r0", 40), ("r1", 24)]


def test_contiguous_reserves_max_model_len_at_admission(fake_step, check_invariants):
    s = make_scheduler(kv_allocation="contiguous", max_model_len=256, block_size=16, num_blocks=40)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, offset=100))
    s.add_request(req("c", 10, offset=200))
    out, _ = fake_step(s)
    # 39 usable blocks hold two reservations of 256 / 16 = 16 blocks; "c" waits.
    assert [len(r.block_ids) for r in out.scheduled] == [16, 16]
    assert s.stats.num_waiting == 1
    for _ in range(5):
        out, _ = fake_step(s)
        check_invariants(s)
        assert all(len(r.block_ids) == 16 for r in out.scheduled)
    waste = s.kv_waste()
    assert waste.num_allocated_slots == 2 * 256 and waste.num_token_slots == 2 * 15


def test_paged_allocates_on_demand(fake_step):
    s = make_scheduler()
    s.add_request(req("a", 10, ignore_eos=True))
    out, _ = fake_step(s)
    assert len(out.scheduled[0].block_ids) == 1
    for _ in range(7):
        out, _ = fake_step(s)
    # After 16 computed tokens the 17th needs a second block; the table only grows at its end.
    assert out.scheduled[0].num_computed_tokens == 16 and len(out.scheduled[0].block_ids) == 2


def test_a_group_over_its_share_lets_another_group_in(fake_step, check_invariants):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                                  block_size=16, num_blocks=256, max_seqs_per_group=2))
    for i in range(6):  # one client request with six prompts, all waiting
        s.add_request(Request(f"big{i}", list(range(10 * i, 10 * i + 8)), 50, group_id="big"))
    out, _ = fake_step(s)
    # Nobody else waits: the big group fills the batch (work-conserving).
    assert [r.req_id for r in out.scheduled] == ["big0", "big1", "big2", "big3"]
    s.add_request(Request("small", [1, 2, 3], 2))
    # No seat is free, and "big" holds 4 > 2 seats: its newest request is preempted for "small",
    # which is admitted ahead of big4 and big5.
    out, _ = fake_step(s)
    assert out.preempted_req_ids == ["big3"] and "small" in [r.req_id for r in out.scheduled]
    assert "big4" not in s.running and "big3" not in s.running
    # A seat that frees goes to the group under its cap first (small is done: big resumes).
    out, done = fake_step(s)
    assert [r.req_id for r in done] == ["small"]
    check_invariants(s)
