"""models/int8_dot.py: the int8 x int8 -> int32 product of quantized activations and weights, as
u8 x s8 with a correction row on the CPU. It must equal the exact integer product at every shape
and value (the correction is exact, not an approximation), and XLA:CPU must run it in the
YNNPACK fusion it was chosen for."""

import numpy as np
import pytest


def _exact(xq, q):
    return np.asarray(xq, np.int64) @ np.asarray(q, np.int64).T


@pytest.mark.parametrize("t,i,o", [(1, 576, 960), (2, 64, 48), (8, 1536, 576), (33, 64, 3072),
                                   (3, 4, 5), (1, 3, 2), (8, 576, 49152)])
def test_equals_the_exact_integer_product(t, i, o):
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    rng = np.random.default_rng(t * 1000 + i + o)
    xq = jnp.asarray(rng.integers(-127, 128, (t, i), dtype=np.int8))
    q = jnp.asarray(rng.integers(-127, 128, (o, i), dtype=np.int8))
    y = jax.jit(int8_product)(xq, q)
    assert y.dtype == jnp.int32 and y.shape == (t, o)
    np.testing.assert_array_equal(np.asarray(y), _exact(xq, q))


def test_the_extremes_do_not_overflow():
    """The shifted product reaches 255 * 127 * i before the correction: at Llama-3-8B's MLP width
    (14,336) still inside int32, and the result is the true product at both ends of the range."""
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    width = 14336
    for x_value, q_value in ((-127, -127), (-128, 127), (127, 127), (127, -128)):
        xq = jnp.full((4, width), x_value, jnp.int8)
        q = jnp.full((16, width), q_value, jnp.int8)
        y = np.asarray(jax.jit(int8_product)(xq, q))
        np.testing.assert_array_equal(y, np.full((4, 16), x_value * q_value * width))


def test_the_cpu_runs_u8_times_s8_in_a_ynnpack_fusion():
    """The form exists for XLA:CPU's YNNPACK u8 x s8 kernel (1.3-1.9x the s8 x s8 dot at 8-32
    rows): the compiled step holds a u8 x s8 dot inside a YNNPACK fusion. A jax upgrade that stops
    fusing it fails here (XLA:CPU would convert both operands to int32: exact, but slow)."""
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    args = (jax.ShapeDtypeStruct((8, 576), jnp.int8), jax.ShapeDtypeStruct((1536, 576), jnp.int8))
    text = jax.jit(int8_product).lower(*args).compile().as_text()
    dots = [line for line in text.splitlines() if " dot(" in line]
    assert len(dots) == 1 and "u8[9,576]" in text and "s32[9,1536]" in dots[0], dots
    fusions = [line for line in text.splitlines() if "ynn_fusion = s32[9,1536]" in line]
    assert len(fusions) == 1 and "kind=kCustom" in fusions[0], fusions


def test_shapes_ynnpack_refuses_take_the_s8_dot():
    """Below YNNPACK's sizes (every size under 8) XLA:CPU would convert the mixed dot's operands
    to int32: those shapes run s8 x s8."""
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    args = (jax.ShapeDtypeStruct((3, 4), jnp.int8), jax.ShapeDtypeStruct((5, 4), jnp.int8))
    text = jax.jit(int8_product).lower(*args).compile().as_text()
    assert "u8[" not in text


def test_the_quantized_product_uses_it_and_stays_exact():
    """QuantizedWeight.product with activations quantized equals the same arithmetic written
    with numpy: int32 codes product times the row and channel scales."""
    import jax
    import jax.numpy as jnp

    from models.quant import quantize_rows, quantize_weight

    rng = np.random.default_rng(3)
    w = quantize_weight(jnp.asarray(rng.standard_normal((96, 64)), jnp.float32), "int8", activation_rows=2)
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    y = np.asarray(jax.jit(lambda w, x: w.product("te,ne->tn", x))(w, x))
    xq, sx = quantize_rows(x, "int8")
    ref = _exact(xq, w.q).astype(np.float32) * np.asarray(sx) * np.asarray(w.scale)[None, :]
    np.testing.assert_array_equal(y, ref)



@pytest.mark.parametrize("t,i,o", [(1, 576, 960), (2, 64, 48), (8, 1536, 576), (33, 64, 3072), (3, 4, 5),
                                   (1, 3, 2)])
def test_with_the_code_sums_held_it_is_the_same_exact_product(t, i, o):
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    rng = np.random.default_rng(t * 7 + i + o)
    xq = jnp.asarray(rng.integers(-127, 128, (t, i), dtype=np.int8))
    q = jnp.asarray(rng.integers(-127, 128, (o, i), dtype=np.int8))
    sums = jnp.sum(q.astype(jnp.int32), axis=-1)
    y = jax.jit(int8_product)(xq, q, sums)
    assert y.dtype == jnp.int32 and y.shape == (t, o)
    np.testing.assert_array_equal(np.asarray(y), _exact(xq, q))


def test_held_code_sums_drop_the_correction_row():
    """With the sums given, the CPU's u8 x s8 dot is the t rows alone (YNNPACK's kernel charges for
    the extra row: module docstring), still in a YNNPACK fusion."""
    import jax
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    args = (jax.ShapeDtypeStruct((8, 576), jnp.int8), jax.ShapeDtypeStruct((1536, 576), jnp.int8),
            jax.ShapeDtypeStruct((1536,), jnp.int32))
    text = jax.jit(int8_product).lower(*args).compile().as_text()
    dots = [line for line in text.splitlines() if " dot(" in line]
    assert len(dots) == 1 and "s32[8,1536]" in dots[0], dots
    assert "u8[8,576]" in text and "u8[9," not in text
    fusions = [line for line in text.splitlines() if "ynn_fusion = s32[8,1536]" in line]
    assert len(fusions) == 1 and "kind=kCustom" in fusions[0], fusions


@pytest.mark.parametrize("sums,match", [(np.zeros(5, np.int32), r"int32 \[6\]"),
                                        (np.zeros(6, np.float32), "float32")])
def test_code_sums_of_the_wrong_shape_or_type_are_refused(sums, match):
    import jax.numpy as jnp

    from models.int8_dot import int8_product

    with pytest.raises(ValueError, match=match):
        int8_product(jnp.zeros((8, 16), jnp.int8), jnp.zeros((6, 16), jnp.int8), jnp.asarray(sums))


def test_hold_code_sums_gives_them_only_to_the_weights_whose_product_reads_them():
    """2-D int8 weights with per-row scales that quantize their activations get their sums (equal
    to the codes' sums); fp8, weight-only, grouped-activation, block and stacked weights and float
    arrays are left as they are, and the held weight's product equals the unheld one's."""
    import jax
    import jax.numpy as jnp

    from models.quant import QuantizedWeight, hold_code_sums, quantize_weight

    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.float32)
    int8 = quantize_weight(w, "int8", activation_rows=2)
    left = {"fp8": quantize_weight(w, "fp8", activation_rows=2), "weight_only": quantize_weight(w, "int8"),
            "grouped": quantize_weight(w, "int8", activation_rows=2, activation_group=32),
            "block": QuantizedWeight(int8.q, jnp.ones((96, 2), jnp.float32), block=32),
            "float": w}
    stacked = quantize_weight(jnp.stack([w, w]), "int8", activation_rows=2)
    held = hold_code_sums({"embed": int8, "layers": [{"qkv_proj": int8, **left}]})
    assert held["layers"][0]["qkv_proj"].code_sums is not None and held["embed"].code_sums is not None
    np.testing.assert_array_equal(np.asarray(held["embed"].code_sums),
                                  np.asarray(int8.q, np.int64).sum(axis=-1))
    for name, weight in left.items():
        assert held["layers"][0][name] is weight, name
    assert hold_code_sums({"layers": {"qkv_proj": stacked}})["layers"]["qkv_proj"].code_sums is None
    x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    product = jax.jit(lambda w, x: w.product("te,ne->tn", x))
    np.testing.assert_array_equal(np.asarray(product(held["embed"], x)), np.asarray(product(int8, x)))


@pytest.mark.aot
@pytest.mark.usefixtures("no_persistent_cache")
def test_other_platforms_compile_the_s8_dot():
    """The u8 form is the CPU's (the platform the product is lowered for): compiled for a TPU on
    this CPU host, the product is the plain s8 x s8 dot."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from experiments.lab.targets import compile_only_devices
    from models.int8_dot import int8_product

    shard = SingleDeviceSharding(compile_only_devices("v5e-1")[0])
    args = (jax.ShapeDtypeStruct((8, 576), jnp.int8, sharding=shard),
            jax.ShapeDtypeStruct((1536, 576), jnp.int8, sharding=shard))
    text = jax.jit(int8_product).lower(*args).compile().as_text()
    assert "u8[" not in text and "s8[8,576]" in text
    sums = jax.ShapeDtypeStruct((1536,), jnp.int32, sharding=shard)  # held sums: unused there
    text = jax.jit(int8_product).lower(*args, sums).compile().as_text()
    assert "u8[" not in text and "s8[8,576]" in text


def test_the_cpu_switch_loop_serves_int8_weights_with_their_sums():
    """serve_layout holds the sums for the switch loop (the CPU's, one device) only, and the served
    model's logits with them are those without (the correction is exact either way)."""
    import jax
    import jax.numpy as jnp

    from engine.step.program import serve_layout
    from models.config import preset_config
    from models.llama import forward_dense
    from models.random_weights import random_params

    config = preset_config("tiny")
    params = random_params(config, dtype="float32")
    switch = serve_layout(params, "switch", "int8", activation_rows=2)
    unrolled = serve_layout(params, "unrolled", "int8", activation_rows=2)
    assert all(layer[k].code_sums is not None for layer in switch["layers"]
               for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert all(getattr(w, "code_sums", None) is None for layer in unrolled["layers"] for w in layer.values())
    ids = jnp.asarray([1, 5, 9, 2, 7, 3], jnp.int32)
    a = jax.jit(lambda p: forward_dense(p, config, ids))(switch)
    b = jax.jit(lambda p: forward_dense(p, config, ids))(unrolled)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
