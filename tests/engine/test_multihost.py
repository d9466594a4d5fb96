"""Multi-host on one machine: two OS processes, jax.distributed on loopback, 2 virtual CPU devices
each, TP = 4 across both (tests/engine/multihost_worker.py). The leader's greedy tokens equal a
one-process TP = 1 engine's and both processes end cleanly; a follower that dies mid-run makes
the leader's requests fail with a clear error, well within a timeout."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from tests.engine.conftest import run_to_completion
from tests.engine.test_tensor_parallel import GREEDY, KNOBS, PROMPTS

WORKER = os.path.join(os.path.dirname(__file__), "multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(mode: str, timeout: float = 240):
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    procs = [subprocess.Popen([sys.executable, WORKER, str(p), port, mode], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in (0, 1)]
    start = time.monotonic()
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    line = [x for x in outs[0].splitlines() if x.startswith("RESULT ")]
    assert line, outs[0][-3000:]
    return json.loads(line[0][len("RESULT "):]), [p.returncode for p in procs], time.monotonic() - start


@pytest.fixture(scope="module")
def reference():
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(**KNOBS), progress=False)
    done = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    return [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]


def test_two_processes_tp4_equal_one_process(reference):
    result, codes, _ = _run_pair("run")
    assert codes == [0, 0] and not result["errors"]
    assert result["tokens"] == [o.token_ids for o in reference]
    for lp, o in zip(result["logprobs"], reference):
        assert abs(lp - o.logprobs[0][o.token_ids[0]]) < 1e-4


def test_a_dead_follower_fails_the_leader_clearly():
    result, codes, seconds = _run_pair("die")
    assert codes == [3, 17]
    assert result["errors"] and all("multi-host step" in e for e in result["errors"])
    assert result["dead"] is not None and seconds < 200
