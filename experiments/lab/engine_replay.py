"""Replay a workload against an in-process LLMEngine, measured as bench/serving.py measures a server.

The experiments compare scheduling ideas on one engine, so they drive `LLMEngine` directly: no
HTTP, no event loop, one thread. What a client would see is rebuilt from the step loop:

1. Every sample gets an intended send time: its `arrival_offset_s` (`use_arrival_offsets`), or
   the gaps of `load_client.arrival_gaps(request_rate, burstiness)` (an infinite rate sends
   everything at t = 0). `max_concurrency` caps requests inside the engine; a capped request is
   sent when a slot frees, and its clock starts then (as the load client's semaphore does).
2. The loop adds every request whose send time has come (and that has a slot), then runs one
   `step()`; when the engine is idle it sleeps until the next send time. A request that arrives
   during a step waits for it, exactly as it would at a single-threaded server.
3. Each `RequestOutput` that carries new tokens is one streamed chunk, stamped with the time the
   step returned. Prompts are tokenized before the clock starts, so tokenization is not timed.
4. The result holds one `metrics.RequestRecord` per sample (so `metrics.compute_metrics` gives
   TTFT, ITL, TPOT, E2EL and throughput with the bench's definitions), the run's duration (first
   send to last token), and a per-step log (end time, duration, running and waiting counts).

`swap_scheduler` gives the engine a fresh scheduler with changed knobs (policy, budget, chunked
prefill, prefix caching, KV allocation): none of them changes a compiled shape, so one engine serves
every arm of an experiment. `warm_up` runs one step in each token bucket first, so no arm pays a
first execution.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import numpy as np

from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from experiments.lab.datasets import SampleRequest
from experiments.lab.load_client import arrival_gaps
from experiments.lab.metrics import RequestRecord
from scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    request_rate: float = math.inf  # requests / s; inf = all at t = 0
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    max_concurrency: int | None = None  # most requests inside the engine at once
    use_arrival_offsets: bool = False  # send each sample at its arrival_offset_s
    temperature: float = 0.0  # greedy by default: arms generate the same tokens
    ignore_eos: bool = True  # output lengths follow the workload, as in vLLM's benchmarks
    seed: int = 0  # arrival gaps

    def __post_init__(self):
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")


@dataclasses.dataclass(frozen=True)
class StepSample:
    end_s: float  # perf_counter when step() returned
    duration_s: float
    num_running: int  # after the step
    num_waiting: int


@dataclasses.dataclass
class ReplayResult:
    records: list[RequestRecord]  # parallel to the samples
    duration_s: float  # first send to last token
    start_s: float  # perf_counter at t = 0 of the run
    steps: list[StepSample]


def send_times(samples: Sequence[SampleRequest], config: ReplayConfig) -> list[float]:
    """Intended send times in seconds after the start, in sample order (non-decreasing)."""
    if config.use_arrival_offsets:
        times = [s.arrival_offset_s or 0.0 for s in samples]
        if any(b < a for a, b in zip(times, times[1:])):
            raise ValueError("arrival offsets must be non-decreasing in sample order")
        return times
    gaps = arrival_gaps(config.request_rate, config.burstiness, np.random.default_rng(config.seed))
    times, t = [], 0.0
    for i in range(len(samples)):
        t += next(gaps) if i else 0.0
        times.append(t)
    return times


def replay(engine: LLMEngine, samples: Sequence[SampleRequest], config: ReplayConfig) -> ReplayResult:
    if not samples:
        raise ValueError("no samples")
    if engine.has_unfinished_requests():
        raise ValueError("the engine still has requests; replay needs an idle engine")
    prompts = [engine.tokenize(s.prompt, add_special_tokens=False) for s in samples]
    offsets = send_times(samples, config)
    cap = config.max_concurrency or len(samples)
    records = [RequestRecord(prompt_len=len(ids), start_s=0.0) for ids in prompts]
    seen_tokens = [0] * len(samples)
    steps: list[StepSample] = []
    in_flight: set[int] = set()
    next_i = 0
    start = time.perf_counter()
    slot_free_since = start
    while next_i < len(samples) or in_flight:
        now = time.perf_counter()
        while next_i < len(samples) and len(in_flight) < cap and start + offsets[next_i] <= now:
            params = SamplingParams(max_tokens=samples[next_i].expected_output_len,
                                    temperature=config.temperature, ignore_eos=config.ignore_eos)
            engine.add_request(str(next_i), prompts[next_i], params, prompt_text=samples[next_i].prompt)
            records[next_i].start_s = max(start + offsets[next_i], slot_free_since)
            in_flight.add(next_i)
            next_i += 1
        if not in_flight:
            time.sleep(max(0.0, start + offsets[next_i] - time.perf_counter()))
            continue
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        for out in outputs:
            i = int(out.request_id)
            completion = out.outputs[0]
            if len(completion.token_ids) > seen_tokens[i]:
                seen_tokens[i] = len(completion.token_ids)
                records[i].chunk_times_s.append(t1)
            if out.finished:
                record = records[i]
                record.output_tokens = len(completion.token_ids)
                record.generated_text = completion.text
                record.success = bool(record.chunk_times_s)
                record.error = "" if record.success else f"finished ({completion.finish_reason}) with no token"
                if len(in_flight) == cap:
                    slot_free_since = t1
                in_flight.discard(i)
        # An LLMEngine's scheduler counts; engines of several pools or replicas report them.
        stats = engine.scheduler.stats if hasattr(engine, "scheduler") else engine.get_stats()
        steps.append(StepSample(t1, t1 - t0, stats.num_running, stats.num_waiting))
    last = max((r.chunk_times_s[-1] for r in records if r.chunk_times_s), default=time.perf_counter())
    return ReplayResult(records, max(last - start, 1e-9), start, steps)


def build_engine(**knobs) -> LLMEngine:
    """An LLMEngine of EngineConfig(**knobs), compiled and warmed up; prints how long that took."""
    from engine.config import EngineConfig

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(**knobs), progress=False)
    warm_up(engine)
    print(f"engine: {engine.model_name}, buckets {[dataclasses.astuple(b) for b in engine.runner.shapes.buckets()]}, max_model_len "
          f"{engine.max_model_len}, {engine.runner.shapes.num_blocks} KV blocks; load {engine.load_seconds:.0f} s, "
          f"compile {engine.compile_seconds:.0f} s, ready in {time.perf_counter() - start:.0f} s",
          flush=True)
    return engine


def swap_scheduler(engine: LLMEngine, **changes) -> Scheduler:
    """A fresh scheduler (empty queues, empty prefix cache) with `changes` to the current knobs
    (EngineConfig's names), through the engine's validated LLMEngine.reconfigure_scheduler."""
    return engine.reconfigure_scheduler(**changes)


def warm_up(engine: LLMEngine) -> None:
    """Runs one step in every token bucket, then leaves a fresh scheduler with the same knobs."""
    knobs = ("max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching", "policy",
             "kv_allocation")
    original = {name: getattr(engine.config, name) for name in knobs}
    buckets = engine.runner.shapes.token_buckets
    swap_scheduler(engine, max_num_batched_tokens=max(buckets[-1], engine.config.max_num_seqs),
                   enable_chunked_prefill=True, enable_prefix_caching=False,
                   policy="fcfs", kv_allocation="paged")
    vocab = engine.model_config.vocab_size
    for t in buckets:
        n = min(t, engine.max_model_len - 1)
        engine.add_request("warm-up", [(7 * k + 3) % vocab for k in range(n)],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    swap_scheduler(engine, **original)
