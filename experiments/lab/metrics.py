"""Serving metrics over per-request records, defined as vLLM's `vllm bench serve` defines them.

A `RequestRecord` holds what the client saw for one request: when it was sent (`start_s`), the
arrival time of every chunk that carried generated text (`chunk_times_s`), the number of output
tokens (the server's `usage.completion_tokens` when it reports it), and success or the error.

Per successful request:
- TTFT = first content chunk - start.
- ITL = the gaps between successive content chunks (a chunk that carries several tokens is one
  gap, as in vLLM). Chunks without text (a chat role delta, the usage chunk) are not tokens.
- E2EL = last content chunk - start.
- TPOT = (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token; for
  goodput a request with one token counts as TPOT 0.
- itl_p95 = the 95th percentile of this request's own ITLs (0 if it has none): a per-request SLO
  that a long stall breaks even when the mean (TPOT) looks fine.

Aggregates over a run of `duration_s` (first send to last completion):
- request throughput = completed / duration; output token throughput = total output tokens /
  duration; total token throughput adds the prompt tokens of completed requests.
- ITL statistics pool every gap of every request; the others take one value per request (TPOT
  only over requests with > 1 output token).
- Percentiles use numpy's default (linear interpolation); statistics of an empty set are 0.
- goodput = requests meeting every given SLO (`ttft`, `tpot`, `e2el`, `itl_p95`, in ms, each
  "value <= target") / duration. A failed request never meets them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el", "itl_p95")


@dataclasses.dataclass
class RequestRecord:
    prompt_len: int
    start_s: float  # perf_counter when the request was sent
    chunk_times_s: list[float] = dataclasses.field(default_factory=list)  # content chunks only
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    generated_text: str = ""

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else 0.0

    @property
    def e2el_s(self) -> float:
        return self.chunk_times_s[-1] - self.start_s if self.chunk_times_s else 0.0

    @property
    def itls_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t[:-1], t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itl_p95_s(self) -> float:
        itls = self.itls_s
        return float(np.percentile(itls, 95)) if itls else 0.0


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values_s: Sequence[float]) -> LatencyStats:
        if len(values_s) == 0:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0
        p = np.percentile(ms, (50, 90, 95, 99))
        return cls(float(ms.mean()), float(p[0]), float(ms.std()), float(p[1]), float(p[2]),
                   float(p[3]))


@dataclasses.dataclass(frozen=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    goodput: float | None  # requests / s meeting every SLO; None when no SLO was given
    num_good: int | None
    slos_ms: dict[str, float]

    @property
    def goodput_ratio(self) -> float | None:
        """Share of all sent requests that met every SLO."""
        if self.num_good is None:
            return None
        total = self.completed + self.failed
        return self.num_good / total if total else 0.0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["goodput_ratio"] = self.goodput_ratio
        return d


def parse_slos(spec: str | Sequence[str]) -> dict[str, float]:
    """`"ttft:1000 itl_p95:50"` (or a list of `name:ms` items) -> {"ttft": 1000.0, ...}."""
    items = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"bad SLO {item!r}: want name:ms with name in {SLO_NAMES}")
        ms = float(value)
        if ms < 0:
            raise ValueError(f"SLO {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def request_values_ms(record: RequestRecord) -> dict[str, float]:
    """The per-request quantities the SLOs are checked against."""
    return {
        "ttft": record.ttft_s * 1000.0,
        "tpot": (record.tpot_s or 0.0) * 1000.0,
        "e2el": record.e2el_s * 1000.0,
        "itl_p95": record.itl_p95_s * 1000.0,
    }


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    if not record.success:
        return False
    values = request_values_ms(record)
    return all(values[name] <= target for name, target in slos_ms.items())


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slos_ms: Mapping[str, float] | None = None
) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    itls = [gap for r in ok for gap in r.itls_s]
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    num_good = sum(meets_slos(r, slos_ms) for r in records) if slos_ms else None
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=LatencyStats.of([r.ttft_s for r in ok]),
        tpot_ms=LatencyStats.of(tpots),
        itl_ms=LatencyStats.of(itls),
        e2el_ms=LatencyStats.of([r.e2el_s for r in ok]),
        goodput=None if num_good is None else num_good / duration_s,
        num_good=num_good,
        slos_ms=dict(slos_ms or {}),
    )


def format_table(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """A readable block in the layout of `vllm bench serve`."""
    lines = [f"{' ' + title + ' ':=^60}"]

    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<44}{text:>16}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        row("Goodput SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in m.slos_ms.items()))
        row("Request goodput (req/s):", m.goodput)
        row("Goodput ratio (good / sent):", m.goodput_ratio)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name, label, stats in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
        ("E2EL", "End-to-end Latency", m.e2el_ms),
    ):
        lines.append(f"{' ' + label + ' ':-^60}")
        row(f"Mean {name} (ms):", stats.mean)
        row(f"Median {name} (ms):", stats.median)
        for p in (90, 95, 99):
            row(f"P{p} {name} (ms):", getattr(stats, f"p{p}"))
    lines.append("=" * 60)
    return "\n".join(lines)
