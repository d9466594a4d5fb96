"""experiments.lab.engine_replay on a real LLMEngine with random tiny weights (compiles in seconds)."""

import math

import pytest

from engine.config import EngineConfig
from experiments.lab import engine_replay, metrics, report
from experiments.lab.datasets import SampleRequest
from experiments.lab.engine_replay import ReplayConfig

# The lab replay end to end: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def engine():
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model="random:tiny", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
        num_kv_blocks=4 * 8 + 1, token_buckets=(16, 64), seq_buckets=(4,), compilation_cache_dir=None,
    ), progress=False)


def samples(n, output_len=5, offsets=None):
    return [SampleRequest(f"prompt number {i} " + "abc " * i, 0, output_len + i % 3,
                          None if offsets is None else offsets[i]) for i in range(n)]


def test_all_at_once_records_every_token(engine):
    work = samples(6)
    result = engine_replay.replay(engine, work, ReplayConfig())
    assert not engine.has_unfinished_requests()
    for sample, record in zip(work, result.records):
        assert record.success and record.output_tokens == sample.expected_output_len
        assert len(record.chunk_times_s) == record.output_tokens  # one streamed chunk per token
        assert record.prompt_len == len(sample.prompt.encode())  # the byte tokenizer
        assert record.start_s == result.start_s and record.ttft_s > 0
    assert max(s.num_running for s in result.steps) == 4  # max_num_seqs
    m = metrics.compute_metrics(result.records, result.duration_s)
    assert m.completed == 6 and m.total_output_tokens == sum(s.expected_output_len for s in work)
    assert m.itl_ms.median > 0 and m.output_throughput > 0
    last = max(r.chunk_times_s[-1] for r in result.records)
    assert result.duration_s == pytest.approx(last - result.start_s)


def test_max_concurrency_caps_requests_and_starts_their_clock_when_a_slot_frees(engine):
    work = samples(5, output_len=4)
    result = engine_replay.replay(engine, work, ReplayConfig(max_concurrency=2))
    assert all(s.num_running + s.num_waiting <= 2 for s in result.steps)
    first_done = sorted(r.chunk_times_s[-1] for r in result.records[:2])[0]
    assert result.records[2].start_s == pytest.approx(first_done)
    assert all(r.success for r in result.records)


def test_arrival_offsets_are_send_times(engine):
    work = samples(3, output_len=2, offsets=[0.0, 0.0, 0.3])
    result = engine_replay.replay(engine, work, ReplayConfig(use_arrival_offsets=True))
    starts = [r.start_s - result.start_s for r in result.records]
    assert starts == pytest.approx([0.0, 0.0, 0.3])
    assert result.records[2].chunk_times_s[0] > result.start_s + 0.3


def test_send_times():
    work = samples(50)
    assert engine_replay.send_times(work, ReplayConfig()) == [0.0] * 50
    times = engine_replay.send_times(work, ReplayConfig(request_rate=10.0, seed=1))
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert 2.0 < times[-1] < 9.0  # 49 gaps of mean 0.1 s
    assert engine_replay.send_times(work, ReplayConfig(request_rate=10.0, seed=1)) == times
    with pytest.raises(ValueError, match="non-decreasing"):
        engine_replay.send_times(samples(2, offsets=[1.0, 0.5]), ReplayConfig(use_arrival_offsets=True))
    with pytest.raises(ValueError, match="request_rate"):
        ReplayConfig(request_rate=0.0)
    with pytest.raises(ValueError, match="max_concurrency"):
        ReplayConfig(max_concurrency=0)


def test_swap_scheduler_and_warm_up(engine):
    original = engine.scheduler.config
    swapped = engine_replay.swap_scheduler(engine, policy="static", enable_prefix_caching=False)
    assert engine.scheduler is swapped and swapped.config.policy == "static"
    assert swapped.config.max_num_seqs == original.max_num_seqs
    result = engine_replay.replay(engine, samples(6, output_len=3), ReplayConfig())
    # Static: nobody joins a running batch, so the first batch of 4 finishes before the 5th starts.
    first_batch_done = max(r.chunk_times_s[-1] for r in result.records[:4])
    assert min(r.chunk_times_s[0] for r in result.records[4:]) > first_batch_done
    engine.add_request("busy", "hello", None)
    with pytest.raises(ValueError, match="idle"):
        engine_replay.swap_scheduler(engine, policy="fcfs")
    engine.abort_request("busy")
    engine_replay.swap_scheduler(engine, policy="fcfs")
    steps_before = engine.runner.num_real_tokens
    engine_replay.warm_up(engine)
    assert engine.runner.num_real_tokens - steps_before == 16 + 64  # one prompt per bucket
    assert engine.scheduler.config.policy == "fcfs" and not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="no samples"):
        engine_replay.replay(engine, [], ReplayConfig())


def test_report_helpers(tmp_path):
    assert report.ratio(3.0, 1.5) == 2.0 and report.ratio(0, 0) == 0.0 and math.isinf(report.ratio(1, 0))
    p = report.percentiles_ms([0.001, 0.002, 0.003, 0.004])
    assert p["max"] == pytest.approx(4.0) and p["p50"] == pytest.approx(2.5) and p["n"] == 4
    assert report.percentiles_ms([])["max"] == 0.0
    g = report.goal("x", 1.5, 2.0)
    assert not g["met"] and report.goal("y", 3.0, 5.0, higher_is_better=False)["met"]
    assert "MISSED" in report.goals_text([g])
    table = report.markdown_table(["a", "b"], [["r", 1234.5], ["s", 0.01234]])
    assert "| r | 1,234 |" in table and "| s | 0.0123 |" in table
    records = [metrics.RequestRecord(1, 0.0, [float(i)]) for i in range(4)]
    assert report.short_records(records, [1, 9, 2, 8]) == [records[0], records[2]]
    fig, axes = report.new_figure(2)
    axes[0].plot([1, 2], [3, 4])
    paths = report.write_results(tmp_path, "t", {"command": "cmd", "v": float("inf")}, "text\n", fig)
    assert paths["json"].read_text().count('"inf"') == 1
    assert paths["md"].read_text().startswith("# t\n\n`cmd`") and paths["png"].stat().st_size > 1000
