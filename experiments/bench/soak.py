"""Soak test: N requests from C concurrent clients against a server this starts, with random client
disconnects and bad requests mixed in; then checks the server is exactly as it was.

    python -m experiments.bench.soak --num_requests=1000 --concurrency=32 --abort_fraction=0.3

1. Starts `python -m entrypoints.openai.serve` (random:tiny by default) with a small KV cache
   (--num_kv_blocks), so running requests are preempted, and waits for it to listen.
2. Records the greedy answer to a fixed prompt.
3. C clients send N requests between them. Each is, at random: a bad request (bad_fraction: a
   body from BAD_BODIES, which must get a 4xx), or a good one (completion or chat, whole or
   streamed, n of 1 or 2, greedy or seeded sampling, text or token-id prompt) of which
   abort_fraction are abandoned: a stream closed after a few chunks, or a whole request whose
   client gives up after a random fraction of a second.
4. At the end (the server must settle within --settle_s): no request running or waiting, every KV
   block free or cached (from /metrics: num_free_blocks + num_cached_blocks = num_kv_blocks - 1,
   usage 0), no 5xx seen by a client or counted by the server, no client stuck past
   --request_timeout_s, the greedy answer unchanged, the server exits 0 on SIGTERM.

Prints a summary, writes --result_json, and exits 1 if any check failed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import aiohttp
from absl import app, flags

_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 1000, "Requests in all (good, aborted and bad).")
_CONCURRENCY = flags.DEFINE_integer("concurrency", 32, "Concurrent clients.")
_ABORT = flags.DEFINE_float("abort_fraction", 0.3, "Fraction of good requests whose client disconnects midway.")
_BAD = flags.DEFINE_float("bad_fraction", 0.1, "Fraction of requests that are malformed or out of range.")
_MODEL = flags.DEFINE_string("model", "random:tiny", "Model to serve (random:tiny, default, ...).")
_NUM_KV_BLOCKS = flags.DEFINE_integer("num_kv_blocks", 40, "KV blocks (small, to force preemption).")
_MAX_NUM_SEQS = flags.DEFINE_integer("max_num_seqs", 8, "Engine max_num_seqs.")
_MAX_MODEL_LEN = flags.DEFINE_integer("max_model_len", 256, "Engine max_model_len.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "Most tokens a good request asks for.")
_SERVER_ARGS = flags.DEFINE_string("server_args", "--max_num_batched_tokens=64 --token_buckets=8,64 --seq_buckets=8",
                                   "More flags for the server.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the request mix.")
_REQUEST_TIMEOUT = flags.DEFINE_float("request_timeout_s", 180.0, "A client waiting longer than this is stuck.")
_SETTLE = flags.DEFINE_float("settle_s", 30.0, "Seconds the server has to settle after the load.")
_STARTUP = flags.DEFINE_float("startup_timeout_s", 600.0, "Seconds the server has to start.")
_RESULT_JSON = flags.DEFINE_string("result_json", None, "Where to write the result (JSON).")

REFERENCE = {"prompt": "The soak test reference prompt", "max_tokens": 24, "temperature": 0}
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "serving", "engine", "token",
         "cache", "block", "paged", "attention", "soak", "naïve", "café", "日本", "😀")
# (name, path, raw body): each must get a 4xx.
BAD_BODIES = [
    ("top_k 2**31", "/v1/completions", b'{"prompt": "Hello", "max_tokens": 4, "top_k": 2147483648}'),
    ("seed 2**64", "/v1/completions", b'{"prompt": "a", "seed": 18446744073709551616}'),
    ("max_tokens 2**70", "/v1/completions", b'{"prompt": "a", "max_tokens": 1180591620717411303424}'),
    ("n 1000", "/v1/completions", b'{"prompt": "a", "n": 1000}'),
    ("temperature NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}'),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}'),
    ("chat lone surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
    ("not JSON", "/v1/completions", b'{"prompt": '),
    ("deep nesting", "/v1/completions", b"[" * 50_000 + b"]" * 50_000),
    ("token id outside the vocabulary", "/v1/completions", b'{"prompt": [2147483647], "echo": true}'),
    ("prompt too long", "/v1/completions", b'{"prompt": "' + b"x" * 5000 + b'"}'),
    ("stop list", "/v1/completions", b'{"prompt": "a", "stop": [' + b",".join([b'"x"'] * 100) + b"]}"),
    ("bad role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}'),
    ("unknown model", "/v1/completions", b'{"prompt": "a", "model": "gpt-9"}'),
]


@dataclasses.dataclass
class Outcome:
    kind: str  # good | aborted | bad
    status: int | None  # HTTP status (None when the client left before the headers)
    seconds: float
    detail: str = ""


class Server:
    """The server subprocess, in its own process group; `url` once it listens."""

    def __init__(self, args: list[str]):
        self.args = args
        self.lines: list[str] = []
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> Server:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        ready = threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.lines.append(line)
                match = re.search(r"jaxserve: serving .* on (http://\S+)", line)
                if match and self.url is None:
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-40:]))
        return self

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def _good_body(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 24)))
    params = {"max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.5}
    if rng.random() < 0.5:
        params.update(temperature=0.8, seed=rng.randrange(2**32))
    else:
        params["temperature"] = 0
    if rng.random() < 0.15:
        params["n"] = 2
    if rng.random() < 0.25:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], **params}
    prompt: str | list[int] | list[str] = text
    if rng.random() < 0.15:
        prompt = list(text.encode()[:64]) or [65]  # token ids (random:tiny's vocabulary is bytes)
    elif rng.random() < 0.1:
        prompt = [text, text[::-1] or "x"]
    return "/v1/completions", {"prompt": prompt, **params}


async def _read_stream(response, leave_after: int | None) -> bool:
    """Reads server-sent events; True once `data: [DONE]` arrived, False if we left first."""
    num_chunks = 0
    async for line in response.content:
        if line.startswith(b"data: [DONE]"):
            return True
        if line.startswith(b"data: "):
            num_chunks += 1
            if leave_after is not None and num_chunks >= leave_after:
                response.close()  # the client disconnects mid-stream
                return False
    return False


async def _one(session, url: str, rng: random.Random) -> Outcome:
    start = time.monotonic()
    if rng.random() < _BAD.value:
        name, path, raw = rng.choice(BAD_BODIES)
        async with session.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            return Outcome("bad", response.status, time.monotonic() - start, name)
    path, body = _good_body(rng, _MAX_TOKENS.value)
    abort = rng.random() < _ABORT.value
    if abort and not body["stream"]:
        try:
            async with asyncio.timeout(rng.uniform(0.01, 0.5)):
                async with session.post(url + path, json=body) as response:
                    await response.read()
                    return Outcome("good", response.status, time.monotonic() - start, "finished before leaving")
        except TimeoutError:
            return Outcome("aborted", None, time.monotonic() - start, "left a whole request")
    async with session.post(url + path, json=body) as response:
        if not body["stream"]:
            payload = await response.json()
            detail = "" if response.status == 200 else payload.get("error", {}).get("message", "")
            return Outcome("good", response.status, time.monotonic() - start, detail)
        if response.status != 200:
            return Outcome("good", response.status, time.monotonic() - start, (await response.text())[:300])
        done = await _read_stream(response, rng.randint(1, 6) if abort else None)
        kind = "good" if done else "aborted"
        return Outcome(kind, response.status, time.monotonic() - start, "" if done or abort else "stream cut")


async def _load(url: str) -> tuple[list[Outcome], int]:
    """Runs the request mix; returns the outcomes and how many clients were stuck."""
    rng = random.Random(_SEED.value)
    seeds = [rng.randrange(2**63) for _ in range(_NUM_REQUESTS.value)]
    queue: asyncio.Queue = asyncio.Queue()
    for seed in seeds:
        queue.put_nowait(seed)
    outcomes: list[Outcome] = []
    stuck = 0
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)

    async def client(session):
        nonlocal stuck
        while not queue.empty():
            request_rng = random.Random(queue.get_nowait())
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT.value):
                    outcomes.append(await _one(session, url, request_rng))
            except TimeoutError:
                stuck += 1
                outcomes.append(Outcome("stuck", None, _REQUEST_TIMEOUT.value))
            except aiohttp.ClientError as exc:
                outcomes.append(Outcome("client_error", None, 0.0, f"{type(exc).__name__}: {exc}"))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(_CONCURRENCY.value)))
    return outcomes, stuck


async def _get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(url + path) as response:
            return response.status, await response.text()


async def _reference(url: str) -> str:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + "/v1/completions", json=REFERENCE) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"the reference request failed: {payload}")
            return payload["choices"][0]["text"]


async def _settle(url: str, seconds: float) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        metrics = parse_metrics((await _get(url, "/metrics"))[1])
        idle = (metrics.get("jaxserve:num_requests_running") == 0 and metrics.get("jaxserve:num_requests_waiting") == 0
                and metrics.get("jaxserve:kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


def run() -> dict:
    args = [sys.executable, "-m", "entrypoints.openai.serve", f"--model={_MODEL.value}", "--host=127.0.0.1",
            "--port=0", f"--num_kv_blocks={_NUM_KV_BLOCKS.value}", f"--max_num_seqs={_MAX_NUM_SEQS.value}",
            f"--max_model_len={_MAX_MODEL_LEN.value}", "--log_level=warning", *shlex.split(_SERVER_ARGS.value)]
    server = Server(args).start(_STARTUP.value)
    failures: list[str] = []
    try:
        reference = asyncio.run(_reference(server.url))
        start = time.monotonic()
        outcomes, stuck = asyncio.run(_load(server.url))
        load_seconds = time.monotonic() - start
        metrics = asyncio.run(_settle(server.url, _SETTLE.value))
        after = asyncio.run(_reference(server.url))
        health = asyncio.run(_get(server.url, "/health"))[0]
    finally:
        exit_code = server.stop()
    counts = collections.Counter(o.kind for o in outcomes)
    statuses = collections.Counter(str(o.status) for o in outcomes)
    server_5xx = {k: v for k, v in metrics.items() if k.startswith('jaxserve:http_responses_total{status="5')}
    free, cached = metrics.get("jaxserve:num_free_blocks"), metrics.get("jaxserve:num_cached_blocks")
    usable = _NUM_KV_BLOCKS.value - 1
    checks = {
        "every request answered": len(outcomes) == _NUM_REQUESTS.value and not counts["client_error"],
        "no client stuck": stuck == 0,
        "no 5xx seen by clients": not any(o.status is not None and o.status >= 500 for o in outcomes),
        "no 5xx counted by the server": not server_5xx,
        "bad requests got 4xx": all(o.status is not None and 400 <= o.status < 500 for o in outcomes if o.kind == "bad"),
        "good requests got 200": all(o.status == 200 for o in outcomes if o.kind == "good"),
        "nothing running or waiting": metrics.get("jaxserve:num_requests_running") == 0
        and metrics.get("jaxserve:num_requests_waiting") == 0,
        "every block free or cached": free is not None and cached is not None and free + cached == usable
        and metrics.get("jaxserve:kv_cache_usage_perc") == 0,
        "greedy answer unchanged": after == reference,
        "healthy at the end": health == 200,
        "clean exit on SIGTERM": exit_code == 0,
    }
    failures = [name for name, ok in checks.items() if not ok]
    bad_details = sorted({o.detail for o in outcomes if o.kind == "good" and o.status != 200})[:10]
    result = {
        "config": {"num_requests": _NUM_REQUESTS.value, "concurrency": _CONCURRENCY.value,
                   "abort_fraction": _ABORT.value, "bad_fraction": _BAD.value, "model": _MODEL.value,
                   "num_kv_blocks": _NUM_KV_BLOCKS.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                   "max_model_len": _MAX_MODEL_LEN.value, "seed": _SEED.value},
        "load_seconds": round(load_seconds, 2),
        "outcomes": dict(counts),
        "statuses": dict(statuses),
        "num_preemptions": metrics.get("jaxserve:num_preemptions_total"),
        "num_free_blocks": free, "num_cached_blocks": cached, "num_usable_blocks": usable,
        "generation_tokens": metrics.get("jaxserve:generation_tokens_total"),
        "slow_clients_dropped": {k: v for k, v in metrics.items() if "slow_clients_dropped" in k},
        "p50_seconds": _percentile([o.seconds for o in outcomes if o.kind == "good"], 0.5),
        "p99_seconds": _percentile([o.seconds for o in outcomes if o.kind == "good"], 0.99),
        "reference": reference,
        "checks": checks,
        "failures": failures,
        "non_200_good_details": bad_details,
        "passed": not failures,
    }
    if failures:
        result["server_log_tail"] = "".join(server.lines[-60:])
    return result


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    result = run()
    print(f"soak: {result['config']['num_requests']} requests at concurrency {result['config']['concurrency']} "
          f"in {result['load_seconds']} s; outcomes {result['outcomes']}; statuses {result['statuses']}; "
          f"preemptions {result['num_preemptions']}; blocks free {result['num_free_blocks']} + cached "
          f"{result['num_cached_blocks']} of {result['num_usable_blocks']}; good p50 {result['p50_seconds']} s, "
          f"p99 {result['p99_seconds']} s")
    for name, ok in result["checks"].items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if _RESULT_JSON.value:
        with open(_RESULT_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
    if not result["passed"]:
        print(result.get("server_log_tail", ""), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
