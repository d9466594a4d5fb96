"""models/layers.py's argmax (the greedy token of every sampler path): jnp.argmax's result, ties,
NaN and all -inf rows included, at the row counts the engine compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import argmax


@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_argmax_equals_jnp_argmax_with_ties_nan_and_masked_rows(rows):
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 1000)).astype(np.float32)
    x[0, [5, 700]] = 9.0  # a tie: the first index wins
    if rows > 1:
        x[1, :] = -np.inf  # a fully masked row: index 0, as jnp.argmax
    if rows > 2:
        x[2, [40, 30]] = np.nan  # NaN wins, the first one
        x[2, 10] = np.inf
    got = jax.jit(argmax)(jnp.asarray(x))
    assert got.dtype == jnp.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert int(got[0]) == 5
    if rows > 2:
        assert int(got[2]) == 30


def test_argmax_takes_leading_axes_and_bfloat16():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 257)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))
