"""Data parallelism: DP = 2 replicas of TP = 2 each (4 devices) on random:tiny-gqa3, driven by one
DPEngine. A 64-request run with 4 shared system prompts: both replicas get >= 25 % of the
requests, every request of a system prompt lands on the replica that holds it (prefix-cache hits
there), nothing is lost, and nothing recompiles; greedy tokens and first logprobs equal a TP = 1
engine's; /metrics has one series per replica."""

import pytest

from engine.config import EngineConfig
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion

# Data parallel over 4 virtual devices: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
             num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(8,), compilation_cache_dir=None,
             prompt_scoring_bucket=False)
# One 16-byte block in common ("You are helper #"), then four distinct system prompts.
SYSTEMS = [f"You are helper #{i} of four, system prompt {i}: be brief, exact and polite. " for i in range(4)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def loaded():
    from models.loader import load_model

    return load_model("random:tiny-gqa3", host=True)


@pytest.fixture(scope="module")
def dp_engine(loaded):
    from engine.scaleout.dp_engine import DPEngine

    return DPEngine(EngineConfig(**KNOBS, tensor_parallel_size=2, data_parallel_size=2), progress=False,
                    loaded=loaded)


def test_replicas_sit_on_disjoint_device_groups(dp_engine):
    groups = [set(r.placement.devices) for r in dp_engine.replicas]
    assert len(groups) == 2 and all(len(g) == 2 for g in groups) and groups[0].isdisjoint(groups[1])
    for replica, group in zip(dp_engine.replicas, groups):
        assert set(replica.runner.kv_cache[0].devices()) == group
        assert set(replica.runner.params["embed"].devices()) == group
        assert replica.runner.cold_buckets() == []  # each replica warmed its buckets at start-up
    assert not dp_engine.warm_up_pending() and not dp_engine.warm_up_next()
    with pytest.raises(ValueError, match="data_parallel_size"):
        from engine.core.llm_engine import LLMEngine

        LLMEngine(EngineConfig(**KNOBS, data_parallel_size=2))


def test_64_requests_balanced_with_prefix_affinity(dp_engine):
    before = dp_engine.get_stats()
    requests = [(f"q{i}", SYSTEMS[i % 4] + f"Question {i}: what is {i} plus {i}?", PARAMS) for i in range(64)]
    for rid, prompt, params in requests:
        dp_engine.add_request(rid, prompt, params)
    where = {rid: dp_engine.replica_of(rid) for rid, _, _ in requests}
    done = {}
    while dp_engine.has_unfinished_requests():
        for out in dp_engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(where)  # nothing lost
    assert all(len(o.outputs[0].token_ids) == 6 and o.outputs[0].error is None for o in done.values())
    counts = [list(where.values()).count(r) for r in (0, 1)]
    assert min(counts) >= 16, counts
    for s in range(4):  # a system prompt's requests all land where the first one went
        assert len({where[f"q{i}"] for i in range(s, 64, 4)}) == 1
    stats = dp_engine.get_stats()
    assert stats.router.num_affinity_hits >= 60 and stats.router.outstanding_tokens == [0, 0]
    for replica, old in zip(stats.replicas, before.replicas):
        assert replica.prefix_cache_hits > old.prefix_cache_hits
    assert stats.num_compilations == before.num_compilations
    assert stats.prefix_cache_hits == sum(r.prefix_cache_hits for r in stats.replicas)
    text = ServerMetrics().render(stats)
    assert 'jaxserve:prefix_cache_hits_total{replica="1"}' in text
    assert 'jaxserve:weight_bytes{device="1",replica="1"}' in text


def test_dp2_tp2_greedy_equals_tp1(dp_engine, loaded):
    from engine.core.llm_engine import LLMEngine

    single = LLMEngine(EngineConfig(**KNOBS), progress=False, loaded=loaded)
    prompts = [SYSTEMS[i % 2] + f"Item {i}." for i in range(8)]
    ref = run_to_completion(single, [(f"g{i}", p, PARAMS) for i, p in enumerate(prompts)])
    got = run_to_completion(dp_engine, [(f"g{i}", p, PARAMS) for i, p in enumerate(prompts)])
    for rid, out in ref.items():
        a, b = out.outputs[0], got[rid].outputs[0]
        assert a.token_ids == b.token_ids
        assert abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0][b.token_ids[0]]) < 1e-4
