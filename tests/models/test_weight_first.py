"""models/weight_first.py: float32 out-major products of 2+ rows, and bfloat16 ones of 2 to
BF16_MAX_ROWS, run weight-first on the CPU (y^T = w . x^T), the plain product everywhere else. The same arithmetic (float32 rounding aside),
the weight as the dot's left operand in the CPU's compiled program, the other platforms' lowering
without it, and the rule of which products take it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import proj
from models.weight_first import BF16_MAX_ROWS, check_out_major, takes_weight_first


@pytest.mark.parametrize("rows", [1, 2, 8, 33])
@pytest.mark.parametrize("spec,o,i", [("te,ne->tn", 96, 64), ("tf,ef->te", 64, 160)])
def test_the_product_is_the_out_major_one(rows, spec, o, i):
    rng = np.random.default_rng(rows + o)
    w = jnp.asarray(rng.standard_normal((o, i)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, i)), jnp.float32)
    got = jax.jit(lambda x, w: proj(spec, x, w))(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert got.dtype == jnp.float32 and got.shape == (rows, o)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


def _dots(compiled_text: str) -> list[str]:
    return [line for line in compiled_text.splitlines() if " dot(" in line]


def test_the_cpu_program_multiplies_the_weight_first_and_the_other_platforms_do_not():
    w = jnp.zeros((96, 64), jnp.float32)
    x = jnp.zeros((8, 64), jnp.float32)
    fn = jax.jit(lambda x, w: proj("te,ne->tn", x, w))
    dots = _dots(fn.lower(x, w).compile().as_text())
    # One dot, the weight [96, 64] first (out [96, 8]), the activations transposed [64, 8] second.
    assert len(dots) == 1 and " = f32[96,8]" in dots[0], dots
    assert "lhs_contracting_dims={1}, rhs_contracting_dims={0}" in dots[0], dots
    for platform in ("tpu", "cuda"):
        text = fn.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        assert "optimization_barrier" not in text and "dot_general" in text, platform
    one_row = jax.jit(lambda x, w: proj("te,ne->tn", x, w)).lower(x[:1], w).as_text()
    assert "optimization_barrier" not in one_row


@pytest.mark.parametrize("rows", [2, 8, 33])
def test_a_bfloat16_product_is_exact_and_stays_bfloat16_on_the_cpu(rows):
    """bfloat16 weight-first: the products of bfloat16 numbers summed in float32 (exact against
    float64 to float32 rounding), and the CPU's compiled dot reads bfloat16 operands, the weight
    first (XLA:CPU widens both to float32 where it sees x^T's transpose: the flat view hides it)."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.bfloat16)
    fn = jax.jit(lambda x, w: proj("te,ne->tn", x, w))
    want = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(fn(x, w)), want, rtol=1e-5, atol=1e-4)
    lowered = fn.lower(x, w).as_text()
    assert "optimization_barrier" in lowered
    assert re.search(rf"dot_general.*\(tensor<96x64xbf16>, tensor<64x{rows}xbf16>\)", lowered), lowered
    compiled = fn.lower(x, w).compile().as_text()
    assert not re.search(r"= f32\[96,64\][^ ]* (convert|fusion)", compiled), "the weight was widened to float32"
    for platform in ("tpu", "cuda"):
        text = fn.trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        assert "optimization_barrier" not in text and "dot_general" in text, platform


def test_only_out_major_float32_products_of_two_or_more_rows_and_small_bfloat16_ones_take_it():
    w32, x32 = jnp.zeros((96, 64), jnp.float32), jnp.zeros((4, 64), jnp.float32)
    assert takes_weight_first("te,ne->tn", x32, w32)
    assert takes_weight_first("te,ne->tn", jnp.zeros((300, 64), jnp.float32), w32)
    assert not takes_weight_first("te,ne->tn", x32[:1], w32)  # one row: XLA's own loop
    w16 = w32.astype(jnp.bfloat16)
    assert takes_weight_first("te,ne->tn", x32.astype(jnp.bfloat16), w16)
    assert takes_weight_first("te,ne->tn", jnp.zeros((BF16_MAX_ROWS, 64), jnp.bfloat16), w16)
    assert not takes_weight_first("te,ne->tn", jnp.zeros((BF16_MAX_ROWS + 1, 64), jnp.bfloat16), w16)
    assert not takes_weight_first("te,ne->tn", jnp.zeros((1, 64), jnp.bfloat16), w16)
    assert not takes_weight_first("te,ne->tn", x32, w16)  # mixed dtypes: proj casts x first
    assert not takes_weight_first("te,ne->tn", x32.astype(jnp.float16), w32.astype(jnp.float16))
    assert not takes_weight_first("te,en->tn", x32, jnp.zeros((64, 96), jnp.float32))  # in-major
    assert not takes_weight_first("thd,hde->te", jnp.zeros((4, 2, 32), jnp.float32),
                                  jnp.zeros((2, 32, 64), jnp.float32))
    with pytest.raises(ValueError, match="a quantized weight takes an out-major product"):
        check_out_major("te,en->tn", (64, 96), "a quantized")


def test_the_served_model_on_the_cpu_equals_the_plain_products():
    """The CPU's served forward (weight-first products, the lm_head included) against the same
    model lowered with plain products: the logits agree to float32 rounding."""
    import models.layers as layers
    from engine.step.program import serve_layout
    from models.config import preset_config
    from models.llama import forward_dense
    from models.random_weights import random_params

    config = preset_config("tiny")
    params = serve_layout(random_params(config, dtype="float32"), "switch")
    ids = jnp.asarray([1, 5, 9, 2, 7, 3], jnp.int32)
    weight_first = jax.jit(lambda p: forward_dense(p, config, ids))
    a = np.asarray(weight_first(params))
    assert "optimization_barrier" in weight_first.lower(params).as_text()
    original = layers.takes_weight_first
    layers.takes_weight_first = lambda *args: False
    try:
        plain = jax.jit(lambda p: forward_dense(p, config, ids))
        assert "optimization_barrier" not in plain.lower(params).as_text()
        b = np.asarray(plain(params))
    finally:
        layers.takes_weight_first = original
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
