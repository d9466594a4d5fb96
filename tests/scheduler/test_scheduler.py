"""Scheduler behaviour under the fcfs policy, asserted on SchedulerOutput (issue acceptance list)."""

from __future__ import annotations

import pytest

from scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    StepResult,
)


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=2048,
        block_size=16,
        num_blocks=512,
    )
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


def req(req_id: str, prompt_len: int, max_tokens: int = 100, offset: int = 0, **kw) -> Request:
    """A request whose prompt is offset, offset+1, ... (distinct offsets: distinct prompts)."""
    return Request(req_id, list(range(offset, offset + prompt_len)), max_tokens, **kw)


def test_decodes_are_served_before_prefills(fake_step):
    s = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(req(f"d{i}", 8, offset=100 * i))
    fake_step(s)
    s.add_request(req("long", 200, offset=5000))
    for _ in range(2):
        # The three decodes take one token each; the prompt (new, then running) takes the rest.
        out, _ = fake_step(s)
        assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [
            ("d0", 1),
            ("d1", 1),
            ("d2", 1),
            ("long", 61),
        ]
        assert out.num_batched_tokens == 64


def test_long_prompt_is_chunked_while_three_requests_decode(fake_step, check_invariants):
    s = make_scheduler(max_num_batched_tokens=256)
    for i in range(3):
        s.add_request(req(f"d{i}", 10, max_tokens=50, offset=100 * i, ignore_eos=True))
    fake_step(s)  # prefill of the three
    long_prompt = list(range(5000, 6000))
    s.add_request(Request("long", long_prompt, max_tokens=5))
    num_computed = 0
    for _ in range(4):
        out, _ = fake_step(s)
        check_invariants(s)
        decodes = out.scheduled[:3]
        assert [r.req_id for r in decodes] == ["d0", "d1", "d2"]
        assert all(r.num_scheduled_tokens == 1 and r.sample for r in decodes)
        chunk = out.scheduled[3]
        assert chunk.req_id == "long" and chunk.num_computed_tokens == num_computed
        assert chunk.num_scheduled_tokens == min(253, 1000 - num_computed)
        assert (
            chunk.token_ids == long_prompt[num_computed : num_computed + chunk.num_scheduled_tokens]
        )
        assert chunk.sample == (num_computed + chunk.num_scheduled_tokens == 1000)
        assert len(chunk.block_ids) * 16 >= num_computed + chunk.num_scheduled_tokens
        assert out.num_batched_tokens <= 256
        num_computed += chunk.num_scheduled_tokens
    assert num_computed == 1000
    out, _ = fake_step(s)  # now all four decode
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled][-1] == ("long", 1)


def test_shared_system_prompt_shares_three_blocks(fake_step, check_invariants):
    s = make_scheduler()
    system = list(range(9000, 9048))  # 48 tokens: three full blocks of 16
    s.add_request(Request("a", system + [1, 2, 3], max_tokens=10))
    out_a, _ = fake_step(s)  # "a" computes its prompt; its three full blocks enter the cache
    s.add_request(Request("b", system + [7, 8], max_tokens=10))
    out, _ = fake_step(s)
    check_invariants(s)
    sched = {r.req_id: r for r in out.scheduled}
    a_blocks = s.kv_cache_manager.get_block_ids("a")
    b = sched["b"]
    assert b.num_computed_tokens == 48 and b.num_scheduled_tokens == 2 and b.token_ids == [7, 8]
    assert b.block_ids[:3] == a_blocks[:3] == out_a.scheduled[0].block_ids[:3]
    assert len(b.block_ids) == 4 and b.block_ids[3] not in a_blocks
    assert [s.kv_cache_manager.pool.ref_cnt[block] for block in a_blocks[:3]] == [2, 2, 2]
    assert s.get_request("b").num_cached_tokens == 48
    stats = s.stats
    assert stats.prefix_cache_hits == 48 and stats.prefix_cache_queries == 51 + 50


def test_prefix_hit_never_covers_the_last_prompt_token(fake_step):
    s = make_scheduler()
    system = list(range(9000, 9048))
    s.add_request(Request("a", system + [1], max_tokens=10))
    fake_step(s)
    s.add_request(Request("b", system, max_tokens=10))  # identical 48 tokens: 3 full blocks
    out, _ = fake_step(s)
    b = out.scheduled[-1]
    assert b.req_id == "b" and b.num_computed_tokens == 32 and b.num_scheduled_tokens == 16
    assert b.sample


def test_cached_blocks_are_evicted_least_recently_used_first(fake_step, check_invariants):
    s = make_scheduler(block_size=4, num_blocks=9, max_model_len=16, max_num_batched_tokens=64)
    pool = s.kv_cache_manager.pool
    tables = {}
    for i, name in enumerate("ABCD"):  # each fills two blocks, finishes, and leaves both cached
        s.add_request(req(name, 8, max_tokens=1, offset=100 * i))
        out, finished = fake_step(s)
        tables[name] = out.scheduled[0].block_ids
        assert [r.finish_reason for r in finished] == [FinishReason.LENGTH]
    check_invariants(s)
    assert pool.num_free_blocks == 0 and pool.num_cached_blocks == 8
    # A table is freed last block first, so A's tail block is evicted first.
    lru = pool.cached_block_ids_lru()
    assert lru[:4] == tables["A"][::-1] + tables["B"][::-1]
    s.add_request(req("E", 8, max_tokens=1, offset=900))
    out, _ = fake_step(s)
    assert sorted(out.scheduled[0].block_ids) == sorted(tables["A"])
    assert s.stats.num_evictions == 2
    check_invariants(s)
    # A's prefix is gone; B's first block is still cached (B2 takes it back and evicts B's tail
    # block, now the least recently used, for its second block).
    s.add_request(req("B2", 8, max_tokens=1, offset=100))
    s.add_request(req("A2", 8, max_tokens=1, offset=0))
    out, _ = fake_step(s)
    assert {r.req_id: r.num_computed_tokens for r in out.scheduled} == {"B2": 4, "A2": 0}
    assert out.scheduled[0].block_ids == [tables["B"][0], tables["B"][1]]


def test_preempted_request_resumes_and_finishes(fake_step, check_invariants):
    # 6 usable blocks of 4 tokens; two requests that each grow to 20 tokens (5 blocks).
    s = make_scheduler(block_size=4, num_blocks=7, max_model_len=24, max_num_batched_tokens=64)
    for i in range(2):
        s.add_request(req(f"r{i}", 8, max_tokens=12, offset=100 * i, ignore_eos=True))
    preempted_at = None
    finished = {}
    for step in range(100):
        out, done = fake_step(s)
        check_invariants(s)
        ids = [r.req_id for r in out.scheduled]
        assert not set(ids) & set(out.preempted_req_ids)
        if out.preempted_req_ids and preempted_at is None:
            preempted_at = step
            assert out.preempted_req_ids == ["r1"]  # the newest
            r1 = s.get_request("r1")
            assert r1.status is RequestStatus.WAITING and r1.num_computed_tokens == 0
            assert r1.num_output_tokens > 0  # outputs are kept for the recompute
        finished.update({r.req_id: r for r in done})
        if not s.has_unfinished_requests():
            break
    assert preempted_at is not None and set(finished) == {"r0", "r1"}
    for r in finished.values():
        # position_token: each output is 1000 + the sequence length when it was sampled.
        assert r.output_token_ids == [1000 + n for n in range(8, 20)]
        assert r.finish_reason is FinishReason.LENGTH
    assert finished["r1"].num_preemptions >= 1 and s.stats.num_preemptions >= 1
    assert s.kv_cache_manager.pool.num_used_blocks == 0


def test_aborted_request_frees_its_blocks_at_once(fake_step, check_invariants):
    s = make_scheduler()
    s.add_request(req("a", 40, offset=0))
    s.add_request(req("w", 40, offset=500))
    fake_step(s)
    assert s.kv_cache_manager.pool.num_used_blocks == 6
    assert s.abort_request("a")
    assert s.kv_cache_manager.get_block_ids("a") == []
    assert s.kv_cache_manager.pool.num_used_blocks == 3
    check_invariants(s)
    request = s.get_request("w")
    assert s.abort_request("w") and request.status is RequestStatus.ABORTED
    assert (
        request.finish_reason is FinishReason.ABORT and s.kv_cache_manager.pool.num_used_blocks == 0
    )
    assert not s.abort_request("a") and not s.abort_request("nobody")
    out = s.schedule()
    assert out.aborted_req_ids == ["a", "w"] and out.scheduled == []
    assert not s.has_unfinished_requests()


def test_abort_of_a_waiting_request_and_between_schedule_and_update(fake_step, check_invariants):
    s = make_scheduler(max_num_seqs=1)
    s.add_request(req("a", 10, offset=0))
    s.add_request(req("queued", 10, offset=100))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled] == ["a"]
    assert s.abort_request("queued") and s.stats.num_waiting == 0
    assert s.abort_request("a")  # the step is in flight
    assert s.update(out, StepResult(["a"], [[5]])) == []
    check_invariants(s)
    assert s.get_request("a") is None and s.kv_cache_manager.pool.num_used_blocks == 0


def test_finish_reasons(fake_step):
    s = make_scheduler(max_model_len=64)
    s.add_request(req("eos", 4, eos_token_id=7))
    s.add_request(req("ignore", 4, max_tokens=2, offset=100, eos_token_id=7, ignore_eos=True))
    s.add_request(req("stop", 4, offset=200, stop_token_ids=(9, 7)))
    s.add_request(req("len", 60, max_tokens=100, offset=300))
    out, finished = fake_step(s, token_of=lambda sr: 7)
    assert {r.req_id: r.finish_reason for r in finished} == {
        "eos": FinishReason.STOP,
        "stop": FinishReason.STOP,
    }
    reported = []  # each SchedulerOutput lists the ids finished since the previous one
    for _ in range(3):
        out, done = fake_step(s, token_of=lambda sr: 7)
        reported += out.finished_req_ids
        finished += done
    reasons = {r.req_id: r.finish_reason for r in finished}
    assert reasons["ignore"] is FinishReason.LENGTH and s.get_request("ignore") is None
    assert reasons["len"] is FinishReason.LENGTH
    assert [r for r in finished if r.req_id == "len"][0].num_tokens == 64  # max_model_len
    assert all(r.status is RequestStatus.FINISHED for r in finished)
    reported += s.schedule().finished_req_ids
    assert sorted(reported) == ["eos", "ignore", "len", "stop"]


def test_finish_request_from_the_engine(fake_step):
    s = make_scheduler()
    s.add_request(req("a", 10))
    fake_step(s)
    assert s.finish_request("a", "stop")
    assert s.kv_cache_manager.pool.num_used_blocks == 0
    assert not s.finish_request("a", FinishReason.STOP)
    assert s.schedule().finished_req_ids == ["a"]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits(fake_step):
    s = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=100, max_model_len=100)
    s.add_request(req("a", 60))
    s.add_request(req("b", 60, offset=500))
    s.add_request(req("c", 10, offset=900))
    out, _ = fake_step(s)
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [("a", 60)]
    out, _ = fake_step(s)
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [
        ("a", 1),
        ("b", 60),
        ("c", 10),
    ]


def test_max_num_seqs_caps_the_batch(fake_step):
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 5, offset=100 * i))
    out, _ = fake_step(s)
    assert [r.req_id for r in out.scheduled] == ["r0", "r1"] and s.stats.num_waiting == 1


def test_held_admissions_let_running_requests_go_on(fake_step):
    """A decode pool whose imported blocks have not landed holds admissions
    (engine/disaggregation/decode_pool.py): running requests keep decoding, a waiting one starts
    once the hold is lifted."""
    s = make_scheduler()
    s.add_request(req("running", 8))
    fake_step(s)
    s.admissions_held = True
    s.add_request(req("held", 8, offset=100))
    for _ in range(2):
        out, _ = fake_step(s)
        assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [("running", 1)]
    s.admissions_held = False
    out, _ = fake_step(s)
    assert [(r.req_id, r.num_scheduled_tokens) for r in out.scheduled] == [("running", 1), ("held", 8)]


def test_add_request_rejects_bad_requests():
    s = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add_request(Request("e", [], 4))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(req("long", 32))
    s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="already has this req_id"):
        s.add_request(req("a", 4))
    with pytest.raises(ValueError, match="max_tokens"):
        Request("z", [1], 0)


def test_schedule_and_update_must_alternate():
    s = make_scheduler()
    s.add_request(req("a", 4))
    out = s.schedule()
    with pytest.raises(RuntimeError, match="update"):
        s.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        s.update(out, StepResult([], []))
    assert s.get_request("a").num_computed_tokens == 0  # the bad result changed nothing
    assert s.update(out, StepResult(["a"], [[1]])) == []
    with pytest.raises(ValueError, match="latest schedule"):
        s.update(out, StepResult(["a"], [[1]]))
    assert s.get_request("a").output_token_ids == [1]
