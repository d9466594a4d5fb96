"""One process of the two-process multi-host test (tests/engine/test_tensor_parallel.py runs two).

argv: process_id port. The leader runs PROMPTS greedily and prints the tokens (RESULT), then
starts a load of long greedy requests; the follower prints each step of that load (LOAD <n>) and
the test kills it with SIGKILL in the middle of the load. The leader prints what its requests got
(DIED: their errors, whether the engine is dead, when), then what a new request gets (REFUSED),
and calls sys.exit(3): the multi-host exit hook ends the process with BROKEN_EXIT_STATUS instead of
waiting at jax.distributed's shutdown barrier for the dead process.
"""

import json
import os
import sys
import time

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=1 "
                           "--xla_cpu_use_fusion_emitters=false")  # tests/conftest.py's TEST_XLA_FLAGS
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scaleout import multihost  # noqa: E402
from tests.engine.test_tensor_parallel import KNOBS, PROMPTS  # noqa: E402

# How long the leader waits for an acknowledgement or for a step before it calls the mesh broken:
# the bound on noticing the killed follower. jax.distributed's heartbeat (whose timeout ends every
# process) is set far above it and above any stall of a loaded machine, so it never decides.
BOUND_S = 8

process_id, port = int(sys.argv[1]), sys.argv[2]
config = EngineConfig(**KNOBS, tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                      num_processes=2, process_id=process_id)
multihost.initialize(config.coordinator_address, 2, process_id, timeout_s=120, heartbeat_timeout_s=300)
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.step.model_runner import ModelRunner  # noqa: E402

# The two processes compile their buckets (a plain one and the scoring one) one at a time in
# opposite orders, as two hosts' compile threads may finish them: nothing a process does while
# compiling may be a collective (placing each bucket's idle mask once was, and the two processes
# ran mismatched all-gathers).
_compile_all = ModelRunner.compile_all


def compile_all(self, progress=True, workers=None, buckets=None):
    order = list(buckets or self.shapes.all_buckets())
    assert len(order) > 1, order  # the regression needs two buckets
    return _compile_all(self, progress, workers=1, buckets=order[::-1] if process_id == 1 else order)


ModelRunner.compile_all = compile_all

engine = LLMEngine(config, progress=False)
if process_id == 1:
    real = engine.runner.execute
    num_load_steps = [0]

    def execute(out):
        if any(sr.req_id.startswith("load") for sr in out.scheduled):
            num_load_steps[0] += 1
            print(f"LOAD {num_load_steps[0]}", flush=True)  # the test kills this process meanwhile
        return real(out)

    engine.runner.execute = execute
    multihost.follow(engine.runner)
    sys.exit(0)
engine.runner = multihost.LeaderRunner(engine.runner, timeout_s=BOUND_S, step_timeout_s=BOUND_S)


def run(tag, params, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    done = {}
    while engine.has_unfinished_requests() and engine.dead_reason is None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}{i}"].outputs[0] for i in range(len(prompts)) if f"{tag}{i}" in done]


first = run("ok", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1), PROMPTS)
print("RESULT " + json.dumps({"tokens": [o.token_ids for o in first], "errors": [o.error for o in first if o.error],
                              "logprobs": [o.logprobs[0][o.token_ids[0]] for o in first if o.logprobs]}), flush=True)
# Every prompt with 90 more tokens stays within max_model_len=128: a load that outlasts the kill.
load = run("load", SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True), PROMPTS)
print("DIED " + json.dumps({"errors": [o.error for o in load if o.error], "num_finished": len(load),
                            "num_tokens": [len(o.token_ids) for o in load], "dead": engine.dead_reason,
                            "time": time.time()}), flush=True)
try:
    engine.add_request("after", PROMPTS[0], SamplingParams(max_tokens=2))
    refused = None
except Exception as exc:  # noqa: BLE001 - reported to the test
    refused = f"{type(exc).__name__}: {exc}"
print("REFUSED " + json.dumps({"error": refused}), flush=True)
sys.exit(3)
