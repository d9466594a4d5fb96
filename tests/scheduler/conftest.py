"""Helpers shared by the scheduler tests, as fixtures (test modules here do not import each other).

`fake_step` runs one schedule()/update() round with a fake model; `check_invariants` asserts the
block-accounting invariants of scheduler/block_pool.py and scheduler/kv_cache_manager.py.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest

from scheduler import ScheduledRequest, Scheduler, SchedulerOutput, StepResult
from scheduler.block_pool import NULL_BLOCK_ID as NULL_BLOCK


def position_token(sr: ScheduledRequest) -> int:
    """A fake model whose next token is a function of the sequence length: 1000 + length.

    The same request therefore produces the same outputs alone, chunked, or after preemption.
    """
    return 1000 + sr.num_computed_tokens + sr.num_scheduled_tokens


def _fake_step(
    scheduler: Scheduler, token_of: Callable[[ScheduledRequest], int] = position_token
) -> tuple[SchedulerOutput, list]:
    output = scheduler.schedule()
    samples = [sr for sr in output.scheduled if sr.sample]
    result = StepResult([sr.req_id for sr in samples], [[token_of(sr)] for sr in samples])
    return output, scheduler.update(output, result)


def _check_invariants(scheduler: Scheduler) -> None:
    config = scheduler.config
    kv = scheduler.kv_cache_manager
    pool = kv.pool
    holders = collections.Counter(b for table in kv.block_tables.values() for b in table)
    assert NULL_BLOCK not in holders and pool.ref_cnt[NULL_BLOCK] == 0
    for block_id in range(1, config.num_blocks):
        assert pool.ref_cnt[block_id] == holders[block_id], f"block {block_id}"
    for table in kv.block_tables.values():
        assert len(set(table)) == len(table), "a table holds a block twice"
    num_used = sum(1 for b in range(1, config.num_blocks) if pool.ref_cnt[b] > 0)
    assert pool.num_used_blocks == num_used
    assert pool.num_free_blocks + pool.num_cached_blocks + num_used == config.num_blocks - 1
    for block_id in pool.free_block_ids():
        assert pool.ref_cnt[block_id] == 0 and pool.block_hash[block_id] is None
    for block_id in pool.cached_block_ids_lru():
        assert pool.ref_cnt[block_id] == 0 and pool.block_hash[block_id] is not None
    for block_hash, block_id in pool.hash_to_block.items():
        assert pool.block_hash[block_id] == block_hash
    assert sum(h is not None for h in pool.block_hash) == len(pool.hash_to_block)
    # Only running requests hold blocks; each table covers its computed tokens.
    assert set(kv.block_tables) == set(scheduler.running)
    assert len(scheduler.running) <= config.max_num_seqs
    for request in scheduler.running.values():
        assert (
            len(kv.block_tables[request.req_id]) * config.block_size >= request.num_computed_tokens
        )
        assert request.num_computed_tokens < request.num_tokens
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0


@pytest.fixture(scope="session")
def fake_step():
    return _fake_step


@pytest.fixture(scope="session")
def check_invariants():
    return _check_invariants
