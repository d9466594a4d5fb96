"""Speculative decoding (ngram) on a compiled random:tiny engine: with drafts or without, every
request gets the same tokens, logprobs and finish, in every mode.

random:tiny's greedy output echoes its input, so n-gram drafts over repetitive prompts are often
right; a high temperature (its logits are very peaked; 8 here) gives variety and rejections. The baseline
of each comparison is the same compiled engine with no proposer (`spec_off`).
"""

import numpy as np
import pytest

from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from engine.spec_decode.base import make_spec_decoder
from engine.speculative_config import SpeculativeConfig
from tests.engine.conftest import run_to_completion, scheduler_as, spec_off


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(2, vocab, int(rng.integers(3, 8))).tolist()
        tail = rng.integers(2, vocab, int(rng.integers(0, 10))).tolist()
        out.append(motif * int(rng.integers(2, 5)) + tail + (motif[:2] if i % 2 else []))
    return out


def _tokens(outs, ids):
    return [outs[i].outputs[0].token_ids for i in ids]


@pytest.fixture(scope="module")
def prompts(tiny_spec_engine):
    return _prompts(tiny_spec_engine.model_config.vocab_size)


def _alone_and_batched(engine, prompts, params, tag):
    alone = [_tokens(run_to_completion(engine, [(f"{tag}a{i}", p, params)]), [f"{tag}a{i}"])[0]
             for i, p in enumerate(prompts)]
    batch = [(f"{tag}b{i}", p, params) for i, p in enumerate(prompts + prompts)]  # 16 together
    together = _tokens(run_to_completion(engine, batch), [r[0] for r in batch])
    return alone, together


def same_tokens_on_and_off(engine, prompts, params):
    """Asserts the tokens without drafts and with them are the same, alone and in a batch of 16;
    returns (drafts verified, drafts accepted, the spec stats after) of the speculative runs."""
    with spec_off(engine):
        off_alone, off_batch = _alone_and_batched(engine, prompts, params, "off")
    before = engine.get_stats().spec_decode
    on_alone, on_batch = _alone_and_batched(engine, prompts, params, "on")
    after = engine.get_stats().spec_decode
    assert off_alone == off_batch[:8] == off_batch[8:]
    assert on_alone == off_alone and on_batch == off_batch
    return (after.num_draft_tokens - before.num_draft_tokens,
            after.num_accepted_tokens - before.num_accepted_tokens, after)


def same_tokens_through_preemption_and_prefix_caching(engine, seed: int) -> None:
    """8 seeded requests sharing a 3x-repeated prefix, off and then on in a 24-block pool (so
    preemptions and prefix-cache hits happen while drafting): the same tokens, every block back,
    nothing compiled."""
    prompts = _prompts(engine.model_config.vocab_size, seed=seed)
    params = SamplingParams(temperature=8.0, seed=2, max_tokens=40, ignore_eos=True)
    requests = [(f"pc{i}", prompts[0] * 3 + p, params) for i, p in enumerate(prompts)]
    with spec_off(engine):
        off = run_to_completion(engine, [(f"off{r}", p, s) for r, p, s in requests])
    # Warm-up of the jitted table helpers that penalties and logprobs use on first sight.
    run_to_completion(engine, [("warm", prompts[0], SamplingParams(temperature=8.0, top_k=20, max_tokens=8,
                                                                   frequency_penalty=0.5, logprobs=2))])
    before = engine.get_stats().num_compilations
    with scheduler_as(engine, num_kv_blocks=25) as sched:
        on = run_to_completion(engine, [(f"on{r}", p, s) for r, p, s in requests])
        assert sched.stats.num_preemptions > 0 and sched.stats.prefix_cache_hits > 0
        assert sched.stats.num_used_blocks == 0
    for rid, _, _ in requests:
        assert off[f"off{rid}"].outputs[0].token_ids == on[f"on{rid}"].outputs[0].token_ids, rid
    assert engine.get_stats().num_compilations == before


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=8.0, top_p=0.95, top_k=50, seed=11, max_tokens=20, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_same_tokens_with_and_without_drafts_alone_and_in_a_batch_of_16(tiny_spec_engine, prompts, params):
    drafted, accepted, _ = same_tokens_on_and_off(tiny_spec_engine, prompts, params)
    assert drafted > 0 and 0 < accepted
    if params.temperature > 0:
        assert accepted < drafted  # some drafts were rejected and rolled back


def test_logprobs_and_penalties_match_the_non_speculative_ones(tiny_spec_engine, prompts):
    engine = tiny_spec_engine
    cases = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3),
             SamplingParams(temperature=8.0, seed=5, max_tokens=16, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
             SamplingParams(temperature=2.0, seed=9, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=2.0)]
    requests = [(f"lp{j}-{i}", p, params) for j, params in enumerate(cases) for i, p in enumerate(prompts)]
    with spec_off(engine):
        off = run_to_completion(engine, [(f"off{r}", p, s) for r, p, s in requests])
    before = engine.get_stats().spec_decode.num_accepted_tokens
    on = run_to_completion(engine, [(f"on{r}", p, s) for r, p, s in requests])
    assert engine.get_stats().spec_decode.num_accepted_tokens > before
    for rid, _, params in requests:
        a, b = off[f"off{rid}"].outputs[0], on[f"on{rid}"].outputs[0]
        assert a.token_ids == b.token_ids, rid
        if params.logprobs:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                np.testing.assert_allclose(list(x.values()), list(y.values()), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(a.cumulative_logprob, b.cumulative_logprob, rtol=1e-4, atol=1e-3)


def test_stops_max_tokens_n_and_finish_reasons_inside_drafts(tiny_spec_engine, prompts):
    engine = tiny_spec_engine
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with spec_off(engine):
        ref = run_to_completion(engine, [(f"ref{i}", p, base) for i, p in enumerate(prompts)])
    requests = []
    for i, p in enumerate(prompts):
        toks = ref[f"ref{i}"].outputs[0].token_ids
        text = ref[f"ref{i}"].outputs[0].text
        requests.append((f"stopid{i}", p, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[toks[5]])))
        requests.append((f"maxtok{i}", p, SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True)))
        requests.append((f"n{i}", p, SamplingParams(temperature=8.0, n=2, seed=i, max_tokens=9, ignore_eos=True)))
        if len(text) > 8:
            requests.append((f"stopstr{i}", p, SamplingParams(temperature=0.0, max_tokens=24,
                                                              stop=[text[6:8]], ignore_eos=True)))
    with spec_off(engine):
        off = run_to_completion(engine, [(f"off{r}", p, s) for r, p, s in requests])
    on = run_to_completion(engine, [(f"on{r}", p, s) for r, p, s in requests])
    assert sum(r.startswith("stopstr") for r, _, _ in requests) >= 4
    for rid, _, _ in requests:
        a, b = off[f"off{rid}"], on[f"on{rid}"]
        assert [(o.token_ids, o.text, o.finish_reason) for o in a.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in b.outputs], rid
    assert all(len(on[f"onmaxtok{i}"].outputs[0].token_ids) == 1 + i for i in range(len(prompts)))


def test_prefix_caching_and_preemption_under_speculation(tiny_spec_engine, prompts):
    engine = tiny_spec_engine
    params = SamplingParams(temperature=8.0, seed=3, max_tokens=40, ignore_eos=True)
    shared = prompts[0] * 3
    requests = [(f"pc{i}", shared + p, params) for i, p in enumerate(prompts)]
    with spec_off(engine):
        off = run_to_completion(engine, [(f"off{r}", p, s) for r, p, s in requests])
    # A pool of 24 blocks for 8 requests of ~100 tokens: preemptions, and cached prefixes reused.
    with scheduler_as(engine, num_kv_blocks=25) as sched:
        before = sched.stats
        on = run_to_completion(engine, [(f"on{r}", p, s) for r, p, s in requests])
        stats = sched.stats
        assert stats.num_preemptions > before.num_preemptions
        assert stats.prefix_cache_hits > 0
        assert stats.num_used_blocks == 0 and stats.num_running == 0
    for rid, _, _ in requests:
        assert off[f"off{rid}"].outputs[0].token_ids == on[f"on{rid}"].outputs[0].token_ids, rid


def test_the_load_switch_turns_speculation_off_and_back_on(tiny_spec_engine, prompts):
    engine = tiny_spec_engine
    config = SpeculativeConfig(num_speculative_tokens=3, disable_by_batch_size=4, min_acceptance_rate=0.0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [(f"ls{i}", p, params) for i, p in enumerate(prompts)]
    with spec_off(engine):
        off = run_to_completion(engine, [(f"off{r}", p, s) for r, p, s in requests])
    spec = engine.spec
    engine.spec = make_spec_decoder(config, engine.runner, max_num_batched_tokens=engine.config.max_num_batched_tokens)
    try:
        on = run_to_completion(engine, [(f"on{r}", p, s) for r, p, s in requests])
        # 8 decode rows turn it off; as they finish it comes back on (3 rows <= 0.75 * 4).
        on_alone = run_to_completion(engine, [("alone", prompts[1], params)])
        stats = engine.get_stats().spec_decode
    finally:
        engine.spec = spec
    assert stats.num_switch_offs >= 1 and stats.num_steps_off > 0 and stats.num_drafts > 0
    assert on_alone["alone"].outputs[0].token_ids == off["offls1"].outputs[0].token_ids
    for rid, _, _ in requests:
        assert off[f"off{rid}"].outputs[0].token_ids == on[f"on{rid}"].outputs[0].token_ids


def test_stats_and_metrics_report_speculation(tiny_spec_engine, prompts):
    engine = tiny_spec_engine
    run_to_completion(engine, [("m", prompts[2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))])
    spec = engine.get_stats().spec_decode
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert spec.num_emitted_tokens == spec.num_accepted_tokens + spec.num_drafts
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[1] >= spec.accepted_per_position[2]
    assert sum(spec.drafted_per_position) == spec.num_draft_tokens
    assert 1.0 < spec.mean_accepted_length <= 4.0 and 0 < spec.acceptance_rate <= 1
    text = ServerMetrics().render(engine.get_stats())
    assert f"jaxserve:spec_decode_num_accepted_tokens_total {spec.num_accepted_tokens}" in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert "jaxserve:spec_decode_mean_accepted_length " in text


def test_300_requests_with_aborts_stops_and_preemptions_compile_nothing_and_leak_nothing(tiny_spec_engine):
    from tests.scheduler.conftest import _check_invariants

    engine = tiny_spec_engine
    rng = np.random.default_rng(1)
    vocab = engine.model_config.vocab_size
    prompts = _prompts(vocab, n=300, seed=2)
    with scheduler_as(engine, num_kv_blocks=41) as sched:  # 40 blocks of 16 for 16 rows: preemptions
        run_to_completion(engine, [("warm", prompts[0], SamplingParams(temperature=8.0, top_k=20, max_tokens=8,
                                                                       presence_penalty=0.5, logprobs=2))])
        before = engine.get_stats().num_compilations
        pending = list(range(300))
        aborted = finished = 0
        while pending or engine.has_unfinished_requests():
            while pending and len(engine._requests) < 24:
                i = pending.pop()
                params = SamplingParams(temperature=float(rng.choice([0.0, 8.0])), seed=i,
                                        max_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                                        stop=[engine.tokenizer.decode([int(rng.integers(40, 120))])] if i % 3 == 0 else [],
                                        stop_token_ids=[int(rng.integers(2, vocab))] if i % 3 == 1 else [],
                                        frequency_penalty=0.5 if i % 5 == 0 else 0.0)
                engine.add_request(f"z{i}", prompts[i] * 2, params)
            finished += sum(out.finished for out in engine.step())
            if rng.random() < 0.1 and engine._requests:
                aborted += engine.abort_request(sorted(engine._requests)[0])
        assert finished + aborted == 300 and aborted > 10
        assert sched.stats.num_preemptions > 0 and engine.get_stats().spec_decode.num_accepted_tokens > 0
        engine.step()
        _check_invariants(sched)
        assert sched.stats.num_used_blocks == 0 and len(engine.runner.table) == 0
    assert engine.get_stats().num_compilations == before


def test_constrained_requests_beside_speculating_ones_get_no_drafts(tiny_spec_engine, prompts):
    """Structured output and speculation in one batch: the constrained rows run without drafts
    (their mask is filled for one position per step) and stay valid; the others still draft and
    keep their non-speculative tokens."""
    import json

    import jsonschema

    from engine.structured_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"],
              "additionalProperties": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=24, seed=5,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    with spec_off(tiny_spec_engine):
        base = run_to_completion(tiny_spec_engine, [(f"cb{i}", p, greedy) for i, p in enumerate(prompts)])
    before = tiny_spec_engine.get_stats().spec_decode.num_draft_tokens
    mixed = [(f"cg{i}", p, greedy) for i, p in enumerate(prompts)]
    mixed += [(f"cj{i}", p, constrained) for i, p in enumerate(prompts)]
    done = run_to_completion(tiny_spec_engine, mixed)
    assert tiny_spec_engine.get_stats().spec_decode.num_draft_tokens > before  # others drafted
    for i in range(len(prompts)):
        assert done[f"cg{i}"].outputs[0].token_ids == base[f"cb{i}"].outputs[0].token_ids
        out = done[f"cj{i}"].outputs[0]
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), schema)
