"""One process of the two-process multi-host test (tests/engine/test_multihost.py runs two).

argv: process_id port. The leader runs PROMPTS greedily and prints the tokens (RESULT), then
runs them again; the follower exits as soon as a step of that second batch reaches it, and the
leader prints the errors it got (DIED) and exits with 3.
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

process_id, port = int(sys.argv[1]), sys.argv[2]
config = EngineConfig(**KNOBS, tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                      num_processes=2, process_id=process_id)
multihost.initialize(config.coordinator_address, 2, process_id, timeout_s=60, heartbeat_timeout_s=10)
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

    def execute(out):
        if any(sr.req_id.startswith("die") for sr in out.scheduled):
            os._exit(17)  # killed in the middle of the second batch
        return real(out)

    engine.runner.execute = execute
    multihost.follow(engine.runner)
    sys.exit(0)
engine.runner = multihost.LeaderRunner(engine.runner, timeout_s=10)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def run(tag):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", p, params)
    done = {}
    while engine.has_unfinished_requests() and engine.dead_reason is None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}{i}"].outputs[0] for i in range(len(PROMPTS)) if f"{tag}{i}" in done]


first = run("ok")
print("RESULT " + json.dumps({"tokens": [o.token_ids for o in first], "errors": [o.error for o in first if o.error],
                              "logprobs": [o.logprobs[0][o.token_ids[0]] for o in first if o.logprobs]}), flush=True)
start = time.monotonic()
second = run("die")
print("DIED " + json.dumps({"errors": [o.error for o in second if o.error], "dead": engine.dead_reason,
                            "seconds": time.monotonic() - start}), flush=True)
os._exit(3)
