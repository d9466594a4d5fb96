"""Engine behaviour: on the default model, logprobs against transformers, stop strings and EOS; on
random:tiny (mechanisms, not numerics), a compile-free steady state, seeds independent of the
batch, n > 1, aborts, and bad input that leaves others unharmed."""

import json
import pathlib

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion, scheduler_as

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def test_first_token_logprobs_match_transformers(engine):
    meta = json.loads((FIXTURES / "smollm2_reference.json").read_text())
    arrays = np.load(FIXTURES / "smollm2_reference.npz")
    for i, prompt in enumerate(meta["prompts"]):
        ids = prompt["prompt_token_ids"]
        if len(ids) >= engine.max_model_len:
            continue
        logits = arrays["last_logits"][i].astype(np.float64)
        ref = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        out = run_to_completion(engine, [(f"lp{i}", ids, params)])[f"lp{i}"].outputs[0]
        entry = out.logprobs[0]
        assert out.token_ids[0] == prompt["greedy_token_ids"][0]
        assert len(entry) >= 5
        top5 = np.argsort(-ref)[:5]
        assert set(top5.tolist()) <= set(entry)
        for token, value in entry.items():
            assert abs(value - ref[token]) < 1e-3, (prompt["name"], token, value, ref[token])


def test_no_compilation_during_200_random_requests(tiny_engine):
    engine = tiny_engine
    rng = np.random.default_rng(7)
    vocab = engine.model_config.vocab_size
    # Warm-up: one request through every path (prefill, decode, sampling with filters/penalties).
    warm = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, presence_penalty=0.5, max_tokens=3, logprobs=2)
    run_to_completion(engine, [("warm", rng.integers(0, vocab, 40).tolist(), warm)])
    before = engine.get_stats().num_compilations
    requests = []
    for i in range(200):
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), max_tokens=int(rng.integers(1, 8)),
                                top_k=int(rng.choice([-1, 40])), ignore_eos=True,
                                frequency_penalty=float(rng.choice([0.0, 0.3])))
        requests.append((f"z{i}", rng.integers(0, vocab, int(rng.integers(1, 120))).tolist(), params))
    outs = run_to_completion(engine, requests)
    assert len(outs) == 200
    assert all(len(o.outputs[0].token_ids) == r[2].max_tokens for o, r in zip(
        (outs[r[0]] for r in requests), requests))
    assert engine.get_stats().num_compilations == before


def test_logprobs_of_one_request_among_requests_that_want_none(tiny_engine):
    """The sampler computes the log-softmax only in steps where some row wants logprobs
    (engine/step/sampler.py): a request with logprobs gets the same values alone and among
    requests without them, which get none; a step after it, with none wanted, still samples."""
    engine = tiny_engine
    rng = np.random.default_rng(5)
    vocab = engine.model_config.vocab_size
    target = rng.integers(0, vocab, 20).tolist()
    wants = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    alone = run_to_completion(engine, [("lp-alone", target, wants)])["lp-alone"].outputs[0]
    assert len(alone.logprobs) == 6 and all(len(e) >= 3 for e in alone.logprobs)
    assert all(v <= 0.0 for e in alone.logprobs for v in e.values())
    assert all(v < -1.0 for e, t in zip(alone.logprobs, alone.token_ids) for k, v in e.items() if k != t)
    assert alone.cumulative_logprob == pytest.approx(sum(e[t] for e, t in zip(alone.logprobs, alone.token_ids)))
    none = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    others = [(f"lp-other{i}", rng.integers(0, vocab, 12).tolist(), none) for i in range(5)]
    outs = run_to_completion(engine, others[:2] + [("lp-batch", target, wants)] + others[2:])
    batched = outs["lp-batch"].outputs[0]
    assert batched.token_ids == alone.token_ids
    for a, b in zip(alone.logprobs, batched.logprobs):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([b[t] for t in a], [a[t] for t in a], atol=1e-4)
    for rid, ids, _ in others:  # no logprobs asked: none reported, and the tokens are greedy's alone
        out = outs[rid].outputs[0]
        assert out.logprobs is None and out.cumulative_logprob is None
        assert out.token_ids == run_to_completion(engine, [(rid + "-alone", ids, none)])[rid + "-alone"].outputs[0].token_ids


def test_seed_gives_same_tokens_alone_and_in_a_batch_of_16(tiny_engine):
    engine = tiny_engine
    rng = np.random.default_rng(3)
    vocab = engine.model_config.vocab_size
    target = rng.integers(0, vocab, 30).tolist()
    # random:tiny's logits are very peaked (tied random embeddings): a high temperature spreads them.
    seeded = SamplingParams(temperature=40.0, top_p=0.95, top_k=100, seed=1234, max_tokens=12, ignore_eos=True)
    alone = run_to_completion(engine, [("seed-alone", target, seeded)])["seed-alone"].outputs[0].token_ids
    others = [(f"other{i}", rng.integers(0, vocab, int(rng.integers(5, 60))).tolist(),
               SamplingParams(temperature=40.0, seed=i, max_tokens=int(rng.integers(4, 16)), ignore_eos=True))
              for i in range(15)]
    batch = run_to_completion(engine, others[:7] + [("seed-batch", target, seeded)] + others[7:])
    assert batch["seed-batch"].outputs[0].token_ids == alone
    # And the seed matters: another seed gives another continuation.
    other_seed = SamplingParams(temperature=40.0, top_p=0.95, top_k=100, seed=99, max_tokens=12, ignore_eos=True)
    assert run_to_completion(engine, [("seed-x", target, other_seed)])["seed-x"].outputs[0].token_ids != alone


def test_stop_string_is_cut_and_not_returned(engine):
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    free = run_to_completion(engine, [("free", ids, SamplingParams(temperature=0, max_tokens=12))])["free"]
    text = free.outputs[0].text
    assert "Paris" in text
    stop = run_to_completion(engine, [("stop", ids, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]))])["stop"]
    out = stop.outputs[0]
    assert out.text == text[: text.index("Paris")]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    incl = run_to_completion(engine, [("incl", ids, SamplingParams(temperature=0, max_tokens=12, stop=["Paris"],
                                                                  include_stop_str_in_output=True))])["incl"]
    assert incl.outputs[0].text == text[: text.index("Paris") + len("Paris")]


def test_eos_stop_token_ids_max_tokens_and_text(engine):
    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]), add_special_tokens=False)
    out = run_to_completion(engine, [("eos", ids, SamplingParams(temperature=0, max_tokens=64))])["eos"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in tok.eos_token_ids
    assert out.text == tok.decode(out.token_ids)  # incremental detokenization ends at the full decode
    first = out.token_ids[0]
    by_id = run_to_completion(engine, [("sid", ids, SamplingParams(temperature=0, max_tokens=64,
                                                                  stop_token_ids=[first]))])["sid"].outputs[0]
    assert by_id.token_ids == [first] and by_id.finish_reason == "stop" and by_id.stop_reason == first
    capped = run_to_completion(engine, [("len", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))])
    assert capped["len"].outputs[0].finish_reason == "length" and len(capped["len"].outputs[0].token_ids) == 3


def test_n_samples_share_one_request(tiny_engine):
    engine = tiny_engine
    ids = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
    out = run_to_completion(engine, [("n3", ids, SamplingParams(n=3, temperature=40.0, seed=5, max_tokens=8,
                                                                ignore_eos=True))])["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


@pytest.mark.parametrize("field,make", [
    ("prompt", lambda e: (list(range(1, e.max_model_len + 5)), SamplingParams())),
    ("prompt", lambda e: ("", SamplingParams())),
    ("prompt", lambda e: ([], SamplingParams())),
    ("prompt", lambda e: ([e.model_config.vocab_size + 3], SamplingParams())),
    ("max_tokens", lambda e: ("hi", SamplingParams(max_tokens=0))),
    ("temperature", lambda e: ("hi", SamplingParams(temperature=-0.5))),
    ("top_p", lambda e: ("hi", SamplingParams(top_p=0.0))),
    ("top_p", lambda e: ("hi", SamplingParams(top_p=1.5))),
    ("top_k", lambda e: ("hi", SamplingParams(top_k=-2))),
    ("unknown sampling field", lambda e: ("hi", SamplingParams.from_dict({"temprature": 0.5}))),
])
def test_bad_input_names_the_field_and_others_are_unaffected(tiny_engine, field, make):
    engine = tiny_engine
    ids = engine.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = run_to_completion(engine, [("ref", ids, params)])["ref"].outputs[0].token_ids
    engine.add_request("good", ids, params)
    engine.step()  # the good request is in flight
    with pytest.raises(ValueError, match=field):
        prompt, bad_params = make(engine)
        engine.add_request("bad", prompt, bad_params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"good"} and done["good"].outputs[0].token_ids == expected


def test_unknown_engine_knob_is_named():
    from engine.frontends.llm import LLM

    with pytest.raises(ValueError, match="max_num_seqz"):
        LLM("random:tiny", max_num_seqz=4)


def test_abort_frees_blocks_at_once(tiny_engine):
    engine = tiny_engine
    with scheduler_as(engine, enable_prefix_caching=False) as sched:
        engine.add_request("ab", list(range(10, 70)), SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        assert sched.stats.num_used_blocks > 0
        assert engine.abort_request("ab")
        assert sched.stats.num_used_blocks == 0 and not engine.has_unfinished_requests()
