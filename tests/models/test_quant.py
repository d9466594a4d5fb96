"""Quantized weights (models/quant.py) and the 8-bit KV cache (pallas_kernels/kv_quant.py) on
random tiny shapes: the schemes' error bounds, the product forms, and the paged forward against the
dense oracle with the same quantization (prefill in chunks, then decode, several sequences in one
ragged batch)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import preset_config
from models.llama import forward_dense, forward_paged
from models.quant import QuantizedWeight, quantize_params, quantize_weight
from models.random_weights import random_params
from models.served_layout import fuse_projections, stack_layers
from pallas_kernels import prepare_attention_metadata, ragged_paged_attention, write_kv
from pallas_kernels.kv_quant import ScaledCache, allocate_scaled, fake_quantize_kv
from tests.models.paged_batch import make_batch

pytestmark = pytest.mark.usefixtures("fast_compile")  # random tiny shapes: -O0 (tests/conftest.py)

RNG = np.random.default_rng(0)


def _weight(rows=48, cols=40):
    w = RNG.standard_normal((rows, cols)).astype(np.float32) * np.exp(RNG.standard_normal((rows, 1)))
    w[3] = 0.0  # an all-zero channel gets scale 1, values 0
    return jnp.asarray(w)


def test_int8_per_channel_error_is_at_most_half_a_step():
    w = _weight()
    qw = quantize_weight(w, "int8")
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (48,) and qw.dtype == jnp.float32
    assert int(jnp.max(jnp.abs(qw.q.astype(jnp.int32)))) == 127
    err = np.abs(np.asarray(qw.dequantize()) - np.asarray(w))
    assert np.all(err <= np.asarray(qw.scale)[:, None] * 0.5 * (1 + 1e-6))
    assert np.all(np.asarray(qw.dequantize())[3] == 0)


def test_fp8_per_channel_error_is_within_e4m3_precision():
    w = _weight()
    qw = quantize_weight(w, "fp8")
    assert qw.q.dtype == jnp.float8_e4m3fn
    deq, w = np.asarray(qw.dequantize()), np.asarray(w)
    # 3 mantissa bits: relative error <= 2^-4 for normals; subnormal steps of scale * 2^-9.
    bound = np.maximum(np.abs(w) * 2.0**-4, np.asarray(qw.scale)[:, None] * 2.0**-10) * (1 + 1e-6)
    assert np.all(np.abs(deq - w) <= bound)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_product_forms(method):
    """Weight-only equals the float product of the dequantized weight; with activation_rows the
    form switches at that row count, and the activations form's rows do not depend on the batch
    (each row's scale is its own; int8 x int8 sums exactly in int32)."""
    w = _weight()
    x = jnp.asarray(RNG.standard_normal((8, 40)).astype(np.float32))
    exact = np.asarray(x) @ np.asarray(quantize_weight(w, method).dequantize()).T
    weight_only = quantize_weight(w, method)
    np.testing.assert_allclose(weight_only.product("te,ne->tn", x), exact, rtol=1e-5, atol=1e-5)
    switched = quantize_weight(w, method, activation_rows=4)
    assert not switched.quantizes_activations(3) and switched.quantizes_activations(4)
    batched = np.asarray(jax.jit(lambda x: switched.product("te,ne->tn", x))(x))
    scale = np.abs(exact).max()
    assert np.max(np.abs(batched - exact)) < scale * (0.03 if method == "int8" else 0.15)
    grouped = quantize_weight(w, method, activation_rows=0, activation_group=8)  # 5 groups of 8
    by_group = np.asarray(jax.jit(lambda x: grouped.product("te,ne->tn", x))(x))
    assert np.max(np.abs(by_group - exact)) < scale * (0.03 if method == "int8" else 0.15)
    if method == "int8":
        for form in (switched, grouped):
            one = jax.jit(lambda x, form=form: dataclasses.replace(form, activation_rows=0).product("te,ne->tn", x))
            rows = np.concatenate([np.asarray(one(x[i : i + 1])) for i in range(8)])
            np.testing.assert_array_equal(rows, batched if form is switched else by_group)
    with pytest.raises(ValueError, match="out-major"):
        weight_only.product("te,en->tn", x)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_16bit_models_one_row_weight_only_product_sums_in_float32_on_the_cpu(method):
    """A bfloat16 model's one-row weight-only product: on the CPU its row (rounded to bfloat16, as
    the model holds it) and the codes widen exactly to float32 (XLA:CPU's one-row bfloat16 loop is
    slower); TPU and GPU lowerings keep the bfloat16 dot. 2+ rows keep bfloat16 everywhere."""
    qw = dataclasses.replace(quantize_weight(_weight(), method), dtype_name="bfloat16")
    x = jnp.asarray(RNG.standard_normal((1, 40)).astype(np.float32))
    x16 = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    exact = x16 @ np.asarray(qw.q.astype(jnp.float32), np.float64).T * np.asarray(qw.scale, np.float64)
    fn = jax.jit(lambda x: qw.product("te,ne->tn", x))
    np.testing.assert_allclose(np.asarray(fn(x)), exact, rtol=1e-6, atol=1e-6)
    cpu = [line for line in fn.lower(x).as_text().splitlines() if "dot_general" in line]
    assert cpu and all(re.search(r"\(tensor<1x40xf32>, tensor<40x48xf32>\)", line) for line in cpu), cpu
    for platform in ("tpu", "cuda"):
        text = fn.trace(x).lower(lowering_platforms=(platform,)).as_text()
        assert re.search(r"dot_general.*tensor<1x40xbf16>", text), platform
    two_rows = jax.jit(lambda x: qw.product("te,ne->tn", x)).trace(jnp.concatenate([x, x])).lower(
        lowering_platforms=("cpu",)).as_text()
    assert re.search(r"dot_general.*tensor<2x40xbf16>", two_rows)


def test_quantize_params_covers_the_weight_matrices_only():
    config = preset_config("tiny")
    params = fuse_projections(random_params(config, seed=1))
    q = quantize_params(params, "int8")
    assert isinstance(q["embed"], QuantizedWeight)
    layer = q["layers"][0]
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert isinstance(layer[name], QuantizedWeight), name
    assert not isinstance(layer["attn_norm"], QuantizedWeight)
    assert quantize_params(params, None) is params
    with pytest.raises(ValueError, match="int8, fp8"):
        quantize_params(params, "int4")
    with pytest.raises(ValueError, match="served layout"):
        quantize_params(random_params(config, seed=1), "int8")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_cache_write_then_attention_equals_attention_over_the_fake_quantized_cache(kv_cache_dtype):
    """write_kv quantizes per token and kv head into a ScaledCache; the xla attention over it
    equals attention over a float cache holding what the 8-bit one gives back."""
    layers, nb, bs, hkv, d, hq = 2, 6, 4, 2, 8, 4
    tokens = 9
    k = jnp.asarray(RNG.standard_normal((tokens, hkv, d)).astype(np.float32) * 3)
    v = jnp.asarray(RNG.standard_normal((tokens, hkv, d)).astype(np.float32))
    q = jnp.asarray(RNG.standard_normal((tokens, hq, d)).astype(np.float32))
    slots = jnp.asarray(np.arange(tokens) + bs, np.int32)  # blocks 1.. of layer 1
    shape = (layers, nb, bs, hkv, d)

    def metadata():
        return prepare_attention_metadata(
            jnp.asarray([tokens], np.int32), jnp.asarray([[1, 2, 3, 0]], np.int32),
            jnp.asarray([0, tokens], np.int32), jnp.asarray(1, np.int32), num_tokens=tokens,
            num_q_heads=hq, num_kv_heads=hkv, block_size=bs, backend="xla")

    @jax.jit
    def both(k, v, q):
        kc, vc = write_kv(allocate_scaled(shape, kv_cache_dtype), allocate_scaled(shape, kv_cache_dtype),
                          k, v, slots, layer=1)
        kf, vf = write_kv(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32),
                          fake_quantize_kv(k, kv_cache_dtype), fake_quantize_kv(v, kv_cache_dtype), slots, layer=1)
        md = metadata()
        return (kc, vc, ragged_paged_attention(q, kc, vc, md, layer=1, sm_scale=0.3),
                ragged_paged_attention(q, kf, vf, md, layer=1, sm_scale=0.3), fake_quantize_kv(k, kv_cache_dtype))

    kc, vc, got, want, k_back = both(k, v, q)
    assert isinstance(kc, ScaledCache) and kc.values.dtype in (jnp.int8, jnp.uint8)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    err = np.abs(np.asarray(k_back) - np.asarray(k)).max()
    assert 0 < err < (0.05 if kv_cache_dtype == "int8" else 0.6)


BLOCK_SIZE, NUM_BLOCKS = 16, 32
LENGTHS = (37, 16, 5)
DECODE_STEPS = 3
STEP_TOKENS, STEP_SEQS, ORACLE_LEN = 64, 4, 48


@pytest.mark.parametrize("quantization,activation_rows,kv_cache_dtype,loop", [
    ("int8", 0, "int8", "switch"), ("int8", None, "auto", "switch"), ("fp8", None, "fp8_e4m3", "switch"),
    ("int8", 0, "auto", "stacked")], ids=["int8-w8a8-kv-int8", "int8-weight-only", "fp8-kv-fp8", "int8-stacked"])
def test_paged_equals_dense_with_the_same_quantization(quantization, activation_rows, kv_cache_dtype, loop):
    config = dataclasses.replace(preset_config("tiny"), num_heads=6, num_kv_heads=2)
    params = jax.tree.map(jnp.asarray, random_params(config, seed=1))
    params = fuse_projections(stack_layers(params) if loop == "stacked" else params)
    params = quantize_params(params, quantization, activation_rows=activation_rows)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, config.vocab_size, n + DECODE_STEPS).tolist() for n in LENGTHS]
    dense = jax.jit(lambda p, ids: forward_dense(p, config, ids, kv_cache_dtype=kv_cache_dtype))
    oracle = [np.asarray(dense(params, jnp.asarray(np.pad(np.asarray(s, np.int32), (0, ORACLE_LEN - len(s))))))
              for s in seqs]
    tables, nxt = [], 1
    for s in seqs:
        n = -(-len(s) // BLOCK_SIZE)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    shape = (config.num_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    if kv_cache_dtype == "auto":
        cache = (jnp.zeros(shape, jnp.float32),) * 2
    else:
        cache = (allocate_scaled(shape, kv_cache_dtype), allocate_scaled(shape, kv_cache_dtype))
    step = jax.jit(lambda p, c, b: forward_paged(p, config, c, b, scan_layers=True))
    # Integer rounding (weights' activations, K and V) can land a value on the other side of a
    # step where the two forwards' float sums differ in the last bit: a looser tolerance than
    # float32's 1e-5.
    tol = 2e-3
    done, chunk = [0] * len(seqs), 20
    while any(done[i] < LENGTHS[i] for i in range(len(seqs))):
        active = [i for i in range(len(seqs)) if done[i] < LENGTHS[i]]
        chunks = [(seqs[i][done[i] : min(LENGTHS[i], done[i] + chunk)], done[i]) for i in active]
        batch = make_batch(chunks, [tables[i] for i in active], BLOCK_SIZE,
                           pad_tokens=STEP_TOKENS - sum(len(c[0]) for c in chunks),
                           pad_seqs=STEP_SEQS - len(active), max_blocks=4)
        cache, logits = step(params, cache, batch)
        for row, i in enumerate(active):
            done[i] += len(chunks[row][0])
            if done[i] == LENGTHS[i]:
                np.testing.assert_allclose(logits[row], oracle[i][LENGTHS[i] - 1], atol=tol, rtol=tol)
    for extra in range(DECODE_STEPS):
        chunks = [(s[LENGTHS[i] + extra : LENGTHS[i] + extra + 1], LENGTHS[i] + extra) for i, s in enumerate(seqs)]
        batch = make_batch(chunks, tables, BLOCK_SIZE, pad_tokens=STEP_TOKENS - len(seqs),
                           pad_seqs=STEP_SEQS - len(seqs), max_blocks=4)
        cache, logits = step(params, cache, batch)
        for i in range(len(seqs)):
            np.testing.assert_allclose(logits[i], oracle[i][LENGTHS[i] + extra], atol=tol, rtol=tol)


def test_the_runner_layout_quantizes_before_16bit_layers_become_bits():
    """On a stacked loop 16-bit layers are held as their bits (pack_layer_bits): the weights are
    quantized from their float values first (engine/step/program.py serve_layout)."""
    from engine.step.program import serve_layout

    config = preset_config("tiny")
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), random_params(config, seed=1))
    served = serve_layout(params, "stacked", "int8")
    qkv = served["layers"]["qkv_proj"]
    assert isinstance(qkv, QuantizedWeight) and qkv.dtype == jnp.bfloat16 and qkv.q.shape[0] == config.num_layers
    want = fuse_projections(stack_layers(params))["layers"]["qkv_proj"].astype(jnp.float32)
    np.testing.assert_allclose(np.asarray(qkv.dequantize(), np.float32), want,
                               atol=float(jnp.max(qkv.scale)) * 0.51 + 0.02 * float(jnp.max(jnp.abs(want))))
    assert served["layers"]["attn_norm"].dtype == jnp.uint16  # the rest still packed
    with pytest.raises(ValueError, match="16-bit bits"):
        quantize_params(serve_layout(params, "stacked"), "int8")


def test_an_8bit_cache_holds_194x_the_blocks_of_bfloat16_in_one_budget():
    """Default model's shapes: 11,880 bytes per token (values + one bfloat16 scale per token and
    kv head) against bfloat16's 23,040 (0.516x); the same byte budget sizes 1.94x the blocks."""
    from engine.step.kv_cache import kv_bytes_per_token, num_blocks_for

    config = preset_config("smollm2-135m")
    bf16 = kv_bytes_per_token(config, "bfloat16")
    for kv in ("int8", "fp8_e4m3"):
        assert kv_bytes_per_token(config, "bfloat16", kv) == kv_bytes_per_token(config, "float32", kv) == 11_880
        assert kv_bytes_per_token(config, "bfloat16", kv) / bf16 < 0.52
    sized = {kv: num_blocks_for(config, block_size=16, dtype="bfloat16", num_kv_blocks=None,
                                kv_cache_bytes=512 << 20, memory_fraction=0.85, max_useful_blocks=10**9,
                                device=jax.devices("cpu")[0], kv_cache_dtype=kv) for kv in ("auto", "int8")}
    assert 1.93 < sized["int8"] / sized["auto"] < 1.95


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
def test_the_rotation_is_orthonormal_symmetric_and_its_own_inverse(head_dim):
    """kv_quant.rotation: Hadamard blocks of the largest power of two dividing D (96: 3 of 32,
    80: 5 of 16); rotate_heads twice gives x back, and q . k is unchanged."""
    from pallas_kernels.kv_quant import rotate_heads, rotation

    h = rotation(head_dim)
    block = head_dim & -head_dim
    np.testing.assert_allclose(h @ h.T, np.eye(head_dim), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    assert np.count_nonzero(h) == head_dim * block and set(np.unique(np.abs(h[h != 0]))) == {np.float32(block ** -0.5)}
    rng = np.random.default_rng(head_dim)
    q, k = (jnp.asarray(rng.normal(size=(5, 3, head_dim)), jnp.float32) for _ in range(2))
    np.testing.assert_allclose(rotate_heads(k), np.asarray(k) @ h, atol=1e-5)  # the transform is the matrix
    np.testing.assert_allclose(rotate_heads(rotate_heads(k)), k, atol=1e-5)
    np.testing.assert_allclose(jnp.sum(rotate_heads(q) * rotate_heads(k), -1), jnp.sum(q * k, -1), rtol=1e-5, atol=1e-5)
    assert rotate_heads(q.astype(jnp.bfloat16)).dtype == jnp.bfloat16
