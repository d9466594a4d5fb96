"""The real LLMEngine (over the engine tests' fake runner) behind the server, in-process: a step
that fails answers 500 for its requests only (CompletionOutput.error), and a runner that lost its
device state makes /health and new requests answer 503 with the reason."""

import asyncio
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_server_admission import serving  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from scheduler import Scheduler, SchedulerConfig  # noqa: E402
from tests.engine.fake_runner import FakeRunner, expected_output  # noqa: E402
from text.byte_tokenizer import ByteTokenizer  # noqa: E402

VOCAB = 256


def _engine() -> tuple[LLMEngine, FakeRunner]:
    knobs = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4)
    runner = FakeRunner(VOCAB)
    engine = LLMEngine.from_parts(EngineConfig(model="fake", num_kv_blocks=200, **knobs),
                                  scheduler=Scheduler(SchedulerConfig(num_blocks=200, **knobs)),
                                  runner=runner, tokenizer=ByteTokenizer(VOCAB))
    return engine, runner


GREEDY = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


async def _post(session, body):
    async with session.post("/v1/completions", json=body) as response:
        return response.status, await response.json()


async def _stream(session, body):
    async with session.post("/v1/completions", json=dict(body, stream=True)) as response:
        return response.status, await response.text()


def test_a_failed_step_fails_its_requests_and_the_next_ones_are_served():
    async def main():
        engine, runner = _engine()
        async with serving(engine) as (server, session):
            runner.fail_at_step = runner.num_steps + 1
            status, body = await _post(session, GREEDY)
            assert status == 500 and "injected fault" in body["error"]["message"], body
            runner.fail_at_step = runner.num_steps + 2
            status, text = await _stream(session, GREEDY)
            assert status == 200 and '"error"' in text and "injected fault" in text and text.endswith("data: [DONE]\n\n")
            status, body = await _post(session, GREEDY)
            assert status == 200 and body["usage"]["completion_tokens"] == 6
            expected = ByteTokenizer(VOCAB).decode(expected_output([5, 6, 7], 6, VOCAB))
            assert body["choices"][0]["text"] == expected
            health = await session.get("/health")
            assert health.status == 200
            stats = server.async_engine.stats()
            assert stats.num_failed_steps == 2 and stats.num_running == 0
            assert stats.num_free_blocks + stats.num_cached_blocks == 199

    asyncio.run(main())


def test_a_dead_runner_makes_health_and_new_requests_503():
    async def main():
        engine, runner = _engine()
        async with serving(engine) as (_, session):
            runner.fail_at_step = runner.num_steps + 1
            runner.healthy = False
            status, body = await _post(session, GREEDY)
            assert status == 503 and "lost its device state" in body["error"]["message"], body
            for _ in range(100):
                health = await session.get("/health")
                if health.status == 503:
                    break
                await asyncio.sleep(0.01)
            reply = await health.json()
            assert health.status == 503 and reply["status"] == "dead" and "lost its device state" in reply["reason"]
            status, body = await _post(session, GREEDY)
            assert status == 503 and body["error"]["code"] == "engine_dead"
            metrics = await (await session.get("/metrics")).text()
            assert "jaxserve:num_failed_steps_total 1" in metrics

    asyncio.run(main())
