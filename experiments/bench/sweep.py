"""Concurrency (or rate) sweep: throughput and tail latency against load, the knee, the capacity.

    python -m experiments.bench.sweep --base_url=http://127.0.0.1:8000 --dataset=random \
        --max_concurrency_limit=32 --goodput="ttft:2000 itl_p95:200" --slo_itl_p95_ms=200

1. Optionally start the server (`--server_cmd`) and wait until `/v1/models` answers.
2. Build one workload (all `serving.py` flags apply) and, for each concurrency 1, 2, 4, ...
   up to `--max_concurrency_limit` (or `--concurrencies`, or each of `--rates` for a rate sweep),
   send its first max(`--num_prompts`, `--prompts_per_concurrency` * c) requests, so every point
   sees the same prompts.
3. Find the knee and the capacity under the SLO, write `<tag>.json`, `<tag>.md` and `<tag>.png`
   (throughput and p95 ITL against load, knee and capacity marked) to `--output_dir`.

The knee (`find_knee`) is the point of maximum vertical distance above the chord of the
throughput curve after both axes are min-max normalized, with load on a log2 axis (the Kneedle
difference curve). Why this rule: the sweep doubles the load, so log2 spaces the points evenly;
normalizing makes it independent of units and of how fast the hardware is; and it needs no
"marginal gain per doubling" threshold, whose meaning would change with the model and the step.
A curve that never bends below the chord (throughput still doubling with load, or growing by a
constant per doubling) has no knee in the range: the distance must reach `KNEE_MIN_DISTANCE`
(0.05 of the normalized range) to count, so noise on a straight line does not make one.

Capacity under the SLO (`capacity_index`) is the highest load whose goodput ratio (requests
meeting every `--goodput` SLO / requests sent) is at least `--min_goodput_ratio` and whose p95 ITL
over all tokens is at most `--slo_itl_p95_ms`, each when given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence

from absl import app, flags

from experiments.bench import serving as bench_serving
from experiments.lab import datasets, load_client, metrics

KNEE_MIN_DISTANCE = 0.05

_CONCURRENCIES = flags.DEFINE_list("concurrencies", [], "Explicit concurrencies (else doublings).")
_MAX_CONCURRENCY_LIMIT = flags.DEFINE_integer(
    "max_concurrency_limit", 64, "Sweep 1, 2, 4, ... up to this concurrency.")
_RATES = flags.DEFINE_list("rates", [], "Request rates (req/s): a rate sweep instead.")
_PROMPTS_PER_CONCURRENCY = flags.DEFINE_integer(
    "prompts_per_concurrency", 4, "Concurrency c sends max(num_prompts, this * c) requests.")
_MIN_GOODPUT_RATIO = flags.DEFINE_float(
    "min_goodput_ratio", 0.9, "Capacity: share of requests that must meet --goodput.")
_SLO_ITL_P95_MS = flags.DEFINE_float("slo_itl_p95_ms", None, "Capacity: p95 ITL target (ms).")
_WARMUP_REQUESTS = flags.DEFINE_integer("warmup_requests", 1, "Unmeasured requests sent first.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "experiments/results", "Where results go.")
_TAG = flags.DEFINE_string("tag", "", "File name stem; default <kind>_sweep_<dataset>.")
_SERVER_CMD = flags.DEFINE_string("server_cmd", "", "Start this server first; stop it after.")
_SERVER_READY_TIMEOUT_S = flags.DEFINE_float("server_ready_timeout_s", 900.0, "Start-up limit.")


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    load: float  # concurrency, or request rate
    metrics: metrics.BenchmarkMetrics

    @property
    def throughput(self) -> float:
        return self.metrics.output_throughput

    @property
    def itl_p95_ms(self) -> float:
        return self.metrics.itl_ms.p95


def doublings(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit`, with `limit` itself last if it is not a power of two."""
    values = [2**i for i in range(int(math.log2(limit)) + 1)]
    return values if values[-1] == limit else values + [limit]


def find_knee(loads: Sequence[float], throughputs: Sequence[float]) -> int | None:
    """Index of the knee of throughput vs log2(load), or None (see the module docstring)."""
    if len(loads) < 3:
        return None
    xs = [math.log2(x) for x in loads]
    x_span, y_min = xs[-1] - xs[0], min(throughputs)
    y_span = max(throughputs) - y_min
    if x_span <= 0 or y_span <= 0:
        return None
    distance = [(y - y_min) / y_span - (x - xs[0]) / x_span for x, y in zip(xs, throughputs)]
    best = max(range(len(distance)), key=distance.__getitem__)
    return best if distance[best] >= KNEE_MIN_DISTANCE else None


def meets_target(
    point: SweepPoint, min_goodput_ratio: float | None, slo_itl_p95_ms: float | None
) -> bool:
    ratio = point.metrics.goodput_ratio
    if min_goodput_ratio is not None and ratio is not None and ratio < min_goodput_ratio:
        return False
    return slo_itl_p95_ms is None or point.itl_p95_ms <= slo_itl_p95_ms


def capacity_index(
    points: Sequence[SweepPoint], min_goodput_ratio: float | None, slo_itl_p95_ms: float | None
) -> int | None:
    """Index of the highest load meeting the targets; None if none does or there is no target."""
    has_goodput = any(p.metrics.goodput_ratio is not None for p in points)
    if not has_goodput and slo_itl_p95_ms is None:
        return None
    ok = [i for i, p in enumerate(points) if meets_target(p, min_goodput_ratio, slo_itl_p95_ms)]
    return max(ok, key=lambda i: points[i].load) if ok else None


def markdown_table(points: Sequence[SweepPoint], kind: str, knee: int | None,
                   capacity: int | None) -> str:
    header = (f"| {kind} | req/s | output tok/s | total tok/s | TTFT p50 / p95 (ms) "
              "| TPOT p50 (ms) | ITL p50 / p95 (ms) | E2EL p95 (ms) | goodput (req/s) | good % | |")
    lines = [header, "|" + "---|" * 11]
    for i, p in enumerate(points):
        m = p.metrics
        marks = " ".join(name for name, idx in (("knee", knee), ("capacity", capacity)) if idx == i)
        good = "-" if m.goodput is None else f"{m.goodput:.2f}"
        ratio = "-" if m.goodput_ratio is None else f"{100 * m.goodput_ratio:.0f}"
        lines.append(
            f"| {p.load:g} | {m.request_throughput:.2f} | {m.output_throughput:.1f} "
            f"| {m.total_token_throughput:.1f} | {m.ttft_ms.median:.0f} / {m.ttft_ms.p95:.0f} "
            f"| {m.tpot_ms.median:.1f} | {m.itl_ms.median:.1f} / {m.itl_ms.p95:.1f} "
            f"| {m.e2el_ms.p95:.0f} | {good} | {ratio} | {marks} |")
    return "\n".join(lines) + "\n"


def plot(points: Sequence[SweepPoint], kind: str, knee: int | None, capacity: int | None,
         slo_itl_p95_ms: float | None, path: str | pathlib.Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [p.load for p in points]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(loads, [p.throughput for p in points], "o-", color="tab:blue",
            label="output throughput")
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}" for x in loads])
    ax.minorticks_off()
    ax.set_xlabel(kind)
    ax.set_ylabel("output tokens / s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(loads, [p.itl_p95_ms for p in points], "s--", color="tab:red", label="p95 ITL")
    ax2.set_ylabel("p95 inter-token latency (ms)", color="tab:red")
    if slo_itl_p95_ms is not None:
        ax2.axhline(slo_itl_p95_ms, color="tab:red", alpha=0.4, linestyle=":",
                    label=f"ITL SLO {slo_itl_p95_ms:g} ms")
    if knee is not None:
        ax.axvline(loads[knee], color="tab:green", alpha=0.6,
                   label=f"knee ({kind} {loads[knee]:g})")
        ax.plot([loads[knee]], [points[knee].throughput], "*", color="tab:green", markersize=16)
    if capacity is not None:
        ax.axvline(loads[capacity], color="tab:purple", alpha=0.6, linestyle="-.",
                   label=f"capacity under SLO ({kind} {loads[capacity]:g})")
    handles = ax.get_legend_handles_labels()
    handles2 = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + handles2[0], handles[1] + handles2[1], loc="upper left", fontsize=8)
    ax.set_title(title or f"throughput and p95 ITL vs {kind}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_summary(points: Sequence[SweepPoint], kind: str, min_goodput_ratio: float | None,
                  slo_itl_p95_ms: float | None) -> dict:
    knee = find_knee([p.load for p in points], [p.throughput for p in points])
    capacity = capacity_index(points, min_goodput_ratio, slo_itl_p95_ms)
    return {
        "kind": kind,
        "knee_index": knee,
        "knee_load": None if knee is None else points[knee].load,
        "capacity_index": capacity,
        "capacity_load": None if capacity is None else points[capacity].load,
        "min_goodput_ratio": min_goodput_ratio,
        "slo_itl_p95_ms": slo_itl_p95_ms,
        "points": [{"load": p.load, "metrics": p.metrics.to_dict()} for p in points],
    }


def write_outputs(points: Sequence[SweepPoint], kind: str, min_goodput_ratio: float | None,
                  slo_itl_p95_ms: float | None, output_dir: str | pathlib.Path, tag: str,
                  extra: dict | None = None) -> dict[str, pathlib.Path]:
    out = pathlib.Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = sweep_summary(points, kind, min_goodput_ratio, slo_itl_p95_ms)
    summary.update(extra or {})
    paths = {ext: out / f"{tag}.{ext}" for ext in ("json", "md", "png")}
    bench_serving.write_json(paths["json"], summary)
    knee, capacity = summary["knee_index"], summary["capacity_index"]
    notes = (f"\nknee: {kind} {summary['knee_load']}; capacity under SLO: {kind} "
             f"{summary['capacity_load']} (min goodput ratio {min_goodput_ratio}, "
             f"p95 ITL target {slo_itl_p95_ms} ms)\n")
    paths["md"].write_text(f"# {tag}\n\n" + markdown_table(points, kind, knee, capacity) + notes)
    plot(points, kind, knee, capacity, slo_itl_p95_ms, paths["png"], title=tag)
    return paths


def run_sweep(samples: Sequence[datasets.SampleRequest], base: load_client.ClientConfig,
              kind: str, loads: Sequence[float], prompts_per_concurrency: int,
              min_prompts: int, slos_ms: dict | None) -> list[SweepPoint]:
    points = []
    for load in loads:
        if kind == "concurrency":
            n = max(min_prompts, prompts_per_concurrency * int(load))
            config = dataclasses.replace(base, max_concurrency=int(load), request_rate=math.inf,
                                         num_requests=n, progress_desc=f"concurrency {load:g}")
        else:
            config = dataclasses.replace(base, request_rate=float(load),
                                         progress_desc=f"rate {load:g}")
        result = bench_serving.benchmark(samples, config, slos_ms)
        print(metrics.format_table(result.metrics, title=f"{kind} {load:g}"))
        points.append(SweepPoint(float(load), result.metrics))
    return points


class ServerProcess:
    """A server started from a command line, in its own process group, stopped on exit."""

    def __init__(self, command: str, log_path: pathlib.Path):
        self.command = command
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")  # noqa: SIM115 (the child keeps writing to it)
        self.process = subprocess.Popen(shlex.split(self.command), stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # the group this object created
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _loads_from_flags(fv: flags.FlagValues) -> tuple[str, list[float]]:
    if fv.rates:
        return "request rate", [float(r) for r in fv.rates]
    if fv.concurrencies:
        return "concurrency", [float(int(c)) for c in fv.concurrencies]
    return "concurrency", [float(c) for c in doublings(fv.max_concurrency_limit)]


def _sweep_from_flags(fv: flags.FlagValues) -> None:
    slos_ms = metrics.parse_slos(fv.goodput) if fv.goodput else None
    kind, loads = _loads_from_flags(fv)
    model = fv.model or load_client.first_model_id(fv.base_url)
    num_samples = fv.num_prompts
    if kind == "concurrency":
        num_samples = max(fv.num_prompts, fv.prompts_per_concurrency * int(max(loads)))
    options = bench_serving.dataset_options_from_flags(fv, num_prompts=num_samples)
    samples = datasets.build_samples(options, bench_serving.tokenizer_from_flags(fv))
    base = bench_serving.client_config_from_flags(fv, model)
    if fv.warmup_requests > 0:
        warm = dataclasses.replace(base, max_concurrency=1, request_rate=math.inf,
                                   num_requests=fv.warmup_requests, duration_s=None,
                                   use_trace_arrivals=False, progress_desc="warm-up")
        load_client.run(samples, warm)
    points = run_sweep(samples, base, kind, loads, fv.prompts_per_concurrency, fv.num_prompts,
                       slos_ms)
    tag = fv.tag or f"{kind.replace(' ', '_')}_sweep_{fv.dataset}"
    extra = {"label": fv.label, "model": model, "base_url": fv.base_url,
             "dataset_options": dataclasses.asdict(options), "slos_ms": slos_ms}
    paths = write_outputs(points, kind, fv.min_goodput_ratio if slos_ms else None,
                          fv.slo_itl_p95_ms, fv.output_dir, tag, extra)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def main(argv: Sequence[str]) -> None:
    del argv
    fv = flags.FLAGS
    if not fv.server_cmd:
        _sweep_from_flags(fv)
        return
    log_path = pathlib.Path(fv.output_dir) / f"{fv.tag or 'sweep'}_server.log"
    with ServerProcess(fv.server_cmd, log_path) as server:
        t0 = time.perf_counter()
        load_client.wait_until_ready(fv.base_url, fv.server_ready_timeout_s, alive=server.alive)
        print(f"server ready after {time.perf_counter() - t0:.0f} s (log: {log_path})")
        _sweep_from_flags(fv)


if __name__ == "__main__":
    app.run(main)
