"""SmoothQuant-style smoothing (Xiao et al. 2023) before int8 x int8 quantization (models/quant.py).

Why: with activations quantized per row (one dynamic scale per token row of a product), a few
outlier channels of the residual stream set each row's scale, so the other channels keep few
levels (BUILD_NOTES.md "Activation scales"). Smoothing moves that range into the weights: for a
product y = x . W^T whose input channel j is divided by s_j and whose weight column j is
multiplied by s_j, y is unchanged in float, and with
    s_j = max|x_j|^alpha / max|W_:,j|^(1 - alpha)    (alpha in [0, 1]; s_j = 1 where either max is 0)
the outlier channels shrink in x (finer per-row activation scales) and grow in W (per output row
weight scales absorb them). The maxima |x_j| come from a calibration pass over CALIBRATION_TEXT.

Where the division by s is folded (the loaders' layout, models/llama.py: list or stacked layers,
so every axis below counts from the end):
- qkv (input: attn_norm's output): attn_norm's scale (offset + w) / s; wq, wk, wv's rows
  [e, ...] times s (one s for the three: they share the input).
- gate/up (input: mlp_norm's output): mlp_norm / s; w_gate, w_up's rows times s. Skipped for a
  mixture of experts (its router and experts share the input; not done).
- down (input: act(gate) * up): w_up's columns [e, f] / s (and only up: act(gate) is not linear),
  w_down's rows [f, e] times s. Scaling an output channel of w_up changes none of its quantized
  values (per-output-channel weight scales), so this moves range for free.
- o_proj (input: attention's output, head h dim d = softmax-weighted rows of v of kv head
  h // group): wv's columns [e, k, d] (and bv [k, d]) / s[k, d], wo's rows [h, d, e] times
  s[h // group, d]. One factor per kv-head channel, shared by the group's query heads: its
  activation maximum is the max over the group's heads, its weight maximum over their wo rows.
  It changes the V values an 8-bit KV cache stores (per token and kv head scales). Only on
  request (product_alphas with "o"): on the default model it gained nothing.
- lm_head (input: final_norm's output): an untied one folds (lm_head [e, v] rows times s,
  final_norm / s); a tied one is the embedding table, whose rows the lookup reads, so its
  factors ride as params["embed_smoothing"] to quantize_params, which stores embed * s with
  input_scale = 1 / s (models/quant.py 6.): products scale their input, lookups their rows.

One alpha smooths DEFAULT_PRODUCTS (all but o_proj); a dict gives each product its own (or None).
Measured on the default model (BUILD_NOTES.md "Activation scales"): alpha 0.5 cuts int8 x int8's
KL from float32 from 0.033 to 0.012 and its perplexity excess on 2,048 tokens from 3.5 % to 1.4 %;
the calibration pass costs 2-4 s at load.

Exact in float up to rounding (tests/models/test_smoothing.py). Not supported: a mesh (the
calibration runs the whole float model on one device; EngineConfig refuses it by name), LoRA
adapters (their A matrices read the unsmoothed input; refused by name), a mixture of experts'
MLP (skipped: the router and the experts share its input).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

# The calibration text (written for this purpose: general prose, a list, numbers, a little code
# and a chat-style question and answer). Not the held-out perplexity text of
# experiments/quant_quality.py (ShareGPT answers) nor any benchmark prompt.
CALIBRATION_TEXT = """\
The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened his \
shutters, and a line of children with satchels crossed the old stone bridge on their way to school. \
By nine o'clock the market square was full: apples, cabbages, wheels of cheese, bundles of rope, \
and a man selling clocks that all showed a different time.

Why do leaves change colour in autumn? As the days shorten, trees stop making chlorophyll, the \
green pigment that captures sunlight. Without it, the yellow and orange carotenoids that were there \
all along become visible, and some species produce red anthocyanins from the sugars left in the leaf.

Steps to repot a plant:
1. Water it a day before, so the roots hold together.
2. Choose a pot 2-5 cm wider than the old one, with a drainage hole.
3. Loosen the root ball gently and trim any dead roots.
4. Set it at the same depth as before, fill with fresh soil and water well.

In 1969 the Apollo 11 crew travelled about 384,400 km to the Moon; the trip took roughly 76 hours. \
A kilogram is 1000 grams, a mile is 1.609 kilometres, and water boils at 100 degrees Celsius at sea level.

def mean(values):
    \"\"\"Return the arithmetic mean of a non-empty list.\"\"\"
    total = 0.0
    for v in values:
        total += v
    return total / len(values)

print(mean([3, 4, 5]))  # 4.0

User: Can you suggest a name for a small cafe by the sea?
Assistant: Here are a few ideas: "Salt & Crumb", "The Tide Table", "Harbour Light Coffee", and \
"Driftwood Cafe". A short name that hints at the view is easy to remember and fits on a sign.
"""


CALIBRATION_MAX_TOKENS = 512  # a byte-level tokenizer (random:<preset> models) gives ~1,800


def calibration_ids(tokenizer) -> list[int]:
    """CALIBRATION_TEXT's token ids (no special tokens), at most CALIBRATION_MAX_TOKENS."""
    return list(tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False))[:CALIBRATION_MAX_TOKENS]


def check_alpha(alpha) -> float:
    """alpha as a float in [0, 1], or a ValueError that names quantization_smoothing."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0 \
            or math.isnan(float(alpha)):
        raise ValueError(f"quantization_smoothing must be a migration strength alpha in [0, 1] "
                         f"(0.5: SmoothQuant's default), got {alpha!r}")
    return float(alpha)


# ---- calibration: per input channel max |x| of each smoothed product, per layer -------------

def activation_maxima(params: dict, config: ModelConfig, token_ids) -> dict:
    """The float model (loaders' layout, list or stacked layers) run densely over token_ids;
    per layer the max |x| per input channel of: "qkv" [e], "o" [h * d], "gate_up" [e],
    "down" [f] (absent for experts), and "final" [e] (the final norm's output). numpy float32.
    One layer is compiled (per layer kind) and run layer after layer."""
    from models.layers import dense_causal_attention, embed_tokens
    from models.llama import _Model

    layers = params["layers"]
    stacked = isinstance(layers, dict)
    n = layers["attn_norm"].shape[0] if stacked else len(layers)
    ids = jnp.asarray(np.asarray(token_ids, np.int32))
    positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
    model = _Model(config, params["embed"].dtype, lambda y: y)

    def run_layer(x, layer, kind):
        stats = {}

        def amax(name, v):
            stats[name] = jnp.max(jnp.abs(v.astype(jnp.float32)).reshape(v.shape[0], -1), axis=0)
            return v

        qkv, out, mlp = model.loader_ops(layer, tap=amax)  # the dense MLP taps "down"

        def attend(q, k, v, cache, kind):
            attn = dense_causal_attention(q, k, v, config.sm_scale, config.window_of(kind),
                                          config.attn_logit_softcap)
            return attn, cache

        ops = (lambda h: qkv(amax("qkv", h)), lambda a: out(amax("o", a)), lambda h: mlp(amax("gate_up", h)))
        x, _ = model.layer(x, (), layer, ops, positions, kind, attend)
        return x, stats

    compiled = {}
    x = embed_tokens(params["embed"], ids, config.embed_scale)
    out = []
    for index in range(n):
        layer = {k: w[index] for k, w in layers.items()} if stacked else layers[index]
        kind = model.kinds[index % model.period]
        if kind not in compiled:
            compiled[kind] = jax.jit(functools.partial(run_layer, kind=kind))
        x, stats = compiled[kind](x, layer)
        out.append(stats)
    final = jnp.max(jnp.abs(model.norm(x, params["final_norm"]).astype(jnp.float32)), 0)
    maxima = {name: np.stack([np.asarray(s[name]) for s in out]) for name in out[0]}
    if not stacked:
        maxima = {name: list(v) for name, v in maxima.items()}
    maxima["final"] = np.asarray(final)
    return maxima


# ---- the factors and their folding -----------------------------------------------------------

def smoothing_factors(x_max, w_max, alpha: float):
    """s = x_max^alpha / w_max^(1 - alpha) per channel (1 where either max is 0), float32."""
    x_max = jnp.asarray(x_max, jnp.float32)
    w_max = jnp.asarray(w_max, jnp.float32)
    ok = (x_max > 0) & (w_max > 0)
    s = jnp.power(jnp.where(ok, x_max, 1.0), alpha) / jnp.power(jnp.where(ok, w_max, 1.0), 1.0 - alpha)
    return jnp.where(ok, s, 1.0)


def _absmax(w, axes):
    return jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axes)


def _scaled(w, s):
    """w times s (broadcast), in w's dtype (the product in float32)."""
    return (w.astype(jnp.float32) * s).astype(w.dtype)


def _norm_divided(w, s, offset: float):
    """A norm weight whose scale (offset + w) is divided by s."""
    return ((w.astype(jnp.float32) + offset) / s - offset).astype(w.dtype)


SMOOTHED_PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")
# What one alpha smooths: not o_proj (measured on the default model: no gain, module docstring).
DEFAULT_PRODUCTS = ("qkv", "gate_up", "down", "lm_head")


def product_alphas(alpha) -> dict:
    """alpha (one float for DEFAULT_PRODUCTS) or {product: alpha or None (not smoothed)} -> a
    dict over SMOOTHED_PRODUCTS, each alpha checked."""
    if not isinstance(alpha, dict):
        alpha = dict.fromkeys(DEFAULT_PRODUCTS, check_alpha(alpha))
    unknown = sorted(set(alpha) - set(SMOOTHED_PRODUCTS))
    if unknown:
        raise ValueError(f"smoothing: unknown products {unknown}; known: {', '.join(SMOOTHED_PRODUCTS)}")
    return {p: None if alpha.get(p) is None else check_alpha(alpha[p]) for p in SMOOTHED_PRODUCTS}


def smooth_layer(layer: dict, maxima: dict, config: ModelConfig, alphas: dict) -> dict:
    """One layer (loaders' layout; a leading stacked axis allowed) with its products smoothed
    (module docstring); maxima is activation_maxima's entry for this layer (or the stack);
    alphas from product_alphas. Every factor is computed from the original weights."""
    out = dict(layer)
    off = config.norm_offset
    if alphas["qkv"] is not None:  # one s per input channel e for wq, wk, wv (rows [..., e, heads, d])
        w_max = jnp.maximum(jnp.maximum(_absmax(layer["wq"], (-2, -1)), _absmax(layer["wk"], (-2, -1))),
                            _absmax(layer["wv"], (-2, -1)))
        s = smoothing_factors(maxima["qkv"], w_max, alphas["qkv"])  # [..., e]
        out["attn_norm"] = _norm_divided(layer["attn_norm"], s, off)
        for name in ("wq", "wk", "wv"):
            out[name] = _scaled(layer[name], s[..., :, None, None])
    if alphas["o"] is not None:  # one s per kv-head channel (k, d), shared by the group's query heads
        h, k, d = config.num_heads, config.num_kv_heads, config.head_dim
        lead = layer["wo"].shape[:-3]
        x_o = jnp.asarray(maxima["o"], jnp.float32).reshape(*lead, k, h // k, d).max(-2)
        w_o = _absmax(layer["wo"], -1).reshape(*lead, k, h // k, d).max(-2)
        s = smoothing_factors(x_o, w_o, alphas["o"])  # [..., k, d]
        out["wv"] = _scaled(out["wv"], 1.0 / s[..., None, :, :])
        if "bv" in layer:
            out["bv"] = _scaled(layer["bv"], 1.0 / s)
        s_heads = jnp.repeat(s, h // k, axis=-2)  # [..., h, d]: query head h reads kv head h // group
        out["wo"] = _scaled(layer["wo"], s_heads[..., None])
    if config.num_experts or "w_gate" not in layer:
        return out
    if alphas["gate_up"] is not None:  # one s per input channel e for w_gate and w_up (rows [..., e, f])
        w_max = jnp.maximum(_absmax(layer["w_gate"], -1), _absmax(layer["w_up"], -1))
        s = smoothing_factors(maxima["gate_up"], w_max, alphas["gate_up"])
        out["mlp_norm"] = _norm_divided(layer["mlp_norm"], s, off)
        out["w_gate"] = _scaled(layer["w_gate"], s[..., :, None])
        out["w_up"] = _scaled(layer["w_up"], s[..., :, None])
    if alphas["down"] is not None:  # its input act(gate) * up: channel f divided through up's column f
        s = smoothing_factors(maxima["down"], _absmax(layer["w_down"], -1), alphas["down"])  # [..., f]
        out["w_up"] = _scaled(out["w_up"], 1.0 / s[..., None, :])
        out["w_down"] = _scaled(layer["w_down"], s[..., :, None])
    return out


def smooth_params(params: dict, config: ModelConfig, maxima: dict, alpha) -> dict:
    """The loaders' layout (list or stacked layers) smoothed; float-equivalent. alpha: one float
    for every product, or per product (product_alphas)."""
    alphas = product_alphas(alpha)
    if any(k in layer for layer in _layer_dicts(params) for k in ("wqkv", "qkv_proj")):
        raise ValueError("smooth_params takes the loaders' layout (separate wq/wk/wv), before "
                         "fuse_projections (models/served_layout.py)")
    layers = params["layers"]
    if isinstance(layers, dict):
        new_layers = smooth_layer(layers, maxima, config, alphas)
    else:
        new_layers = [smooth_layer(layer, {k: v[i] for k, v in maxima.items() if k != "final"}, config, alphas)
                      for i, layer in enumerate(layers)]
    out = {**params, "layers": new_layers}
    if "lm_head" in params and alphas["lm_head"] is not None:  # untied: final_norm feeds lm_head [e, v]
        s = smoothing_factors(maxima["final"], _absmax(params["lm_head"], -1), alphas["lm_head"])
        out["final_norm"] = _norm_divided(params["final_norm"], s, config.norm_offset)
        out["lm_head"] = _scaled(params["lm_head"], s[:, None])
    elif alphas["lm_head"] is not None:  # tied: the factors ride to quantize_params (input_scale)
        s = smoothing_factors(maxima["final"], _absmax(params["embed"], 0), alphas["lm_head"])
        out["embed_smoothing"] = s
    return out


def _layer_dicts(params):
    layers = params["layers"]
    return [layers] if isinstance(layers, dict) else layers


def smooth_for_quantization(params: dict, config: ModelConfig, tokenizer, alpha: float) -> tuple[dict, float]:
    """Calibrate on CALIBRATION_TEXT and smooth: (smoothed params on the default device, seconds)."""
    import time

    start = time.perf_counter()
    params = jax.tree.map(jnp.asarray, params)
    maxima = activation_maxima(params, config, calibration_ids(tokenizer))
    smoothed = smooth_params(params, config, maxima, alpha)
    jax.block_until_ready(smoothed)
    return smoothed, time.perf_counter() - start
