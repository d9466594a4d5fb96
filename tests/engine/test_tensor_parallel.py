"""Tensor parallelism, mechanism: knobs and meshes, the padded per-shard layout, the compiled
step's collectives (the Megatron pattern, read from the HLO), the bytes each device holds, and
TP = 4 tokens equal to TP = 1, on random:tiny-gqa3 (the default model's 9 q / 3 KV heads at tiny
size; MLP width 90 and vocabulary 254, which 4 does not divide either)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.scaleout import multihost
from engine.step.mesh import device_grid, make_mesh, replica_meshes
from models.config import preset_config
from models.sharding import shard_layer_host, tp_layout
from tests.engine.conftest import run_to_completion

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
             num_kv_blocks=40, token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None)
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def engines():
    from engine.core.llm_engine import LLMEngine
    from models.loader import load_model

    loaded = load_model("random:tiny-gqa3", host=True)
    return {tp: LLMEngine(EngineConfig(**KNOBS, tensor_parallel_size=tp), progress=False, loaded=loaded)
            for tp in (1, 4)}


def test_knobs_are_validated_by_name():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=-1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 x data_parallel_size=2 needs 16 devices"):
        device_grid(8, 2)


def test_mesh_axes_and_replica_groups():
    mesh = make_mesh(2, 2)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (2, 2)
    rows = replica_meshes(2, 2)
    assert [r.devices.shape for r in rows] == [(1, 2), (1, 2)]
    assert set(rows[0].devices.flat).isdisjoint(rows[1].devices.flat)
    given = jax.devices()[::-1]
    assert list(make_mesh(4, devices=given).devices.flat) == given


def test_heads_are_padded_per_gqa_group_and_fused_per_shard():
    config = preset_config("tiny-gqa3")
    layout = tp_layout(config, 4)
    assert (layout.num_heads, layout.num_kv_heads, layout.local.num_heads, layout.local.num_kv_heads) == (12, 4, 3, 1)
    assert (layout.intermediate_size, layout.vocab_size) == (92, 256)
    rng = np.random.default_rng(0)
    e, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    layer = {"attn_norm": np.ones(e), "mlp_norm": np.ones(e), "wq": rng.normal(size=(e, 9, d)),
             "wk": rng.normal(size=(e, 3, d)), "wv": rng.normal(size=(e, 3, d)),
             "wo": rng.normal(size=(9, d, e)), "w_gate": rng.normal(size=(e, f)),
             "w_up": rng.normal(size=(e, f)), "w_down": rng.normal(size=(f, e))}
    out = shard_layer_host(layer, config, layout)
    # What each device receives (the served layout is out-major): qkv_proj rows [3 q + 1 k + 1 v
    # heads, d] of e columns; gate_up_proj rows [f/4 gate, f/4 up].
    shards = np.split(out["qkv_proj"].reshape(-1, d, e), 4, axis=0)
    for i, shard in enumerate(shards):
        real = i < 3  # KV head 3 (and its 3 query heads) is padding
        q = np.moveaxis(layer["wq"][:, 3 * i : 3 * i + 3], 0, -1) if real else 0
        np.testing.assert_array_equal(shard[:3], q)
        np.testing.assert_array_equal(shard[3], layer["wk"][:, i].T if real else 0)
        np.testing.assert_array_equal(shard[4], layer["wv"][:, i].T if real else 0)
    np.testing.assert_array_equal(out["o_proj"][:, : 9 * d], layer["wo"].reshape(9 * d, e).T)
    assert not out["o_proj"][:, 9 * d :].any() and not out["down_proj"][:, f:].any()
    fp = layout.intermediate_size // 4
    gate_up = np.split(out["gate_up_proj"], 4, axis=0)
    for i, shard in enumerate(gate_up):
        cols = slice(i * fp, min((i + 1) * fp, f))
        real = cols.stop - cols.start
        np.testing.assert_array_equal(shard[:real], layer["w_gate"][:, cols].T)
        np.testing.assert_array_equal(shard[fp : fp + real], layer["w_up"][:, cols].T)
        assert not shard[real:fp].any() and not shard[fp + real :].any()


def _collectives(hlo: str) -> dict[str, list[tuple[str, str]]]:
    """{computation name ("ENTRY" for the entry): [(op, result shape)]} for every collective."""
    found: dict[str, list] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
        m = re.search(r"= (\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                      r"(-start)?\(", line)
        if m:
            found.setdefault(name, []).append((m.group(2), m.group(1).split("{")[0]))
    return found


@pytest.mark.extended  # tests/experiments/test_aot.py checks the pattern on random:tiny in make test; make test-extended (CI runs it after make test)
def test_compiled_step_is_the_megatron_pattern(engines):
    """Per layer (the lax.scan body, run num_layers times): exactly 2 all-reduces of the
    residual stream [T, e]; per step: the vocab-parallel embedding's all-reduce and one
    all-gather of the logits [L, v]; nothing else (no weight is ever gathered)."""
    engine = engines[4]
    config = engine.model_config
    hlo = engine.runner._compiled[engine.runner.shapes.buckets()[0]].as_text()  # a plain bucket
    found = _collectives(hlo)
    residual = f"f32[16,{config.hidden_size}]"
    body = [n for n in found if n != "ENTRY"]
    assert len(body) == 1, found
    assert found[body[0]] == [("all-reduce", residual)] * 2
    loop = [line for line in hlo.splitlines() if f"body={body[0]}" in line]
    assert len(loop) == 1 and f'"known_trip_count":{{"n":"{config.num_layers}"}}' in loop[0]
    entry = sorted(found["ENTRY"])
    assert entry == [("all-gather", "f32[4,256]"), ("all-reduce", residual)]


def test_each_device_holds_a_quarter_of_each_split_weight(engines):
    stats4, stats1 = engines[4].get_stats(), engines[1].get_stats()
    assert len(stats4.weight_bytes_per_device) == 4 and len(set(stats4.weight_bytes_per_device)) == 1
    assert max(stats4.weight_bytes_per_device) <= 0.3 * stats1.weight_bytes_per_device[0]
    assert len(set(stats4.kv_cache_bytes_per_device)) == 1
    # 4 padded KV heads over 4 devices (1 each) against 3 on one device.
    assert stats4.kv_cache_bytes_per_device[0] * 3 == stats1.kv_cache_bytes_per_device[0]
    params = engines[4].runner.params
    layers = params["layers"]  # per-layer buffers on the CPU (the switch scan), stacked elsewhere
    for layer in layers if isinstance(layers, list) else [layers]:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            w = layer[name]
            assert {s.data.size for s in w.addressable_shards} == {w.size // 4}, name
    k_cache = engines[4].runner.kv_cache[0]
    heads = 2 if engines[4].runner.kv_layout == "head_major" else 3  # the xla path's head-major pages
    assert k_cache.shape[heads] == 4 and {s.data.shape[heads] for s in k_cache.addressable_shards} == {1}


def test_tp4_tokens_and_logprobs_equal_tp1(engines):
    outs = {}
    for tp, engine in engines.items():
        before = engine.get_stats().num_compilations
        done = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        outs[tp] = [done[f"r{i}"].outputs[0] for i in range(len(PROMPTS))]
        assert engine.get_stats().num_compilations == before  # nothing recompiles
    for a, b in zip(outs[1], outs[4]):
        assert a.token_ids == b.token_ids
        lp1, lp4 = a.logprobs[0][a.token_ids[0]], b.logprobs[0][b.token_ids[0]]
        assert abs(lp1 - lp4) < 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_tp4_equal_one_process_then_a_dead_follower_fails_clearly(engines):
    """Multi-host on one machine: two OS processes, jax.distributed on loopback, 2 virtual CPU
    devices each, TP = 4 across both (tests/engine/multihost_worker.py; the two compile their
    buckets in opposite orders). The leader's greedy tokens equal TP = 1 in this process; then,
    under a load of 4 decoding requests, the follower is killed (SIGKILL) between or inside steps:
    every request fails with MultiHostError within the worker's bound (8 s, well before
    jax.distributed's heartbeat), the engine is dead, a new request is refused with the reason,
    and the leader exits by itself with BROKEN_EXIT_STATUS (no hang at the shutdown barrier)."""
    reference = run_to_completion(engines[1], [(f"m{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    worker = os.path.join(os.path.dirname(__file__), "multihost_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(p), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in (0, 1)]
    killed_at, follower_log = None, []
    try:
        deadline = time.monotonic() + 240
        for line in procs[1].stdout:  # the follower's steps of the load, as they run
            follower_log.append(line)
            if line.startswith("LOAD 5"):
                procs[1].send_signal(signal.SIGKILL)
                killed_at = time.time()
                break
            assert time.monotonic() < deadline, "".join(follower_log[-50:])
        leader_log = procs[0].communicate(timeout=120)[0]
        procs[1].wait(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert killed_at is not None, "".join(follower_log[-50:])
    lines = {x.split(" ", 1)[0]: json.loads(x.split(" ", 1)[1]) for x in leader_log.splitlines()
             if x.startswith(("RESULT ", "DIED ", "REFUSED "))}
    assert set(lines) == {"RESULT", "DIED", "REFUSED"}, leader_log[-3000:]
    result, died = lines["RESULT"], lines["DIED"]
    assert not result["errors"]
    assert result["tokens"] == [reference[f"m{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]
    for i, lp in enumerate(result["logprobs"]):
        out = reference[f"m{i}"].outputs[0]
        assert abs(lp - out.logprobs[0][out.token_ids[0]]) < 1e-4
    assert [p.returncode for p in procs] == [multihost.BROKEN_EXIT_STATUS, -signal.SIGKILL]
    # All 4 in flight, none complete (90 tokens each), every one failed saying why.
    assert died["num_finished"] == 4 and len(died["errors"]) == 4, died
    assert all(n < 90 for n in died["num_tokens"]), died
    assert all("MultiHostError" in e and "multi-host step" in e for e in died["errors"]), died
    assert died["dead"] is not None and "multi-host step" in died["dead"]
    assert died["time"] - killed_at < 8 + 10, died  # the bound, plus a loaded machine's slack
    assert "EngineDeadError" in lines["REFUSED"]["error"] and "multi-host step" in lines["REFUSED"]["error"]
