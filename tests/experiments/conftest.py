"""Fixtures for the measurement tests: a fake tokenizer and a fake OpenAI-compatible server.

The server runs aiohttp on loopback in a thread with its own event loop (the client under test
runs `asyncio.run` on the test's thread). It streams `max_tokens` tokens named `t0 t1 ...`: the
first after `ttft_s`, each next one `itl_s` later, then a usage event and `[DONE]`. A prompt
containing "FAIL" gets HTTP 500. It records every payload and the most requests in flight.
"""

import asyncio
import dataclasses
import json
import threading

import pytest
from aiohttp import web


class WordTokenizer:
    """One token per whitespace-separated word; ids are assigned on first sight."""

    def __init__(self):
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text, add_special_tokens=False):
        ids = []
        for word in text.split():
            if word not in self.vocab:
                self.vocab[word] = len(self.words)
                self.words.append(word)
            ids.append(self.vocab[word])
        return ids

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


@pytest.fixture
def tokenizer():
    return WordTokenizer()


@dataclasses.dataclass
class FakeServer:
    base_url: str = ""
    ttft_s: float = 0.05
    itl_s: float = 0.02
    payloads: list = dataclasses.field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        if "FAIL" in prompt:
            return web.Response(status=500, text="injected failure")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)

            async def send(event):
                await response.write(f"data: {json.dumps(event)}\n\n".encode())

            if chat:  # OpenAI sends the role first, with no content
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            n = payload["max_tokens"]
            for i in range(n):
                await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
                text = f" t{i}"
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                                  "text": text}
                await send({"choices": [choice]})
            if payload.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n}
                await send({"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            self.in_flight -= 1

    async def completions(self, request):
        return await self._stream(request, chat=False)

    async def chat(self, request):
        return await self._stream(request, chat=True)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})


@pytest.fixture
def fake_server():
    server = FakeServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_get("/v1/models", server.models)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(app)

    async def start():
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    server.base_url = f"http://127.0.0.1:{port}"
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()
