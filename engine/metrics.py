"""Prometheus metrics through `prometheus_client` (the exposition format, escaping, histograms and
process metrics Prometheus setups expect), one registry per server.

The server keeps one `ServerMetrics`: latency histograms it observes itself as outputs arrive on
the event loop (time to first token, inter-token latency, end-to-end latency), request counters by
finish reason, and the engine's counters and gauges copied from the latest `EngineStats` snapshot
at scrape time (a custom collector). Every jaxserve name starts with `jaxserve:`; the registry also
carries the standard `process_*` and `python_*` metrics. Everything here runs on the event-loop
thread.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

prometheus_client.disable_created_metrics()  # no "_created" series: the names stay what they were

PREFIX = "jaxserve:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_PLAIN_0_0_4  # text/plain; version=0.0.4; charset=utf-8

# Bucket upper bounds in seconds (the +Inf bucket is implicit).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Histogram:
    """A prometheus_client histogram in `registry` that also keeps its count and sum at hand."""

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...], registry=None):
        self.name = PREFIX + name
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._hist = prometheus_client.Histogram(self.name, help_text, buckets=tuple(sorted(buckets)),
                                                 registry=self.registry)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self._hist.observe(value)
        self.sum += value
        self.count += 1


# Engine stats: (EngineStats field, metric name, kind, help). Counters get prometheus' "_total".
_ENGINE_METRICS = (
    ("num_running", "num_requests_running", "gauge", "Requests in the running batch."),
    ("kv_cache_usage", "kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0..1)."),
    ("num_free_blocks", "num_free_blocks", "gauge", "KV cache blocks free (no owner, nothing cached)."),
    ("num_cached_blocks", "num_cached_blocks", "gauge",
     "KV cache blocks with no owner whose contents stay in the prefix cache (evictable)."),
    ("num_sliding_used_blocks", "num_sliding_used_blocks", "gauge",
     "Blocks in use in the sliding-window layers' own pool (a model mixing windows; 0 otherwise)."),
    ("prefix_cache_queries", "prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", "counter", "Requests preempted (recomputed) for lack of KV blocks."),
    ("num_prompt_tokens", "prompt_tokens", "counter", "Prompt tokens processed."),
    ("num_generation_tokens", "generation_tokens", "counter", "Tokens generated."),
    ("num_failed_steps", "num_failed_steps", "counter",
     "Engine steps whose runner call raised (their requests failed; the engine kept serving)."),
    ("num_compilations", "num_compilations", "counter", "XLA compilations of the step function."),
    ("num_constrained_requests", "num_constrained_requests", "counter",
     "Requests added with structured output (a grammar)."),
    ("num_grammars_compiled", "num_grammars_compiled", "counter", "Structured-output grammars compiled (LRU misses)."),
    ("grammar_compile_seconds", "grammar_compile_seconds", "counter",
     "Seconds spent compiling grammars (off the step loop)."),
    ("mask_fill_seconds", "mask_fill_seconds", "counter", "Host seconds the step loop spent filling token masks."),
)


class _EngineCollector:
    """The latest EngineStats snapshot as metrics, read at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        stats, num_pending = self.metrics.scrape_stats, self.metrics.scrape_pending
        if stats is None:
            return
        replicas = getattr(stats, "replicas", ())
        label, names = _replica_labels(stats)
        for field, name, kind, help_text in _ENGINE_METRICS:
            value = getattr(stats, field, None)
            if value is None:
                continue
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            if replicas:  # one series per replica (DPEngine) or pool (PDEngine)
                labelled = family(PREFIX + name, help_text, labels=[label])
                for replica_name, replica in zip(names, replicas):
                    labelled.add_metric([replica_name], getattr(replica, field))
                yield labelled
            else:
                yield family(PREFIX + name, help_text, value=value)
        yield from _device_families(stats)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled (including "
                                "those not yet handed to the engine).", value=stats.num_waiting + num_pending)
        yield GaugeMetricFamily(PREFIX + "engine_degraded", "1 while the engine serves in a degraded mode (under "
                                "disaggregation: the decode pool is lost and the prefill pool decodes itself); "
                                "/health gives the reason.", value=float(bool(getattr(stats, "degraded_reason", None))))
        queries = stats.prefix_cache_queries
        yield GaugeMetricFamily(PREFIX + "prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens, since start.",
                                value=stats.prefix_cache_hits / queries if queries else 0.0)
        spec = getattr(stats, "spec_decode", None)
        if spec is not None:
            yield from _spec_decode_families(spec)
        transfer = getattr(stats, "kv_transfer", None)
        if transfer is not None:
            yield from _transfer_families(transfer, stats.num_pending_transfers)


def _replica_labels(stats) -> tuple[str, list[str]]:
    """("replica", ["0", "1", ...]) under data parallelism; ("pool", ["prefill", "decode"]) under
    disaggregation."""
    pools = getattr(stats, "pool_names", ())
    if pools:
        return "pool", list(pools)
    return "replica", [str(i) for i in range(len(getattr(stats, "replicas", ())))]


def _transfer_families(transfer, num_pending: int):
    """Prefill/decode disaggregation (engine/disaggregation/kv_transfer.TransferStats)."""
    for field, name, help_text in (
            ("num_transfers", "kv_transfers", "Requests whose KV blocks moved from the prefill to the decode pool."),
            ("num_blocks", "kv_transfer_blocks", "KV blocks moved to the decode pool."),
            ("num_bytes", "kv_transfer_bytes", "Bytes of KV blocks moved to the decode pool."),
            ("seconds", "kv_transfer_seconds", "Seconds from dispatch to landing, summed over landed transfers."),
            ("num_fallbacks", "kv_transfer_fallbacks",
             "Handovers whose blocks did not fit the decode pool (it recomputed the prompt).")):
        yield CounterMetricFamily(PREFIX + name, help_text, value=getattr(transfer, field))
    yield GaugeMetricFamily(PREFIX + "kv_transfer_gb_per_s", "Landed transfer bytes / their seconds, since start.",
                            value=transfer.gb_per_s)
    yield GaugeMetricFamily(PREFIX + "kv_transfer_queue_depth", "Moved requests the decode pool has not admitted "
                            "yet (their blocks pinned there).", value=num_pending)


def _device_families(stats):
    """Weight and KV-cache bytes per device (labelled by device index within the engine's group,
    and by replica under data parallelism), and the router's counts."""
    replicas = getattr(stats, "replicas", ()) or (stats,)
    label, names = _replica_labels(stats)
    names = names or ["0"]
    for field, name, help_text in (
            ("weight_bytes_per_device", "weight_bytes", "Bytes of weight shards held by each device."),
            ("kv_cache_bytes_per_device", "kv_cache_bytes", "Bytes of KV-cache shards held by each device.")):
        family = GaugeMetricFamily(PREFIX + name, help_text, labels=[label, "device"])
        for replica_name, replica in zip(names, replicas):
            for d, value in enumerate(getattr(replica, field, ()) or ()):
                family.add_metric([replica_name, str(d)], value)
        if family.samples:
            yield family
    router = getattr(stats, "router", None)
    if router is not None:
        family = CounterMetricFamily(PREFIX + "router_requests", "Requests routed to each replica.",
                                     labels=["replica"])
        for r, n in enumerate(router.num_routed):
            family.add_metric([str(r)], n)
        yield family
        yield CounterMetricFamily(PREFIX + "router_affinity_hits", "Requests routed to the replica "
                                  "holding their prefix (at least one full block).", value=router.num_affinity_hits)


# Speculative decoding (engine/spec_decode/controller.py SpecDecodeStats), vLLM's names.
_SPEC_COUNTERS = (
    ("num_drafts", "Rows that verified drafts."),
    ("num_draft_tokens", "Draft tokens verified."),
    ("num_accepted_tokens", "Draft tokens accepted."),
    ("num_emitted_tokens", "Tokens emitted by rows that verified drafts (accepted plus one bonus each)."),
    ("num_switch_offs", "Times the load switch turned speculation off."),
    ("num_steps_off", "Steps that did not speculate because of the load."),
    ("num_request_disables", "Times a request stopped drafting for low acceptance."),
)


def _spec_decode_families(spec):
    for field, help_text in _SPEC_COUNTERS:
        yield CounterMetricFamily(PREFIX + "spec_decode_" + field, help_text, value=getattr(spec, field))
    for field, name, help_text in (
            ("accepted_per_position", "num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft."),
            ("drafted_per_position", "num_draft_tokens_per_pos", "Draft tokens verified, by position in the draft.")):
        family = CounterMetricFamily(PREFIX + "spec_decode_" + name, help_text, labels=["position"])
        for i, n in enumerate(getattr(spec, field)):
            family.add_metric([str(i)], n)
        yield family
    yield GaugeMetricFamily(PREFIX + "spec_decode_acceptance_rate", "Accepted / drafted tokens since start.",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily(PREFIX + "spec_decode_mean_accepted_length",
                            "Tokens per verifying row since start, the bonus token included.",
                            value=spec.mean_accepted_length)


class ServerMetrics:
    """What the server measures itself, plus the engine's stats, in one prometheus_client registry."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        prometheus_client.ProcessCollector(registry=self.registry)
        prometheus_client.PlatformCollector(registry=self.registry)
        prometheus_client.GCCollector(registry=self.registry)
        r = self.registry
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request arrival to its first generated token.",
                              TTFT_BUCKETS, r)
        self.itl = Histogram("inter_token_latency_seconds", "Time between consecutive generated tokens of a request.",
                             ITL_BUCKETS, r)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request arrival to its last output.", E2E_BUCKETS, r)
        self._finished = prometheus_client.Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                                   ["finished_reason"], registry=r)
        self._responses = prometheus_client.Counter(PREFIX + "http_responses", "HTTP responses of /v1 endpoints by "
                                                    "status code.", ["status"], registry=r)
        self._step_errors = prometheus_client.Counter(PREFIX + "engine_step_errors", "Engine steps that raised; their "
                                                      "requests failed.", registry=r)
        self._slow = prometheus_client.Counter(PREFIX + "slow_clients_dropped", "Connections dropped for not sending "
                                               "their request headers or body in time.", ["phase"], registry=r)
        for phase in ("headers", "body"):
            self._slow.labels(phase=phase)
        self.requests_finished: dict[str, int] = {}  # finish reason -> count (also in the registry)
        self._engine_step_errors = 0
        self.scrape_stats = None
        self.scrape_pending = 0
        r.register(_EngineCollector(self))

    @property
    def engine_step_errors(self) -> int:
        """Engine steps that raised (their requests failed with 500)."""
        return self._engine_step_errors

    @engine_step_errors.setter
    def engine_step_errors(self, value: int) -> None:
        self._step_errors.inc(value - self._engine_step_errors)
        self._engine_step_errors = value

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
        self._finished.labels(finished_reason=finish_reason).inc()

    def observe_http_response(self, status: int) -> None:
        self._responses.labels(status=str(status)).inc()

    def observe_slow_client(self, phase: str) -> None:
        self._slow.labels(phase=phase).inc()

    def render(self, stats, *, num_pending: int = 0) -> str:
        """Prometheus text (format 0.0.4) for the server's own metrics, an engine stats snapshot
        (None before the engine's first report) and the process."""
        self.scrape_stats, self.scrape_pending = stats, num_pending
        try:
            return prometheus_client.generate_latest(self.registry).decode("utf-8")
        finally:
            self.scrape_stats = None
