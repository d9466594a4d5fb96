"""The paged KV cache: its layout, its size, and its allocation on the device.

Layout (the one place it is defined; the kernels' docstrings repeat it): one (k_cache, v_cache)
pair for all layers, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim] in the
model dtype; a layer's kernels index their layer in place (a Python int in the unrolled layer
loop, a traced index inside `lax.scan`), so no layer's cache is ever copied. Block 0 is the null
block: the scheduler never hands it out, and padding tokens' slots and padded block-table entries
point into it.

On the xla attention path a 16-bit cache (bfloat16, float16) is allocated as uint16, its bits
(`bits=True`): XLA:CPU cannot scatter bfloat16 and would otherwise convert (copy) the whole
cache around every layer's write (pallas_kernels/kv_write.py). The Pallas kernels take the float
cache.

An 8-bit cache (kv_cache_dtype "int8" or "fp8_e4m3", vLLM's names) is, for each of K and V, a
ScaledCache: the values [L, num_blocks, block_size, Hkv, D] in 8 bits and one bfloat16 scale per
token and kv head [L, num_blocks, block_size, Hkv] (pallas_kernels/kv_quant.py); its bytes per
token, scales counted, size the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from pallas_kernels.kv_quant import ScaledCache, allocate_scaled, bytes_per_value_and_scale


def kv_bytes_per_token(config: ModelConfig, dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K and V bytes of one token over all layers: the model dtype's, or an 8-bit cache's values
    plus their scales (one per token and kv head, pallas_kernels/kv_quant.py)."""
    per_head = bytes_per_value_and_scale(kv_cache_dtype, jnp.dtype(dtype).itemsize, config.head_dim)
    return 2 * config.num_layers * config.num_kv_heads * int(per_head)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: str, kv_cache_dtype: str = "auto") -> int:
    return block_size * kv_bytes_per_token(config, dtype, kv_cache_dtype)


def num_blocks_for(
    config: ModelConfig, *, block_size: int, dtype: str, num_kv_blocks: int | None,
    kv_cache_bytes: int, memory_fraction: float, max_useful_blocks: int, device=None,
    kv_cache_dtype: str = "auto",
) -> int:
    """The cache size in blocks (including the null block).

    Explicit `num_kv_blocks` wins. On an accelerator, `memory_fraction` of the memory still free
    (after the weights are placed); on the CPU, the `kv_cache_bytes` budget. Never more than the
    engine can use (max_num_seqs full-length requests, plus the null block).
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    device = device or jax.devices()[0]
    budget = kv_cache_bytes
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            budget = int((limit - stats.get("bytes_in_use", 0)) * memory_fraction)
    return max(2, min(budget // per_block, max_useful_blocks))


def scaled_sharding(sharding, kv_cache_dtype: str) -> ScaledCache:
    """The sharding of one ScaledCache whose values have `sharding` (a NamedSharding of the
    [L, blocks, block_size, Hkv, D] values): the scales [L, blocks, block_size, Hkv] split alike."""
    scales = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[:4]))
    return ScaledCache(sharding, scales, kv_cache_dtype)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: str, *,
                      bits: bool = False, sharding=None, kv_cache_dtype: str = "auto") -> tuple:
    """Zeroed (k_cache, v_cache); bits=True stores a 16-bit dtype as uint16 (same bytes).
    `sharding` (a NamedSharding splitting the KV-head axis, models/sharding.py): each device
    allocates only its own shard. kv_cache_dtype "int8" / "fp8_e4m3": each of K and V is a
    ScaledCache (values and scales, pallas_kernels/kv_quant.py; on a mesh both split on KV
    heads)."""
    shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if kv_cache_dtype != "auto":
        if sharding is None:
            return allocate_scaled(shape, kv_cache_dtype), allocate_scaled(shape, kv_cache_dtype)
        split = scaled_sharding(sharding, kv_cache_dtype)
        zeros = jax.jit(lambda: (allocate_scaled(shape, kv_cache_dtype), allocate_scaled(shape, kv_cache_dtype)),
                        out_shardings=(split, split))
        return zeros()
    if bits and jnp.dtype(dtype).itemsize == 2:
        dtype = jnp.uint16
    if sharding is None:
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    zeros = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                    out_shardings=(sharding, sharding))
    return zeros()
