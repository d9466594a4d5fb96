"""One compiled engine on the default model, shared by the engine tests of the whole session.

Its buckets: 1 and 8 tokens with 8 rows (one request alone, a batch of up to 8 decoding), 32
and 128 tokens with 32 rows (the 50-schema batch decodes 32 at a time: on this CPU a 32-row
step costs little more than an 8-row one, whose time is mostly reading the weights).

Scheduler knobs do not change compiled shapes, so tests that need another token budget, prefix
caching on or off, or a smaller KV pool get a new scheduler over the same runner
(`scheduler_as`, through LLMEngine.reconfigure_scheduler) instead of compiling a new engine.
"""

import contextlib

import pytest

from engine.config import EngineConfig

ENGINE_KNOBS = dict(
    model="default", max_num_seqs=32, max_num_batched_tokens=128, max_model_len=256,
    block_size=16, num_kv_blocks=16 * 16 + 1, token_buckets=(1, 8, 32, 128), seq_buckets=(8, 32),
    compilation_cache_dir=None,
)


@pytest.fixture(scope="session")
def engine():
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**ENGINE_KNOBS), progress=False)


@contextlib.contextmanager
def scheduler_as(engine, **changes):
    """Runs the block with a fresh scheduler of changed knobs; restores a fresh default after.

    `changes` use EngineConfig's names (num_kv_blocks, not the scheduler's num_blocks)."""
    assert not engine.has_unfinished_requests()
    original = {name: getattr(engine.config, name) for name in changes}
    try:
        yield engine.reconfigure_scheduler(**changes)
    finally:
        engine.reconfigure_scheduler(**original)


def run_to_completion(engine, requests):
    """requests: list of (request_id, prompt, SamplingParams). Returns {request_id: RequestOutput}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


TINY_KNOBS = dict(
    model="random:tiny", max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
    block_size=16, num_kv_blocks=16 * 16 + 1, token_buckets=(1, 4, 16, 64), seq_buckets=(4, 16),
    compilation_cache_dir=None,
)


@pytest.fixture(scope="session")
def tiny_engine():
    """A compiled engine on random:tiny (2 layers, vocab 256, byte tokenizer): for mechanism
    tests (recompiles, seeds, n > 1, aborts, bad input) where real numerics are not the point."""
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**TINY_KNOBS), progress=False)


# random:tiny compiled for speculative decoding (k = 3: L = S * 4 logit rows per bucket). Drafting
# is never switched off by load or acceptance here unless a test installs another SpecDecoder;
# `spec_off` runs the same compiled engine without drafts (the baseline of every comparison).
TINY_SPEC_KNOBS = dict(
    TINY_KNOBS, token_buckets=(4, 16, 64),
    speculative_config=dict(method="ngram", num_speculative_tokens=3, disable_by_batch_size=None,
                            disable_by_token_share=1.0, min_acceptance_rate=0.0),
)


@pytest.fixture(scope="session")
def tiny_spec_engine():
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**TINY_SPEC_KNOBS), progress=False)


@contextlib.contextmanager
def spec_off(engine):
    """Runs the block without drafts: every decode row is one token, as without speculation."""
    engine.spec.enabled = False
    try:
        yield engine
    finally:
        engine.spec.enabled = True


@pytest.fixture(scope="session")
def pd():
    """A PDEngine on random:tiny-gqa3 (tests/engine/disaggregation_shared.py's KNOBS): a prefill
    pool and a decode pool of 2 virtual devices each. Session-scoped and shared by
    test_disaggregation.py and test_disaggregation_process.py, one xdist work unit
    (tests/conftest.py), so it is built once; test_disaggregation_quant.py builds its own (int8,
    one device per pool)."""
    from engine.disaggregation.pd_engine import PDEngine
    from engine.sampling_params import SamplingParams
    from tests.engine.disaggregation_shared import KNOBS, PROMPTS

    engine = PDEngine(EngineConfig(**KNOBS, disaggregation="prefill:2,decode:2"), progress=False)
    # Warm-up: a penalized request compiles the request tables' history fill in both pools.
    run_to_completion(engine, [("warm", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4,
                                                                   presence_penalty=0.5))])
    return engine
