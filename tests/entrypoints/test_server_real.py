"""`python -m entrypoints.openai.serve --model=default` in a real process: the real engine
(SmolLM2-135M on the CPU) behind the server. One server for the session (conftest.py, shared with
test_server_structured.py); small buckets (the engine tests' shapes, so the persistent
compilation cache is shared with them).
"""

import asyncio
import json
import pathlib
import sys
import time

import aiohttp
import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import http, parse_metrics  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(server):
    return parse_metrics(http("GET", server.url + "/metrics")[2])


def test_greedy_stream_equals_whole(client, server):
    compilations = _metrics(server)["jaxserve:num_compilations_total"]
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    assert whole.usage.completion_tokens == 10 or whole.choices[0].finish_reason == "stop"
    assert "Paris" in whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == whole.choices[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert "Paris" in chat.choices[0].message.content
    # Steady state: serving compiles nothing new.
    assert _metrics(server)["jaxserve:num_compilations_total"] == compilations


def test_bad_requests_against_the_real_tokenizer(server):
    status, _, text = http("POST", server.url + "/v1/completions", {"prompt": "word " * 300, "max_tokens": 4})
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "prompt" and "max_model_len" in error["message"]
    status, _, text = http("POST", server.url + "/v1/completions", {"prompt": [10**9], "max_tokens": 4})
    assert status == 400 and json.loads(text)["error"]["param"] == "prompt"
    body = {"prompt": "One, two, three, four", "max_tokens": 12, "temperature": 0}
    full = json.loads(http("POST", server.url + "/v1/completions", body)[2])["choices"][0]["text"]
    stop = full.strip()[4:7]
    status, _, text = http("POST", server.url + "/v1/completions", dict(body, stop=[stop]))
    choice = json.loads(text)["choices"][0]
    assert status == 200 and choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_concurrent_streams_then_disconnects_free_everything(server):
    idle = _metrics(server)["jaxserve:kv_cache_usage_perc"]

    async def stream(session, i, max_tokens, leave_after=None):
        body = {"prompt": f"Story number {i}: once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        arrivals, usage = [], None
        response = await session.post(server.url + "/v1/completions", json=body)
        buffer = b""
        async for piece in response.content.iter_any():
            buffer += piece
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                data = event[len(b"data: "):]
                if data == b"[DONE]":
                    continue
                payload = json.loads(data)
                if payload["choices"] and payload["choices"][0]["text"]:
                    arrivals.append(time.monotonic())
                usage = payload["usage"] or usage
            if leave_after is not None and len(arrivals) >= leave_after:
                response.close()
                return arrivals, None
        return arrivals, usage

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            finished = await asyncio.gather(*(stream(session, i, 12) for i in range(8)))
            await asyncio.gather(*(stream(session, 100 + i, 200, leave_after=2) for i in range(4)))
            return finished

    finished = asyncio.run(main())
    for arrivals, usage in finished:
        assert usage["completion_tokens"] == 12
        assert len(arrivals) >= 6 and arrivals[0] < arrivals[-1]  # incremental
    left = time.monotonic()
    settled = server.wait_for(
        lambda: (m := _metrics(server))["jaxserve:num_requests_running"] == 0
        and m["jaxserve:kv_cache_usage_perc"] == idle, timeout=2.0)
    assert settled and time.monotonic() - left < 2.0, _metrics(server)


def test_echo_with_logprobs_scores_the_prompt_whole_and_streamed(client, server):
    """`echo` with `logprobs`: the prompt's tokens lead the logprobs (the first with None), as
    OpenAI's legacy completions return them; vLLM's prompt_logprobs field lists them per token."""
    prompt = "The capital of France is"
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert whole.text == prompt + plain.text
    lp = whole.logprobs
    generated = len(plain.logprobs.tokens)
    num_prompt = len(lp.tokens) - generated
    assert num_prompt >= 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:num_prompt])
    assert all(len(t) >= 2 for t in lp.top_logprobs[1:num_prompt])
    assert lp.tokens[num_prompt:] == plain.logprobs.tokens
    assert lp.token_logprobs[num_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    chunks = list(client.completions.create(stream=True, **kwargs))
    first = chunks[0].choices[0]
    assert first.text == prompt and first.logprobs.tokens == lp.tokens[:num_prompt]
    assert first.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:num_prompt], abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    status, _, text = http("POST", server.url + "/v1/completions",
                           {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1})
    listed = json.loads(text)["choices"][0]["prompt_logprobs"]
    assert status == 200 and listed[0] is None and len(listed) == num_prompt
    for entry, token_lp in zip(listed[1:], lp.token_logprobs[1:num_prompt]):
        assert any(abs(v["logprob"] - token_lp) < 1e-4 for v in entry.values())
        assert all(v["rank"] is None or v["rank"] >= 1 for v in entry.values())
