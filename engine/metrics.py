"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms.

The server keeps one `ServerMetrics`: latency histograms it observes itself as outputs arrive on
the event loop (time to first token, inter-token latency, end-to-end latency), request counters by
finish reason, and the engine's counters and gauges copied from the latest `EngineStats` snapshot
at scrape time. Every name starts with `jaxserve:`. Everything here runs on the event-loop thread,
so nothing is locked.
"""

from __future__ import annotations

import bisect
import math

PREFIX = "jaxserve:"

# Bucket upper bounds in seconds (the +Inf bucket is implicit).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


def _format_value(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(val))}"' for key, val in labels.items()) + "}"


class Histogram:
    """Cumulative-bucket histogram; `observe` is O(log buckets)."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name = PREFIX + name
        self.help_text = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_format_value(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def _scalar(kind: str, name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    full = PREFIX + name
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    lines.extend(f"{full}{_format_labels(labels)} {_format_value(value)}" for labels, value in samples)
    return lines


class ServerMetrics:
    """What the server measures itself, plus rendering of the engine's stats."""

    def __init__(self) -> None:
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request arrival to its last output.", E2E_BUCKETS)
        self.requests_finished: dict[str, int] = {}  # finish reason -> count
        self.http_responses: dict[str, int] = {}  # status code -> count
        self.engine_step_errors = 0  # engine steps that raised (their requests failed with 500)
        # Connections the server dropped for sending too slowly, by phase ("headers", "body").
        self.slow_clients_dropped: dict[str, int] = {"headers": 0, "body": 0}

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int) -> None:
        """`num_tokens` tokens arrived together `seconds` after the previous ones: each counts once,
        at the average gap, so coalesced tokens do not hide in one large sample."""
        if num_tokens <= 0:
            return
        gap = seconds / num_tokens
        for _ in range(num_tokens):
            self.itl.observe(gap)

    def observe_finished(self, seconds: float, finish_reason: str) -> None:
        self.e2e.observe(seconds)
        self.requests_finished[finish_reason] = self.requests_finished.get(finish_reason, 0) + 1

    def observe_http_response(self, status: int) -> None:
        key = str(status)
        self.http_responses[key] = self.http_responses.get(key, 0) + 1

    def observe_slow_client(self, phase: str) -> None:
        self.slow_clients_dropped[phase] = self.slow_clients_dropped.get(phase, 0) + 1

    def render(self, stats, *, num_pending: int = 0) -> str:
        """Prometheus text for the server's own metrics and an engine stats snapshot (None before
        the engine's first report)."""
        lines: list[str] = []
        if stats is not None:
            queries = stats.prefix_cache_queries
            hit_rate = stats.prefix_cache_hits / queries if queries else 0.0
            lines += _scalar("gauge", "num_requests_running", "Requests in the running batch.", [({}, stats.num_running)])
            lines += _scalar(
                "gauge",
                "num_requests_waiting",
                "Requests waiting to be scheduled (including those not yet handed to the engine).",
                [({}, stats.num_waiting + num_pending)],
            )
            lines += _scalar("gauge", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", [({}, stats.kv_cache_usage)])
            for name, help_text in (("num_free_blocks", "KV cache blocks free (no owner, nothing cached)."),
                                    ("num_cached_blocks", "KV cache blocks with no owner whose contents stay in the "
                                                          "prefix cache (evictable).")):
                value = getattr(stats, name, None)
                if value is not None:
                    lines += _scalar("gauge", name, help_text, [({}, value)])
            lines += _scalar("gauge", "prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens, since start.", [({}, hit_rate)])
            lines += _scalar("counter", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", [({}, queries)])
            lines += _scalar("counter", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", [({}, stats.prefix_cache_hits)])
            lines += _scalar("counter", "num_preemptions_total", "Requests preempted (recomputed) for lack of KV blocks.", [({}, stats.num_preemptions)])
            lines += _scalar("counter", "prompt_tokens_total", "Prompt tokens processed.", [({}, stats.num_prompt_tokens)])
            lines += _scalar("counter", "generation_tokens_total", "Tokens generated.", [({}, stats.num_generation_tokens)])
            failed = getattr(stats, "num_failed_steps", None)
            if failed is not None:
                lines += _scalar("counter", "num_failed_steps_total", "Engine steps whose runner call raised "
                                 "(their requests failed; the engine kept serving).", [({}, failed)])
            lines += _scalar("counter", "num_compilations_total", "XLA compilations of the step function.", [({}, stats.num_compilations)])
            for name, kind, help_text in (
                    ("num_constrained_requests", "counter", "Requests added with structured output (a grammar)."),
                    ("num_grammars_compiled", "counter", "Structured-output grammars compiled (LRU misses)."),
                    ("grammar_compile_seconds", "counter", "Seconds spent compiling grammars (off the step loop)."),
                    ("mask_fill_seconds", "counter", "Host seconds the step loop spent filling token masks.")):
                value = getattr(stats, name, None)
                if value is not None:
                    lines += _scalar(kind, name + "_total", help_text, [({}, value)])
        finished = [({"finished_reason": reason}, count) for reason, count in sorted(self.requests_finished.items())]
        lines += _scalar("counter", "request_success_total", "Finished requests by finish reason.", finished)
        responses = [({"status": status}, count) for status, count in sorted(self.http_responses.items())]
        lines += _scalar("counter", "http_responses_total", "HTTP responses of /v1 endpoints by status code.", responses)
        lines += _scalar("counter", "engine_step_errors_total", "Engine steps that raised; their requests failed.",
                         [({}, self.engine_step_errors)])
        slow = [({"phase": phase}, count) for phase, count in sorted(self.slow_clients_dropped.items())]
        lines += _scalar("counter", "slow_clients_dropped_total",
                         "Connections dropped for not sending their request headers or body in time.", slow)
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        return "\n".join(lines) + "\n"
