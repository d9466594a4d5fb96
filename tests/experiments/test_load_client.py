"""The streaming client against the fake server of conftest.py (known delays, on loopback).

Delays are lower bounds on a shared machine, so latencies are checked as at least the server's
sleep and at most a generous multiple of it.
"""

import math

import numpy as np
import pytest

from experiments.lab import load_client
from experiments.lab.datasets import SampleRequest
from experiments.lab.metrics import compute_metrics, parse_slos


def _samples(n, output_len=5, prompt="a b c", offsets=None):
    return [SampleRequest(prompt, len(prompt.split()), output_len,
                          None if offsets is None else offsets[i]) for i in range(n)]


def _config(server, **kw):
    kw.setdefault("show_progress", False)
    return load_client.ClientConfig(base_url=server.base_url, model="fake-model", **kw)


def test_completions_stream_timing_tokens_and_concurrency_cap(fake_server):
    result = load_client.run(_samples(6), _config(fake_server, max_concurrency=2))
    assert len(result.records) == 6 and all(r.success for r in result.records)
    assert fake_server.max_in_flight == 2
    for r in result.records:
        assert r.output_tokens == 5 and len(r.chunk_times_s) == 5
        assert r.generated_text == " t0 t1 t2 t3 t4"
        assert r.prompt_len == 3  # from usage.prompt_tokens
        assert 0.05 <= r.ttft_s < 0.5
        # A descheduled client can read two chunks at once (a gap near 0), so single gaps are only
        # bounded above; the stream as a whole took at least the server's sleeps.
        assert all(0 <= gap < 0.5 for gap in r.itls_s)
        assert r.ttft_s + sum(r.itls_s) >= 0.05 + 4 * 0.02 - 1e-3
    payload = fake_server.payloads[0]
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["max_tokens"] == 5 and payload["prompt"] == "a b c"
    assert "ignore_eos" not in payload
    # Three waves of two requests, each at least 0.05 + 4 * 0.02 s long.
    assert result.duration_s >= 3 * 0.13
    m = compute_metrics(result.records, result.duration_s, parse_slos("ttft:5000 itl_p95:5000"))
    assert m.completed == 6 and m.total_output_tokens == 30 and m.num_good == 6
    assert m.tpot_ms.median >= 20 and m.itl_ms.median >= 20


def test_chat_role_delta_is_not_a_token(fake_server):
    config = _config(fake_server, endpoint="chat", ignore_eos=True, max_tokens=3,
                     sampling={"temperature": 0.0})
    (record,) = load_client.run(_samples(1), config).records
    assert record.success and record.output_tokens == 3 and len(record.chunk_times_s) == 3
    assert record.ttft_s >= 0.05  # the role delta arrives at once; the first token after 50 ms
    payload = fake_server.payloads[0]
    assert payload["messages"] == [{"role": "user", "content": "a b c"}]
    assert payload["ignore_eos"] is True and payload["temperature"] == 0.0
    assert payload["max_tokens"] == 3


def test_failures_are_recorded_not_raised(fake_server):
    samples = _samples(2) + _samples(1, prompt="please FAIL now")
    records = load_client.run(samples, _config(fake_server)).records
    assert [r.success for r in records] == [True, True, False]
    assert records[2].error.startswith("HTTP 500")
    dead = load_client.ClientConfig(base_url="http://127.0.0.1:9", model="m", show_progress=False)
    (record,) = load_client.run(_samples(1), dead).records
    assert not record.success and record.error


def test_poisson_sends_follow_the_seeded_gaps(fake_server):
    fake_server.ttft_s, fake_server.itl_s = 0.001, 0.001
    config = _config(fake_server, request_rate=20.0, seed=7)
    records = load_client.run(_samples(8, output_len=1), config).records
    gaps = load_client.arrival_gaps(20.0, 1.0, np.random.default_rng(7))
    expected = np.cumsum([0.0] + [next(gaps) for _ in range(7)])
    sent = np.array([r.start_s for r in records]) - records[0].start_s
    assert np.all(sent >= expected - 0.005) and np.all(sent < expected + 0.25)


def test_trace_arrivals_are_honoured(fake_server):
    fake_server.ttft_s, fake_server.itl_s = 0.001, 0.001
    offsets = [0.0, 0.1, 0.3]
    config = _config(fake_server, use_trace_arrivals=True)
    records = load_client.run(_samples(3, output_len=1, offsets=offsets), config).records
    sent = np.array([r.start_s for r in records]) - records[0].start_s
    assert np.all(sent >= np.array(offsets) - 0.005) and np.all(sent < np.array(offsets) + 0.25)


def test_duration_mode_cycles_samples_and_stops(fake_server):
    # Each request takes >= 0.1 + 2 * 0.02 s; one at a time for 0.3 s -> 2 or 3 sent, from a
    # single sample.
    fake_server.ttft_s = 0.1
    config = _config(fake_server, max_concurrency=1, duration_s=0.3)
    result = load_client.run(_samples(1, output_len=3), config)
    assert 2 <= len(result.records) <= 3 and all(r.success for r in result.records)
    assert len(fake_server.payloads) == len(result.records)
    assert result.duration_s >= 0.3


def test_gamma_gaps_mean_and_burstiness():
    rng = np.random.default_rng(0)
    for burstiness in (0.25, 1.0, 4.0):
        gaps = load_client.arrival_gaps(10.0, burstiness, rng)
        x = np.array([next(gaps) for _ in range(20000)])
        assert x.mean() == pytest.approx(0.1, rel=0.05)
        assert x.std() / x.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
    assert next(load_client.arrival_gaps(math.inf, 1.0, rng)) == 0.0


def test_config_validation_and_model_lookup(fake_server):
    for bad in ({"endpoint": "embeddings"}, {"request_rate": 0.0}, {"burstiness": 0.0},
                {"max_concurrency": 0}, {"duration_s": -1.0}):
        with pytest.raises(ValueError):
            load_client.ClientConfig(base_url="http://x", model="m", **bad)
    assert load_client.first_model_id(fake_server.base_url) == "fake-model"
    load_client.wait_until_ready(fake_server.base_url, timeout_s=5)
    with pytest.raises(RuntimeError):
        load_client.wait_until_ready("http://127.0.0.1:9", timeout_s=5, alive=lambda: False)
