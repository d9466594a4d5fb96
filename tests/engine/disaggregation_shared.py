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
PHASES = ("prefill", "transfer", "decode")  # a request's phases in order (PDEngine.pool_of)


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


def churn(engine, num_requests: int, seed: int, every_phase: bool = True) -> None:
    """One request added per step (random sampling, n, lengths); after every step each live
    request is aborted with probability 0.08, in whatever phase it is. All of them end, and (with
    `every_phase`: an engine whose pools all step in this process, so the phases each request
    passes through do not depend on timing) the aborts hit every phase."""
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
    if every_phase:
        assert stages["prefill"] and stages["transfer"] and stages["decode"], stages


def abort_in_every_phase(engine, timeout_s: float = 120.0) -> None:
    """For an engine whose decode pool steps in another process (so which phase a request is in
    after a step depends on timing): a request is driven to each phase in turn and aborted there;
    one that skips past the phase between two calls is aborted and another tried. All end."""
    import time

    deadline = time.monotonic() + timeout_s
    for phase in PHASES:
        for attempt in range(50):
            rid = f"{phase}{attempt}"
            engine.add_request(rid, PROMPTS[attempt % 10], SamplingParams(temperature=0.0, max_tokens=100,
                                                                          ignore_eos=True))
            while engine.pool_of(rid) not in (phase, None) and time.monotonic() < deadline:
                if PHASES.index(engine.pool_of(rid)) > PHASES.index(phase):
                    break  # it went past the phase between two calls
                engine.step()
            reached = engine.pool_of(rid) == phase
            assert engine.pool_of(rid) is not None and engine.abort_request(rid), (rid, phase)
            if reached:
                break
            assert time.monotonic() < deadline, f"no request seen in phase {phase!r} in {timeout_s} s"
        else:
            raise AssertionError(f"50 requests went past phase {phase!r} between two calls")
    while engine.has_unfinished_requests():
        engine.step()

