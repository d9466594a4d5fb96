"""The KV cache's bytes per token, and the cache dtypes it knows: the one rule, without jax.

K and V of one token over all layers (or `num_layers` of them): 2 x layers x KV heads x
head_dim x the model dtype's size; an 8-bit cache ("int8", "fp8_e4m3", pallas_kernels/kv_quant.py)
stores head_dim bytes plus one bfloat16 scale per token and KV head (`SCALE_BYTES`).

Its readers: the engine's pool (engine/step/kv_cache.py kv_bytes_per_token, by dtype name),
`ModelConfig.kv_bytes_per_token`, EngineConfig's check of kv_cache_dtype and the capacity
calculator (experiments/lab/capacity_bytes.py). The 8-bit formats themselves are
pallas_kernels/kv_quant.py's (EIGHT_BIT_FORMATS; kernels import nothing of models, and a test
keeps the two lists equal). It imports nothing but the standard library, so
the calculator sizes a cache without importing jax.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # vLLM's names ("auto": the model's dtype)
SCALE_BYTES = 2  # an 8-bit cache's scale: one bfloat16 per token and kv head


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def bytes_per_value_and_scale(kv_cache_dtype: str, model_itemsize: int, head_dim: int) -> int:
    """Bytes of one token's K (or V) for one kv head: head_dim values, plus the scale."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return head_dim * model_itemsize
    return head_dim + SCALE_BYTES


def kv_bytes_per_token(config, itemsize: int, kv_cache_dtype: str = "auto", num_layers: int | None = None) -> int:
    """K and V bytes of one token over all layers (or `num_layers` of them), scales counted;
    `config`: a models.config.ModelConfig (its num_layers, num_kv_heads, head_dim; not imported
    here, which models/config.py imports); `itemsize`: the model dtype's bytes per value."""
    per_head = bytes_per_value_and_scale(kv_cache_dtype, itemsize, config.head_dim)
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * config.num_kv_heads * per_head
