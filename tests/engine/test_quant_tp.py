"""Quantized weights and an 8-bit KV cache under tensor parallelism (TP = 2 over virtual CPU devices,
random:tiny-gqa3: 9 q / 3 KV heads padded to 12 / 4, an untied head): the int8 values split as the
float weights they replace, their per-output-channel scales with the output dim (split with a
column-parallel weight's rows and the vocabulary, replicated for a row-parallel weight), the int8
cache and its scales on KV heads (models/sharded_quant.py). The step keeps the Megatron pattern,
and greedy tokens and first-token logprobs equal TP = 1 with the same quantization.

Both engines pin the weight-only form (quantization_activation_rows above the one bucket): with
quantized activations the row-parallel products scale each device's slice of the input, another
rounding than one device's (models/sharded_quant.py), checked in
tests/models/test_sharded_quant.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.step.program import serve_layout
from models.llama import forward_dense
from models.quant import QuantizedWeight
from pallas_kernels.kv_quant import ScaledCache
from tests.engine.conftest import run_to_completion
from tests.engine.hlo_collectives import collectives_by_computation

KNOBS = dict(model="random:tiny-gqa3", max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
             num_kv_blocks=40, token_buckets=(16,), seq_buckets=(4,), compilation_cache_dir=None,
             prompt_scoring_bucket=False, quantization="int8", quantization_activation_rows=17,
             kv_cache_dtype="int8")
PROMPTS = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7], list(range(30, 60))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def setup():
    """The TP = 2 engine, and TP = 1 with the same quantization: the served weights one device
    quantizes (engine/step/program.py serve_layout, weight-only) and the dense oracle over them,
    K and V rounded as the int8 cache rounds them (tests/engine/test_quant_engine.py: the TP = 1
    engine equals it)."""
    from engine.core.llm_engine import LLMEngine
    from models.loader import load_model

    loaded = load_model("random:tiny-gqa3", host=True, progress=False)
    engine = LLMEngine(EngineConfig(**KNOBS, tensor_parallel_size=2), progress=False, loaded=loaded)
    one = serve_layout(jax.tree.map(jnp.asarray, loaded.params), "unrolled", "int8")
    dense = jax.jit(lambda p, ids: forward_dense(p, loaded.config, ids, kv_cache_dtype="int8"))
    return engine, one, functools.partial(dense, one)


def _shard_shapes(a) -> set:
    return {s.data.shape for s in a.addressable_shards}


def test_values_and_scales_are_split_as_the_float_weights(setup):
    engine, one, _ = setup
    two = engine.runner.params
    d, kv_cols = 16, 9 * 16  # TP = 2 pads 3 KV heads to 4: o_proj's last 48 columns are padding
    for i, layer in enumerate(two["layers"]):
        qkv, o, gate_up, down = (layer[n] for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
        assert all(isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8 for w in (qkv, o, gate_up, down))
        # column-parallel: rows and their scales split (per device 6 q, 2 k, 2 v heads)
        assert _shard_shapes(qkv.q) == {(10 * d, 64)} and _shard_shapes(qkv.scale) == {(10 * d,)}
        assert _shard_shapes(gate_up.scale) == {(90,)}
        # row-parallel: columns split, scales whole on each device, and equal to one device's
        # (each row's max taken over the whole row)
        assert _shard_shapes(o.q) == {(64, 6 * d)} and _shard_shapes(o.scale) == {(64,)}
        assert _shard_shapes(down.q) == {(64, 45)} and _shard_shapes(down.scale) == {(64,)}
        ref_o, ref_down = one["layers"][i]["o_proj"], one["layers"][i]["down_proj"]
        np.testing.assert_array_equal(np.asarray(o.scale), np.asarray(ref_o.scale))
        np.testing.assert_array_equal(np.asarray(o.q)[:, :kv_cols], np.asarray(ref_o.q))
        assert not np.asarray(o.q)[:, kv_cols:].any()
        np.testing.assert_array_equal(np.asarray(down.q), np.asarray(ref_down.q))
        np.testing.assert_array_equal(np.asarray(down.scale), np.asarray(ref_down.scale))
    for name in ("embed", "output_proj"):  # by vocabulary, scales too
        assert _shard_shapes(two[name].scale) == {(127,)}
        np.testing.assert_array_equal(np.asarray(two[name].scale), np.asarray(one[name].scale))
    for cache in engine.runner.kv_cache:
        assert isinstance(cache, ScaledCache) and cache.values.dtype == jnp.int8
        assert engine.runner.kv_layout == "head_major"  # the xla path's pages: [L, blocks, Hkv, block_size, D]
        assert _shard_shapes(cache.values) == {(2, 40, 2, 16, 16)}
        assert _shard_shapes(cache.scales) == {(2, 40, 2, 16)}
    w1 = sum(a.nbytes for a in jax.tree.leaves(one))
    w2 = engine.get_stats().weight_bytes_per_device
    assert len(w2) == 2 and max(w2) < 0.7 * w1  # a half each, plus padding and replicated scales


def test_tp2_keeps_two_all_reduces_per_layer_and_equals_tp1(setup):
    engine, _, dense = setup
    runner = engine.runner
    found = collectives_by_computation(runner._compiled[runner.shapes.buckets()[0]].as_text())
    body = [n for n in found if n != "ENTRY"]
    assert len(body) == 1 and found[body[0]] == ["all-reduce"] * 2, found
    assert sorted(found["ENTRY"]) == ["all-gather", "all-reduce"]  # embedding lookup, logits
    done = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    vocab = runner.sample_vocab_size
    for i, prompt in enumerate(PROMPTS):
        out = done[f"r{i}"].outputs[0]
        ids = np.zeros(64, np.int32)
        ids[: len(prompt) + len(out.token_ids)] = prompt + out.token_ids
        logits = np.asarray(dense(jnp.asarray(ids)))[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids), :vocab]
        assert out.token_ids == np.argmax(logits, axis=-1).tolist(), f"prompt {i}"
        first = jax.nn.log_softmax(jnp.asarray(logits[0]))[out.token_ids[0]]
        assert abs(out.logprobs[0][out.token_ids[0]] - float(first)) < 1e-4
    assert len({tuple(done[f"r{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))}) == len(PROMPTS)
