"""Prefill/decode disaggregation (engine/disaggregation/pd_engine.py) on random:tiny-gqa3 (3 KV
heads, padded to 4 for TP = 2): a prefill pool and a decode pool of 2 virtual devices each, one
PDEngine. Its prefill engine, used on its own, is the colocated reference (TP = 2, the same compiled
steps): greedy, seeded, n > 1, logprobs and stop strings give the same outputs; the first token
comes out before the decode pool has the request; aborts in every phase, decode-side preemption and
backpressure leave no block held; nothing recompiles after warm-up; metrics per pool."""

import collections

import pytest

from engine.config import EngineConfig
from engine.disaggregation_config import DisaggregationConfig
from engine.metrics import ServerMetrics
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
             num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(8,), compilation_cache_dir=None)
SYSTEM = "You are a helpful assistant for the disaggregation test. "  # 56 bytes: 3 full blocks
PROMPTS = [SYSTEM + f"Question {i}: " + "why? " * i for i in range(10)]


@pytest.fixture(scope="module")
def pd():
    from engine.disaggregation.pd_engine import PDEngine

    engine = PDEngine(EngineConfig(**KNOBS, disaggregation="prefill:2,decode:2"), progress=False)
    # Warm-up: a penalized request compiles the request tables' history fill in both pools.
    run_to_completion(engine, [("warm", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4,
                                                                   presence_penalty=0.5))])
    return engine


def _no_blocks_held(pd):
    for engine in (pd.prefill, pd.decode.engine):
        pool = engine.scheduler.kv_cache_manager.pool
        assert pool.num_used_blocks == 0 and not engine.has_unfinished_requests()
    assert not pd.decode.num_pending and not pd.has_unfinished_requests()


def _same(a, b, logprobs=False):
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], (a.outputs, b.outputs)
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
    if logprobs:
        for x, y in zip(a.outputs, b.outputs):
            assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
            for ex, ey in zip(x.logprobs, y.logprobs):
                assert ex.keys() == ey.keys()
                assert all(abs(ex[t] - ey[t]) < 1e-4 for t in ex)


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
        _same(out, got[rid], logprobs=rid in ("r3", "r8", "r4", "r9"))
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


def _churn(engine, num_requests: int, seed: int) -> None:
    """One request added per step (random sampling, n, lengths); after every step each live
    request is aborted with probability 0.08, in whatever phase it is. All of them end, and the
    aborts hit every phase."""
    import random

    rng = random.Random(seed)
    live, stages, done = set(), collections.Counter(), 0
    for i in range(num_requests):
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i, max_tokens=rng.randint(1, 12),
                                n=rng.choice([1, 1, 2]), ignore_eos=True)
        engine.add_request(f"z{i}", PROMPTS[i % 10][: rng.randint(5, 110)], params)
        live.add(f"z{i}")
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
        for rid in [r for r in sorted(live) if rng.random() < 0.08]:
            stages[engine.pool_of(rid)] += 1
            assert engine.abort_request(rid)
            live.discard(rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                done += 1
    assert not live and done + sum(stages.values()) == num_requests
    assert stages["prefill"] and stages["transfer"] and stages["decode"], stages


def test_200_requests_with_random_aborts_at_every_stage_leak_nothing(pd):
    before = pd.get_stats()
    _churn(pd, 200, seed=0)
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
            _same(out, got[rid])
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


# The load on the decode process when it is killed (test below): prompts no pool has seen, so each
# moves blocks the decode process must pull. "d": decoding there (long outputs, so they still are),
# "t": moving (their pull hangs), "p": prefilling; "after": served once the engine is degraded.
FRESH = [f"A fresh prompt, number {i}, that no pool has seen before the decode process dies." for i in range(10)]
KILL_LOAD = [
    ("d0", FRESH[0], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, logprobs=1)),
    ("d1", FRESH[1], SamplingParams(temperature=1.0, seed=3, max_tokens=100, ignore_eos=True)),
    ("d2", FRESH[2], SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=80, ignore_eos=True)),
    ("d3", FRESH[3], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)),
    ("t0", FRESH[4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
    ("t1", FRESH[5], SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=20, ignore_eos=True)),
    ("p0", FRESH[6], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
    ("p1", FRESH[7], SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True, logprobs=2)),
]
AFTER = [("after0", FRESH[8], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
         ("after1", FRESH[9], SamplingParams(temperature=1.0, seed=8, max_tokens=10, ignore_eos=True))]
KILL_BOUND_S = 90  # every request in flight ends this soon after the kill (a few s when idle)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_decode_pool_in_another_process_then_killed_under_load(pd, tmp_path):
    """Two OS processes: this one runs the prefill pool (2 devices) and the engine, the other the
    decode pool (`python -m engine.disaggregation.decode_pool`, 2 devices of its own); KV blocks
    move through jax.experimental.transfer. Outputs equal colocated and every moved block is a
    prefix hit there; only `step` waits for the decode process, which runs on by itself; random
    aborts in every phase leave no block held in either process. Then, under a load with requests
    decoding there, moving (a pull in flight) and prefilling, the decode process is killed
    (SIGKILL): the engine degrades instead of dying (it names the lost process), every request in
    flight ends within KILL_BOUND_S with the outputs colocated gives (the prefill pool decodes them
    itself), new ones are served there, no block stays held, and the server's /health says
    "degraded" (200) and /metrics' jaxserve:engine_degraded is 1."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from engine.disaggregation.pd_engine import PDEngine
    from tests.conftest import TEST_XLA_FLAGS

    address = f"127.0.0.1:{_free_port()}"
    hang = tmp_path / "hang_pulls"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HANG_PULLS_FILE=str(hang),
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}")
    worker = os.path.join(os.path.dirname(__file__), "decode_pool_worker.py")
    proc = subprocess.Popen([sys.executable, worker, f"--listen={address}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []  # the decode process's output, read as it comes
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        remote = PDEngine(EngineConfig(**KNOBS, disaggregation=dict(prefill=2, decode=2, decode_address=address)),
                          progress=False)
        cases = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
                 SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=8, ignore_eos=True)]
        requests = [(f"x{i}", p, cases[i % 2]) for i, p in enumerate(PROMPTS[:6])]
        want = run_to_completion(pd.prefill, requests)
        want_runs = run_to_completion(pd.prefill, [("runs", PROMPTS[6], SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True))])["runs"]
        # Handovers and aborts are messages: the only call that waits for the decode process
        # (so for its step in flight) is `step`, made off the caller's thread.
        calls, call = [], remote.decode._call
        remote.decode._call = lambda op, *a: calls.append(op) or call(op, *a)
        got = run_to_completion(remote, requests)
        remote.decode._call = call
        assert set(calls) == {"step"}
        for rid, out in want.items():
            _same(out, got[rid], logprobs=rid in ("x0", "x2", "x4"))
        stats = remote.get_stats()
        # Every request's blocks are gathered; the decode process pulls only buckets with a block
        # it lacks: x0's (the 4 blocks all prompts share) and x3-x5's (their fifth).
        assert stats.kv_transfer.num_transfers == 6 and stats.kv_transfer.num_landed == 4
        assert stats.kv_transfer.seconds > 0
        # Every full prompt block of every sequence is a prefix hit there: the decode process
        # hashes blocks as this one does (it takes this process's root hash at start).
        full = [cases[i % 2].n * (len(remote.tokenize(p)) // 16) * 16 for i, p in enumerate(PROMPTS[:6])]
        assert stats.replicas[1].prefix_cache_hits == sum(full) and remote.decode.num_pending == 0
        # The decode process steps on its own: once a request decodes there, it runs on while
        # this process does not ask, and the next calls return what it made meanwhile (a
        # process stepped only by the leader's calls would need one call per token).
        remote.add_request("runs", PROMPTS[6], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        outs = []  # its output from each call that returned one
        for _ in range(500):  # until it decodes there (or is done already)
            if remote.pool_of("runs") == "decode" or (outs and outs[-1].finished):
                break
            outs += [o for o in remote.step() if o.request_id == "runs"]
        time.sleep(3.0)
        for _ in range(500):
            if outs and outs[-1].finished:
                break
            outs += [o for o in remote.step() if o.request_id == "runs"]
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want_runs.outputs[0].token_ids
        # 24 tokens in a handful of calls (one per token if the leader drove each step).
        assert len(outs) <= 6, [len(o.outputs[0].token_ids) for o in outs]
        # 100 requests with random aborts in every phase leave every block of both processes
        # free or cached (none pinned or held), the decode process's counted there.
        _churn(remote, 100, seed=1)
        assert remote.prefill.scheduler.kv_cache_manager.pool.num_used_blocks == 0
        decode_stats = remote.decode._call("stats")  # fresh, not the last step's snapshot
        assert decode_stats.num_free_blocks + decode_stats.num_cached_blocks == KNOBS["num_kv_blocks"] - 1
        assert remote.decode.num_pending == 0 and not remote.has_unfinished_requests()
        assert remote.get_stats().degraded_reason is None

        _kill_under_load(pd, remote, proc, lines, hang, address)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        reader.join(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert "Traceback" not in "".join(lines), "".join(lines)[-3000:]


def _kill_under_load(pd, remote, proc, lines, hang, address) -> None:
    """The second half of the test above: SIGKILL with requests in every phase, then degraded."""
    import asyncio
    import pathlib
    import sys
    import time

    want = run_to_completion(pd.prefill, KILL_LOAD + AFTER)
    for rid, prompt, params in KILL_LOAD[:4]:
        remote.add_request(rid, prompt, params)
    got, deadline = {}, time.monotonic() + 120
    while any(remote.pool_of(rid) != "decode" for rid, _, _ in KILL_LOAD[:4]):  # all four decode there
        assert time.monotonic() < deadline, [remote.pool_of(rid) for rid, _, _ in KILL_LOAD[:4]]
        got.update((o.request_id, o) for o in remote.step())
    hang.touch()  # from now on the decode process's pulls hang
    for rid, prompt, params in KILL_LOAD[4:6]:
        remote.add_request(rid, prompt, params)
    while not any(line.startswith("PULLING") for line in lines) or any(
            remote.pool_of(rid) != "transfer" for rid, _, _ in KILL_LOAD[4:6]):  # t0's pull hangs
        assert time.monotonic() < deadline, ("".join(lines[-20:]), [remote.pool_of(r) for r, _, _ in KILL_LOAD])
        got.update((o.request_id, o) for o in remote.step())
    for rid, prompt, params in KILL_LOAD[6:]:
        remote.add_request(rid, prompt, params)
    phases = {rid: remote.pool_of(rid) for rid, _, _ in KILL_LOAD}
    proc.kill()
    killed = time.monotonic()
    ended = {}
    while remote.has_unfinished_requests():
        assert time.monotonic() - killed < KILL_BOUND_S, {rid: remote.pool_of(rid) for rid in phases}
        for out in remote.step():
            got[out.request_id] = out
            if out.finished:
                ended[out.request_id] = time.monotonic() - killed
    # The kill found requests in every phase; the engine is degraded, not dead, and says why.
    assert set(phases.values()) == {"prefill", "transfer", "decode"}, phases
    assert remote.dead_reason is None and address in remote.degraded_reason, remote.degraded_reason
    assert "is gone" in remote.degraded_reason
    # Every one of them finished (none failed) with colocated's outputs: the tokens it had
    # returned, then the prefill pool's own, which are the ones the decode pool would have made.
    assert set(ended) == set(phases) and max(ended.values()) < KILL_BOUND_S, ended
    for rid, _, params in KILL_LOAD:
        assert all(c.error is None for c in got[rid].outputs), got[rid].outputs
        _same(want[rid], got[rid], logprobs=params.logprobs is not None)
    # New requests are served there, and nothing is left held: every block free or cached.
    done = run_to_completion(remote, AFTER)
    for rid, _, _ in AFTER:
        _same(want[rid], done[rid])
    for i in range(6):  # aborts in degraded mode free their blocks too
        remote.add_request(f"gone{i}", FRESH[i], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        remote.step()
        assert remote.pool_of(f"gone{i}") == "local" and remote.abort_request(f"gone{i}")
    while remote.has_unfinished_requests():  # an abort lands when the step in flight ends
        remote.step()
    pool = remote.prefill.scheduler.kv_cache_manager.pool
    assert pool.num_used_blocks == 0 and not remote.has_unfinished_requests()
    assert pool.num_free_blocks + pool.num_cached_blocks == KNOBS["num_kv_blocks"] - 1
    stats = remote.get_stats()
    assert stats.degraded_reason == remote.degraded_reason and stats.replicas[1].num_running == 0
    assert not remote.decode._inflight and remote.decode.num_pending == 0  # nothing kept for its pulls

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "entrypoints"))
    from test_server_admission import serving

    async def server_checks():
        async with serving(remote) as (_, session):
            health = await session.get("/health")
            reply = await health.json()
            assert health.status == 200 and reply["status"] == "degraded" and address in reply["reason"], reply
            body = {"prompt": FRESH[8], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            async with session.post("/v1/completions", json=body) as response:
                assert response.status == 200
                assert (await response.json())["choices"][0]["text"] == want["after0"].outputs[0].text
            metrics = await (await session.get("/metrics")).text()
            assert "jaxserve:engine_degraded 1.0" in metrics, metrics

    asyncio.run(server_checks())
