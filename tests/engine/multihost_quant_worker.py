"""One process of the two-process quantized multi-host test (tests/engine/test_quant_parallel.py).

argv: process_id port. TP = 4 across two processes of 2 virtual CPU devices, int8 weights and an
int8 cache (tests/engine/test_quant_tp.py's knobs); the leader prints each prompt's greedy tokens
and first-token logprob (RESULT), then stops the follower and leaves the mesh.
"""

import json
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=1 "
                           "--xla_cpu_use_fusion_emitters=false")  # tests/conftest.py's TEST_XLA_FLAGS
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from engine.config import EngineConfig  # noqa: E402
from engine.scaleout import multihost  # noqa: E402
from tests.engine.test_quant_tp import GREEDY, KNOBS, PROMPTS  # noqa: E402

process_id, port = int(sys.argv[1]), sys.argv[2]
config = EngineConfig(**KNOBS, tensor_parallel_size=4, coordinator_address=f"127.0.0.1:{port}",
                      num_processes=2, process_id=process_id)
engine = multihost.engine_for_process(config, progress=False)  # a follower serves, then exits here
for i, prompt in enumerate(PROMPTS):
    engine.add_request(f"r{i}", prompt, GREEDY)
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out.outputs[0]
outs = [done[f"r{i}"] for i in range(len(PROMPTS))]
print("RESULT " + json.dumps([[o.token_ids, o.logprobs[0][o.token_ids[0]]] for o in outs]), flush=True)
engine.multihost_stop()
multihost.shutdown()
