"""Prompt logprobs (SamplingParams.prompt_logprobs; `echo` with `logprobs` on the server): every
prompt position is scored in the compiled step, chunked to the step's token budget (a step whose
logit rows no plain bucket holds runs in the scoring bucket, L = T) or, without the scoring
bucket, to the logit rows the step has left.

On the default model the scores equal the dense oracle's log-softmax at every position, across
chunks and token budgets, beside other requests, and scoring changes nothing about what is
generated (greedy and seeded tokens, penalties, speculation). The prompt skips the prefix cache.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.errors import ParamError
from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from scheduler import Request, Scheduler, SchedulerConfig, StepResult
from tests.engine.conftest import run_to_completion, scheduler_as, spec_off

QUESTION = ("Explain in two short sentences why the sky is blue during the day, why it turns red and "
            "orange at sunset, why clouds look white or grey, and why the sky at night is dark even "
            "though the universe holds countless stars. Use plain words a child would understand, "
            "and do not use any formulas or numbers in the answer at all.")


@pytest.fixture(scope="module")
def prompt(engine):
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 3 * 32  # at the 32-token budget, scored over several steps
    return ids


@pytest.fixture(scope="module")
def dense_logprobs(engine, prompt):
    forward = jax.jit(lambda p, ids: forward_dense(p, engine.model_config, ids))
    x = np.zeros(-(-len(prompt) // 64) * 64, np.int32)
    x[: len(prompt)] = prompt
    logits = np.asarray(forward(engine.runner.params, jnp.asarray(x)))[: len(prompt)].astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def _check_scores(scored, prompt, dense, k):
    assert len(scored) == len(prompt) and scored[0] is None
    for pos in range(1, len(prompt)):
        entry = scored[pos]
        token = prompt[pos]
        assert token in entry and len(entry) in (k, k + 1), (pos, entry)
        top = np.argsort(-dense[pos - 1])[:k]
        assert set(top.tolist()) <= set(entry), pos
        for t, value in entry.items():  # position pos is predicted from the logits at pos - 1
            assert abs(value - dense[pos - 1][t]) < 1e-4, (pos, t, value, dense[pos - 1][t])


@pytest.mark.parametrize("budget", [128, 32], ids=["budget128", "budget32"])
def test_prompt_scores_equal_the_dense_oracle_beside_other_requests(engine, prompt, dense_logprobs, budget):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=2)
    with scheduler_as(engine, enable_prefix_caching=False, max_num_batched_tokens=budget):
        plain = run_to_completion(engine, [("g", prompt, greedy), ("s", prompt, seeded)])
        scored = run_to_completion(engine, [
            ("other", prompt[:20], greedy),
            ("g+", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)),
            ("s+", prompt, SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True, logprobs=2,
                                          prompt_logprobs=0)),
        ])
    _check_scores(scored["g+"].prompt_logprobs, prompt, dense_logprobs, 3)
    _check_scores(scored["s+"].prompt_logprobs, prompt, dense_logprobs, 0)
    assert scored["other"].prompt_logprobs is None
    # Scoring changes nothing about the sampled tokens (the rng step of the first output is 0).
    assert scored["g+"].outputs[0].token_ids == plain["g"].outputs[0].token_ids
    assert scored["s+"].outputs[0].token_ids == plain["s"].outputs[0].token_ids
    for got, want in zip(scored["s+"].outputs[0].logprobs, plain["s"].outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-4 for t in got)


def test_a_scored_prompt_skips_the_prefix_cache(engine, prompt, dense_logprobs):
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with scheduler_as(engine, enable_prefix_caching=True):
        run_to_completion(engine, [("warm", prompt, greedy)])
        again = run_to_completion(engine, [("hit", prompt, greedy)])["hit"]
        scored = run_to_completion(engine, [("scored", prompt, SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))])["scored"]
    assert again.metrics.num_cached_tokens > 0
    assert scored.metrics.num_cached_tokens == 0
    _check_scores(scored.prompt_logprobs, prompt, dense_logprobs, 1)
    assert scored.outputs[0].token_ids == again.outputs[0].token_ids


def test_n_samples_score_the_prompt_once_and_bad_values_are_refused(tiny_engine):
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=1.0, seed=2, n=3, max_tokens=4, prompt_logprobs=2)
    out = run_to_completion(tiny_engine, [("n3", prompt, params)])["n3"]
    assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs) == 3
    with pytest.raises(ParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ParamError, match="prompt_logprobs"):
        tiny_engine.add_request("big", prompt, SamplingParams(prompt_logprobs=tiny_engine.config.max_logprobs + 1))


def test_penalties_and_speculation_ignore_the_scored_prompt(tiny_engine, tiny_spec_engine):
    """Scored rows are no outputs: the penalty counts and the drafts' verification skip them."""
    prompt = [5, 6, 7, 8] * 6 + [9, 10]
    base = dict(temperature=4.0, seed=3, max_tokens=12, ignore_eos=True, frequency_penalty=1.5,
                presence_penalty=0.5)
    plain = run_to_completion(tiny_engine, [("p", prompt, SamplingParams(**base))])["p"]
    scored = run_to_completion(tiny_engine, [("p+", prompt, SamplingParams(**base, prompt_logprobs=1))])["p+"]
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    with spec_off(tiny_spec_engine):
        off = run_to_completion(tiny_spec_engine, [("o", prompt, SamplingParams(**greedy))])["o"]
    spec = run_to_completion(tiny_spec_engine, [("o+", prompt, SamplingParams(**greedy, prompt_logprobs=2))])["o+"]
    assert spec.outputs[0].token_ids == off.outputs[0].token_ids
    # The same random:tiny weights in both engines: the same scores (k = 2 and k = 1 share the top one).
    assert len(spec.prompt_logprobs) == len(prompt) and spec.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        for t, value in scored.prompt_logprobs[pos].items():
            assert spec.prompt_logprobs[pos][t] == pytest.approx(value, rel=1e-5, abs=1e-4)


def test_the_scheduler_cuts_scored_chunks_to_the_logit_rows():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=16,
                             num_blocks=32, max_num_logits=8)
    s = Scheduler(config)
    s.add_request(Request("plain", list(range(30)), max_tokens=2))
    scored = Request("scored", list(range(1, 21)), max_tokens=2, prompt_logprobs=True)
    s.add_request(scored)
    s.add_request(Request("late", list(range(5)), max_tokens=2))
    chunks = []
    for _ in range(6):
        out = s.schedule()
        rows = {sr.req_id: sr for sr in out.scheduled}
        assert sum(sr.num_logits for sr in out.scheduled) <= 8
        if out.step_id == 1:
            late_first_step = "late" in rows
        if "scored" in rows:
            sr = rows["scored"]
            chunks.append((sr.num_computed_tokens, sr.num_scheduled_tokens, sr.num_logits, sr.num_prompt_logits))
        sampling = [sr.req_id for sr in out.scheduled if sr.sample]
        s.update(out, StepResult(sampling, [[7] for _ in sampling]))
    # 20 prompt tokens: 7 rows are left beside the plain request's final chunk, one of them kept
    # for the request still waiting ("late", admitted in the same step); then what the decodes
    # leave. Positions 0..18 score the next prompt token, position 19 samples.
    assert chunks[0] == (0, 6, 6, 6) and late_first_step
    assert sum(c[1] for c in chunks[:3]) == 20 and chunks[2][3] == chunks[2][2] - 1
    assert not scored.prompt_logprobs and scored.is_finished  # cleared once the prompt is computed
