"""Quantized serving on meshes, end to end against TP = 1 engines with the same quantization
(greedy tokens, first-token logprobs within 1e-4): fp8 weights with an fp8_e4m3 cache at TP = 2,
int8 weights with an int8 cache on DP = 2 replicas of TP = 2 (4 virtual devices), bfloat16 with
stacked layers (the accelerators' layout), and a mixture of experts (random:tiny-mixtral) at TP = 2, where each expert's down_proj is split over both
devices and keeps its whole rows' scales (models/sharded_quant.py). Every engine pins the
weight-only form (the row-parallel products' activation scales are per device otherwise:
tests/models/test_sharded_quant.py). And multi-host: TP = 4 over two processes (jax.distributed
on loopback, 2 virtual devices each) with int8 weights and an int8 cache equals TP = 1. The
default-tier check is tests/engine/test_quant_tp.py."""

import json
import os
import socket
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion

pytestmark = pytest.mark.extended  # make test-extended (CI runs it after make test)

KNOBS = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=40,
             token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None, prompt_scoring_bucket=False,
             quantization_activation_rows=17)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def _run(engine) -> list:
    done = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    return [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]


def _assert_equal(outs, reference):
    for a, b in zip(outs, reference):
        assert a.token_ids == b.token_ids
        assert abs(a.logprobs[0][a.token_ids[0]] - b.logprobs[0][b.token_ids[0]]) < 1e-4


@pytest.mark.parametrize("model,quantization,kv_cache_dtype,parallel,dtype", [
    ("random:tiny-gqa3", "fp8", "fp8_e4m3", dict(tensor_parallel_size=2), "float32"),
    ("random:tiny-gqa3", "int8", "int8", dict(tensor_parallel_size=2, data_parallel_size=2), "float32"),
    ("random:tiny-mixtral", "int8", "int8", dict(tensor_parallel_size=2), "float32"),
    # the accelerators' layout: stacked layers, the norms as 16-bit bits after quantizing
    ("random:tiny-gqa3", "int8", "int8", dict(tensor_parallel_size=2, stack_layer_weights=True), "bfloat16"),
])
def test_a_mesh_equals_one_device_with_the_same_quantization(model, quantization, kv_cache_dtype, parallel, dtype):
    from engine.core.llm_engine import LLMEngine
    from engine.scaleout.dp_engine import DPEngine
    from models.loader import load_model

    loaded = load_model(model, host=True, progress=False, dtype=dtype)
    parallel = dict(parallel)
    stacked = {k: parallel.pop(k) for k in list(parallel) if k == "stack_layer_weights"}  # TP = 1 too
    knobs = dict(KNOBS, model=model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
                 **stacked)
    reference = _run(LLMEngine(EngineConfig(**knobs), progress=False, loaded=loaded))
    cls = DPEngine if parallel.get("data_parallel_size", 1) > 1 else LLMEngine
    engine = cls(EngineConfig(**knobs, **parallel), progress=False, loaded=loaded)
    _assert_equal(_run(engine), reference)
    if cls is DPEngine:  # both replicas served, each on its own two devices
        assert all(r.runner.kv_cache[0].values.sharding.mesh.devices.size == 2 for r in engine.replicas)
        assert min(r.num_generation_tokens for r in engine.get_stats().replicas) > 0


def test_two_processes_tp4_with_int8_weights_and_cache_equal_tp1():
    from engine.core.llm_engine import LLMEngine
    from tests.engine.test_quant_tp import KNOBS as TP_KNOBS

    reference = _run(LLMEngine(EngineConfig(**TP_KNOBS), progress=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    worker = os.path.join(os.path.dirname(__file__), "multihost_quant_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(p), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in (0, 1)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    line = next(x for x in logs[0].splitlines() if x.startswith("RESULT "))
    for (tokens, logprob), ref in zip(json.loads(line.split(" ", 1)[1]), reference):
        assert tokens == ref.token_ids and abs(logprob - ref.logprobs[0][ref.token_ids[0]]) < 1e-4
