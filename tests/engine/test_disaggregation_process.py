"""Prefill/decode disaggregation across two OS processes (engine/disaggregation/pd_engine.py with
its decode pool in tests/engine/decode_pool_worker.py, on random:tiny-gqa3): the prefill pool and
the engine here, the decode pool in a process of its own, which is then killed under load. The
colocated reference is the prefill engine of the `pd` fixture (tests/engine/conftest.py), shared
with test_disaggregation.py."""

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion
from tests.engine.disaggregation_shared import (
    KNOBS,
    PROMPTS,
    abort_in_every_phase,
    churn,
    same_outputs,
)

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
            same_outputs(out, got[rid], logprobs=rid in ("x0", "x2", "x4"))
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
        # 100 requests with random aborts, then one aborted in each phase in turn, leave every
        # block of both processes free or cached (none pinned or held), the decode process's
        # counted there. (Which phases the random aborts hit depends on the two processes' speeds.)
        churn(remote, 100, seed=1, every_phase=False)
        abort_in_every_phase(remote)
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
        same_outputs(want[rid], got[rid], logprobs=params.logprobs is not None)
    # New requests are served there, and nothing is left held: every block free or cached.
    done = run_to_completion(remote, AFTER)
    for rid, _, _ in AFTER:
        same_outputs(want[rid], done[rid])
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
