"""The soak's load (experiments/bench/soak.py): the request mix its clients send, and the clients.

`run_load` has C clients (concurrency) send N requests (num_requests) between them. Each is, at
random: a bad request (bad_fraction: a body from BAD_BODIES, which must get a 4xx), a hostile one
(hostile_fraction, HOSTILE: echo + logprobs over a long prompt, n=3 with long outputs, a prompt
near max_model_len; never abandoned), or a good one (completion or chat, whole or streamed, n of
1 or 2, greedy or seeded sampling, text or token-id prompt) of which abort_fraction are abandoned:
a stream closed after a few chunks, or a whole request whose client gives up after a random
fraction of a second. Streams ask for usage (stream_options.include_usage), so every finished
request knows its size (a soak_progress.Sample). A client waiting past request_timeout_s is
stuck. While it runs, the server's resident memory (rss_kib) is read once warmup_fraction of the
requests are done and every 5 % of them after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import aiohttp

from experiments.bench.soak_progress import Sample

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


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """The load's knobs (soak.py's flags of the same names)."""
    num_requests: int
    concurrency: int
    abort_fraction: float
    bad_fraction: float
    hostile_fraction: float
    max_tokens: int  # most tokens a good request asks for
    long_prompt_tokens: int  # prompt tokens of the echo + logprobs case (capped by max_model_len)
    long_output_tokens: int  # max_tokens of the n=3 case (capped by max_model_len)
    seed: int
    request_timeout_s: float
    warmup_fraction: float


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
# ids (from /tokenize), `limit` the server's max_model_len, `config` the LoadConfig; each prompt
# starts at its own offset, so no two share a prefix.
HOSTILE = (
    ("echo+logprobs long prompt", lambda rng, ids, limit, config: {
        "prompt": _ids(rng, ids, min(config.long_prompt_tokens, limit - 8)), "echo": True, "logprobs": 2,
        "max_tokens": 2, "temperature": 0}),
    ("n=3 long outputs", lambda rng, ids, limit, config: {
        "prompt": _ids(rng, ids, 16), "n": 3, "max_tokens": max(1, min(config.long_output_tokens, limit - 32)),
        "temperature": 0.8, "seed": rng.randrange(2**32), "ignore_eos": True}),
    ("prompt near max_model_len", lambda rng, ids, limit, config: {
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


async def _one(session, url: str, rng: random.Random, ids: list[int], limit: int, config: LoadConfig) -> Outcome:
    start = time.monotonic()
    if rng.random() < config.bad_fraction:
        name, path, raw = rng.choice(BAD_BODIES)
        async with session.post(url + path, data=raw, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            return Outcome("bad", response.status, time.monotonic() - start, name)
    if rng.random() < config.hostile_fraction:
        name, make = rng.choice(HOSTILE)
        body = {**make(rng, ids, limit, config), "stream": rng.random() < 0.5}
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        return await _send(session, url, "/v1/completions", body, "hostile", name, None, start)
    path, body = _good_body(rng, config.max_tokens)
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    label = f"{path.rsplit('/', 1)[1]} {'stream' if body['stream'] else 'whole'} n={body.get('n', 1)}"
    abort = rng.random() < config.abort_fraction
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


async def run_load(url: str, ids: list[int], limit: int, pid: int,
                   config: LoadConfig) -> tuple[list[Outcome], int, dict]:
    """Runs the request mix; returns the outcomes, how many clients were stuck, and the server's
    RSS (KiB) when warm (warmup_fraction of the requests done) and every 5 % of them."""
    rng = random.Random(config.seed)
    seeds = [rng.randrange(2**63) for _ in range(config.num_requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for seed in seeds:
        queue.put_nowait(seed)
    outcomes: list[Outcome] = []
    stuck = 0
    rss = {"warm": None, "series": []}
    warm_at = max(1, int(config.warmup_fraction * config.num_requests))
    every = max(1, config.num_requests // 20)
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
                async with asyncio.timeout(config.request_timeout_s):
                    record(await _one(session, url, request_rng, ids, limit, config))
            except TimeoutError:
                stuck += 1
                record(Outcome("stuck", None, config.request_timeout_s))
            except aiohttp.ClientError as exc:
                record(Outcome("client_error", None, 0.0, f"{type(exc).__name__}: {exc}"))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(config.concurrency)))
    return outcomes, stuck, rss
