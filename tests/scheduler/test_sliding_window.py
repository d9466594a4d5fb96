"""Sliding-window block accounting (scheduler/sliding_window.py): the sliding layers' own tables
release the blocks their window has passed, prefix hits need the blocks both groups read, and
outputs stay those of the request alone.

A fake two-group paged model stands in for the engine: every fed token is written into both
caches through both tables; every query reads its whole sequence through the global table and its
window through the sliding one (asserting the two agree), and the next token is a function of both
reads. A released block read by a query, a hit on an evicted block, or a block reused while still
in a window shows up as a wrong read or a wrong output.
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import Request, Scheduler, SchedulerConfig, StepResult
from scheduler.block_pool import NULL_BLOCK_ID
from scheduler.sliding_window import num_blocks_needed, num_out_of_window


def next_token(seq: list[int], window: int) -> int:
    return (sum(seq) * 31 + sum(seq[-window:]) * 7 + len(seq) * 17) % 48 + 1


class FakeTwoGroupModel:
    def __init__(self, config: SchedulerConfig) -> None:
        self.bs, self.window = config.block_size, config.sliding_window
        self.full: list[int | None] = [None] * (config.num_blocks * self.bs)
        self.local: list[int | None] = [None] * (config.num_sliding_blocks * self.bs)

    def _slot(self, table: list[int], p: int) -> int:
        return table[p // self.bs] * self.bs + p % self.bs

    def step(self, output) -> StepResult:
        for sr in output.scheduled:
            assert len(sr.sliding_block_ids) == len(sr.block_ids)
            for i, token in enumerate(sr.token_ids):
                p = sr.num_computed_tokens + i
                self.full[self._slot(sr.block_ids, p)] = token
                self.local[self._slot(sr.sliding_block_ids, p)] = token
        req_ids, tokens = [], []
        for sr in output.scheduled:
            for q in range(sr.num_computed_tokens, sr.num_computed_tokens + sr.num_scheduled_tokens):
                seq = [self.full[self._slot(sr.block_ids, p)] for p in range(q + 1)]
                lo = max(0, q - self.window + 1)
                local = [self.local[self._slot(sr.sliding_block_ids, p)] for p in range(lo, q + 1)]
                assert local == seq[lo:], f"{sr.req_id}: the window of position {q} reads wrong K/V"
            if sr.sample:
                req_ids.append(sr.req_id)
                tokens.append([next_token(seq, self.window)])
        return StepResult(req_ids, tokens)


def check_sliding_invariants(scheduler: Scheduler) -> None:
    kv, config = scheduler.kv_cache_manager, scheduler.config
    group = kv.sliding
    pool = group.pool
    holders = collections.Counter(b for t in group.block_tables.values() for b in t if b != NULL_BLOCK_ID)
    assert pool.ref_cnt[NULL_BLOCK_ID] == 0
    for block_id in range(1, config.num_sliding_blocks):
        assert pool.ref_cnt[block_id] == holders[block_id], f"sliding block {block_id}"
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == config.num_sliding_blocks - 1
    assert set(group.block_tables) == set(kv.block_tables) == set(scheduler.running)
    per_seq = -(-(config.sliding_window - 1) // config.block_size) + 1
    for req_id, table in group.block_tables.items():
        request = scheduler.running[req_id]
        assert len(table) == len(kv.block_tables[req_id])
        released = num_out_of_window(request.num_computed_tokens, config.sliding_window, config.block_size)
        assert all(b == NULL_BLOCK_ID for b in table[:released]), "a passed block is still held"
        assert NULL_BLOCK_ID not in table[released:], "a block the window reads is missing"
        # Between steps: the window's blocks (a table may hold blocks past its computed tokens).
        assert len(table[released:-(-request.num_computed_tokens // config.block_size)]) <= per_seq


def run_alone(request: Request, window: int) -> list[int]:
    seq, out = list(request.prompt_token_ids), []
    while len(out) < request.max_tokens:
        out.append(next_token(seq, window))
        seq.append(out[-1])
    return out


def sliding_config(**kwargs) -> SchedulerConfig:
    base = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96, block_size=4,
                num_blocks=120, sliding_window=8)
    base.update(kwargs)
    if "num_sliding_blocks" not in base:
        base["num_sliding_blocks"] = num_blocks_needed(
            window=base["sliding_window"], block_size=base["block_size"], max_num_seqs=base["max_num_seqs"],
            max_num_batched_tokens=base["max_num_batched_tokens"], max_model_len=base["max_model_len"])
    return SchedulerConfig(**base)


def drain(scheduler: Scheduler, model: FakeTwoGroupModel, bound: int = 2000) -> None:
    for _ in range(bound):
        if not scheduler.has_unfinished_requests():
            return
        output = scheduler.schedule()
        scheduler.update(output, model.step(output))
        check_sliding_invariants(scheduler)
    raise AssertionError("not finished")


def test_released_blocks_and_outputs_at_eight_windows():
    """A 72-token request (9 windows) holds its window's blocks, not its length's, and its outputs
    are the request's alone; every pool is empty after."""
    config = sliding_config()
    scheduler, model = Scheduler(config), FakeTwoGroupModel(config)
    request = Request("a", [3 + i % 11 for i in range(40)], 32)
    scheduler.add_request(request)
    held = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, model.step(output))
        check_sliding_invariants(scheduler)
        if scheduler.running:
            held.append((len(scheduler.kv_cache_manager.block_tables["a"]),
                         scheduler.kv_cache_manager.sliding.num_held_blocks("a")))
    assert request.output_token_ids == run_alone(request, config.sliding_window)
    assert held[-1][0] == 18 and held[-1][1] <= 3  # 71 tokens: 18 global blocks, 2-3 sliding
    kv = scheduler.kv_cache_manager
    assert kv.pool.num_used_blocks == kv.sliding.pool.num_used_blocks == 0


def test_prefix_hit_needs_the_window_blocks():
    """A prompt seen before hits the cache when the blocks its first query's window reads are still
    in the sliding pool; once they are evicted the hit stops where the window's blocks were kept."""
    config = sliding_config(num_blocks=60)
    scheduler, model = Scheduler(config), FakeTwoGroupModel(config)
    prompt = [5 + i % 13 for i in range(41)]
    first = Request("first", prompt, 1)
    scheduler.add_request(first)
    drain(scheduler, model)
    second = Request("second", prompt + [1], 1)
    scheduler.add_request(second)
    # 42 tokens: the hit can cover 10 blocks; the window of position 40 reads blocks 8 and 9,
    # released by "first" (cached) when its queries passed them.
    assert len(scheduler.kv_cache_manager.get_computed_blocks(second)) == 10
    drain(scheduler, model)
    assert second.num_cached_tokens == 40
    assert second.output_token_ids == run_alone(second, config.sliding_window)
    # Evict the sliding pool's copy of block 9 alone: the longest hit is now 9 blocks (position
    # 36, the first to compute, reads 29 .. 36: blocks 7 and 8 from the cache, 9 it writes).
    kv = scheduler.kv_cache_manager
    pool = kv.sliding.pool
    block_9 = pool.hash_to_block[second.block_hashes[9]]
    del pool.hash_to_block[second.block_hashes[9]]
    pool.block_hash[block_9] = None
    del pool._cached[block_9]
    pool._free.append(block_9)
    third = Request("third", prompt + [2], 1)
    scheduler.add_request(third)
    assert len(kv.get_computed_blocks(third)) == 9
    drain(scheduler, model)
    assert third.num_cached_tokens == 36
    assert third.output_token_ids == run_alone(third, config.sliding_window)


def test_gemma3_shape_holds_at_most_half_the_blocks_at_eight_windows():
    """The acceptance test of issue 29: a Gemma-3-shaped model (5 sliding layers to 1 global) at a
    context of 8x the window holds at most half the KV of the same model with every layer global,
    counted in layer-blocks (a block of one group holds its layers only)."""
    window, bs, num_local, num_global = 16, 4, 5, 1
    config = sliding_config(sliding_window=window, block_size=bs, max_model_len=160, num_blocks=60,
                            max_num_batched_tokens=32)
    scheduler, model = Scheduler(config), FakeTwoGroupModel(config)
    request = Request("long", [7 + i % 5 for i in range(8 * window)], 4)
    scheduler.add_request(request)
    while request.num_computed_tokens < 8 * window:
        output = scheduler.schedule()
        scheduler.update(output, model.step(output))
    kv = scheduler.kv_cache_manager
    global_blocks, sliding_blocks = kv.pool.num_used_blocks, kv.sliding.pool.num_used_blocks
    hybrid = num_global * global_blocks + num_local * sliding_blocks
    all_global = (num_global + num_local) * global_blocks
    assert global_blocks == 32 and sliding_blocks == 4
    assert hybrid / all_global <= 0.5  # 52 / 192 = 0.27


def test_config_refuses_what_is_not_implemented():
    with pytest.raises(ValueError, match="contiguous"):
        sliding_config(kv_allocation="contiguous")
    with pytest.raises(ValueError, match="policy='static'"):
        sliding_config(policy="static")
    with pytest.raises(ValueError, match="needs sliding_window"):
        SchedulerConfig(num_sliding_blocks=10)
    with pytest.raises(ValueError, match="cannot hold one request's window"):
        sliding_config(num_sliding_blocks=4)
    scheduler = Scheduler(sliding_config())
    with pytest.raises(ValueError, match="import_blocks is not implemented with sliding-window"):
        scheduler.kv_cache_manager.import_blocks([1, 2])


@st.composite
def two_group_configs(draw) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(12, 64))
    max_num_seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(max_num_seqs, max_num_seqs + 24))
    window = draw(st.integers(1, 20))
    min_blocks = -(-max_model_len // block_size) + 1
    config = sliding_config(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
        block_size=block_size, sliding_window=window,
        num_blocks=draw(st.integers(min_blocks, 2 * min_blocks)),
        enable_prefix_caching=draw(st.booleans()), policy=draw(st.sampled_from(["fcfs", "priority"])))
    needed = config.num_sliding_blocks
    smallest = min(-(-(window - 1 + budget) // block_size) + 1, -(-max_model_len // block_size)) + 1
    # From the smallest pool the config accepts (the sliding group runs short and preempts) to roomy.
    return sliding_config(**{**{f: getattr(config, f) for f in (
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "sliding_window",
        "num_blocks", "enable_prefix_caching", "policy")},
        "num_sliding_blocks": draw(st.integers(min(smallest, needed), max(smallest, needed)))})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=two_group_configs(),
       prompts=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2)),
                        min_size=1, max_size=8))
def test_random_requests_equal_alone(config, prompts):
    """Random two-group configs (tight pools preempt) and requests sharing prefixes: every read
    is right and every output is the request's alone."""
    scheduler, model = Scheduler(config), FakeTwoGroupModel(config)
    added = []
    for i, (length, max_tokens, family) in enumerate(prompts):
        length = min(length, config.max_model_len - max_tokens - 1)
        if length < 1:
            continue
        request = Request(f"r{i}", [100 * family + j % 9 for j in range(length)], max_tokens,
                          priority=i % 2, arrival_time=float(i))
        scheduler.add_request(request)
        added.append(request)
        output = scheduler.schedule()  # arrivals between steps
        scheduler.update(output, model.step(output))
        check_sliding_invariants(scheduler)
    drain(scheduler, model)
    for request in added:
        assert request.output_token_ids == run_alone(request, config.sliding_window)
    kv = scheduler.kv_cache_manager
    assert kv.pool.num_used_blocks == kv.sliding.pool.num_used_blocks == 0
