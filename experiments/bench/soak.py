"""Soak test: N requests from C concurrent clients against a server this starts, with random client
disconnects, bad requests and hostile ones mixed in; then checks that every request kept pace and
that the server is exactly as it was.

    python -m experiments.bench.soak --num_requests=1000 --concurrency=32 --abort_fraction=0.3

1. Starts `python -m entrypoints.openai.serve` (random:tiny by default) with a small KV cache
   (--num_kv_blocks), so running requests are preempted, and waits for it to listen.
2. Records the greedy answer to a fixed prompt, and tokenizes a long text (/tokenize) for the
   token-id prompts of the hostile cases.
3. Load (soak_load.py): C clients send N requests between them, at random bad ones (each must
   get a 4xx), hostile ones (never abandoned) and good ones, of which abort_fraction are
   abandoned midway. Streams ask for usage, so every finished request knows its size.
4. Progress (soak_progress.py): each finished request's latency against the median of its size
   class (prompt tokens, generated tokens, n, scored); one more than --max_progress_ratio times
   its class fails the run, and the worst ratio and its request are reported.
5. Memory: the server's resident memory (/proc/<pid>/status VmRSS) once warmup_fraction of the
   requests are done, every twentieth of them after, and at the end; growth past --max_rss_growth fails.
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

from experiments.bench.soak_load import WORDS, LoadConfig, rss_kib, run_load
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


def _load_config() -> LoadConfig:
    return LoadConfig(num_requests=_NUM_REQUESTS.value, concurrency=_CONCURRENCY.value, abort_fraction=_ABORT.value,
                      bad_fraction=_BAD.value, hostile_fraction=_HOSTILE.value, max_tokens=_MAX_TOKENS.value,
                      long_prompt_tokens=_LONG_PROMPT.value, long_output_tokens=_LONG_OUTPUT.value,
                      seed=_SEED.value, request_timeout_s=_REQUEST_TIMEOUT.value,
                      warmup_fraction=_WARMUP.value)


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
        outcomes, stuck, rss = asyncio.run(run_load(server.url, ids, limit, server.proc.pid, _load_config()))
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
