"""Concurrency, disconnects, overload and SIGTERM, against the fake engine in real processes."""

import asyncio
import json
import pathlib
import sys
import time

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import ServerProcess, http, parse_metrics  # noqa: E402

STEP = 0.01  # seconds per fake engine step: one token per running request per step


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max_num_seqs=64", f"--fake_step_sleep={STEP}", "--num_kv_blocks=600",
                         "--block_size=16", "--max_model_len=512").start()
    yield proc
    assert proc.terminate() == 0, proc.output()


def _metrics(server) -> dict[str, float]:
    return parse_metrics(http("GET", server.url + "/metrics")[2])


async def _read_events(response, on_event=None):
    """Yields the parsed `data:` payloads of a server-sent event stream."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            data = event[len(b"data: "):].decode()
            yield data if data == "[DONE]" else json.loads(data)


async def _stream_one(session, url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times, text, usage, done = [], "", None, False
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for event in _read_events(response):
            if event == "[DONE]":
                done = True
            elif event["choices"]:
                if event["choices"][0]["text"]:
                    times.append(time.monotonic())
                text += event["choices"][0]["text"]
            else:
                usage = event["usage"]
    return {"times": times, "text": text, "usage": usage, "done": done}


def test_64_concurrent_streams_finish_and_arrive_incrementally(server):
    max_tokens = 40

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            return await asyncio.gather(*(_stream_one(session, server.url, f"client {i}", max_tokens) for i in range(64)))

    results = asyncio.run(main())
    for result in results:
        assert result["done"]
        assert result["usage"]["completion_tokens"] == max_tokens
        assert len(result["text"]) == max_tokens  # the fake tokenizer: one character per token
        # Incremental: many chunks, and the first arrived long before the last token existed
        # (40 tokens take 40 engine steps).
        assert len(result["times"]) >= max_tokens // 4
        assert result["times"][-1] - result["times"][0] > 10 * STEP
    metrics = _metrics(server)
    assert metrics["jaxserve:time_to_first_token_seconds_count"] >= 64
    assert metrics["jaxserve:num_requests_running"] == 0


def test_disconnected_streams_are_aborted_and_free_their_blocks(server):
    before = _metrics(server)
    idle = before["jaxserve:kv_cache_usage_perc"]

    async def disconnect_midway(session, i):
        body = {"prompt": f"leaver {i}", "max_tokens": 400, "stream": True}
        response = await session.post(server.url + "/v1/completions", json=body)
        seen = 0
        async for event in _read_events(response):
            if event != "[DONE]" and event["choices"] and event["choices"][0]["text"]:
                seen += 1
            if seen >= 3:
                break
        response.close()  # drops the connection mid-stream

    async def main():
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(disconnect_midway(session, i) for i in range(16)))

    asyncio.run(main())
    left = time.monotonic()
    settled = server.wait_for(
        lambda: (m := _metrics(server))["jaxserve:num_requests_running"] == 0
        and m["jaxserve:num_requests_waiting"] == 0 and m["jaxserve:kv_cache_usage_perc"] == idle,
        timeout=2.0,
    )
    assert settled, _metrics(server)
    assert time.monotonic() - left < 2.0
    time.sleep(0.2)
    # Aborted, not finished in the background: 16 x 400 tokens would take 400 steps.
    generated = _metrics(server)["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"]
    assert 16 * 3 <= generated < 16 * 50


def test_non_streaming_client_that_leaves_is_aborted(server):
    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "impatient", "max_tokens": 400}
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(session.post(server.url + "/v1/completions", json=body), 0.3)

    asyncio.run(main())
    assert server.wait_for(lambda: _metrics(server)["jaxserve:num_requests_running"] == 0, timeout=2.0)


def test_overload_gets_503_at_once_and_accepted_requests_complete():
    proc = ServerProcess("--max_num_seqs=2", "--max_queue_len=2", "--fake_step_sleep=0.02").start()
    try:
        async def one(session, i):
            start = time.monotonic()
            async with session.post(proc.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 20}) as r:
                return r.status, r.headers.get("Retry-After"), await r.json(), time.monotonic() - start

        async def main():
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(one(session, i) for i in range(12)))

        results = asyncio.run(main())
    finally:
        assert proc.terminate() == 0, proc.output()
    accepted = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 503]
    assert len(accepted) + len(rejected) == 12
    assert 2 <= len(accepted) <= 4  # two running plus at most two waiting
    for _, _, body, _ in accepted:
        assert body["usage"]["completion_tokens"] == 20
    slowest_accepted = max(r[3] for r in accepted)
    for _, retry_after, body, seconds in rejected:
        assert retry_after is not None and int(retry_after) >= 1
        assert body["error"]["code"] == "queue_full"
        assert seconds < slowest_accepted / 2  # refused at once, not after queueing


def test_sigterm_finishes_in_flight_requests_then_exits_zero():
    proc = ServerProcess("--fake_step_sleep=0.01", "--shutdown_grace_s=20").start()

    async def main():
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(_stream_one(session, proc.url, f"draining {i}", 60)) for i in range(4)]
            await asyncio.sleep(0.2)  # all four are generating
            proc.proc.send_signal(15)
            await asyncio.sleep(0.1)
            async with session.post(proc.url + "/v1/completions", json={"prompt": "late"}) as late:
                late_status = late.status
            return await asyncio.gather(*streams), late_status

    results, late_status = asyncio.run(main())
    assert proc.proc.wait(30) == 0, proc.output()
    assert late_status == 503
    for result in results:
        assert result["done"] and result["usage"]["completion_tokens"] == 60


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_sigterm_after_grace_ends_streams_cleanly():
    proc = ServerProcess("--fake_step_sleep=0.01", "--shutdown_grace_s=0.3").start()

    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "long", "max_tokens": 400, "stream": True}
            async with session.post(proc.url + "/v1/completions", json=body) as response:
                events = []
                async for event in _read_events(response):
                    events.append(event)
                    if len(events) == 3:
                        proc.proc.send_signal(15)
                return events

    events = asyncio.run(main())
    assert proc.proc.wait(30) == 0, proc.output()
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert 3 <= len(events) < 400


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_second_signal_cuts_the_grace_period_short():
    proc = ServerProcess("--fake_step_sleep=0.01", "--shutdown_grace_s=60").start()

    async def main():
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "long", "max_tokens": 500, "stream": True}
            async with session.post(proc.url + "/v1/completions", json=body) as response:
                events = []
                async for event in _read_events(response):
                    events.append(event)
                    if len(events) == 3:
                        proc.proc.send_signal(15)
                        await asyncio.sleep(0.2)
                        proc.proc.send_signal(15)
                return events

    start = time.monotonic()
    events = asyncio.run(main())
    assert proc.proc.wait(30) == 0, proc.output()
    assert time.monotonic() - start < 4.0  # 500 tokens would take 5 s; the grace 60 s
    assert events[-1] == "[DONE]" and "error" in events[-2]
