"""BlockPool and KVCacheManager on their own; SchedulerConfig and Request validation."""

from __future__ import annotations

import pytest

from scheduler import BlockPool, KVCacheManager, Request, SchedulerConfig
from scheduler.block_pool import ROOT_BLOCK_HASH, hash_block_tokens


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert sorted(pool.allocate(4)) == [1, 2, 3, 4]
    assert pool.num_available_blocks == 0
    with pytest.raises(ValueError, match="only 0 available"):
        pool.allocate(1)


def test_ref_counts_and_cached_lru():
    pool = BlockPool(6)
    a, b, c = pool.allocate(3)
    assert pool.register(a, 11) and pool.register(b, 22)
    assert not pool.register(c, 11)  # one block per hash
    pool.touch([a])
    assert pool.ref_cnt[a] == 2
    pool.free([a, b, c])
    assert pool.ref_cnt[a] == 1 and pool.num_cached_blocks == 1 and pool.num_free_blocks == 3
    pool.free([a])
    assert pool.cached_block_ids_lru() == [b, a]
    pool.touch([b])  # a prefix hit takes a cached block out of the LRU
    assert pool.cached_block_ids_lru() == [a] and pool.num_used_blocks == 1
    # Free blocks go first, then the LRU head is evicted and its hash dropped.
    pool.allocate(3)
    assert pool.num_evictions == 0
    (evicted,) = pool.allocate(1)
    assert evicted == a and pool.lookup(11) is None and pool.num_evictions == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([evicted, evicted])


def test_block_hash_chains_the_parent():
    first = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    assert hash_block_tokens(first, [3, 4]) != hash_block_tokens(ROOT_BLOCK_HASH, [3, 4])
    assert hash_block_tokens(first, [3, 4]) == hash_block_tokens(first, (3, 4))


def test_manager_hashes_each_full_block_once_and_counts_waste():
    config = SchedulerConfig(block_size=4, num_blocks=16, max_model_len=32, max_num_seqs=4)
    kv = KVCacheManager(config)
    request = Request("r", list(range(10)), max_tokens=5)
    kv.update_block_hashes(request)
    assert len(request.block_hashes) == 2
    assert kv.allocate_slots(request, 10) is not None
    assert kv.num_allocated_slots("r") == 12
    request.num_computed_tokens = 10
    request.output_token_ids += [50, 51]
    kv.cache_full_blocks(request)
    assert len(kv.pool.hash_to_block) == 2
    request.output_token_ids.append(52)  # 13 tokens: the third block is full but not computed
    kv.cache_full_blocks(request)
    assert len(kv.pool.hash_to_block) == 2
    kv.free(request)
    assert kv.pool.num_cached_blocks == 2 and kv.pool.num_free_blocks == 13
    twin = Request("t", list(range(10)) + [50, 51, 99], max_tokens=5)
    kv.update_block_hashes(twin)
    assert len(kv.get_computed_blocks(twin)) == 2


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size": 0}, "SchedulerConfig.block_size must be a positive integer, got 0"),
        ({"max_num_seqs": True}, "SchedulerConfig.max_num_seqs"),
        ({"policy": "lifo"}, "SchedulerConfig.policy"),
        ({"kv_allocation": "slab"}, "SchedulerConfig.kv_allocation"),
        ({"enable_prefix_caching": 1}, "SchedulerConfig.enable_prefix_caching"),
        ({"num_blocks": 10, "max_model_len": 2048}, "raise num_blocks to at least 129"),
        ({"max_num_seqs": 512, "max_num_batched_tokens": 256}, "max_num_batched_tokens"),
        (
            {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
            "enable_chunked_prefill is False",
        ),
    ],
)
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SchedulerConfig(**fields)


def test_config_defaults_are_valid():
    config = SchedulerConfig()
    assert config.max_blocks_per_seq == 128 and config.policy == "fcfs"


def test_request_token_views():
    request = Request("r", [1, 2, 3], max_tokens=4, stop_token_ids=(9,), arrival_time=5.0)
    request.output_token_ids += [4, 5]
    assert request.all_token_ids == [1, 2, 3, 4, 5] and request.num_tokens == 5
    assert request.token_slice(1, 4) == [2, 3, 4] and request.token_slice(3, 5) == [4, 5]
    assert request.token_slice(0, 2) == [1, 2]
    assert request.stop_token_ids == (9,) and not request.is_finished
    with pytest.raises(ValueError, match="Request.priority"):
        Request("p", [1], 1, priority=1.5)
