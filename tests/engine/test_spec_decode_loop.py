"""Speculative decoding through the engine loop on a fake runner (no model, no compile): with
n-gram drafts, 300 requests with random aborts, stop strings, stop ids and preemptions get
exactly the hand-computed tokens, and no KV block is leaked or double-owned at the end.

The fake model copies the token five back, except every eleventh position: so n-gram drafts are
mostly right and sometimes wrong (rejected and rolled back).
"""

import numpy as np

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from scheduler import Scheduler, SchedulerConfig
from tests.engine.conftest import run_to_completion
from tests.engine.fake_runner import FakeRunner, expected_output
from tests.scheduler.conftest import _check_invariants
from text.byte_tokenizer import ByteTokenizer

VOCAB = 256
SPEC = dict(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None,
            disable_by_token_share=1.0, min_acceptance_rate=0.0)


def cyclic(tokens: list[int], vocab: int) -> int:
    if len(tokens) % 11 == 0 or len(tokens) < 5:
        return (tokens[-1] * 7 + len(tokens)) % (vocab - 34) + 34  # never a printable stop char below
    return tokens[-5]


def make_engine(num_blocks: int, spec=SPEC, **knobs):
    fields = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, block_size=4,
                  num_blocks=num_blocks, **knobs)
    config = EngineConfig(model="fake", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                          block_size=4, num_kv_blocks=num_blocks, speculative_config=spec)
    runner = FakeRunner(VOCAB, next_token=cyclic)
    engine = LLMEngine.from_parts(config, scheduler=Scheduler(SchedulerConfig(**fields)), runner=runner,
                                  tokenizer=ByteTokenizer(VOCAB))
    return engine, runner


def test_300_requests_with_aborts_stops_and_preemptions_are_exact_and_leak_nothing():
    engine, runner = make_engine(num_blocks=40)  # 39 blocks of 4 tokens for up to 8 requests
    rng = np.random.default_rng(0)
    requests = {}
    for i in range(300):
        prompt = rng.integers(40, 120, int(rng.integers(3, 30))).tolist()
        max_tokens = int(rng.integers(1, 40))
        want = expected_output(prompt, max_tokens, VOCAB, next_token=cyclic)
        kind = rng.choice(["plain", "stop_id", "stop_str"])
        stop_ids, stops = [], []
        if kind == "stop_id" and len(want) > 3:
            stop_ids = [want[int(rng.integers(0, len(want)))]]
        if kind == "stop_str" and len(want) > 3:
            stops = [ByteTokenizer(VOCAB).decode([want[int(rng.integers(0, len(want)))]])]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                stop_token_ids=stop_ids, stop=stops)
        requests[f"r{i}"] = (prompt, params, want)
    pending = list(requests)
    done, aborted = {}, set()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine._requests) < 12:
            rid = pending.pop(0)
            engine.add_request(rid, requests[rid][0], requests[rid][1])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if rng.random() < 0.05 and engine._requests:
            rid = sorted(engine._requests)[int(rng.integers(0, len(engine._requests)))]
            assert engine.abort_request(rid)
            aborted.add(rid)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and len(aborted) > 5
    spec = stats.spec_decode
    assert spec.num_accepted_tokens > 300 and spec.num_accepted_tokens < spec.num_draft_tokens
    # The reference: the same requests without speculation (and without aborts).
    ref_engine, _ = make_engine(num_blocks=400, spec=None)
    ref = run_to_completion(ref_engine, [(rid, p, params) for rid, (p, params, _) in requests.items()])
    num_stopped = 0
    for rid, (_, params, want) in requests.items():
        a = ref[rid].outputs[0]
        assert a.token_ids == want[: len(a.token_ids)]
        if rid in aborted:
            continue
        b = done[rid].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids, a.text, a.finish_reason, a.stop_reason), rid
        num_stopped += isinstance(b.stop_reason, str) and len(b.token_ids) < params.max_tokens
    assert num_stopped > 10  # stop strings did cut outputs short
    engine.step()  # the last finishes reach the runner
    assert not runner.fed
    _check_invariants(engine.scheduler)
    assert engine.scheduler.stats.num_used_blocks == 0


def test_low_acceptance_stops_drafting_for_a_request_and_probes_it_again():
    # A model n-gram drafts predict only sometimes: requests' EMAs fall below a high threshold, so
    # they stop drafting and are re-probed every probe_interval steps; outputs stay exact.
    def run(min_acceptance_rate):
        engine, runner = make_engine(num_blocks=200, spec=dict(
            SPEC, min_acceptance_rate=min_acceptance_rate, probe_interval=8))
        runner.next_token = lambda tokens, vocab: (len(tokens) * 2654435761 % 4093) % 8 + 40
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
        outs = run_to_completion(engine, [(f"a{i}", prompt, params) for i in range(4)])
        want = expected_output(prompt, 60, VOCAB, next_token=runner.next_token)
        assert all(o.outputs[0].token_ids == want for o in outs.values())
        return engine.get_stats().spec_decode

    always, adaptive = run(0.0), run(0.75)
    assert always.num_request_disables == 0 and adaptive.num_request_disables >= 4
    assert adaptive.num_drafts < always.num_drafts


def test_a_failing_proposer_costs_its_drafts_not_the_requests():
    engine, _ = make_engine(num_blocks=200)

    def broken(requests):
        raise RuntimeError("proposer bug")

    engine.spec.proposer.propose = broken
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = run_to_completion(engine, [("a", [5, 6, 7, 5, 6, 7], params)])
    assert outs["a"].outputs[0].token_ids == expected_output([5, 6, 7, 5, 6, 7], 10, VOCAB, next_token=cyclic)
    assert engine.spec.num_proposer_errors > 0 and engine.get_stats().spec_decode.num_drafts == 0
