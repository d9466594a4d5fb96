"""Prefill/decode disaggregation with int8 weights and an int8 KV cache (random:tiny-gqa3, one
device per pool): the handover moves the cache's per-token scales with its values, so the
outputs equal the prefill pool's engine used on its own (the colocated reference, same
quantization) and the bytes moved per block count both."""

import jax
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from pallas_kernels.kv_quant import ScaledCache
from tests.engine.conftest import run_to_completion

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
             num_kv_blocks=64, token_buckets=(16, 64), seq_buckets=(8,), compilation_cache_dir=None,
             quantization="int8", kv_cache_dtype="int8")
SYSTEM = "You are a helpful assistant for the quantized disaggregation test. "
PROMPTS = [SYSTEM + f"Question {i}: " + "why? " * i for i in range(6)]


@pytest.fixture(scope="module")
def pd8():
    from engine.disaggregation.pd_engine import PDEngine

    return PDEngine(EngineConfig(**KNOBS, disaggregation="prefill:1,decode:1"), progress=False)


def test_the_8bit_cache_moves_with_its_scales_and_outputs_equal_colocated(pd8):
    k_prefill, _ = pd8.prefill.runner.kv_cache
    k_decode, _ = pd8.decode.engine.runner.kv_cache
    assert isinstance(k_prefill, ScaledCache) and isinstance(k_decode, ScaledCache)
    cases = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)]
    requests = [(f"r{i}", p, cases[i % 2]) for i, p in enumerate(PROMPTS)]
    want = run_to_completion(pd8.prefill, requests)
    before = pd8.get_stats()
    got = run_to_completion(pd8, requests)
    after = pd8.get_stats()
    for rid, out in want.items():
        assert out.outputs[0].token_ids == got[rid].outputs[0].token_ids, rid
        if cases[int(rid[1:]) % 2].logprobs:
            for a, b in zip(out.outputs[0].logprobs, got[rid].outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    moved = after.kv_transfer.num_blocks - before.kv_transfer.num_blocks
    assert moved > 0 and after.kv_transfer.num_transfers - before.kv_transfer.num_transfers == len(PROMPTS)
    layers, _, block_size, kv_heads, head_dim = k_prefill.values.shape
    per_block = 2 * layers * block_size * kv_heads * (head_dim * 1 + 2)  # K and V: int8 values, bf16 scales
    assert (after.kv_transfer.num_bytes - before.kv_transfer.num_bytes) == moved * per_block
    # The decode pool served every moved prompt block as a prefix hit: its blocks hold the prefill
    # pool's values and scales bit for bit.
    hashes, k, v = pd8._gather(pd8.tokenize(PROMPTS[0]))
    lookup = pd8.decode.engine.scheduler.kv_cache_manager.pool.lookup
    blocks = [lookup(h) for h in hashes]
    assert hashes and all(b is not None for b in blocks)
    ids = np.asarray(blocks)
    for sent, held in ((k, pd8.decode.engine.runner.kv_cache[0]), (v, pd8.decode.engine.runner.kv_cache[1])):
        for name in ("values", "scales"):
            np.testing.assert_array_equal(np.asarray(getattr(sent, name))[:, : len(ids)],
                                          np.asarray(getattr(held, name))[:, ids])
    assert pd8.decode.engine.scheduler.kv_cache_manager.pool.num_used_blocks == 0
    jax.block_until_ready(pd8.decode.engine.runner.kv_cache)


@pytest.mark.extended  # make test-extended: a second process compiles its own engine (~30 s)
def test_a_decode_pool_in_another_process_pulls_the_scales_too(pd8):
    """The decode pool in another process (`python -m engine.disaggregation.decode_pool`): each
    gathered bucket is pulled as its four arrays (K and V values and scales) through
    jax.experimental.transfer and lands as an 8-bit cache; outputs equal colocated."""
    import os
    import socket
    import subprocess
    import sys

    from engine.disaggregation.pd_engine import PDEngine
    from tests.conftest import TEST_XLA_FLAGS

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=1 {TEST_XLA_FLAGS}")
    proc = subprocess.Popen([sys.executable, "-m", "engine.disaggregation.decode_pool", f"--listen={address}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        remote = PDEngine(EngineConfig(**KNOBS, disaggregation=dict(prefill=1, decode=1, decode_address=address)),
                          progress=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
        requests = [(f"x{i}", p, greedy) for i, p in enumerate(PROMPTS[:4])]
        want = run_to_completion(pd8.prefill, requests)
        got = run_to_completion(remote, requests)
        for rid, out in want.items():
            assert out.outputs[0].token_ids == got[rid].outputs[0].token_ids, rid
            for a, b in zip(out.outputs[0].logprobs, got[rid].outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        stats = remote.get_stats()
        assert stats.kv_transfer.num_landed >= 1 and remote.decode.num_pulled >= 1
        assert stats.replicas[1].prefix_cache_hits > 0  # the pulled blocks were read there
        remote.decode.close()
    finally:
        proc.kill()
        proc.wait()



def test_the_handover_reads_and_writes_a_pinned_cache_in_its_layout():
    """A runner that pins its cache's layout (ModelRunner.cache_formats: the TPU's steps; here the
    formats a jit with Layout.AUTO gives on the CPU) hands KVGather and KVScatter those formats:
    the gather reads the blocks, the scatter writes them in place and leaves the cache in them.
    (The engines themselves on the TPU kernel cannot run here: TPU interpret mode's shared memory
    is one per process, and the two pools step on two threads.)"""
    import types

    import jax.numpy as jnp
    from jax.experimental.layout import Format, Layout

    from engine.disaggregation.kv_transfer import KVGather, KVScatter
    from pallas_kernels.kv_quant import allocate_scaled, as_page_layout

    shape = (2, 6, 4, 2, 8)
    cache = (as_page_layout(allocate_scaled(shape, "int8")), as_page_layout(allocate_scaled(shape, "int8")))
    auto = jax.tree.map(lambda _: Format(Layout.AUTO), cache)
    sds = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), cache)
    formats = jax.jit(lambda c: c, in_shardings=(auto,), out_shardings=auto).lower(sds).compile().input_formats[0][0]
    rng = np.random.default_rng(0)
    filled = jax.tree.map(lambda a: jnp.asarray(rng.integers(0, 100, a.shape), a.dtype), cache)
    source = types.SimpleNamespace(pins_cache=True, cache_formats=formats, kv_cache=jax.device_put(filled, formats))
    dest = types.SimpleNamespace(pins_cache=True, cache_formats=formats, kv_cache=jax.device_put(cache, formats))
    gather, scatter = KVGather(source, (1, 2, 4)), KVScatter(dest, (1, 2, 4))
    k, v = gather.gather(np.array([3, 1], np.int32))
    scatter.write([5, 2], k, v)
    for got, want in zip(jax.tree.leaves(dest.kv_cache), jax.tree.leaves(filled)):
        got, want = np.asarray(got), np.asarray(want)
        np.testing.assert_array_equal(got[:, [5, 2]], want[:, [3, 1]])
        assert not got[:, [0, 1, 3, 4]].any()  # the other blocks untouched
    assert [a.format for a in jax.tree.leaves(dest.kv_cache)] == list(jax.tree.leaves(formats))
