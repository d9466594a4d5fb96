"""Tensor parallelism on the default model (9 q / 3 KV heads, padded to 12 / 4): greedy tokens of
TP = 2, TP = 4 and DP = 2 x TP = 2 equal the dense no-cache forward on one device (teacher
forcing, as test_greedy_equivalence checks TP = 1) up to the first near-tie (the dense top-2
margin < 0.02), and the first token's logprob agrees within 1e-4, batched with chunked prefill
(32-token budget, prompts longer than that), with prefix caching (a shared system prompt, a
second wave that hits it) and under preemption (a KV pool too small for the batch), all in one
run per engine; the DP = 2 x TP = 2 engine is a DPEngine over the 4 devices. One load, three
engines, one dense forward per distinct token sequence; nothing recompiles after warm-up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from models.served_layout import stack_layers
from tests.engine.conftest import run_to_completion

# TP on the default model (tests/engine/test_tensor_parallel.py covers TP on random:tiny in make test): make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

NEW_TOKENS = 8
SYSTEM = ("You are a careful assistant. Answer in plain words, keep it short, and do not repeat "
          "the question. Prefer facts to opinions, and say when you do not know.")
# Six prompts of 51-59 tokens in an 8-block (128-token) pool: two fit at a time, so the later
# ones hit the system prompt the earlier ones cached, and growing ones are preempted.
QUESTIONS = ["Why is the sky blue?", "Name three prime numbers.", "What is 12 times 7?",
             "Write a haiku about autumn leaves.", "Hi", "Explain what a hash map is, briefly."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
# Stacked layer weights, as accelerators (tensor parallelism's home) serve them: the CPU's own
# layout (per-layer buffers under a lax.switch scan) is checked under TP = 4 on random:tiny in
# test_tensor_parallel.py, and the stacked scan compiles in a third of the time under the tests'
# XLA flags.
KNOBS = dict(model="default", max_num_seqs=8, max_num_batched_tokens=32, max_model_len=112,
             num_kv_blocks=8, token_buckets=(32,), seq_buckets=(8,), compilation_cache_dir=None,
             stack_layer_weights=True, prompt_scoring_bucket=False)


@pytest.fixture(scope="module")
def loaded():
    from models.loader import load_model

    return load_model("default", host=True, progress=False)


@pytest.fixture(scope="module")
def engines(loaded):
    from engine.core.llm_engine import LLMEngine
    from engine.scaleout.dp_engine import DPEngine

    out = {tp: LLMEngine(EngineConfig(**KNOBS, tensor_parallel_size=tp), progress=False, loaded=loaded)
           for tp in (2, 4)}
    out["dp2xtp2"] = DPEngine(EngineConfig(**KNOBS, tensor_parallel_size=2, data_parallel_size=2),
                              progress=False, loaded=loaded)
    return out


@pytest.fixture(scope="module")
def dense_logprobs(loaded):
    """ids -> float64 log-softmax [len(ids), V] of the dense forward on one device."""
    params = jax.device_put(stack_layers(loaded.params))
    forward = jax.jit(lambda p, ids: jax.nn.log_softmax(forward_dense(p, loaded.config, ids), axis=-1))

    memo = {}  # the three engines mostly produce the same tokens: one dense forward each

    def run(ids):
        key = tuple(ids)
        if key not in memo:
            x = np.zeros(-(-len(ids) // 128) * 128, np.int32)  # one compiled length for every prompt here
            x[: len(ids)] = ids
            memo[key] = np.asarray(forward(params, jnp.asarray(x)))[: len(ids)].astype(np.float64)
        return memo[key]

    return run


@pytest.fixture(scope="module")
def prompts(engines):
    tok = engines[4].tokenizer
    out = [tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": q}]), add_special_tokens=False)
           for q in QUESTIONS]
    assert min(len(p) for p in out) > KNOBS["max_num_batched_tokens"]  # every prefill is chunked
    return out


def _run(engine, prompts, tag):
    done = run_to_completion(engine, [(f"{tag}{i}", p, GREEDY) for i, p in enumerate(prompts)])
    return [done[f"{tag}{i}"].outputs[0] for i in range(len(prompts))]


def _assert_dense(prompts, outputs, dense_logprobs):
    """Each token is the dense argmax given the tokens before it, up to the first near-tie; the
    first token's logprob within 1e-4 of the dense one."""
    compared = 0
    for prompt, out in zip(prompts, outputs):
        dense = dense_logprobs(prompt + out.token_ids)[len(prompt) - 1 :]
        first = out.token_ids[0]
        assert abs(out.logprobs[0][first] - dense[0][first]) < 1e-4, (out.logprobs[0][first], dense[0][first])
        for i, token in enumerate(out.token_ids):
            top2 = np.sort(dense[i])[-2:]
            if top2[1] - top2[0] < 0.02:
                break
            assert token == int(np.argmax(dense[i])), (i, out.token_ids)
            compared += 1
    assert compared >= len(prompts) * NEW_TOKENS // 2  # the check was not vacuous


@pytest.fixture(scope="module")
def outputs(engines, prompts):
    """One run per engine: all prompts together, prefills chunked, later prompts hitting the
    system prompt the first ones cached, and a pool too small for all of them (preemption)."""
    outs = {}
    for tp, engine in engines.items():
        before = engine.get_stats()
        outs[tp] = _run(engine, prompts, "a")
        after = engine.get_stats()
        assert after.prefix_cache_hits > before.prefix_cache_hits
        assert after.num_preemptions > before.num_preemptions
        assert after.num_compilations == before.num_compilations  # nothing recompiles
    return outs


@pytest.mark.parametrize("tp", [2, 4, "dp2xtp2"])
def test_batched_chunked_prefix_cached_preempted_equal_the_dense_forward(prompts, outputs, dense_logprobs, tp):
    _assert_dense(prompts, outputs[tp], dense_logprobs)


def test_tp4_weight_bytes_per_device_under_a_third(engines, loaded):
    whole = sum(np.asarray(x).nbytes for x in jax.tree.leaves(loaded.params))
    tp4 = engines[4].get_stats().weight_bytes_per_device
    assert len(tp4) == 4
    assert max(tp4) <= 0.3 * whole, (tp4, whole)
