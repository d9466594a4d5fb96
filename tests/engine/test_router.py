"""The data-parallel router alone (engine/scaleout/router.py): prefix affinity, then least load."""

from engine.scaleout.router import PrefixAffinityRouter


def _router(**kwargs):
    return PrefixAffinityRouter(2, block_size=4, capacity_blocks=64, **kwargs)


def test_new_prefixes_go_to_the_least_loaded_replica():
    router = _router()
    assert router.route([1] * 8, cost=100) == 0
    assert router.route([2] * 8, cost=10) == 1
    assert router.route([3] * 8, cost=10) == 1  # 100 vs 10 outstanding
    router.finish(0, 100)
    assert router.route([4] * 8, cost=10) == 0


def test_a_shared_prefix_follows_its_replica_until_it_is_overloaded():
    router = _router(balance_rel=1.0, balance_abs=50)
    system = [9, 9, 9, 9, 8, 8, 8, 8]
    assert router.route(system + [1, 2, 3, 4], cost=20) == 0
    assert router.route([5] * 8, cost=20) == 1
    assert router.route(system + [7, 7, 7, 7], cost=20) == 0  # affinity, loads 20 vs 20
    assert router.route(system + [6, 6, 6, 6], cost=20) == 0  # 40 <= 20 + 50
    assert router.route(system + [4, 4, 4, 4], cost=20) == 0  # 60 <= 70
    assert router.route(system + [3, 3, 3, 3], cost=20) == 1  # 80 > 70: balance wins
    stats = router.stats()
    assert stats.num_routed == [4, 2] and stats.num_affinity_hits == 3
    assert stats.outstanding_tokens == [80, 40]


def test_one_common_block_is_no_affinity():
    router = _router()
    header = [1, 1, 1, 1]
    assert router.route(header + [2] * 16, cost=10) == 0
    assert router.route(header + [3] * 16, cost=10) == 1  # 1 of 5 blocks < 25 %: by load
    assert router.route(header + [2] * 16, cost=10) == 0  # 5 of 5


def test_the_cache_picture_is_bounded_lru():
    router = PrefixAffinityRouter(2, block_size=4, capacity_blocks=2)
    router.route([1] * 12, cost=1)  # 3 blocks, only the last 2 kept
    assert router._match(0, router.block_hashes([1] * 12)) == 0  # the first block was evicted
