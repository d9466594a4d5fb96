"""GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / Q8_0 served in their own blocks (models/gguf_blocks.py, models/quant.py 5.;
EngineConfig.quantization="gguf"): the decode is gguf.quants' bit for bit, the products equal the
dequantized float product, and a written GGUF's layers load and serve in blocks with the float
load's logits and greedy tokens."""

import dataclasses
import logging
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from models.config import preset_config
from models.gguf_blocks import NATIVE_TYPES, block_weight, concat_rows
from models.gguf_loader import load_gguf
from models.llama import forward_dense
from models.quant import QuantizedWeight
from models.random_weights import random_params
from models.served_layout import fuse_projections, stack_layers
from tests.models.gguf_writer import hf_matrices, write_gguf

TINY = preset_config("tiny")
SERVED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# The float16 fields of a block (byte offsets) where they are not (0, 2): d (and m / dmin).
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,)}


def _tensor(data: np.ndarray, qtype, rows: int, cols: int, name: str = "w"):
    """What text/gguf_file.GGUFFile gives block_weight: the raw bytes, the type, the GGUF shape."""
    return types.SimpleNamespace(name=name, tensor_type=qtype, shape=(cols, rows), data=data)


def _raw_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Every byte random except the float16 d (and m): finite, both signs, zero and subnormal."""
    rng = np.random.default_rng(seed)
    size, values = NATIVE_TYPES[qtype.name]
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for at in HALVES.get(qtype.name, (0, 2)):  # d, and m or dmin
        halves = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        halves.flat[:3] = np.array([0.0, -0.0, 3e-7], np.float16)  # zero, negative zero, subnormal
        raw[..., at:at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


ZERO_OFFSETS = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q3_K, Q.Q6_K)
BLOCK_16 = (Q.Q2_K, Q.Q3_K, Q.Q6_K)
ALL_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_block_decode_is_gguf_bit_for_bit(qtype):
    rows, cols = 6, 512
    raw = _raw_blocks(qtype, rows, cols, seed=1)
    want = quants.dequantize(raw, qtype).reshape(rows, cols)
    w = block_weight("f.gguf", _tensor(raw, qtype, rows, cols), "float32")
    block = 16 if qtype in BLOCK_16 else 32
    assert w.q.dtype == np.int8 and w.block == block and w.offset.shape == w.scale.shape == (rows, cols // block)
    assert qtype not in ZERO_OFFSETS or not np.any(w.offset)  # Q8_0, Q4_0, Q5_0: zero offsets
    for got in (w.dequantize(), jax.jit(QuantizedWeight.dequantize)(w)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(w.rows(jnp.array([4, 0]))).view(np.uint32), want[[4, 0]].view(np.uint32))
    with pytest.raises(ValueError, match=f"f.gguf: {qtype.name} tensor w holds"):
        block_weight("f.gguf", _tensor(raw[:, :-1], qtype, rows, cols), "float32")


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_block_products_equal_the_dequantized_float_product(rows):
    """A fused product of mixed parts (Q4_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q6_K, Q8_0 rows: zero
    offsets for Q4_0, Q3_K, Q6_K and Q8_0; the 16-value blocks make the whole product 16) against
    x . dequantized^T, weight-only at every row count; and a block weight made without offset
    (x . dequantized^T)."""
    cols = 256
    parts = [block_weight("f.gguf", _tensor(_raw_blocks(t, n, cols, seed=n), t, n, cols), "float32")
             for t, n in ((Q.Q4_0, 40), (Q.Q4_1, 24), (Q.Q5_1, 8), (Q.Q2_K, 4), (Q.Q3_K, 4), (Q.Q4_K, 12),
                          (Q.Q6_K, 4), (Q.Q8_0, 16))]
    w = concat_rows(parts)
    assert w.block == 16 and w.scale.shape == (112, cols // 16)
    dense = np.concatenate([np.asarray(p.dequantize()) for p in parts])
    np.testing.assert_array_equal(np.asarray(w.dequantize()), dense)
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, cols), np.float32))
    want = np.asarray(x) @ dense.T
    bare = QuantizedWeight(parts[0].q, parts[0].scale, block=32)
    for weight in (w, bare):
        ref = want if weight is w else np.asarray(x) @ dense[:40].T
        got = jax.jit(lambda a, b: b.product("te,ne->tn", a))(x, weight)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_a_table_sized_block_product_in_slices_equals_the_dequantized_product():
    """More than 16384 output rows (a vocabulary table, the tied lm_head): sliced on the CPU."""
    rows, cols = 16384 + 3072 + 100, 32
    w = block_weight("f.gguf", _tensor(_raw_blocks(Q.Q8_0, rows, cols, seed=2), Q.Q8_0, rows, cols), "float32")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, cols), np.float32))
    want = np.asarray(x) @ np.asarray(w.dequantize()).T
    got = np.asarray(jax.jit(lambda a, b: b.product("te,ne->tn", a))(x, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_gguf_q4_layers_load_in_their_blocks(tmp_path, qtype):
    """native_blocks=True: every layer product a block weight in the served layout, dequantizing
    to the float load's fused matrices bit for bit; logits equal the float load's (Q4_1's
    layers stacked on a layer axis)."""
    params = random_params(TINY, seed=5)
    path = tmp_path / "q4.gguf"
    write_gguf(path, TINY, params, qtype)
    _, floats, _ = load_gguf(path, progress=False)
    config, native, _ = load_gguf(path, progress=False, native_blocks=True)
    served = fuse_projections(floats)
    for got, want in zip(native["layers"], served["layers"]):
        for key in SERVED:
            w = got[key]
            assert isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8 and w.scale.dtype == jnp.float32
            assert qtype not in ZERO_OFFSETS or not np.any(np.asarray(w.offset))
            np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(want[key]))
    assert isinstance(native["embed"], QuantizedWeight)  # token_embd written in the same type
    ids = jnp.arange(12) % config.vocab_size
    forward = jax.jit(forward_dense, static_argnums=1)  # the forms as compiled together
    want = np.asarray(forward(floats, config, ids))
    got = forward(stack_layers(native) if qtype in (Q.Q4_1, Q.Q5_1) else native, config, ids)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())  # float rounding


def _mixed_file(tmp_path, types: dict, seed: int, config=None):
    """A written Q4_1 GGUF of `config` (TINY with an MLP width of 256, a K-quant row), whose
    tensors named in `types` are random blocks of the given types (F16: the weights in float16)."""
    config = config or dataclasses.replace(TINY, intermediate_size=256)
    params = random_params(config, seed=seed)
    path = tmp_path / "mixed.gguf"
    matrices = hf_matrices(params, config)
    raw = {name: (matrices[name].astype(np.float16) if t == Q.F16 else
                  _raw_blocks(t, *matrices[name].shape, seed=seed + i), t) for i, (name, t) in enumerate(types.items())}
    write_gguf(path, config, params, Q.Q4_1, raw=raw)
    return path


def test_a_product_with_a_part_in_float_stays_float_and_is_logged(tmp_path, caplog):
    """blk.0.ffn_up in F16: layer 0's gate_up_proj is float (its Q4_1 ffn_gate dequantized), its
    other products and layer 1 in blocks; the load says which quantized tensors were dequantized."""
    path = _mixed_file(tmp_path, {"blk.0.ffn_up.weight": Q.F16}, seed=6)
    _, floats, _ = load_gguf(path, progress=False)
    with caplog.at_level(logging.WARNING, logger="models.gguf_loader"):
        config, native, _ = load_gguf(path, progress=False, native_blocks=True)
    assert "mixed.gguf" in caplog.text and "1 Q4_1 tensors dequantized" in caplog.text
    assert not isinstance(native["layers"][0]["gate_up_proj"], QuantizedWeight)
    assert all(isinstance(native["layers"][i][k], QuantizedWeight) for i in (0, 1) for k in SERVED
               if (i, k) != (0, "gate_up_proj"))
    ids = jnp.arange(12) % config.vocab_size
    want = np.asarray(forward_dense(floats, config, ids))
    np.testing.assert_allclose(np.asarray(forward_dense(native, config, ids)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_a_product_in_q6_k_and_q4_k_layers_stacks_at_16_value_blocks(tmp_path):
    """A Q4_K_M-like file: layer 0's ffn_down Q6_K (16-value blocks), layer 1's Q4_K (32): both
    layers' down_proj load at 16 (the finest), dequantize to the float load's bit for bit, and
    stack on a layer axis with the float load's logits."""
    path = _mixed_file(tmp_path, {"blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K}, seed=8)
    _, floats, _ = load_gguf(path, progress=False)
    config, native, _ = load_gguf(path, progress=False, native_blocks=True)
    served = fuse_projections(floats)
    for got, want in zip(native["layers"], served["layers"]):
        assert got["down_proj"].block == 16 and got["gate_up_proj"].block == 32
        np.testing.assert_array_equal(np.asarray(got["down_proj"].dequantize()), np.asarray(want["down_proj"]))
    stacked = stack_layers(native)
    assert stacked["layers"]["down_proj"].scale.shape == (2, config.hidden_size, 256 // 16)
    ids = jnp.arange(12) % config.vocab_size
    forward = jax.jit(forward_dense, static_argnums=1)
    want = np.asarray(forward(floats, config, ids))
    np.testing.assert_allclose(np.asarray(forward(stacked, config, ids)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


# Q2_K and Q3_K among Q4_1 (the rest) and Q4_K: fused with 32-value parts (qkv: v; gate_up: gate
# Q4_K), stacked over layers with them (down: Q2_K then Q4_K), permuted (attn_k), and a table.
K23 = {"blk.0.attn_v.weight": Q.Q2_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q3_K,
       "blk.0.ffn_down.weight": Q.Q2_K, "blk.1.attn_k.weight": Q.Q3_K, "blk.1.attn_output.weight": Q.Q3_K,
       "blk.1.ffn_gate.weight": Q.Q2_K, "blk.1.ffn_up.weight": Q.Q2_K, "blk.1.ffn_down.weight": Q.Q4_K,
       "token_embd.weight": Q.Q3_K}


def test_q2_k_and_q3_k_load_in_16_value_blocks_with_no_float_copy(tmp_path, caplog, monkeypatch):
    """A file with Q2_K and Q3_K tensors (K23; every width 256): every served product and the
    table are block weights at 16 values, dequantizing to the float load's (gguf.quants) bit for
    bit; the native load dequantizes no quantized tensor (only the norms go through the float
    path) and logs nothing; the stacked layers give the float load's logits."""
    import models.gguf_loader as loader

    config = dataclasses.replace(TINY, hidden_size=256, head_dim=64, intermediate_size=256)
    path = _mixed_file(tmp_path, K23, seed=9, config=config)
    _, floats, _ = load_gguf(path, progress=False)
    read_as_float, dequantize = [], loader._dequantize
    monkeypatch.setattr(loader, "_dequantize", lambda p, t: read_as_float.append(t.name) or dequantize(p, t))
    with caplog.at_level(logging.WARNING, logger="models.gguf_loader"):
        _, native, _ = load_gguf(path, progress=False, native_blocks=True)
    assert read_as_float and all(name.endswith("norm.weight") for name in read_as_float)
    assert not caplog.text
    served = fuse_projections(floats)
    for got, want in zip(native["layers"], served["layers"]):
        for key in SERVED:  # each product has a Q2_K or Q3_K part in some layer: 16 in all
            assert isinstance(got[key], QuantizedWeight) and got[key].block == 16, key
            np.testing.assert_array_equal(np.asarray(got[key].dequantize()), np.asarray(want[key]))
    embed = native["embed"]
    assert isinstance(embed, QuantizedWeight) and embed.block == 16 and not np.any(np.asarray(embed.offset))
    np.testing.assert_array_equal(np.asarray(embed.dequantize()), np.asarray(floats["embed"]))
    ids = jnp.arange(12) % config.vocab_size
    forward = jax.jit(forward_dense, static_argnums=1)
    want = np.asarray(forward(floats, config, ids))
    np.testing.assert_allclose(np.asarray(forward(stack_layers(native), config, ids)), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


def test_engine_serves_q4_layers_in_blocks_with_the_float_greedy_tokens(tmp_path):
    """quantization="gguf" on a written Q4_1 GGUF (Q4_0 token_embd), its layers stacked for a scan:
    greedy tokens of a lone and of batched requests equal the float load's engine (per-layer
    buffers); the weight bytes are the blocks' (1 byte a value + float32 scales and offsets)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from models.default_model import default_model_path
    from tests.engine.conftest import TINY_KNOBS, run_to_completion

    config = dataclasses.replace(TINY, num_layers=2)
    params = random_params(config, seed=7)
    path = tmp_path / "q4.gguf"
    embed = np.asarray(params["embed"], np.float32)
    write_gguf(path, config, params, Q.Q4_1,
               raw={"token_embd.weight": (quants.quantize(embed, Q.Q4_0), Q.Q4_0)})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((9, 20, 5))]
    requests = [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]
    tokens, weight_bytes = {}, {}
    for quantization in (None, "gguf"):
        knobs = dict(TINY_KNOBS, model=str(path), tokenizer=str(default_model_path()), quantization=quantization,
                     max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=17, token_buckets=(1, 16),
                     max_num_seqs=4, seq_buckets=(4,), prompt_scoring_bucket=False,
                     stack_layer_weights=quantization == "gguf")  # blocks on a scan over stacked layers
        engine = LLMEngine(EngineConfig(**knobs), progress=False)
        outs = run_to_completion(engine, requests)
        alone = run_to_completion(engine, requests[:1])
        tokens[quantization] = [outs[r].outputs[0].token_ids for r, _, _ in requests]
        assert alone["r0"].outputs[0].token_ids == tokens[quantization][0]
        weight_bytes[quantization] = engine.get_stats().weight_bytes_per_device[0]
        layers = engine.runner.params["layers"]
    gate_up = layers["gate_up_proj"]  # stacked [n, 2f, e]
    assert isinstance(gate_up, QuantizedWeight) and gate_up.q.shape == (2, 2 * config.intermediate_size, config.hidden_size)
    assert gate_up.offset.shape == (2, 2 * config.intermediate_size, config.hidden_size // 32)
    assert tokens["gguf"] == tokens[None]
    e, f, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads * config.head_dim
    matrices = config.num_layers * e * (e + 2 * kv + e + 3 * f) + config.vocab_size * e
    # every block weight: 1 byte a value, float32 scales and offsets (-0.0 for Q4_0) per 32
    assert weight_bytes[None] - weight_bytes["gguf"] == matrices * (4 - 1 - 8 / 32)
