"""Metric definitions on synthetic timestamps whose answers are worked out by hand."""

import pytest

from experiments.lab.metrics import (
    LatencyStats,
    RequestRecord,
    compute_metrics,
    format_table,
    meets_slos,
    parse_slos,
)


def _records():
    # r1: sent at 0, chunks at 0.1, 0.15, 0.25, 0.3 -> TTFT 100, ITLs 50/100/50, E2EL 300,
    #     TPOT (300 - 100) / 3, own p95 ITL over [50, 50, 100] = 50 + 0.9 * 50 = 95 (ms).
    r1 = RequestRecord(prompt_len=10, start_s=0.0, chunk_times_s=[0.1, 0.15, 0.25, 0.3],
                       output_tokens=4, success=True)
    # r2: one token at +0.2 -> TTFT = E2EL = 200, no ITL, no TPOT.
    r2 = RequestRecord(prompt_len=20, start_s=1.0, chunk_times_s=[1.2], output_tokens=1,
                       success=True)
    r3 = RequestRecord(prompt_len=30, start_s=1.0, error="HTTP 500")
    return [r1, r2, r3]


def test_per_request_quantities():
    r1, r2, _ = _records()
    assert r1.ttft_s == pytest.approx(0.1)
    assert r1.itls_s == pytest.approx([0.05, 0.1, 0.05])
    assert r1.e2el_s == pytest.approx(0.3)
    assert r1.tpot_s == pytest.approx(0.2 / 3)
    assert r1.itl_p95_s == pytest.approx(0.095)
    assert r2.ttft_s == pytest.approx(0.2) and r2.e2el_s == pytest.approx(0.2)
    assert r2.tpot_s is None and r2.itls_s == [] and r2.itl_p95_s == 0.0


def test_aggregates_match_hand_computation():
    m = compute_metrics(_records(), duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 30  # the failed request's prompt does not count
    assert m.total_output_tokens == 5
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    # TTFT over [100, 200]: linear interpolation between the two.
    assert m.ttft_ms.mean == pytest.approx(150)
    assert m.ttft_ms.median == pytest.approx(150)
    assert m.ttft_ms.p90 == pytest.approx(190)
    assert m.ttft_ms.p95 == pytest.approx(195)
    assert m.ttft_ms.p99 == pytest.approx(199)
    assert m.ttft_ms.std == pytest.approx(50)
    # ITL pools the gaps of every request: [50, 100, 50].
    assert m.itl_ms.mean == pytest.approx(200 / 3)
    assert m.itl_ms.median == pytest.approx(50)
    assert m.itl_ms.p99 == pytest.approx(99)
    # TPOT only over requests with more than one token: r1 alone.
    assert m.tpot_ms.mean == pytest.approx(200 / 3)
    assert m.e2el_ms.mean == pytest.approx(250)
    assert m.goodput is None and m.num_good is None and m.goodput_ratio is None


@pytest.mark.parametrize(
    "spec, num_good",
    [
        ("ttft:150", 1),  # r1 (100) yes, r2 (200) no, r3 failed
        ("ttft:250", 2),
        ("tpot:60", 1),  # r1's TPOT is 66.7; r2 counts as TPOT 0
        ("tpot:70", 2),
        ("itl_p95:90", 1),  # r1's own p95 ITL is 95; r2 has none (0)
        ("itl_p95:95", 2),
        ("e2el:250 ttft:1000", 1),
        ("ttft:1000 tpot:1000 e2el:1000 itl_p95:1000", 2),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(spec, num_good):
    m = compute_metrics(_records(), duration_s=2.0, slos_ms=parse_slos(spec))
    assert m.num_good == num_good
    assert m.goodput == pytest.approx(num_good / 2.0)
    assert m.goodput_ratio == pytest.approx(num_good / 3)


def test_failed_request_never_meets_slos():
    _, _, r3 = _records()
    assert not meets_slos(r3, {"ttft": 1e9})


def test_parse_slos_forms_and_errors():
    assert parse_slos("ttft:1000 itl_p95:50") == {"ttft": 1000.0, "itl_p95": 50.0}
    assert parse_slos("ttft:1000,tpot:20") == {"ttft": 1000.0, "tpot": 20.0}
    assert parse_slos(["e2el:5"]) == {"e2el": 5.0}
    for bad in ("ttft", "latency:5", "ttft:-1", "ttft:abc"):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_empty_sets_give_zero_stats_and_duration_must_be_positive():
    assert LatencyStats.of([]) == LatencyStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    m = compute_metrics([RequestRecord(prompt_len=5, start_s=0.0, error="x")], duration_s=1.0)
    assert m.completed == 0 and m.ttft_ms.mean == 0.0 and m.request_throughput == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], duration_s=0.0)


def test_table_and_dict_carry_the_numbers():
    m = compute_metrics(_records(), duration_s=2.0, slos_ms={"ttft": 150.0})
    table = format_table(m)
    assert "Successful requests:" in table and "P95 ITL (ms):" in table
    assert "Request goodput (req/s):" in table and "ttft:150" in table
    d = m.to_dict()
    assert d["ttft_ms"]["p95"] == pytest.approx(195) and d["goodput_ratio"] == pytest.approx(1 / 3)
