"""The shared layers every family's decoder is built from (pure functions, no parameters of their own).

Einsum axes as in models/llama.py: t tokens, s key positions, e hidden, h query heads, k KV
heads, g query heads per KV head, d head dim, f MLP width, v vocabulary, n a fused output axis.

- RMSNorm, scaling by (offset + weight): offset 0 (Llama, Qwen) or 1 (Gemma's (1 + w)).
- RoPE: the inverse frequencies of a (theta, scaling) pair (plain, linear, llama3) and the
  rotate-half rotation of Hugging Face checkpoints; a model may use one pair per layer kind.
- Gated MLP activations: SwiGLU (silu) and GeGLU (tanh-approximated GELU).
- Soft-capping: cap * tanh(x / cap) (Gemma 2's attention and final logits).
- Projections `proj`: the input cast to the weight's dtype, accumulated in float32.
- Dense causal attention of one sequence, with an optional window and soft cap: the oracle
  the paged kernels (pallas_kernels/) are tested against.
- The embedding lookup, gathered as bits on the CPU.
- `argmax` over the last axis (greedy tokens): jnp.argmax's result written as plain
  reductions, which XLA:CPU runs 3-5x faster than its variadic (value, index) reduce.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from models.quant import QuantizedWeight
from models.weight_first import takes_weight_first, weight_first_product
from pallas_kernels.kv_write import as_bits, from_bits


def inv_freq_of(head_dim: int, theta: float, scaling) -> np.ndarray:
    """Inverse frequencies [d/2] with RoPE scaling applied (float64 numpy)."""
    d = head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    ramp = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(middle, ramp, scaled)


def rope_inv_freq(config, kind: str = "full_attention") -> np.ndarray:
    """The inverse frequencies of a layer kind's RoPE (a config without per-kind RoPE, such as
    the draft head's, has one pair: rope_theta, rope_scaling)."""
    if hasattr(config, "rope_of"):
        theta, scaling = config.rope_of(kind)
    else:
        theta, scaling = config.rope_theta, config.rope_scaling
    return inv_freq_of(config.head_dim, theta, scaling)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates x [t, n, d] by position (the rotate-half layout of HF checkpoints)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [t, d/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis in float32, scaled by (offset + weight)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32)
    if offset:
        scale = scale + offset
    return (x32 * scale).astype(x.dtype)


def argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, axis=-1) as int32: the first index of the maximum, or of the first NaN if
    any, written as plain reductions (the max, then the least index holding it and the least NaN
    index; XLA:CPU's max may skip NaN, so NaN is looked for on its own). On XLA:CPU [8, 49152]
    float32 logits took 0.19-0.34 ms against 0.87-0.91 ms, [32, 49152] 0.74-1.1 against 3.5 ms
    (BUILD_NOTES.md "Greedy argmax")."""
    size = x.shape[-1]
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first_max = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), index, size), axis=-1)
    first_nan = jnp.min(jnp.where(jnp.isnan(x), index, size), axis=-1)
    return jnp.where(first_nan < size, first_nan, first_max)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unknown MLP activation {name!r} (known: silu, gelu_tanh)")


def gated(gate_up: jax.Array, act: str) -> jax.Array:
    """The fused gate/up product [..., 2f] -> act(gate) * up [..., f]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return activation(act)(gate) * up


def proj(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [t, ...] times a weight: x cast to the weight's dtype, accumulated and returned in f32
    (a quantized weight runs its own product form, models/quant.py; a float32 out-major product of
    2+ rows, or a bfloat16 one of 2-64, runs weight-first on the CPU, models/weight_first.py)."""
    if isinstance(w, QuantizedWeight):
        return w.product(spec, x)
    x = x.astype(w.dtype)
    if takes_weight_first(spec, x, w):
        return weight_first_product(spec, x, w)
    product = lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)  # noqa: E731
    if x.shape[0] != 1 or w.dtype != jnp.bfloat16:
        return product(x, w)

    def padded(x, w):
        # XLA:CPU runs a one-row bfloat16 product through a slow path (tens of times slower
        # than two rows, BUILD_NOTES.md): a zero second row keeps it on the fast one.
        return product(jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1]

    return jax.lax.platform_dependent(x, w, cpu=padded, default=product)


def dense_causal_attention(q, k, v, sm_scale: float, sliding_window: int | None = None,
                           soft_cap_value: float | None = None):
    """q [t, h, d], k/v [t, k, d] of one sequence; plain softmax attention, causal."""
    t, num_heads, d = q.shape
    groups = num_heads // k.shape[1]
    qg = q.reshape(t, k.shape[1], groups, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    scores = soft_cap(scores, soft_cap_value)
    pos = jnp.arange(t)
    mask = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgts,skd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(t, num_heads, d).astype(q.dtype)


def embed_tokens(embed: jax.Array, token_ids: jax.Array, scale: bool = False) -> jax.Array:
    """Rows of the embedding table as float32. On the CPU a 16-bit table is gathered as its bits
    (XLA:CPU would convert the whole table to float32 every step to gather from it); elsewhere
    as itself (XLA:TPU makes the bits a copy of the whole table every step: Llama-3-8B's
    bfloat16 table, 1 GB of temporaries and 2 GB of HBM traffic a step; BUILD_NOTES.md
    "Compiled for the targets from the CPU", stop 44). The platform is the one the step is lowered for, so a compile for
    a TPU on a CPU host (experiments.aot) takes the TPU's gather. scale: times sqrt(hidden),
    rounded to the table's dtype first (as Gemma's checkpoints compute it)."""
    if isinstance(embed, QuantizedWeight):
        rows = embed.rows(token_ids)
    else:
        bits = lambda e, ids: from_bits(as_bits(e)[ids], e.dtype).astype(jnp.float32)  # noqa: E731
        rows = jax.lax.platform_dependent(embed, token_ids, cpu=bits,
                                          default=lambda e, ids: e[ids].astype(jnp.float32))
    if scale:
        rows = rows * jnp.asarray(math.sqrt(embed.shape[-1]), embed.dtype).astype(jnp.float32)
    return rows
