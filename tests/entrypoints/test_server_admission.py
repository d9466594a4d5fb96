"""Admission in sequences and groups, in-process (OpenAIServer over the fake engine on 127.0.0.1):
max_queue_len counts prompts x n, requests that could never fit are 400s that say so, and every
prompt of one HTTP request reaches the engine with the same group_id."""

import asyncio
import contextlib
import pathlib
import sys

import aiohttp
import pytest
from aiohttp import web

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from fake_engine import FakeLLMEngine  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.frontends.async_engine import AsyncLLMEngine, EngineDeadError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from entrypoints.openai.api_server import OpenAIServer, ServerConfig, default_body_limit  # noqa: E402


@contextlib.asynccontextmanager
async def serving(engine, **config):
    server = OpenAIServer(engine, ServerConfig(port=0, **config))
    server.async_engine.start()
    runner = server.make_runner()
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{runner.addresses[0][1]}") as session:
            yield server, session
    finally:
        await server.async_engine.shutdown()
        await runner.cleanup()


def _engine(step_sleep=0.0, **knobs):
    return FakeLLMEngine(EngineConfig(**{"max_num_seqs": 8, "max_model_len": 128, **knobs}), step_sleep=step_sleep)


async def _post(session, path, body):
    async with session.post(path, json=body) as response:
        return response.status, await response.json()


def test_the_prompts_of_one_request_share_a_group():
    async def main():
        engine = _engine()
        async with serving(engine) as (_, session):
            status, body = await _post(session, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 3})
            assert status == 200 and len(body["choices"]) == 6
            status, _ = await _post(session, "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert status == 200
        groups = engine.group_ids
        first = [group for request_id, group in groups.items() if request_id.startswith(body["id"])]
        assert len(first) == 3 and set(first) == {body["id"]}
        assert len(set(groups.values())) == 2

    asyncio.run(main())


def test_the_queue_counts_sequences_and_a_request_that_never_fits_is_a_400():
    async def main():
        engine = _engine(step_sleep=0.01, max_num_seqs=1)
        async with serving(engine, max_queue_len=4) as (server, session):
            async def until(predicate):
                for _ in range(300):
                    if predicate(server.async_engine.stats()):
                        return
                    await asyncio.sleep(0.01)

            running = asyncio.create_task(_post(session, "/v1/completions", {"prompt": "run", "max_tokens": 120}))
            await until(lambda stats: stats.num_running == 1)
            waiting = asyncio.create_task(_post(session, "/v1/completions", {"prompt": "wait", "n": 4, "max_tokens": 2}))
            await until(lambda stats: stats.num_waiting == 4)
            assert server.async_engine.stats().num_waiting == 4  # one request, four sequences
            status, body = await _post(session, "/v1/completions", {"prompt": "late", "max_tokens": 2})
            assert status == 503 and body["error"]["code"] == "queue_full"
            status, body = await _post(session, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2})
            assert status == 400 and body["error"]["code"] == "request_too_large"
            assert body["error"]["param"] == "n" and "6 sequences" in body["error"]["message"]
            status, body = await _post(session, "/v1/completions", {"prompt": ["a"] * 5})
            assert status == 400 and body["error"]["param"] == "prompt"
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)

    asyncio.run(main())


def test_server_knobs_bound_the_request_shape():
    async def main():
        async with serving(_engine(), max_n=2, max_prompts=3) as (_, session):
            status, body = await _post(session, "/v1/completions", {"prompt": "a", "n": 3})
            assert status == 400 and body["error"]["param"] == "n" and "on this server" in body["error"]["message"]
            status, body = await _post(session, "/v1/completions", {"prompt": ["a"] * 4})
            assert status == 400 and body["error"]["param"] == "prompt"
            status, body = await _post(session, "/v1/completions", {"prompt": "a" * 200, "max_tokens": 4})
            assert status == 400 and "max_model_len" in body["error"]["message"]
            status, body = await _post(session, "/v1/completions", {"prompt": "a" * 100, "max_tokens": 100})
            assert status == 400 and body["error"]["param"] == "max_tokens"
            async with session.post("/v1/completions", data=b"x" * (default_body_limit(128) + 1)) as response:
                assert response.status == 413 and (await response.json())["error"]["code"] == "request_too_large"

    asyncio.run(main())


@pytest.mark.parametrize("knob,value", [("max_queue_len", 0), ("max_n", 17), ("max_prompts", 0),
                                        ("header_timeout_s", -1), ("num_prepare_threads", 0),
                                        ("max_body_bytes", True)])
def test_bad_server_knobs_are_refused(knob, value):
    with pytest.raises(ValueError, match=knob):
        ServerConfig(**{knob: value})


def test_a_dead_engine_fails_in_flight_requests_and_refuses_new_ones():
    async def main():
        engine = _engine(step_sleep=0.005)
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        try:
            long = async_engine.new_stream()
            await async_engine.add_request(long, "long", [1, 5, 6], SamplingParams(max_tokens=1000))
            await long.next_outputs()
            killer = async_engine.new_stream()
            await async_engine.add_request(killer, "kill", engine.tokenizer.encode("KILL_ENGINE"), SamplingParams())
            with pytest.raises(EngineDeadError, match="injected device loss"):
                while True:
                    await long.next_outputs()
            assert async_engine.dead_reason == "injected device loss"
            with pytest.raises(EngineDeadError):
                await async_engine.add_request(async_engine.new_stream(), "late", [1, 2], SamplingParams())
            assert async_engine.metrics.engine_step_errors == 0  # a death, not a failed step
        finally:
            await async_engine.shutdown()
        assert async_engine.dead_reason == "injected device loss"

    asyncio.run(main())
