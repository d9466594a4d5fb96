"""The fairness acceptance at full size, on the default model (SmolLM2-135M on the CPU): with a
huge request running (64 prompts x n=16 x max_tokens=4000, ignore_eos: 32 running, 992
waiting), a 4-token request from another client completes within 10 s.

Slow (the model loads and compiles, then one client fills the engine): deselected by default
(pyproject addopts), it runs when asked,
`pytest -m slow tests/entrypoints/test_server_fairness.py`. The fast version of the same check is
test_server_tiny.py::test_a_small_request_is_served_while_a_huge_one_runs.
"""

import asyncio
import json
import os
import pathlib
import sys
import time

import aiohttp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import ROOT, ServerProcess, http, parse_metrics  # noqa: E402

CACHE = os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax"))
FLAGS = ("--model=default", "--max_num_seqs=32", "--max_num_batched_tokens=256", "--token_buckets=32,256",
         "--seq_buckets=32", f"--compilation_cache_dir={CACHE}")


@pytest.mark.slow
def test_a_4_token_request_completes_within_10_s_beside_a_huge_one():
    proc = ServerProcess(*FLAGS, fake=False, startup_timeout=900).start()
    huge = {"prompt": [f"Write story number {i}:" for i in range(64)], "n": 16, "max_tokens": 4000,
            "ignore_eos": True, "temperature": 1.0, "stream": True}

    async def main():
        finished, leave = set(), asyncio.Event()

        async def run_huge(session):
            async with session.post(proc.url + "/v1/completions", json=huge) as response:
                assert response.status == 200
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        finished.update(c["index"] for c in json.loads(line[6:])["choices"] if c["finish_reason"])
                    if leave.is_set():
                        return

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            task = asyncio.create_task(run_huge(session))
            while True:  # until the huge request fills the engine
                metrics = parse_metrics(http("GET", proc.url + "/metrics")[2])
                if metrics["jaxserve:num_requests_running"] == 32 and metrics["jaxserve:num_requests_waiting"] > 900:
                    break
                await asyncio.sleep(0.5)
            start = time.monotonic()
            try:
                async with session.post(proc.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4},
                                        timeout=aiohttp.ClientTimeout(total=10)) as response:
                    small = await response.json()
                return small, time.monotonic() - start, set(finished)
            finally:
                leave.set()
                await task

    try:
        small, elapsed, finished_before = asyncio.run(main())
    finally:
        assert proc.terminate(timeout=120) == 0, proc.output()[-3000:]
    assert small["usage"]["completion_tokens"] == 4 and elapsed < 10 and not finished_before
    print(f"the 4-token request took {elapsed:.2f} s beside the huge one")
