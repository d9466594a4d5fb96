"""SmoothQuant-style smoothing (models/smoothing.py): exact in float on random tiny models of each
layout (tied; untied with 9 query heads on 3 kv heads and biases, stacked; Gemma 2's norm offset,
sandwich norms and windows; a mixture of experts), a smaller quantization error on an outlier channel, the tied embedding's factors carried
by the quantized table, and the refusals by name."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import preset_config
from models.llama import forward_dense
from models.quant import QuantizedWeight, quantize_params, quantize_rows, quantize_weight
from models.random_weights import random_params
from models.served_layout import fuse_projections, stack_layers
from models.smoothing import (
    SMOOTHED_PRODUCTS,
    activation_maxima,
    check_alpha,
    product_alphas,
    smooth_params,
    smoothing_factors,
)

pytestmark = pytest.mark.usefixtures("fast_compile")  # random tiny shapes: -O0 (tests/conftest.py)

IDS = [(5 * j + 3) % 250 + 1 for j in range(24)]
EVERY_PRODUCT = dict.fromkeys(SMOOTHED_PRODUCTS, 0.5)  # o_proj too (not in one alpha's default)


@functools.cache
def _forward(config):
    return jax.jit(lambda p, ids: forward_dense(p, config, ids))


def _logits(params, config):
    params = {k: v for k, v in params.items() if k != "embed_smoothing"}  # (float: unused)
    return np.asarray(_forward(config)(params, jnp.asarray(IDS)))


@pytest.mark.parametrize("preset,stacked", [("tiny", False), ("tiny-gqa3", True), ("tiny-gemma2", False),
                                            ("tiny-mixtral", False)])
def test_smoothing_is_exact_in_float(preset, stacked):
    config = preset_config(preset)
    if preset == "tiny-gqa3":  # 9 query heads on 3 kv heads, untied, and v's bias divided too
        config = dataclasses.replace(config, attention_bias=True)
    params = random_params(config, seed=1)
    params = stack_layers(params) if stacked else params
    maxima = activation_maxima(params, config, IDS)
    smoothed = smooth_params(params, config, maxima, EVERY_PRODUCT)
    before, after = _logits(fuse_projections(params), config), _logits(fuse_projections(smoothed), config)
    np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-4 * np.abs(before).max())
    layer = smoothed["layers"] if stacked else smoothed["layers"][0]
    original = params["layers"] if stacked else params["layers"][0]
    assert not np.allclose(layer["attn_norm"], original["attn_norm"])  # something was folded in
    if config.tie_word_embeddings:  # the tied lm_head's factors ride to quantize_params
        assert smoothed["embed_smoothing"].shape == (config.hidden_size,)
        assert smoothed["embed"] is params["embed"]
    else:
        assert not np.allclose(smoothed["final_norm"], params["final_norm"])


def test_the_tied_embedding_carries_its_factors_through_quantization():
    config = preset_config("tiny")
    params = random_params(config, seed=2)
    smoothed = smooth_params(params, config, activation_maxima(params, config, IDS), 0.5)
    assert "embed_smoothing" not in quantize_params(fuse_projections(smoothed), None)
    served = quantize_params(fuse_projections(smoothed), "int8", activation_rows=0)
    embed = served["embed"]
    assert "embed_smoothing" not in served and embed.input_scale.shape == (config.hidden_size,)
    # lookups give the unsmoothed rows back (to the table's int8 rounding of embed * s)
    rows = np.asarray(embed.rows(jnp.arange(10)))
    step = np.asarray(embed.scale[:10])[:, None] * np.asarray(embed.input_scale)[None, :]
    assert np.all(np.abs(rows - np.asarray(params["embed"][:10])) <= 0.5 * step * (1 + 1e-5))
    # and the quantized model still tracks the float one
    reference = _logits(fuse_projections(params), config)
    np.testing.assert_allclose(_logits(served, config), reference, atol=0.1 * np.abs(reference).max())


def test_smoothing_shrinks_an_outlier_channels_activation_scale_and_the_product_error():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    x[:, 5] *= 60.0  # the residual stream's kind of outlier channel
    w = rng.standard_normal((32, 64)).astype(np.float32)
    exact = x @ w.T
    s = np.asarray(smoothing_factors(np.abs(x).max(0), np.abs(w).max(0), 0.5))
    errors, scales = [], []
    for xs, ws in ((x, w), (x / s, w * s)):
        y = quantize_weight(jnp.asarray(ws), "int8", activation_rows=0).product("te,ne->tn", jnp.asarray(xs))
        errors.append(np.abs(np.asarray(y) - exact).mean())
        rows = np.asarray(quantize_rows(jnp.asarray(xs), "int8")[1])[:, 0]
        scales.append(np.median(rows / np.sqrt(np.mean(xs ** 2, axis=1))))  # relative to each row's rms
    assert scales[1] < 0.5 * scales[0], scales
    assert errors[1] < 0.5 * errors[0], errors


def test_smoothing_lowers_the_int8_x_int8_error_of_a_model_with_outlier_channels():
    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False)
    params = random_params(config, seed=3)
    for layer in params["layers"]:  # norms that blow channel 7 up, as trained models' do
        layer["attn_norm"] = layer["attn_norm"].at[7].mul(40.0)
        layer["mlp_norm"] = layer["mlp_norm"].at[7].mul(40.0)
    reference = _logits(fuse_projections(params), config)
    smoothed = smooth_params(params, config, activation_maxima(params, config, IDS), 0.5)
    errors = [np.abs(_logits(quantize_params(fuse_projections(p), "int8", activation_rows=0), config)
                     - reference).mean() for p in (params, smoothed)]
    assert errors[1] < 0.7 * errors[0], errors


@pytest.mark.parametrize("alpha", [-0.1, 1.5, math.nan, True, "0.5", None])
def test_a_bad_alpha_is_refused_by_name(alpha):
    with pytest.raises(ValueError, match="quantization_smoothing"):
        check_alpha(alpha)


def test_smoothing_refusals():
    assert product_alphas(0.5)["o"] is None and product_alphas(0.5)["qkv"] == 0.5
    with pytest.raises(ValueError, match="unknown products"):
        product_alphas({"mlp": 0.5})
    config = preset_config("tiny")
    params = random_params(config)
    with pytest.raises(ValueError, match="loaders' layout"):
        smooth_params(fuse_projections(params), config, {}, 0.5)


def test_engine_knob_defaults_and_refusals():
    from engine.config import EngineConfig, resolve_smoothing

    def resolved(**knobs):
        return resolve_smoothing(EngineConfig(**knobs), "cpu")

    assert resolved(quantization="int8") == 0.5  # the CPU's int8 x int8 form: on by default
    assert resolved(quantization="int8", quantization_smoothing="off") is None
    assert resolved(quantization="int8", quantization_smoothing="0.6") == 0.6  # as a flag gives it
    # every product weight-only (rows past the token budget): nothing to smooth for
    assert resolved(quantization="int8", quantization_activation_rows=257) is None
    assert resolved(quantization="int8", quantization_activation_rows=256) == 0.5
    assert resolve_smoothing(EngineConfig(quantization="int8"), "tpu") is None  # weight-only there
    assert resolved(quantization="fp8") is None and resolved() is None
    assert resolved(quantization="int8", tensor_parallel_size=2) is None  # a mesh: off by default
    for knobs in (dict(quantization="int8", quantization_smoothing="half"),
                  dict(quantization="int8", quantization_smoothing=2.0),
                  dict(quantization_smoothing=0.5),
                  dict(quantization="gguf", quantization_smoothing=0.5),
                  dict(quantization="int8", quantization_smoothing=0.5, tensor_parallel_size=2),
                  dict(quantization="int8", quantization_smoothing=0.5, enable_lora=True)):
        with pytest.raises(ValueError, match="quantization_smoothing"):
            EngineConfig(**knobs)


def test_quant_quality_names_smoothed_configurations():
    from experiments.quant_quality import config_named

    assert config_named("int8-smooth").smoothing == 0.5
    assert config_named("int8-weight-only-smooth-0.6") == dataclasses.replace(config_named("int8-weight-only"),
                                                                               smoothing=0.6)
    for bad in ("float32-smooth-0.5", "int8-smooth-x"):
        with pytest.raises(ValueError, match="unknown"):
            config_named(bad)


def test_a_quantized_weight_without_factors_is_unchanged():
    w = quantize_weight(jnp.ones((4, 8)), "int8")
    assert w.input_scale is None and isinstance(w, QuantizedWeight)
    assert len(jax.tree.leaves(w)) == 2  # q and scale: the pytree of every existing weight
