"""Knee and capacity on synthetic curves; outputs; a short live sweep against the fake server."""

import json

import pytest

from experiments.bench import sweep
from experiments.lab import load_client
from experiments.lab.datasets import SampleRequest
from experiments.lab.metrics import BenchmarkMetrics, LatencyStats, parse_slos


def _metrics(throughput, itl_p95_ms=10.0, num_good=None, sent=10):
    itl = LatencyStats(itl_p95_ms / 2, itl_p95_ms / 2, 1.0, itl_p95_ms, itl_p95_ms, itl_p95_ms)
    zero = LatencyStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return BenchmarkMetrics(
        completed=sent, failed=0, duration_s=1.0, total_input_tokens=0,
        total_output_tokens=int(throughput), request_throughput=sent,
        output_throughput=throughput, total_token_throughput=throughput, ttft_ms=zero,
        tpot_ms=zero, itl_ms=itl, e2el_ms=zero, goodput=num_good, num_good=num_good,
        slos_ms={} if num_good is None else {"ttft": 1.0})


def test_doublings():
    assert sweep.doublings(64) == [1, 2, 4, 8, 16, 32, 64]
    assert sweep.doublings(12) == [1, 2, 4, 8, 12]
    assert sweep.doublings(1) == [1]


@pytest.mark.parametrize(
    "throughputs, knee",
    [
        ([100, 200, 400, 700, 900, 1000, 1000], 4),  # saturates: knee at 16, 90% of the peak
        ([100, 190, 350, 560, 640, 660, 665], 3),  # bends earlier
        ([100, 200, 400, 800, 600], 3),  # a peak, then collapse: the peak
        ([100, 200, 400, 800, 1600, 3200, 6400], None),  # still scaling: no knee yet
        ([100, 200, 300, 400, 500, 600, 700], None),  # a constant gain per doubling: straight
        ([500, 500, 500, 500], None),  # flat
        ([100, 200], None),  # too few points
    ],
)
def test_find_knee_on_synthetic_curves(throughputs, knee):
    loads = [2**i for i in range(len(throughputs))]
    assert sweep.find_knee(loads, throughputs) == knee


def test_find_knee_ignores_units():
    curve = [100, 190, 350, 560, 640, 660, 665]
    loads = [2**i for i in range(len(curve))]
    assert sweep.find_knee(loads, [y * 1e-3 for y in curve]) == sweep.find_knee(loads, curve)
    assert sweep.find_knee([x * 3 for x in loads], curve) == 3


def test_capacity_is_the_highest_load_meeting_the_targets():
    points = [sweep.SweepPoint(float(c), _metrics(100 * c, itl_p95_ms=itl, num_good=good))
              for c, itl, good in ((1, 10, 10), (2, 20, 10), (4, 40, 9), (8, 80, 6), (16, 160, 2))]
    assert sweep.capacity_index(points, 0.9, None) == 2
    assert sweep.capacity_index(points, 0.5, None) == 3
    assert sweep.capacity_index(points, 0.9, 30.0) == 1
    assert sweep.capacity_index(points, None, 100.0) == 3
    assert sweep.capacity_index(points, 0.9, 5.0) is None
    no_slo = [sweep.SweepPoint(p.load, _metrics(p.throughput, p.itl_p95_ms)) for p in points]
    assert sweep.capacity_index(no_slo, 0.9, None) is None
    assert sweep.capacity_index(no_slo, None, 50.0) == 2


def test_write_outputs_json_markdown_png(tmp_path):
    curve = [100, 200, 400, 700, 900, 1000, 1000]
    points = [sweep.SweepPoint(float(2**i), _metrics(y, itl_p95_ms=5.0 * 2**i, num_good=10 - i))
              for i, y in enumerate(curve)]
    paths = sweep.write_outputs(points, "concurrency", 0.8, 100.0, tmp_path, "synthetic",
                                extra={"label": "test"})
    summary = json.loads(paths["json"].read_text())
    assert summary["knee_load"] == 16.0 and summary["knee_index"] == 4
    assert summary["capacity_load"] == 4.0  # ratios 1.0, .9, .8, .7: 4 is the last >= 0.8
    assert summary["label"] == "test" and len(summary["points"]) == 7
    table = paths["md"].read_text()
    assert table.count("\n| ") == 8  # header and 7 rows
    assert "| 16 |" in table and "knee |" in table and "capacity |" in table
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_live_concurrency_sweep_against_fake_server(fake_server, tmp_path):
    fake_server.ttft_s, fake_server.itl_s = 0.02, 0.01
    samples = [SampleRequest(f"q{i} a b", 3, 4) for i in range(8)]
    base = load_client.ClientConfig(base_url=fake_server.base_url, model="fake-model",
                                    show_progress=False)
    points = sweep.run_sweep(samples, base, "concurrency", [1.0, 2.0, 4.0],
                             prompts_per_concurrency=2, min_prompts=4,
                             slos_ms=parse_slos("ttft:5000"))
    assert [p.load for p in points] == [1.0, 2.0, 4.0]
    assert [p.metrics.completed for p in points] == [4, 4, 8]
    assert all(p.metrics.goodput_ratio == 1.0 for p in points)
    # The fake server is delay-bound, so more concurrency means more throughput.
    assert points[2].throughput > points[0].throughput
    assert fake_server.max_in_flight == 4
    paths = sweep.write_outputs(points, "concurrency", 0.9, None, tmp_path, "live")
    assert json.loads(paths["json"].read_text())["capacity_load"] == 4.0
