"""Soak test: N requests from C concurrent clients against a server this starts, with random client
disconnects, bad requests and hostile ones mixed in; then checks that every request kept pace and
that the server is exactly as it was.

    python -m experiments.bench.soak --num_requests=1000 --concurrency=32 --abort_fraction=0.3

1. Starts `python -m entrypoints.openai.serve` (random:tiny by default) with a small KV cache
   (--num_kv_blocks), so running requests are preempted, and waits for it to listen.
2. Records the greedy answer to a fixed prompt, and tokenizes a long text (/tokenize) for the
   token-id prompts of the hostile cases.
3. C clients send N requests between them. Each is, at random: a bad request (bad_fraction: a
   body from BAD_BODIES, which must get a 4xx), a hostile one (hostile_fraction, HOSTILE: echo +
   logprobs over a long prompt, n=3 with long outputs, a prompt near max_model_len; never
   abandoned), or a good one (completion or chat, whole or streamed, n of 1 or 2, greedy or
   seeded sampling, text or token-id prompt) of which abort_fraction are abandoned: a stream
   closed after a few chunks, or a whole request whose client gives up after a random fraction
   of a second. Streams ask for usage (stream_options.include_usage), so every finished request
   knows its size.
4. Progress (soak_progress.py): each finished request's latency against the median of its size
   class (prompt tokens, generated tokens, n, scored); one more than --max_progress_ratio times
   its class fails the run, and the worst ratio and its request are reported.
5. Memory: the server's resident memory (/proc/<pid>/status VmRSS) once warmup_fraction of the
   requests are done, every 5 % after, and at the end; growth past --max_rss_growth fails.
6. At the end (the server must settle within --settle_s): no request running or waiting, every KV
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

from experiments.bench.soak_progress import Sample, check_progress

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
_HOSTILE = flags.DEFINE_float("hostile_fraction", 0.06, "Fraction of requests that are the hostile cases (HOSTILE): "
                              "echo + logprobs over a long prompt, n=3 with long outputs, a prompt near max_model_len. "
                              "Never abandoned, so their progress is always checked.")
_LONG_PROMPT = flags.DEFINE_integer("long_prompt_tokens", 720, "Prompt tokens of the echo + logprobs case (capped "
                                    "by max_model_len).")
_LONG_OUTPUT = flags.DEFINE_integer("long_output_tokens", 160, "max_tokens of the n=3 case (capped by max_model_len).")
_MAX_RATIO = flags.DEFINE_float("max_progress_ratio", 8.0, "A finished request whose latency is more than this many "
                                "times its size class's median fails the run (soak_progress.py).")
_PROGRESS_FLOOR = flags.DEFINE_float("progress_floor_s", 1.0, "A request is held to at least this many seconds "
                                     "(times max_progress_ratio): the jitter of a busy machine's steps.")
_MAX_RSS_GROWTH = flags.DEFINE_float("max_rss_growth", 0.05, "Most growth of the server's resident memory from "
                                     "warm-up to the end, as a fraction.")
_WARMUP = flags.DEFINE_float("warmup_fraction", 0.1, "Fraction of the requests after which the server counts as "
                             "warmed up (its RSS then is the baseline).")

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
    kind: str  # good | aborted | bad | hostile
    status: int | None  # HTTP status (None when the client left before the headers)
    seconds: float
    detail: str = ""
    sample: Sample | None = None  # its size and latency, when it finished with usage (soak_progress.py)
    num_done: int = 0  # requests finished before this one, this one included (set by the load)


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


def _usage_sample(body: dict, usage: dict | None, seconds: float, label: str) -> Sample | None:
    """The request's size from its response's usage: per prompt and per sample."""
    if not usage:
        return None
    prompt = body.get("prompt")
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else 1
    n = body.get("n", 1)
    scored = bool(body.get("echo") and body.get("logprobs") is not None) or body.get("prompt_logprobs") is not None
    return Sample(seconds, usage["prompt_tokens"] // num_prompts, usage["completion_tokens"] // (num_prompts * n), n,
                  scored, label)


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


# The hostile cases (issue 32): each (name, body maker). `ids` is a long run of the model's token
# ids (from /tokenize), `limit` the server's max_model_len; each prompt starts at its own offset,
# so no two share a prefix.
HOSTILE = (
    ("echo+logprobs long prompt", lambda rng, ids, limit: {
        "prompt": _ids(rng, ids, min(_LONG_PROMPT.value, limit - 8)), "echo": True, "logprobs": 2, "max_tokens": 2,
        "temperature": 0}),
    ("n=3 long outputs", lambda rng, ids, limit: {
        "prompt": _ids(rng, ids, 16), "n": 3, "max_tokens": max(1, min(_LONG_OUTPUT.value, limit - 32)),
        "temperature": 0.8, "seed": rng.randrange(2**32), "ignore_eos": True}),
    ("prompt near max_model_len", lambda rng, ids, limit: {
        "prompt": _ids(rng, ids, limit - 5), "max_tokens": 4, "temperature": 0}),
)


def _ids(rng: random.Random, ids: list[int], length: int) -> list[int]:
    start = rng.randrange(len(ids))
    return [ids[(start + i) % len(ids)] for i in range(max(1, length))]


async def _read_stream(response, leave_after: int | None) -> tuple[bool, dict | None]:
    """Reads server-sent events: (whether `data: [DONE]` arrived before we left, the usage chunk's usage)."""
    num_chunks, usage = 0, None
    async for line in response.content:
        if line.startswith(b"data: [DONE]"):
            return True, usage
        if line.startswith(b"data: "):
            num_chunks += 1
            if b'"usage"' in line:  # the last chunk (stream_options.include_usage) carries it
                usage = json.loads(line[6:]).get("usage") or usage
            if leave_after is not None and num_chunks >= leave_after:
                response.close()  # the client disconnects mid-stream
                return False, usage
    return False, usage


async def _send(session, url: str, path: str, body: dict, kind: str, label: str, leave_after: int | None,
                start: float) -> Outcome:
    async with session.post(url + path, json=body) as response:
        if not body.get("stream"):
            payload = await response.json()
            seconds = time.monotonic() - start
            if response.status != 200:
                return Outcome(kind, response.status, seconds, payload.get("error", {}).get("message", ""))
            return Outcome(kind, 200, seconds, "", _usage_sample(body, payload.get("usage"), seconds, label))
        if response.status != 200:
            return Outcome(kind, response.status, time.monotonic() - start, (await response.text())[:300])
        done, usage = await _read_stream(response, leave_after)
        seconds = time.monotonic() - start
        if not done:
            return Outcome("aborted" if leave_after is not None else kind, 200, seconds,
                           "" if leave_after is not None else "stream cut")
        return Outcome(kind, 200, seconds, "", _usage_sample(body, usage, seconds, label))


async def _one(session, url: str, rng: random.Random, ids: list[int], limit: int) -> Outcome:
    start = time.monotonic()
    if rng.random() < _BAD.value:
        name, path, raw = rng.choice(BAD_BODIES)
        async with session.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            return Outcome("bad", response.status, time.monotonic() - start, name)
    if rng.random() < _HOSTILE.value:
        name, make = rng.choice(HOSTILE)
        body = {**make(rng, ids, limit), "stream": rng.random() < 0.5}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return await _send(session, url, "/v1/completions", body, "hostile", name, None, start)
    path, body = _good_body(rng, _MAX_TOKENS.value)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    label = f"{path.rsplit('/', 1)[1]} {'stream' if body['stream'] else 'whole'} n={body.get('n', 1)}"
    abort = rng.random() < _ABORT.value
    if abort and not body["stream"]:
        try:
            async with asyncio.timeout(rng.uniform(0.01, 0.5)):
                return await _send(session, url, path, body, "good", label, None, start)
        except TimeoutError:
            return Outcome("aborted", None, time.monotonic() - start, "left a whole request")
    return await _send(session, url, path, body, "good", label, rng.randint(1, 6) if abort else None, start)


def rss_kib(pid: int) -> int | None:
    """A process's resident memory (VmRSS, KiB), or None if it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def _load(url: str, ids: list[int], limit: int, pid: int) -> tuple[list[Outcome], int, dict]:
    """Runs the request mix; returns the outcomes, how many clients were stuck, and the server's
    RSS (KiB) when warm (warmup_fraction of the requests done) and every 5 % of them."""
    rng = random.Random(_SEED.value)
    seeds = [rng.randrange(2**63) for _ in range(_NUM_REQUESTS.value)]
    queue: asyncio.Queue = asyncio.Queue()
    for seed in seeds:
        queue.put_nowait(seed)
    outcomes: list[Outcome] = []
    stuck = 0
    rss = {"warm": None, "series": []}
    warm_at = max(1, int(_WARMUP.value * _NUM_REQUESTS.value))
    every = max(1, _NUM_REQUESTS.value // 20)
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        outcome.num_done = len(outcomes)
        if outcome.num_done == warm_at:
            rss["warm"] = rss_kib(pid)
        if outcome.num_done % every == 0:
            rss["series"].append((outcome.num_done, rss_kib(pid)))

    async def client(session):
        nonlocal stuck
        while not queue.empty():
            request_rng = random.Random(queue.get_nowait())
            try:
                async with asyncio.timeout(_REQUEST_TIMEOUT.value):
                    record(await _one(session, url, request_rng, ids, limit))
            except TimeoutError:
                stuck += 1
                record(Outcome("stuck", None, _REQUEST_TIMEOUT.value))
            except aiohttp.ClientError as exc:
                record(Outcome("client_error", None, 0.0, f"{type(exc).__name__}: {exc}"))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(_CONCURRENCY.value)))
    return outcomes, stuck, rss


async def _get(url: str, path: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(url + path) as response:
            return response.status, await response.text()


async def _long_ids(url: str) -> tuple[list[int], int]:
    """A long run of the served model's token ids (tokenized words) and its max_model_len."""
    rng = random.Random(_SEED.value + 1)
    text = " ".join(rng.choices(WORDS, k=3000))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"/tokenize failed: {payload}")
            return payload["tokens"], payload["max_model_len"]


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
        ids, limit = asyncio.run(_long_ids(server.url))
        start = time.monotonic()
        outcomes, stuck, rss = asyncio.run(_load(server.url, ids, limit, server.proc.pid))
        load_seconds = time.monotonic() - start
        metrics = asyncio.run(_settle(server.url, _SETTLE.value))
        after = asyncio.run(_reference(server.url))
        health = asyncio.run(_get(server.url, "/health"))[0]
        rss["end"] = rss_kib(server.proc.pid)
    finally:
        exit_code = server.stop()
    counts = collections.Counter(o.kind for o in outcomes)
    statuses = collections.Counter(str(o.status) for o in outcomes)
    server_5xx = {k: v for k, v in metrics.items() if k.startswith('jaxserve:http_responses_total{status="5')}
    free, cached = metrics.get("jaxserve:num_free_blocks"), metrics.get("jaxserve:num_cached_blocks")
    usable = _NUM_KV_BLOCKS.value - 1
    finished = [o for o in outcomes if o.kind in ("good", "hostile") and o.status == 200]
    progress = check_progress([o.sample for o in finished if o.sample is not None], max_ratio=_MAX_RATIO.value,
                              min_seconds=_PROGRESS_FLOOR.value)
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss["warm"] and rss["end"] else None
    checks = {
        "every request answered": len(outcomes) == _NUM_REQUESTS.value and not counts["client_error"],
        "no client stuck": stuck == 0,
        "no 5xx seen by clients": not any(o.status is not None and o.status >= 500 for o in outcomes),
        "no 5xx counted by the server": not server_5xx,
        "bad requests got 4xx": all(o.status is not None and 400 <= o.status < 500 for o in outcomes if o.kind == "bad"),
        "good requests got 200": all(o.status == 200 for o in outcomes if o.kind in ("good", "hostile")),
        "every finished request reported its usage": all(o.sample is not None for o in finished),
        f"every request kept pace (latency <= {_MAX_RATIO.value:g} x its class's median)": progress.passed,
        "nothing running or waiting": metrics.get("jaxserve:num_requests_running") == 0
        and metrics.get("jaxserve:num_requests_waiting") == 0,
        "every block free or cached": free is not None and cached is not None and free + cached == usable
        and metrics.get("jaxserve:kv_cache_usage_perc") == 0,
        f"RSS growth after warm-up under {_MAX_RSS_GROWTH.value:.0%}": growth is not None
        and growth < _MAX_RSS_GROWTH.value,
        "greedy answer unchanged": after == reference,
        "healthy at the end": health == 200,
        "clean exit on SIGTERM": exit_code == 0,
    }
    failures = [name for name, ok in checks.items() if not ok]
    bad_details = sorted({o.detail for o in outcomes if o.kind in ("good", "hostile") and o.status != 200})[:10]
    latencies = [o.seconds for o in finished]
    worst = progress.worst
    result = {
        "config": {"num_requests": _NUM_REQUESTS.value, "concurrency": _CONCURRENCY.value,
                   "abort_fraction": _ABORT.value, "bad_fraction": _BAD.value, "hostile_fraction": _HOSTILE.value,
                   "model": _MODEL.value, "num_kv_blocks": _NUM_KV_BLOCKS.value, "max_num_seqs": _MAX_NUM_SEQS.value,
                   "max_model_len": _MAX_MODEL_LEN.value, "seed": _SEED.value, "server_args": _SERVER_ARGS.value},
        "load_seconds": round(load_seconds, 2),
        "outcomes": dict(counts),
        "statuses": dict(statuses),
        "hostile": _by_label([o.sample for o in outcomes if o.kind == "hostile" and o.sample], progress),
        "num_preemptions": metrics.get("jaxserve:num_preemptions_total"),
        "num_free_blocks": free, "num_cached_blocks": cached, "num_usable_blocks": usable,
        "num_leaked_blocks": None if free is None or cached is None else usable - free - cached,
        "generation_tokens": metrics.get("jaxserve:generation_tokens_total"),
        "slow_clients_dropped": {k: v for k, v in metrics.items() if "slow_clients_dropped" in k},
        "p50_seconds": _percentile(latencies, 0.5),
        "p95_seconds": _percentile(latencies, 0.95),
        "p99_seconds": _percentile(latencies, 0.99),
        "progress": {"worst_ratio": None if progress.worst_ratio is None else round(progress.worst_ratio, 3),
                     "max_ratio": progress.max_ratio, "num_checked": progress.num_checked,
                     "num_over": progress.num_over, "worst": dataclasses.asdict(worst) if worst else None,
                     "worst_class": progress.worst_class, "worst_class_median": progress.worst_median,
                     "top": progress.top, "summary": progress.summary()},
        "rss_kib": {"warm": rss["warm"], "end": rss["end"], "growth": None if growth is None else round(growth, 4),
                    "max": max((v for _, v in rss["series"] if v), default=None), "series": rss["series"]},
        "reference": reference,
        "checks": checks,
        "failures": failures,
        "non_200_good_details": bad_details,
        "passed": not failures,
    }
    if failures:
        result["server_log_tail"] = "".join(server.lines[-60:])
    return result


def _by_label(samples: list[Sample], progress) -> dict:
    """Per hostile case: how many finished, their median and longest latency (s), their worst progress ratio."""
    by: dict[str, list[float]] = collections.defaultdict(list)
    for s in samples:
        by[s.label].append(s.latency)
    return {label: {"count": len(v), "median_s": _percentile(v, 0.5), "max_s": round(max(v), 3),
                    "worst_ratio": progress.worst_by_label.get(label)}
            for label, v in sorted(by.items())}


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
          f"{result['num_cached_blocks']} of {result['num_usable_blocks']}; finished p50 {result['p50_seconds']} s, "
          f"p95 {result['p95_seconds']} s, p99 {result['p99_seconds']} s; server RSS {result['rss_kib']['warm']} KiB "
          f"warm -> {result['rss_kib']['end']} KiB at the end (growth {result['rss_kib']['growth']})")
    print(result["progress"]["summary"])
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
