"""Quantized weights on a mesh (models/sharded_quant.py), at the product and weight level: what a
row-parallel product with quantized activations computes over 2 devices (each device scales its
slice of the input: the one-device product with an activation scale per half row), that a
column-parallel one equals one device's, and an expert's down_proj split over devices keeps the
one-device scales. The engine at TP = 2: tests/engine/test_quant_tp.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.config import preset_config
from models.quant import quantize_weight
from models.random_weights import random_params
from models.sharded_quant import quantize_array
from models.sharding import MODEL_AXIS, shard_params_host, tp_layout, weight_spec


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (MODEL_AXIS,))


def test_products_with_quantized_activations_over_two_devices():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(4, 32)) * np.linspace(0.1, 3.0, 32), jnp.float32)  # uneven halves
    w = quantize_weight(jnp.asarray(rng.normal(size=(8, 32)), jnp.float32), "int8", activation_rows=0)
    mesh = _mesh(2)

    def sharded(spec_w, spec_x, reduce):
        def local(wl, xl):
            y = wl.product("tf,ef->te", xl)
            return jax.lax.psum(y, MODEL_AXIS) if reduce else y
        out = P() if reduce else P(None, MODEL_AXIS)
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(weight_spec(spec_w, w), spec_x), out_specs=out,
                                     check_vma=False))(w, x)

    # Row-parallel (input columns split, scales replicated): each device quantizes its half of
    # every row with its own scale, i.e. one device's product with a scale per 16 input channels.
    row = sharded(P(None, MODEL_AXIS), P(None, MODEL_AXIS), reduce=True)
    halves = dataclasses.replace(w, activation_group=16).product("tf,ef->te", x)
    np.testing.assert_allclose(np.asarray(row), np.asarray(halves), rtol=1e-6, atol=1e-6)
    whole = w.product("tf,ef->te", x)
    assert not np.allclose(np.asarray(row), np.asarray(whole), rtol=1e-6, atol=1e-6)  # another rounding
    # Column-parallel (rows and their scales split, input whole): one device's product.
    col = sharded(P(MODEL_AXIS, None), P(), reduce=False)
    np.testing.assert_allclose(np.asarray(col), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_an_experts_down_split_over_devices_keeps_the_whole_rows_scales():
    """tp = 4, ep = 2: each expert's MLP width is split 2 ways, held as 2 blocks of the leading
    axis (models/sharding.py _shard_experts); each block's scales are its whole row's."""
    config = preset_config("tiny-mixtral")
    layout = tp_layout(config, 4, ep=2)
    params = random_params(config, host=True)
    host = shard_params_host(params, config, layout, dtype="float32", stack=False, pack_bits=False)
    down = host["layers"][0]["experts_down"]  # [4 devices x 2 local experts, e, f / 2]
    ref = quantize_weight(jnp.asarray(params["layers"][0]["experts_down"]), "int8")  # [4 experts, e, f]
    got = quantize_array(jnp.asarray(down), method="int8", activation_rows=None, expert_split=(2, 2))
    f_half = down.shape[-1]
    for i in range(4):
        experts, cols = slice((i // 2) * 2, (i // 2) * 2 + 2), slice((i % 2) * f_half, (i % 2 + 1) * f_half)
        np.testing.assert_array_equal(np.asarray(got.scale[2 * i : 2 * i + 2]), np.asarray(ref.scale[experts]))
        np.testing.assert_array_equal(np.asarray(got.q[2 * i : 2 * i + 2]), np.asarray(ref.q[experts, :, cols]))
    per_block = quantize_weight(jnp.asarray(down), "int8")  # the blocks' own maxima: not the row's
    assert not np.array_equal(np.asarray(per_block.scale), np.asarray(got.scale))
