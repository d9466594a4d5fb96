"""AsyncLLMEngine in-process, over the fake engine: one step thread, outputs to asyncio streams."""

import asyncio
import pathlib
import sys
import threading

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fake_engine import FakeLLMEngine  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.frontends.async_engine import AsyncLLMEngine, EngineError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


class _ThreadCheckingEngine(FakeLLMEngine):
    """Records which threads call into the engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.threads = set()

    def step(self):
        self.threads.add(threading.get_ident())
        return super().step()

    def add_request(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return super().add_request(*args, **kwargs)


def _run(coro_fn, **engine_kwargs):
    max_queue_len = engine_kwargs.pop("max_queue_len", None)

    async def main():
        engine = _ThreadCheckingEngine(EngineConfig(max_num_seqs=4, max_model_len=64, num_kv_blocks=64),
                                       **engine_kwargs)
        async_engine = AsyncLLMEngine(engine, max_queue_len=max_queue_len)
        async_engine.start()
        try:
            return await coro_fn(engine, async_engine)
        finally:
            await async_engine.shutdown()
            assert not async_engine.is_alive

    return asyncio.run(main())


async def _collect(stream):
    newest = {}
    while not stream.done:
        newest.update(await stream.next_outputs())
    return newest


def test_outputs_reach_streams_and_only_the_step_thread_touches_the_engine():
    async def body(engine, async_engine):
        streams = []
        for i in range(6):
            stream = async_engine.new_stream()
            await async_engine.add_request(stream, f"r{i}", [1, 5 + i], SamplingParams(max_tokens=5, temperature=0))
            streams.append(stream)
        results = await asyncio.gather(*(_collect(s) for s in streams))
        assert all(len(r[f"r{i}"].outputs[0].token_ids) == 5 for i, r in enumerate(results))
        assert engine.threads == {async_engine._thread.ident}
        assert async_engine.stats().num_running == 0 and async_engine.num_pending() == 0
        assert async_engine.metrics.ttft.count == 6 and async_engine.metrics.e2e.count == 6

    _run(body, step_sleep=0.001)


def test_engine_value_error_reaches_the_caller():
    async def body(engine, async_engine):
        stream = async_engine.new_stream()
        with pytest.raises(ValueError, match="max_model_len"):
            await async_engine.add_request(stream, "long", list(range(3, 100)), SamplingParams())
        assert stream.done and async_engine.num_in_flight == 0
        ok = async_engine.new_stream()
        await async_engine.add_request(ok, "ok", [1, 2, 3], SamplingParams(max_tokens=2))
        assert (await _collect(ok))["ok"].finished

    _run(body)


def test_abort_frees_blocks_and_a_failed_step_fails_only_in_flight_requests():
    async def body(engine, async_engine):
        stream = async_engine.new_stream()
        await async_engine.add_request(stream, "a", [1, 2, 3], SamplingParams(max_tokens=50))
        await stream.next_outputs()
        assert async_engine.stats().kv_cache_usage > 0
        stream.abort_unfinished()
        for _ in range(100):
            if async_engine.stats().kv_cache_usage == 0 and async_engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert async_engine.stats().kv_cache_usage == 0
        bad = async_engine.new_stream()
        await async_engine.add_request(bad, "bad", [1] + [ord(c) + 3 for c in "FAIL_STEP"], SamplingParams())
        with pytest.raises(EngineError, match="injected"):
            await _collect(bad)
        good = async_engine.new_stream()
        await async_engine.add_request(good, "good", [1, 2], SamplingParams(max_tokens=3))
        assert len((await _collect(good))["good"].outputs[0].token_ids) == 3

    _run(body, step_sleep=0.005)


def test_queue_full_counts_waiting_and_pending():
    async def body(engine, async_engine):
        assert not async_engine.queue_is_full(2) and async_engine.queue_is_full(3)
        streams = [async_engine.new_stream() for _ in range(6)]
        for i, stream in enumerate(streams):  # 4 run, 2 wait
            # Long enough that no running request finishes (and a waiting one joins) while the
            # loop below polls on a loaded machine; they are aborted at the end.
            await async_engine.add_request(stream, f"q{i}", [1, 2], SamplingParams(max_tokens=10_000))
        for _ in range(300):  # the step thread takes the adds in over a few steps
            stats = async_engine.stats()
            if stats.num_running == 4 and stats.num_waiting == 2:
                break
            await asyncio.sleep(0.01)
        assert async_engine.stats().num_waiting == 2 and async_engine.queue_is_full(1)
        for stream in streams:
            stream.abort_unfinished()

    _run(body, step_sleep=0.01, max_queue_len=2)


def test_an_add_racing_shutdown_fails_instead_of_hanging():
    async def body(engine, async_engine):
        stream = async_engine.new_stream()
        await async_engine.add_request(stream, "running", [1, 2], SamplingParams(max_tokens=1000))
        shutdown = asyncio.create_task(async_engine.shutdown())
        await asyncio.sleep(0)  # the stop command is queued
        with pytest.raises(EngineError):
            await asyncio.wait_for(async_engine.add_request(async_engine.new_stream(), "late", [1, 2], SamplingParams()), 5)
        with pytest.raises(EngineError, match="shutting down"):
            await _collect(stream)
        await shutdown
        assert not engine.has_unfinished_requests()  # the step thread aborted what it held

    _run(body, step_sleep=0.005)
