"""What the disaggregation tests share (tests/engine/test_disaggregation.py and
test_disaggregation_process.py): the knobs and prompts of their engine on random:tiny-gqa3 (3 KV
heads, padded to 4 for TP = 2; the engine itself is the session-scoped `pd` fixture of
tests/engine/conftest.py), the comparison of two outputs, and the churn of random aborts."""

import collections

from engine.sampling_params import SamplingParams

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
             num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(8,), compilation_cache_dir=None)
SYSTEM = "You are a helpful assistant for the disaggregation test. "  # 56 bytes: 3 full blocks
PROMPTS = [SYSTEM + f"Question {i}: " + "why? " * i for i in range(10)]


def same_outputs(a, b, logprobs=False):
    """Two RequestOutputs have the same tokens, text and finish reasons (and logprobs within 1e-4)."""
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], (a.outputs, b.outputs)
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
    if logprobs:
        for x, y in zip(a.outputs, b.outputs):
            assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                assert all(abs(ex[t] - ey[t]) < 1e-4 for t in ex)


def churn(engine, num_requests: int, seed: int) -> None:
    """One request added per step (random sampling, n, lengths); after every step each live
    request is aborted with probability 0.08, in whatever phase it is. All of them end, and the
    aborts hit every phase."""
    import random

    rng = random.Random(seed)
    live, stages, done = set(), collections.Counter(), 0
    for i in range(num_requests):
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randint(1, 12),
                                n=rng.choice([1, 1, 2]), ignore_eos=True)
        engine.add_request(f"z{i}", PROMPTS[i % 10][: rng.randint(5, 110)], params)
        live.add(f"z{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
        for rid in [r for r in sorted(live) if rng.random() < 0.08]:
            stages[engine.pool_of(rid)] += 1
            assert engine.abort_request(rid)
            live.discard(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
    assert not live and done + sum(stages.values()) == num_requests
    assert stages["prefill"] and stages["transfer"] and stages["decode"], stages
