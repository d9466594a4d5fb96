"""Warm-up (EngineConfig.warmup, ModelRunner.warm_up): every compiled bucket runs once on an
all-padding step before a request needs it (XLA:CPU's first run of an executable costs ~0.3 s
more than the next on the default model; BUILD_NOTES.md "Warm-up"), and that step changes no
request's state: its tokens write K/V into the null block only, its logit rows sample into no
request's table slot."""

import asyncio
import time

import jax
import numpy as np

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.frontends.async_engine import AsyncLLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.conftest import TINY_KNOBS, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _state(runner):
    """The runner's device state on the host: the caches without block 0 (the null block, which
    padding tokens write) and the request table."""
    caches = [np.asarray(c)[:, 1:] for c in jax.tree.leaves(runner.kv_cache)]
    return caches, [np.asarray(x) for x in jax.tree.leaves(runner.table.state)]


def test_warm_up_runs_each_cold_bucket_once_and_no_request_state_changes(tiny_engine):
    assert tiny_engine.runner.cold_buckets() == []  # the default: warmed at start-up
    assert not tiny_engine.warm_up_pending() and not tiny_engine.warm_up_next()
    engine = LLMEngine(EngineConfig(**TINY_KNOBS, warmup=False), progress=False)
    runner = engine.runner
    buckets = runner.shapes.all_buckets()
    assert runner.cold_buckets() == buckets and not runner.warm_up_next()  # warmup off: no idle warm-up
    # A request in flight (prompt done, one token out): its KV blocks and its table slot hold
    # values a warm-up step must leave as they are.
    prompt = "a prompt of a few words to fill a block or two"
    outputs = {}
    engine.add_request("mid", prompt, GREEDY)
    for _ in range(2):  # the prompt, then one token out
        outputs.update({o.request_id: o for o in engine.step()})
    ran = [b for b in buckets if b not in runner.cold_buckets()]
    assert ran and len(ran) < len(buckets)
    before = _state(runner)
    warmed = runner.warm_up()
    assert warmed == [b for b in buckets if b not in ran] and runner.cold_buckets() == []
    assert runner.warm_up() == []  # each bucket once
    after = _state(runner)
    for old, new in zip(before[0] + before[1], after[0] + after[1], strict=True):
        np.testing.assert_array_equal(old, new)
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    # The same tokens as an engine that never paused for a warm-up.
    want = run_to_completion(tiny_engine, [("mid", prompt, GREEDY)])["mid"].outputs[0].token_ids
    assert outputs["mid"].finished and outputs["mid"].outputs[0].token_ids == want


def test_an_idle_server_warms_the_buckets_compiled_in_the_background():
    """background_compile: the start-up buckets warm at construction; the rest compile on a thread
    and the async engine's step thread warms them while no request is in flight."""
    engine = LLMEngine(EngineConfig(**TINY_KNOBS, background_compile=True), progress=False)
    started = set(engine.runner._compiled)
    assert engine.runner.cold_buckets() == []  # what compiled at start-up is warm

    async def main():
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        try:
            deadline = time.monotonic() + 240
            while not (engine.runner.all_compiled and not engine.runner.cold_buckets()):
                assert time.monotonic() < deadline, (engine.runner.all_compiled, engine.runner.cold_buckets())
                await asyncio.sleep(0.05)
            stream = async_engine.new_stream()
            await async_engine.add_request(stream, "r", [1, 5, 9], GREEDY)
            while not stream.done:
                await stream.next_outputs()
        finally:
            await async_engine.shutdown()

    asyncio.run(main())
    assert set(engine.runner._compiled) > started  # some compiled in the background, then warmed
    assert engine.runner.cold_buckets() == []
