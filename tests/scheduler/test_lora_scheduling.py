"""LoRA in the scheduler: prefix-cache blocks keyed by adapter (scheduler/block_pool.root_hash),
and at most max_loras distinct adapters running at once (scheduler/lora_seats.py), with the
requests that can run admitted past one that waits for a slot."""

from __future__ import annotations

import pytest

from scheduler import Request, Scheduler, SchedulerConfig


def make_scheduler(**overrides) -> Scheduler:
    fields = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, block_size=16,
                  num_blocks=128, max_loras=2)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields))


PROMPT = list(range(100, 150))  # 50 tokens: three full blocks


def test_the_same_prompt_under_two_adapters_and_the_base_shares_no_block(fake_step, check_invariants):
    s = make_scheduler()
    s.add_request(Request("one", PROMPT, max_tokens=1, lora_id=1))
    fake_step(s)  # computes the prompt, caches its three full blocks, finishes
    cached = set(s.kv_cache_manager.pool.hash_to_block.values())
    assert len(cached) == 3
    for rid, lora_id in (("two", 2), ("base", 0)):
        s.add_request(Request(rid, PROMPT, max_tokens=2, lora_id=lora_id))
    out, _ = fake_step(s)
    check_invariants(s)
    scheduled = {sr.req_id: sr for sr in out.scheduled}
    for rid in ("two", "base"):
        assert scheduled[rid].num_computed_tokens == 0  # no prefix hit
        assert not cached & set(scheduled[rid].block_ids)  # and no shared block
    assert not set(scheduled["two"].block_ids) & set(scheduled["base"].block_ids)
    # The same adapter again hits its own blocks.
    s.add_request(Request("one-again", PROMPT, max_tokens=1, lora_id=1))
    out, _ = fake_step(s)
    again = next(sr for sr in out.scheduled if sr.req_id == "one-again")
    assert again.num_computed_tokens == 48 and set(again.block_ids[:3]) == cached
    check_invariants(s)


def test_at_most_max_loras_adapters_run_and_others_are_not_blocked(fake_step, check_invariants):
    s = make_scheduler()
    for rid, lora_id in (("a1", 1), ("b2", 2), ("c3", 3), ("base", 0), ("a1-bis", 1)):
        s.add_request(Request(rid, list(range(len(rid), len(rid) + 20)), max_tokens=3 if rid == "a1" else 6,
                              lora_id=lora_id))
    out, _ = fake_step(s)
    assert [sr.req_id for sr in out.scheduled] == ["a1", "b2", "base", "a1-bis"]  # c3 waits, the rest go
    assert s.lora_seats.active == {1: 2, 2: 1}
    assert [r.req_id for r in s.waiting] == ["c3"]
    fake_step(s)
    fake_step(s)  # a1 finishes (3 tokens); a1-bis still runs adapter 1
    assert [r.req_id for r in s.waiting] == ["c3"]
    for _ in range(3):
        fake_step(s)  # a1-bis and b2 finish: slots free up
    while "c3" not in s.running and s.has_unfinished_requests():
        fake_step(s)
    assert "c3" in s.running and 3 in s.lora_seats.active
    while s.has_unfinished_requests():
        fake_step(s)
        check_invariants(s)
    assert s.lora_seats.active == {}


def test_an_abort_gives_the_adapter_seat_back(fake_step):
    s = make_scheduler(max_loras=1)
    s.add_request(Request("a", list(range(20)), max_tokens=50, lora_id=7))
    s.add_request(Request("b", list(range(30, 50)), max_tokens=50, lora_id=8))
    fake_step(s)
    assert list(s.running) == ["a"] and s.lora_seats.active == {7: 1}
    assert s.abort_request("a")
    fake_step(s)
    assert list(s.running) == ["b"] and s.lora_seats.active == {8: 1}


def test_refused_without_adapters_or_under_static():
    with pytest.raises(ValueError, match="max_loras is 0"):
        make_scheduler(max_loras=0).add_request(Request("x", [1, 2], max_tokens=1, lora_id=3))
    with pytest.raises(ValueError, match="policy 'static'"):
        make_scheduler(policy="static").add_request(Request("x", [1, 2], max_tokens=1, lora_id=3))
    with pytest.raises(ValueError, match="lora_id must be an integer >= 0"):
        Request("x", [1], max_tokens=1, lora_id=-1)
