"""An async load generator for any OpenAI-compatible streaming endpoint.

1. `run(samples, config)` opens one aiohttp session (no connection cap, so concurrency is only
   what the config says) and dispatches requests from one loop.
2. Arrivals: with `use_trace_arrivals`, each sample is sent at its `arrival_offset_s`; otherwise
   at `request_rate` per second with gamma-distributed gaps (shape = `burstiness`, mean
   1 / rate; burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular); an
   infinite rate sends everything at once.
3. `max_concurrency` caps requests in flight with a semaphore taken before a request is sent, so
   a request's clock starts when it actually goes out (as in vLLM).
4. The run stops issuing after `num_requests` requests or `duration_s` seconds (samples are
   reused cyclically in duration mode) and waits for the requests in flight.
5. Each request streams server-sent events (`data: {...}` lines, `data: [DONE]` at the end); every
   event with generated text is timestamped on arrival, and `stream_options.include_usage` makes
   the server report the exact `completion_tokens` (without it the chunks are counted).
   The result is one `metrics.RequestRecord` per request; `metrics.compute_metrics` does the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from experiments.lab.datasets import SampleRequest
from experiments.lab.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "completions"  # completions | chat
    request_rate: float = math.inf  # requests / s; inf = all at once
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1 = Poisson
    max_concurrency: int | None = None
    use_trace_arrivals: bool = False  # send at each sample's arrival_offset_s
    num_requests: int | None = None  # None: len(samples), or unlimited with duration_s
    duration_s: float | None = None
    max_tokens: int | None = None  # overrides each sample's expected_output_len
    ignore_eos: bool = False  # vLLM/SGLang extension; only sent when True
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # merged into payload
    request_timeout_s: float = 6 * 3600.0
    seed: int = 0
    show_progress: bool = True
    progress_desc: str = "requests"

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclasses.dataclass
class RunResult:
    records: list[RequestRecord]
    duration_s: float  # first dispatch to last completion


def build_payload(config: ClientConfig, sample: SampleRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": config.max_tokens or sample.expected_output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(config.sampling)
    return payload


def _event_text(event: Mapping[str, Any]) -> str | None:
    """The generated text of one event; None when it carries no choice (e.g. the usage event)."""
    choices = event.get("choices")
    if not choices:
        return None
    choice = choices[0]
    if "delta" in choice:  # chat
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(
    session: aiohttp.ClientSession, url: str, payload: Mapping[str, Any], prompt_len: int
) -> RequestRecord:
    record = RequestRecord(prompt_len=prompt_len, start_s=time.perf_counter())
    parts: list[str] = []
    first_choice_s: float | None = None
    usage: Mapping[str, Any] | None = None
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return record
            async for raw in response.content:
                now = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    record.error = f"server error: {str(event['error'])[:300]}"
                    return record
                if event.get("usage"):
                    usage = event["usage"]
                text = _event_text(event)
                if text is None:
                    continue
                first_choice_s = now if first_choice_s is None else first_choice_s
                if text:
                    record.chunk_times_s.append(now)
                    parts.append(text)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
        return record
    if first_choice_s is None:
        record.error = "stream ended without a choice"
        return record
    if not record.chunk_times_s:
        # Only empty choices (e.g. an immediate EOS): the first one is the server's answer.
        record.chunk_times_s.append(first_choice_s)
    record.generated_text = "".join(parts)
    record.output_tokens = int(usage["completion_tokens"]) if usage else len(parts)
    if usage and usage.get("prompt_tokens") is not None:
        record.prompt_len = int(usage["prompt_tokens"])
    record.success = True
    return record


def arrival_gaps(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """Seconds between successive sends: gamma(shape=burstiness, mean=1/rate); 0 if rate is inf."""
    while True:
        yield 0.0 if math.isinf(rate) else float(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def run_async(samples: Sequence[SampleRequest], config: ClientConfig) -> RunResult:
    if not samples:
        raise ValueError("no samples")
    num_requests = config.num_requests
    if num_requests is None and (config.duration_s is None or config.use_trace_arrivals):
        num_requests = len(samples)
    if config.use_trace_arrivals:
        num_requests = min(num_requests, len(samples))
    gaps = arrival_gaps(config.request_rate, config.burstiness, np.random.default_rng(config.seed))
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = tqdm(total=num_requests, desc=config.progress_desc, disable=not config.show_progress)
    tasks: list[asyncio.Task] = []

    def done(_task: asyncio.Task) -> None:
        if semaphore is not None:
            semaphore.release()
        progress.update(1)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        send_at = start
        for i in itertools.count():
            if num_requests is not None and i >= num_requests:
                break
            sample = samples[i % len(samples)]
            if config.use_trace_arrivals:
                send_at = start + (sample.arrival_offset_s or 0.0)
            elif i > 0:
                send_at += next(gaps)
            if config.duration_s is not None and send_at - start >= config.duration_s:
                break
            await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
            if semaphore is not None:
                await semaphore.acquire()
            if config.duration_s is not None and time.perf_counter() - start >= config.duration_s:
                if semaphore is not None:
                    semaphore.release()
                break
            payload = build_payload(config, sample)
            task = asyncio.create_task(send_request(session, config.url, payload, sample.prompt_len))
            task.add_done_callback(done)
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - start
    progress.close()
    return RunResult(records, duration_s)


def run(samples: Sequence[SampleRequest], config: ClientConfig) -> RunResult:
    return asyncio.run(run_async(samples, config))


async def _first_model_id(base_url: str, timeout_s: float) -> str:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(base_url.rstrip("/") + "/v1/models") as response:
            response.raise_for_status()
            models = (await response.json())["data"]
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def first_model_id(base_url: str, timeout_s: float = 30.0) -> str:
    """The id of the first model the server lists (what `--model` defaults to)."""
    return asyncio.run(_first_model_id(base_url, timeout_s))


async def _is_ready(base_url: str) -> bool:
    try:
        await _first_model_id(base_url, timeout_s=2.0)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError):
        return False
    return True


def wait_until_ready(
    base_url: str, timeout_s: float, poll_s: float = 1.0, alive: Callable[[], bool] | None = None
) -> None:
    """Polls `/v1/models` until it answers; TimeoutError after `timeout_s`, RuntimeError as soon
    as `alive()` says the server process has exited."""
    deadline = time.monotonic() + timeout_s
    while not asyncio.run(_is_ready(base_url)):
        if alive is not None and not alive():
            raise RuntimeError(f"the server for {base_url} exited before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} not ready after {timeout_s:.0f} s")
        time.sleep(poll_s)
