"""models/in_major.py: float32 layer products held in-major on the CPU's layer loop. The product
is the out-major one (the same arithmetic, a different weight layout), the weight answers for the
out-major matrix it stands for, and only float32 2-D layer products of the switch loop's
per-layer lists are held so."""

import numpy as np
import pytest


@pytest.mark.parametrize("rows", [1, 2, 8, 33])
@pytest.mark.parametrize("spec,o,i", [("te,ne->tn", 96, 64), ("tf,ef->te", 64, 160)])
def test_the_product_is_the_out_major_one(rows, spec, o, i):
    import jax
    import jax.numpy as jnp

    from models.in_major import InMajorWeight
    from models.layers import proj

    rng = np.random.default_rng(rows + o)
    w = jnp.asarray(rng.standard_normal((o, i)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, i)), jnp.float32)
    held = InMajorWeight(jnp.swapaxes(w, 0, 1))
    assert held.shape == (o, i) and held.dtype == jnp.float32 and held.ndim == 2
    got = jax.jit(lambda x, w: proj(spec, x, w))(x, held)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.dtype == jnp.float32 and got.shape == (rows, o)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def test_a_spec_that_is_not_out_major_is_refused():
    import jax.numpy as jnp

    from models.in_major import InMajorWeight

    held = InMajorWeight(jnp.zeros((64, 96), jnp.float32))
    with pytest.raises(ValueError, match="in-major weight takes an out-major product"):
        held.product("te,en->tn", jnp.zeros((2, 64), jnp.float32))


def test_only_float32_layer_products_of_a_layer_list_are_held():
    import jax.numpy as jnp

    from models.in_major import InMajorWeight, hold_in_major
    from models.quant import quantize_weight

    w = jnp.ones((96, 64), jnp.float32)
    layer = {"qkv_proj": w, "o_proj": w.astype(jnp.bfloat16), "gate_up_proj": quantize_weight(w, "int8"),
             "down_proj": w, "attn_norm": jnp.ones((64,), jnp.float32), "router": w,
             "experts_down": jnp.ones((4, 96, 64), jnp.float32)}
    held = hold_in_major({"layers": [layer], "embed": w})["layers"][0]
    assert isinstance(held["qkv_proj"], InMajorWeight) and held["qkv_proj"].wt.shape == (64, 96)
    assert isinstance(held["down_proj"], InMajorWeight)
    for name in ("o_proj", "gate_up_proj", "attn_norm", "router", "experts_down"):
        assert held[name] is layer[name], name
    stacked = {"layers": {"qkv_proj": jnp.ones((2, 96, 64), jnp.float32)}}
    assert hold_in_major(stacked) is stacked


def test_the_cpu_layer_loop_serves_float32_in_major():
    """serve_layout holds them for the switch loop (the CPU's) only, and the served model's
    logits are the out-major model's."""
    import jax
    import jax.numpy as jnp

    from engine.step.program import serve_layout
    from models.config import preset_config
    from models.in_major import InMajorWeight
    from models.llama import forward_dense
    from models.random_weights import random_params

    config = preset_config("tiny")
    params = random_params(config, dtype="float32")
    switch = serve_layout(params, "switch")
    unrolled = serve_layout(params, "unrolled")
    assert all(isinstance(layer["qkv_proj"], InMajorWeight) for layer in switch["layers"])
    assert not any(isinstance(w, InMajorWeight) for layer in unrolled["layers"] for w in layer.values())
    ids = jnp.asarray([[1, 5, 9, 2, 7, 3]], jnp.int32)[0]
    a = jax.jit(lambda p: forward_dense(p, config, ids))(switch)
    b = jax.jit(lambda p: forward_dense(p, config, ids))(unrolled)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
