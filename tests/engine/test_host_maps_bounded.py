"""Memory steadiness on the host (issue 32): after many distinct prompts, shared prefixes, n > 1,
preemptions and aborts in every state, the prefix cache's maps (BlockPool.hash_to_block and its
cached LRU) never hold more entries than there are blocks, every per-request map of the
scheduler, KV cache manager, fairness seats, engine and runner holds only live requests while
it runs and is empty once it is idle, and the hash map agrees with the blocks. The real
LLMEngine and Scheduler over the engine tests' fake runner (no model)."""

import random

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from scheduler import Scheduler, SchedulerConfig
from tests.engine.fake_runner import FakeRunner
from text.byte_tokenizer import ByteTokenizer

VOCAB = 256
NUM_BLOCKS = 41  # 40 usable blocks of 4 tokens: far fewer than the prompts' blocks, so most are evicted
KNOBS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4)


def _check_bounded(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.pool
    usable = NUM_BLOCKS - 1
    assert len(pool.hash_to_block) <= usable and pool.num_cached_blocks <= usable
    assert all(pool.block_hash[b] == h for h, b in pool.hash_to_block.items())
    assert len(pool.hash_to_block) == sum(h is not None for h in pool.block_hash)
    live = set(scheduler.requests)
    assert set(manager.block_tables) <= set(scheduler.running) <= live
    assert set(manager._num_registered) <= set(scheduler.running)
    assert len(scheduler.running) <= KNOBS["max_num_seqs"]
    assert sum(scheduler.group_seats._seats.values()) == len(scheduler.running)
    assert set(engine._seqs) <= live
    # The runner hears of a step's leavers with the next step: one step's worth more at most.
    assert len(engine.runner.fed) <= 2 * KNOBS["max_num_seqs"]


def test_host_maps_stay_bounded_by_the_blocks_after_many_prompts_and_aborts():
    runner = FakeRunner(VOCAB)
    engine = LLMEngine.from_parts(EngineConfig(model="fake", num_kv_blocks=NUM_BLOCKS, **KNOBS),
                                  scheduler=Scheduler(SchedulerConfig(num_blocks=NUM_BLOCKS, **KNOBS)),
                                  runner=runner, tokenizer=ByteTokenizer(VOCAB))
    rng = random.Random(0)
    shared = [rng.randrange(2, VOCAB) for _ in range(40)]
    live, num_aborted, num_finished = set(), 0, 0
    for i in range(600):
        fresh = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 60))]  # distinct prompts
        prompt = shared[: rng.choice([0, 0, 8, 24])] + fresh  # some share a prefix
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randint(1, 24),
                                n=rng.choice([1, 1, 2]), ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params, group_id=f"g{i % 5}")
        live.add(f"r{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                num_finished += 1
        for rid in [r for r in sorted(live) if rng.random() < 0.05]:  # waiting, running or preempted
            assert engine.abort_request(rid)
            live.discard(rid)
            num_aborted += 1
        _check_bounded(engine)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                num_finished += 1
        _check_bounded(engine)
    assert not live and num_finished + num_aborted == 600 and num_aborted > 50
    scheduler = engine.scheduler
    manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.pool
    # The bound was pressed: blocks were evicted and requests preempted many times over.
    assert pool.num_evictions > 10 * NUM_BLOCKS and scheduler.num_preemptions > 0
    # Idle: no per-request entry anywhere, and only cached blocks keep a hash.
    assert not (scheduler.requests or scheduler.running or len(scheduler.waiting) or manager.block_tables
                or manager._num_registered or scheduler.group_seats._seats or engine._requests or engine._seqs)
    assert len(runner.fed) <= KNOBS["max_num_seqs"]  # the last step's leavers, told with the next step
    assert pool.num_used_blocks == 0 and len(pool.hash_to_block) == pool.num_cached_blocks <= NUM_BLOCKS - 1
