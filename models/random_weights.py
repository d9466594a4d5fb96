"""Random weights of a named shape (`random:<name>`): performance work and tests, no downloads.

On an accelerator weights are drawn on the device, tensor by tensor, directly in the target dtype,
so an 8B-shaped model costs no host memory. On the CPU (or with host=True) they are drawn by
numpy: each distinct shape would otherwise compile its own small XLA program (0.3-1 s each on a
2-core CPU: 5 s for random:tiny before its first step). So the same seed gives different weights
on the CPU and on an accelerator; on one platform it always gives the same ones. Scales keep
activations O(1) through the layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig


def random_params(config: ModelConfig, *, seed: int = 0, dtype: str = "float32", host: bool = False) -> dict:
    """host=True: each tensor is fetched to host memory as soon as it is drawn (numpy), so a
    sharded engine never holds the whole model on one device."""
    e, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    h, k = config.num_heads, config.num_kv_heads
    target = jnp.dtype(dtype)
    counter = iter(range(1 << 30))
    # Under a trace (jax.eval_shape of this function: shapes without memory) the device path
    # keeps every tensor abstract; numpy would really draw them.
    tracing = isinstance(jnp.zeros(()), jax.core.Tracer)
    on_host = not tracing and (host or jax.default_backend() == "cpu")
    base = None if on_host else jax.random.key(seed)

    def draw(shape, scale, offset):
        index = next(counter)
        if on_host:  # one generator per tensor, keyed by (seed, index): order-independent
            rng = np.random.default_rng([seed, index])
            out = (offset + np.float32(scale) * rng.standard_normal(shape, np.float32)).astype(target)
            return out if host else jnp.asarray(out)
        noise = jax.random.normal(jax.random.fold_in(base, index), shape, jnp.float32)
        return (offset + scale * noise).astype(target)

    def normal(shape, fan_in):
        return draw(shape, 1.0 / np.sqrt(fan_in), 0.0)

    def norm_weight(size=e):  # the norm's scale near 1 (offset + weight)
        return draw((size,), 0.1, 1.0 - config.norm_offset)

    layers = []
    for _ in range(config.num_layers):
        layer = {
            "attn_norm": norm_weight(),
            "wq": normal((e, h, d), e),
            "wk": normal((e, k, d), e),
            "wv": normal((e, k, d), e),
            "wo": normal((h, d, e), h * d * config.num_layers),
            "mlp_norm": norm_weight(),
        }
        if config.num_experts:
            n, fe = config.num_experts, config.expert_size
            layer["router"] = normal((n, e), e)
            layer["experts_gate_up"] = normal((n, 2 * fe, e), e)
            layer["experts_down"] = normal((n, e, fe), fe * config.num_layers)
        else:
            layer["w_gate"] = normal((e, f), e)
            layer["w_up"] = normal((e, f), e)
            layer["w_down"] = normal((f, e), f * config.num_layers)
        if config.qk_norm:
            layer["q_norm"] = norm_weight(d)
            layer["k_norm"] = norm_weight(d)
        if config.sandwich_norms:
            layer["post_attn_norm"] = norm_weight()
            layer["post_mlp_norm"] = norm_weight()
        if config.attention_bias:
            layer["bq"] = normal((h, d), 16.0)
            layer["bk"] = normal((k, d), 16.0)
            layer["bv"] = normal((k, d), 16.0)
        layers.append(layer)
    params = {"embed": normal((config.vocab_size, e), 1.0), "layers": layers, "final_norm": norm_weight()}
    if not config.tie_word_embeddings:
        params["lm_head"] = normal((e, config.vocab_size), e)
    return params
