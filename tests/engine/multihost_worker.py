"""One process of the two-process multi-host test (tests/engine/test_multihost.py runs two).

argv: process_id port mode ("run": the leader prints its greedy tokens as JSON; "die": the
follower exits before acknowledging its third step, the leader prints the error it gets).
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine import multihost  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_tensor_parallel import KNOBS, PROMPTS  # noqa: E402

process_id, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
config = EngineConfig(**KNOBS, tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                      num_processes=2, process_id=process_id)
multihost.initialize(config.coordinator_address, 2, process_id, timeout_s=60, heartbeat_timeout_s=10)
from engine.llm_engine import LLMEngine  # noqa: E402

engine = LLMEngine(config, progress=False)
if process_id == 1:
    if mode == "die":
        real = engine.runner.execute
        calls = []

        def execute(out):
            calls.append(1)
            if len(calls) == 2:
                os._exit(17)  # killed: the next step is never acknowledged
            return real(out)

        engine.runner.execute = execute
    multihost.follow(engine.runner)
    multihost.shutdown()
    sys.exit(0)
engine.runner = multihost.LeaderRunner(engine.runner, timeout_s=10)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
for i, p in enumerate(PROMPTS):
    engine.add_request(f"r{i}", p, params)
done = {}
while engine.has_unfinished_requests() and engine.dead_reason is None:
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out
outs = [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS)) if f"r{i}" in done]
errors = [o.error for o in outs if o.error]
print("RESULT " + json.dumps({"tokens": [o.token_ids for o in outs], "errors": errors,
                              "dead": engine.dead_reason,
                              "logprobs": [o.logprobs[0][o.token_ids[0]] if o.logprobs else None for o in outs]}),
      flush=True)
if not errors:
    engine.runner.stop()
    multihost.shutdown()
os._exit(3 if errors else 0)
