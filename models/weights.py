"""From checkpoint tensors to our parameter layout (see models/llama.py for the layout).

Checkpoints store linear weights as [out, in] matrices; our einsums want [in, out] with the head
axes split out. Both loaders (GGUF, safetensors) hand per-layer [out, in] numpy arrays to
`assemble_params`, which reshapes, casts and places them on the device.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

# Per-layer tensors every checkpoint must provide, by our names.
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_KEYS = ("bq", "bk", "bv")


def layer_from_matrices(config: ModelConfig, m: dict[str, np.ndarray], where: str) -> dict:
    """m holds HF-layout arrays: q/k/v/o/gate/up/down [out, in], norms [e], biases [out]."""
    e, d = config.hidden_size, config.head_dim
    h, k = config.num_heads, config.num_kv_heads

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in m:
            raise ValueError(f"{where}: missing tensor for {name}")
        arr = m[name]
        if arr.shape != shape:
            raise ValueError(f"{where}: tensor {name} has shape {arr.shape}, expected {shape}")
        return arr

    f = config.intermediate_size
    layer = {
        "attn_norm": take("attn_norm", (e,)),
        "wq": take("q", (h * d, e)).T.reshape(e, h, d),
        "wk": take("k", (k * d, e)).T.reshape(e, k, d),
        "wv": take("v", (k * d, e)).T.reshape(e, k, d),
        "wo": take("o", (e, h * d)).T.reshape(h, d, e),
        "mlp_norm": take("mlp_norm", (e,)),
    }
    if config.num_experts:
        n, fe = config.num_experts, config.expert_size
        layer["router"] = take("router", (n, e))
        # Per-expert [out, in] matrices stacked: gate rows then up rows, as the served layout.
        layer["experts_gate_up"] = np.concatenate([take("experts_gate", (n, fe, e)),
                                                   take("experts_up", (n, fe, e))], axis=1)
        layer["experts_down"] = take("experts_down", (n, e, fe))
    else:
        layer["w_gate"] = take("gate", (f, e)).T
        layer["w_up"] = take("up", (f, e)).T
        layer["w_down"] = take("down", (e, f)).T
    if config.qk_norm:
        layer["q_norm"] = take("q_norm", (d,))
        layer["k_norm"] = take("k_norm", (d,))
    if config.sandwich_norms:
        layer["post_attn_norm"] = take("post_attn_norm", (e,))
        layer["post_mlp_norm"] = take("post_mlp_norm", (e,))
    if config.attention_bias:
        layer["bq"] = take("q_bias", (h * d,)).reshape(h, d)
        layer["bk"] = take("k_bias", (k * d,)).reshape(k, d)
        layer["bv"] = take("v_bias", (k * d,)).reshape(k, d)
    return layer


def to_device(tree, dtype: str, *, host: bool = False):
    """Casts numpy leaves to `dtype` on the host (so only the final array crosses) and places them
    on the default device; host=True keeps them in host memory (numpy), for a caller that places
    each device's shard itself (models/sharding.py)."""
    import jax

    target = jnp.dtype(dtype)
    cast = lambda a: np.asarray(a, dtype=np.float32).astype(target)  # noqa: E731
    return jax.tree.map(cast if host else (lambda a: jnp.asarray(cast(a))), tree)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's conversion permutation of Q/K rows (GPT-J interleaved -> rotate-half).

    llama.cpp reorders each head's rows from [first half, second half] to interleaved pairs;
    rows are [n_head * head_dim] (weights may have a trailing input axis).
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's permutation (rotate-half -> interleaved); the inverse of `unpermute_rows`."""
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *rest).swapaxes(1, 2).reshape(w.shape)
