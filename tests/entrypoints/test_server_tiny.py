"""The real server and engine on random:tiny (2 layers, byte tokenizer) in a real process: the
hostile-input matrix end to end, and fairness between a huge request and a small one."""

import asyncio
import json
import os
import pathlib
import sys
import time

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from hostile_inputs import CASES  # noqa: E402
from server_launcher import ROOT, ServerProcess, http, parse_metrics  # noqa: E402

CACHE = os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax"))
MAX_NUM_SEQS = 8
TINY_FLAGS = (
    "--model=random:tiny", f"--max_num_seqs={MAX_NUM_SEQS}", "--max_num_batched_tokens=64", "--max_model_len=1024",
    "--block_size=16", "--num_kv_blocks=1025", "--token_buckets=8,64", f"--seq_buckets={MAX_NUM_SEQS}",
    "--max_queue_len=256", f"--compilation_cache_dir={CACHE}",
)
GREEDY = {"prompt": "The reference prompt", "max_tokens": 16, "temperature": 0}


# A real server on random:tiny: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(*TINY_FLAGS, fake=False, startup_timeout=600).start()
    yield proc
    assert proc.terminate(timeout=60) == 0, proc.output()[-3000:]


def _metrics(server):
    return parse_metrics(http("GET", server.url + "/metrics")[2])


def _greedy(server) -> str:
    status, _, text = http("POST", server.url + "/v1/completions", GREEDY)
    assert status == 200, text
    return json.loads(text)["choices"][0]["text"]


def test_hostile_inputs_end_to_end(server):
    reference = _greedy(server)
    for name, path, body in CASES:
        status, _, text = http("POST", server.url + path, body, {"Content-Type": "application/json"})
        assert status < 500, (name, status, text[:500])
        assert _greedy(server) == reference, name
    for body in ({"prompt": [300]}, {"prompt": [5, 256], "echo": True}):  # the vocabulary is 256 ids
        status, _, text = http("POST", server.url + "/v1/completions", body)
        assert status == 400 and json.loads(text)["error"]["param"] == "prompt", text
    status, _, text = http("POST", server.url + "/v1/completions",
                           {"prompt": "Hello", "max_tokens": 4, "top_k": 2**31 - 1, "seed": 2**64 - 1})
    assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4  # top_k clamped to 256
    metrics = _metrics(server)
    assert not any(key.startswith('jaxserve:http_responses_total{status="5') for key in metrics), metrics
    assert metrics["jaxserve:num_requests_running"] == 0
    blocks = metrics["jaxserve:num_free_blocks"] + metrics["jaxserve:num_cached_blocks"]
    assert blocks == 1024  # every block but the null block is free or cached


async def _stream_until(session, url, body, stop: asyncio.Event, progress: dict, finished: set):
    """Streams a request, noting which choices produced text (`progress`) and which finished,
    until `stop` is set (then it disconnects, which aborts the rest) or it ends."""
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    progress[choice["index"]] = progress.get(choice["index"], 0) + 1
                    if choice["finish_reason"] is not None:
                        finished.add(choice["index"])
            if stop.is_set():
                return "left"
    return "finished"


def test_a_small_request_is_served_while_a_huge_one_runs(server):
    # 8 prompts x n=4 = 32 sequences of 900 tokens on 8 seats: about 3600 steps of work.
    huge = {"prompt": [f"huge {i}" for i in range(8)], "n": 4, "max_tokens": 900, "ignore_eos": True,
            "stream": True, "temperature": 1.0}

    async def main():
        stop, progress, finished = asyncio.Event(), {}, set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            task = asyncio.create_task(_stream_until(session, server.url, huge, stop, progress, finished))
            while len(progress) < MAX_NUM_SEQS:  # the huge request holds every seat
                await asyncio.sleep(0.05)
            start = time.monotonic()
            try:
                async with session.post(server.url + "/v1/completions", json={"prompt": "small", "max_tokens": 4},
                                        timeout=aiohttp.ClientTimeout(total=10)) as response:
                    small = await response.json()
                elapsed = time.monotonic() - start
                finished_before = set(finished)
            finally:
                stop.set()
            huge_outcome = await task
        return small, elapsed, huge_outcome, finished_before

    small, elapsed, huge_outcome, finished_before = asyncio.run(main())
    assert small["usage"]["completion_tokens"] == 4
    # Served beside the huge request, not after one of its sequences freed a seat.
    assert huge_outcome == "left" and not finished_before, sorted(finished_before)
    assert elapsed < 10
