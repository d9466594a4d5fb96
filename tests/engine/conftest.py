"""One compiled engine on the default model, shared by the engine tests of the whole session.

Scheduler knobs do not change compiled shapes, so tests that need another token budget, prefix
caching on or off, or a smaller KV pool swap in a new Scheduler over the same runner (`scheduler_as`)
instead of compiling a new engine.
"""

import contextlib
import dataclasses

import pytest

from engine.config import EngineConfig
from scheduler import Scheduler

ENGINE_KNOBS = dict(
    model="default", max_num_seqs=8, max_num_batched_tokens=128, max_model_len=256,
    block_size=16, num_kv_blocks=8 * 16 + 1, token_buckets=(16, 32, 128), seq_buckets=(8,),
    compilation_cache_dir=None,
)


@pytest.fixture(scope="session")
def engine():
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**ENGINE_KNOBS), progress=False)


@contextlib.contextmanager
def scheduler_as(engine, **changes):
    """Runs the block with a fresh scheduler of changed knobs; restores a fresh default after."""
    assert not engine.has_unfinished_requests()
    original = engine.scheduler.config
    engine.scheduler = Scheduler(dataclasses.replace(original, **changes))
    try:
        yield engine.scheduler
    finally:
        engine.scheduler = Scheduler(original)


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
