"""The KV cache's bytes per token, and the cache dtypes it knows: the one rule, without jax.

K and V of one token over all layers (or `num_layers` of them): 2 x layers x KV heads x
head_dim x the model dtype's size; an 8-bit cache ("int8", "fp8_e4m3", pallas_kernels/kv_quant.py)
stores head_dim bytes plus one bfloat16 scale per token and KV head (`SCALE_BYTES`), or on a TPU
(the "page" scale layout, pallas_kernels/kv_quant.py) one float32 scale per token and KV head in a
row per page padded to a multiple of 128 lanes (`page_scale_width`): bytes per token then depend
on block_size and on how many devices split the kv heads (`shards`).

Its readers: the engine's pool (engine/step/kv_cache.py kv_bytes_per_token, by dtype name),
`ModelConfig.kv_bytes_per_token`, EngineConfig's check of kv_cache_dtype and the capacity
calculator (experiments/lab/capacity_bytes.py). The 8-bit formats themselves are
pallas_kernels/kv_quant.py's (EIGHT_BIT_FORMATS; kernels import nothing of models, and a test
keeps the two lists equal). It imports nothing but the standard library, so
the calculator sizes a cache without importing jax.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")  # vLLM's names ("auto": the model's dtype)
SCALE_BYTES = 2  # an 8-bit cache's scale: one bfloat16 per token and kv head (the "token" layout)
PAGE_SCALE_BYTES = 4  # the "page" layout's: one float32 (its bits) per token and kv head, rows padded
LANES = 128  # the page layout's rows are a multiple of this (pallas_kernels/kv_quant.py LANES)
SCALE_LAYOUTS = ("token", "page")


def scale_layout_for(platform: str) -> str:
    """The scale layout of an 8-bit cache on a platform ("cpu", "gpu", "tpu") or attention backend
    (pallas_kernels/kv_quant.scale_layout): "page" on the TPU, else "token"."""
    return "page" if platform in ("tpu", "pallas_tpu") else "token"


def page_scale_width(block_size: int, num_kv_heads: int, shards: int = 1) -> int:
    """Lanes of one page's scale row in the page layout (pallas_kernels/kv_quant.py's rule, kept
    equal by a test): per shard of the kv heads, block_size scales per head, padded to LANES."""
    if shards < 1 or num_kv_heads % shards:
        raise ValueError(f"page scales: {num_kv_heads} kv heads do not split into {shards} shards")
    local = num_kv_heads // shards * block_size
    return shards * (-(-local // LANES) * LANES)


def scale_bytes_per_token(num_kv_heads: int, scale_layout: str = "token", block_size: int = 16,
                          shards: int = 1) -> int:
    """One layer's scale bytes per token for K (or V), every kv head's."""
    if scale_layout == "token":
        return num_kv_heads * SCALE_BYTES
    if scale_layout != "page":
        raise ValueError(f"scale_layout must be one of {SCALE_LAYOUTS}; got {scale_layout!r}")
    row = PAGE_SCALE_BYTES * page_scale_width(block_size, num_kv_heads, shards)
    if row % block_size:
        raise ValueError(f"the page scale layout needs a block_size dividing {row} (a row's bytes); got {block_size}")
    return row // block_size


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def bytes_per_value_and_scale(kv_cache_dtype: str, model_itemsize: int, head_dim: int) -> int:
    """Bytes of one token's K (or V) for one kv head: head_dim values, plus the scale."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return head_dim * model_itemsize
    return head_dim + SCALE_BYTES


def kv_bytes_per_token(config, itemsize: int, kv_cache_dtype: str = "auto", num_layers: int | None = None, *,
                       scale_layout: str = "token", block_size: int = 16, shards: int = 1) -> int:
    """K and V bytes of one token over all layers (or `num_layers` of them), scales counted;
    `config`: a models.config.ModelConfig (its num_layers, num_kv_heads, head_dim; not imported
    here, which models/config.py imports); `itemsize`: the model dtype's bytes per value. An 8-bit
    cache's scales in `scale_layout` ("page": rows of block_size tokens, kv heads split over
    `shards` devices, the padding counted)."""
    layers = config.num_layers if num_layers is None else num_layers
    if kv_cache_dtype == "auto" or scale_layout == "token":
        per_head = bytes_per_value_and_scale(kv_cache_dtype, itemsize, config.head_dim)
        return 2 * layers * config.num_kv_heads * per_head
    check_kv_cache_dtype(kv_cache_dtype)
    values = config.num_kv_heads * config.head_dim
    return 2 * layers * (values + scale_bytes_per_token(config.num_kv_heads, scale_layout, block_size, shards))
