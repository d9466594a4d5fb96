"""Greedy output of the engine equals a naive loop over the dense no-cache forward, in every mode:
each prompt alone, all together, chunked prefill (32-token budget) with prefix caching of a shared
system prompt, and a KV pool so small that requests are preempted.

The naive loop is checked by teacher forcing: one dense forward over prompt + the engine's tokens
must have the engine's next token as the argmax at every position (by induction, that is exactly
what the token-by-token loop would produce).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from tests.engine.conftest import run_to_completion, scheduler_as

NEW_TOKENS = 24
ALONE_TOKENS = 12
SMALL_CACHE_TOKENS = 16
SYSTEM = ("You are a careful assistant. Answer in plain words, keep it short, and do not repeat "
          "the question. Prefer facts to opinions.")
QUESTIONS = ["Why is the sky blue?", "Name three prime numbers.", "What is 12 times 7?",
             "Write a haiku about autumn leaves falling on a quiet river at dusk.",
             "Hi", "Explain what a hash map is and when you would use one in a program, briefly.",
             "Translate 'good morning' into French.", "List the planets of the solar system in order."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        out.append(tok.encode(text, add_special_tokens=False))
    lengths = sorted(len(p) for p in out)
    assert lengths[0] < lengths[-1]  # mixed lengths
    return out


@pytest.fixture(scope="module")
def dense_argmax(engine):
    params = engine.runner.params
    config = engine.model_config
    forward = jax.jit(lambda p, ids: forward_dense(p, config, ids))

    def run(ids):
        x = np.zeros(-(-len(ids) // 128) * 128, np.int32)
        x[: len(ids)] = ids
        return np.asarray(forward(params, jnp.asarray(x)))[: len(ids)]

    return run


@pytest.fixture(scope="module")
def together(engine, prompts, dense_argmax):
    with scheduler_as(engine, enable_prefix_caching=False):
        outs = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
    tokens = [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    for p, toks in zip(prompts, tokens):
        assert len(toks) == NEW_TOKENS
        logits = dense_argmax(p + toks)
        expected = np.argmax(logits[len(p) - 1 : len(p) - 1 + NEW_TOKENS], axis=-1).tolist()
        assert toks == expected
    return tokens


def test_all_together_equals_dense_loop(together):
    assert len(together) == len(QUESTIONS)


def test_each_prompt_alone(engine, prompts, together):
    """Alone, a request takes one 1-row step per token: its first ALONE_TOKENS (greedy, so a
    prefix of the batched run's tokens) are compared, half the batched run's tokens, for the
    shortest and the longest prompt and two between them."""
    params = SamplingParams(temperature=0.0, max_tokens=ALONE_TOKENS, ignore_eos=True)
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    chosen = sorted({by_length[0], by_length[len(by_length) // 3], by_length[2 * len(by_length) // 3], by_length[-1]})
    with scheduler_as(engine, enable_prefix_caching=False):
        for i, p in ((i, prompts[i]) for i in chosen):
            out = run_to_completion(engine, [(f"alone{i}", p, params)])[f"alone{i}"]
            assert out.outputs[0].token_ids == together[i][:ALONE_TOKENS]


def test_chunked_prefill_with_prefix_caching(engine, prompts, together):
    """A 32-token budget with prefix caching on: the first request (48 tokens) is prefilled in
    two chunks and caches the system prompt; the other seven hit it and share the budget."""
    assert len(prompts[0]) > 32
    with scheduler_as(engine, enable_prefix_caching=True, max_num_batched_tokens=32) as sched:
        first = run_to_completion(engine, [("p0", prompts[0], GREEDY)])
        outs = run_to_completion(engine, [(f"p{i}", p, GREEDY) for i, p in enumerate(prompts) if i])
        outs.update(first)
        assert sched.stats.prefix_cache_hits > 0
        assert all(outs[f"p{i}"].metrics.num_cached_tokens > 0 for i in range(1, len(prompts)))
    assert [outs[f"p{i}"].outputs[0].token_ids for i in range(len(prompts))] == together


def test_small_cache_preempts_and_still_matches(engine, prompts, together):
    # 32 usable blocks (512 tokens) admit every prompt (43-60 tokens: 3-4 blocks each) but not
    # eight growing requests (59-76 tokens after SMALL_CACHE_TOKENS, 4-5 blocks each by the end):
    # some are preempted and recomputed. Their tokens are a prefix of the batched run's.
    params = SamplingParams(temperature=0.0, max_tokens=SMALL_CACHE_TOKENS, ignore_eos=True)
    with scheduler_as(engine, enable_prefix_caching=False, num_kv_blocks=33) as sched:
        outs = run_to_completion(engine, [(f"s{i}", p, params) for i, p in enumerate(prompts)])
        assert sched.stats.num_preemptions > 0
    assert [outs[f"s{i}"].outputs[0].token_ids for i in range(len(prompts))] == [
        t[:SMALL_CACHE_TOKENS] for t in together]
