"""Prefill/decode disaggregation (engine/disaggregation/pd_engine.py) on random:tiny-gqa3 (3 KV
heads, padded to 4 for TP = 2): a prefill pool and a decode pool of 2 virtual devices each, one
PDEngine. Its prefill engine, used on its own, is the colocated reference (TP = 2, the same compiled
steps): greedy, seeded, n > 1, logprobs and stop strings give the same outputs; the first token
comes out before the decode pool has the request; aborts in every phase, decode-side preemption and
backpressure leave no block held; nothing recompiles after warm-up; metrics per pool. The engine is
the `pd` fixture (tests/engine/conftest.py), shared with the two-process tests
(test_disaggregation_process.py)."""

import pytest

from engine.config import EngineConfig
from engine.disaggregation_config import DisaggregationConfig
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion
from tests.engine.disaggregation_shared import KNOBS, PROMPTS, churn, same_outputs


def _no_blocks_held(pd):
    for engine in (pd.prefill, pd.decode.engine):
        pool = engine.scheduler.kv_cache_manager.pool
        assert pool.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert not pd.decode.num_pending and not pd.has_unfinished_requests()


def test_outputs_equal_colocated_and_the_kv_moves(pd):
    reference = pd.prefill  # the prefill pool's engine alone: colocated TP = 2
    cases = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=3, n=3, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=8, logprobs=0, presence_penalty=0.5,
                            ignore_eos=True)]
    requests = [(f"r{i}", p, cases[i % len(cases)]) for i, p in enumerate(PROMPTS)]
    want = run_to_completion(reference, requests)
    # A stop string from inside one greedy output: both must cut there.
    text = want["r0"].outputs[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[text[5:7]])
    want.update(run_to_completion(reference, [("stop", PROMPTS[0], stop)]))
    assert want["stop"].outputs[0].finish_reason == "stop"
    before = pd.get_stats()
    got = run_to_completion(pd, requests + [("stop", PROMPTS[0], stop)])
    after = pd.get_stats()
    for rid, out in want.items():
        same_outputs(out, got[rid], logprobs=rid in ("r3", "r8", "r4", "r9"))
    moved = after.kv_transfer.num_transfers - before.kv_transfer.num_transfers
    # Every request's full blocks move (gathered while the decode pool may be stepping); those
    # the decode pool already holds (the 4 every prompt starts with) are not written again.
    full_blocks = [len(pd.tokenize(p)) // 16 for p in PROMPTS + [PROMPTS[0]]]
    assert moved == len(full_blocks)
    assert after.kv_transfer.num_blocks - before.kv_transfer.num_blocks == sum(full_blocks)
    assert after.kv_transfer.num_bytes > before.kv_transfer.num_bytes
    decode_before, decode_after = before.replicas[1], after.replicas[1]
    assert decode_after.prefix_cache_hits - decode_before.prefix_cache_hits >= 3 * 16 * len(want)
    assert decode_after.num_prompt_tokens > decode_before.num_prompt_tokens
    assert after.num_compilations == before.num_compilations  # nothing recompiles
    _no_blocks_held(pd)
    metrics = ServerMetrics().render(after)
    assert 'jaxserve:kv_cache_usage_perc{pool="decode"}' in metrics
    assert 'jaxserve:weight_bytes{device="1",pool="prefill"}' in metrics
    assert "jaxserve:kv_transfers_total" in metrics and "jaxserve:kv_transfer_queue_depth" in metrics


def test_greedy_equals_colocated_and_no_op_mixes_the_pools(pd):
    """Ten prompts with a shared prefix, longer than one 64-token chunk, greedy; and an op over
    arrays of both pools raises in JAX (nothing in the engine may need one)."""
    import jax.numpy as jnp

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [(f"g{i}", p + p[:20], greedy) for i, p in enumerate(PROMPTS)]
    assert all(len(pd.tokenize(p)) > KNOBS["max_num_batched_tokens"] for _, p, _ in requests)
    want = run_to_completion(pd.prefill, requests)
    got = run_to_completion(pd, requests)
    assert [got[f"g{i}"].outputs[0].token_ids for i in range(10)] == [want[f"g{i}"].outputs[0].token_ids
                                                                      for i in range(10)]
    prefill_k, decode_k = pd.prefill.runner.kv_cache[0], pd.decode.engine.runner.kv_cache[0]
    assert prefill_k.devices().isdisjoint(decode_k.devices())
    with pytest.raises(ValueError, match="[Dd]evice"):
        jnp.add(prefill_k[:, :1], decode_k[:, :1])


def test_200_requests_with_random_aborts_at_every_stage_leak_nothing(pd):
    before = pd.get_stats()
    churn(pd, 200, seed=0)
    assert pd.get_stats().num_compilations == before.num_compilations
    _no_blocks_held(pd)


def test_the_first_token_streams_from_the_prefill_pool(pd):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    pd.add_request("first", PROMPTS[3], params)
    assert pd.pool_of("first") == "prefill"
    outs = []
    while not outs:
        outs = pd.step()
    (out,) = outs
    assert len(out.outputs[0].token_ids) == 1 and not out.finished and out.outputs[0].finish_reason is None
    assert pd.pool_of("first") in ("transfer", "decode")
    assert out.metrics.first_token_time is not None
    done = run_to_completion(pd, [])
    assert done["first"].outputs[0].token_ids[:1] == out.outputs[0].token_ids
    assert len(done["first"].outputs[0].token_ids) == 6
    _no_blocks_held(pd)


def test_aborts_while_prefilling_in_transfer_and_decoding_leak_nothing(pd):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(6):
        pd.add_request(f"a{i}", PROMPTS[i] * 2, params)  # 140-190 tokens: prefills take 3 steps
    assert pd.abort_request("a0")  # queued in the prefill pool
    aborted = {}  # phase -> request aborted in it
    while pd.has_unfinished_requests():
        pd.step()
        for i in range(1, 6):
            phase = pd.pool_of(f"a{i}")
            if phase is not None and phase not in aborted:
                aborted[phase] = i
                assert pd.abort_request(f"a{i}") and pd.pool_of(f"a{i}") is None
    assert set(aborted) == {"prefill", "transfer", "decode"}, aborted
    assert not pd.abort_request("a0")  # gone
    _no_blocks_held(pd)


def test_decode_preemption_recomputes_and_backpressure_bounds_the_transfers(pd):
    reference = pd.prefill
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [(f"p{i}", PROMPTS[i], params) for i in range(8)]
    want = run_to_completion(reference, requests)
    pd.decode.engine.reconfigure_scheduler(num_kv_blocks=20)  # 19 usable: 8 growing requests do not fit
    pd.max_pending = 2
    try:
        before = pd.decode.engine.get_stats().num_preemptions
        for rid, prompt, p in requests:
            pd.add_request(rid, prompt, p)
        got, most_pending = {}, 0
        while pd.has_unfinished_requests():
            for out in pd.step():
                if out.finished:
                    got[out.request_id] = out
            most_pending = max(most_pending, pd.decode.num_pending)
        assert most_pending <= 2
        assert pd.decode.engine.get_stats().num_preemptions > before
        for rid, out in want.items():
            same_outputs(out, got[rid])
        _no_blocks_held(pd)
    finally:
        pd.decode.engine.reconfigure_scheduler(num_kv_blocks=KNOBS["num_kv_blocks"])
        pd.max_pending = pd.config.disaggregation.max_pending_transfers


@pytest.mark.parametrize("value, match", [
    ("prefill:2", "decode missing"),
    ("prefill:2,decode:1", "must be the same size"),
    ("prefill:x,decode:2", r"disaggregation.prefill must be an integer"),
    ("prefill:2,decode:2,bogus:1", "unknown key"),
    ("prefill=2", "is not NAME:COUNT"),
    (dict(prefill=2, decode=2, max_pending_transfers=0), "max_pending_transfers must be a positive"),
    (dict(prefill=1, decode=1, decode_num_kv_blocks=1), "decode_num_kv_blocks must be >= 2"),
])
def test_bad_disaggregation_values_name_the_knob(value, match):
    with pytest.raises(ValueError, match=match):
        DisaggregationConfig.from_value(value)


def test_engine_config_checks_the_combination():
    with pytest.raises(ValueError, match="tensor_parallel_size=4: with disaggregation"):
        EngineConfig(**KNOBS, disaggregation="prefill:2,decode:2", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="data_parallel_size and num_processes must be 1"):
        EngineConfig(**KNOBS, disaggregation="prefill:1,decode:1", data_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(**KNOBS, disaggregation="prefill:1,decode:1", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(**{**KNOBS, "enable_prefix_caching": False}, disaggregation="prefill:1,decode:1")
    from engine.disaggregation.pd_engine import PDEngine

    with pytest.raises(ValueError, match="needs 6 devices here, but only 4"):
        PDEngine(EngineConfig(**KNOBS, disaggregation="prefill:3,decode:3"), progress=False)
    # A pool that could not hold one max_model_len request (so some prompt would fit the other
    # pool but not this one) is refused before anything is built.
    with pytest.raises(ValueError, match=r"decode_num_kv_blocks=10 holds 9 blocks of 16 tokens, less than one "
                                         r"request of max_model_len=256"):
        PDEngine(EngineConfig(**KNOBS, disaggregation=dict(prefill=2, decode=2, decode_num_kv_blocks=10)),
                 progress=False)


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_the_server_serves_disaggregated_and_checks_the_flag():
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tests" / "entrypoints"))
    from server_launcher import ServerProcess, http, parse_metrics

    bad = subprocess.run([sys.executable, "-m", "entrypoints.openai.serve", "--model=random:tiny",
                          "--disaggregation=prefill:2,decode:1"], capture_output=True, text=True, timeout=120,
                         cwd=root)
    assert bad.returncode != 0 and "disaggregation: the prefill pool (2 devices)" in bad.stderr + bad.stdout
    cache = os.environ.get("JAXSERVE_COMPILATION_CACHE", str(root / ".cache" / "jax"))
    server = ServerProcess("--model=random:tiny", "--disaggregation=prefill:1,decode:1", "--max_num_seqs=4",
                           "--max_num_batched_tokens=64", "--max_model_len=128", "--token_buckets=16,64",
                           "--seq_buckets=4", f"--compilation_cache_dir={cache}", fake=False,
                           startup_timeout=300).start()
    try:
        body = {"prompt": "A prompt long enough to fill two blocks of sixteen bytes.", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        status, _, text = http("POST", server.url + "/v1/completions", body)
        assert status == 200, text
        whole = json.loads(text)
        assert whole["usage"]["completion_tokens"] == 8
        status, _, text = http("POST", server.url + "/v1/completions", {**body, "stream": True})
        assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
        # A client that reads slower than the tokens arrive gets several in one chunk: the
        # streamed text, not the number of chunks, must equal the whole response's.
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert len(chunks) >= 2 and chunks[-1]["choices"][0]["finish_reason"] == "length", text
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        metrics = parse_metrics(http("GET", server.url + "/metrics")[2])
        assert metrics["jaxserve:kv_transfers_total"] >= 1 and metrics["jaxserve:kv_transfer_bytes_total"] > 0
        assert 'jaxserve:num_requests_running{pool="decode"}' in metrics and metrics["jaxserve:engine_degraded"] == 0
        assert http("GET", server.url + "/health")[::2] == (200, '{"status": "ok"}')
    finally:
        assert server.terminate(timeout=60) == 0, server.output()[-3000:]
