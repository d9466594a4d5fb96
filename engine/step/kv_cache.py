"""The paged KV cache: its layout, its size, and its allocation on the device.

Layout (the one place it is defined; the kernels' docstrings repeat it): one (k_cache, v_cache)
pair for all layers, each [num_layers, num_blocks, block_size, num_kv_heads, head_dim] in the
model dtype, or on the xla attention path [num_layers, num_blocks, num_kv_heads, block_size,
head_dim]: head-major pages (`kv_layout`, pallas_kernels/validation.py kv_layout_for; a head's
page is one contiguous row the xla path gathers and multiplies without a transpose). A layer's kernels index their layer in place (a Python int in the unrolled layer
loop, a traced index inside `lax.scan`), so no layer's cache is ever copied. Block 0 is the null
block: the scheduler never hands it out, and padding tokens' slots and padded block-table entries
point into it.

On the xla attention path a 16-bit cache (bfloat16, float16) is allocated as uint16, its bits
(`bits=True`): XLA:CPU cannot scatter bfloat16 and would otherwise convert (copy) the whole
cache around every layer's write (pallas_kernels/kv_write.py). The Pallas kernels take the float
cache.

Sliding-window accounting (a model mixing sliding-window and global layers, Gemma 2/3; vLLM's
hybrid KV cache): two groups, each a (k_cache, v_cache) pair of its own, so the cache is
(k_global, v_global, k_sliding, v_sliding): the global layers' [num_global_layers, num_blocks, ...]
and the sliding layers' [num_sliding_layers, num_sliding_blocks, ...], each indexed by a layer's
rank among the layers of its kind and by its group's block table (the scheduler's two pools,
scheduler/sliding_window.py). The sliding pool is sized for what a running batch can hold
(`num_blocks_needed`), the global pool gets the rest of the budget (`pool_sizes`, which sizes the
pools of every case). One group (the pair) otherwise.

An 8-bit cache (kv_cache_dtype "int8" or "fp8_e4m3", vLLM's names) is, for each of K and V, a
ScaledCache: the values [L, num_blocks, block_size, Hkv, D] in 8 bits and one bfloat16 scale per
token and kv head [L, num_blocks, block_size, Hkv] (pallas_kernels/kv_quant.py); its bytes per
token, scales counted (models/kv_bytes.py), size the pool.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models import kv_bytes
from models.config import ModelConfig
from pallas_kernels.kv_quant import ScaledCache, allocate_scaled
from pallas_kernels.validation import CacheShapes, check_kv_layout
from scheduler.sliding_window import num_blocks_needed

if TYPE_CHECKING:
    from engine.config import EngineConfig


def every_layer_slides(config: ModelConfig, sliding) -> bool:
    """With sliding accounting (`sliding`: engine/core/builder.uses_sliding_groups, or the sliding
    pool's blocks), a model whose every layer slides (Mistral v0.1): its one cache group is the
    sliding pool (cache_groups' "sliding"), and the scheduler's global pool holds no memory. A
    config without layer kinds (a fake runner's None) counts as mixing them."""
    return bool(sliding) and not getattr(config, "mixes_windows", True)


def cache_groups(config: ModelConfig, num_blocks: int, num_sliding_blocks: int) -> tuple[int, int, str]:
    """How a runner lays out the scheduler's pools (RunnerShapes.num_blocks, num_sliding_blocks):
    (blocks of its first cache group, of its second (0: none), which tables its steps carry):
    "global" without sliding accounting; "both" for a model mixing windows (two groups); and for a
    model whose every layer slides "sliding": one group, over the sliding pool, read through the
    sliding tables (the scheduler's global pool then holds no memory: it keeps the prefix hashes and
    the tables' lengths)."""
    if not num_sliding_blocks:
        return num_blocks, 0, "global"
    if every_layer_slides(config, num_sliding_blocks):
        return num_sliding_blocks, 0, "sliding"
    return num_blocks, num_sliding_blocks, "both"


def pool_sizes(engine: EngineConfig, config: ModelConfig, budget: int, *, sliding: bool, dtype: str,
               max_model_len: int, tp: int = 1, scale_layout: str = "token") -> tuple[int, int]:
    """The scheduler's pools (num_blocks, num_sliding_blocks; 0: no sliding group), each with its
    null block, for engine.num_kv_blocks or a cache of `budget` bytes per device (each of `tp`
    devices holds 1 / tp of a block; an 8-bit cache's scales in `scale_layout`, the attention
    backend's). `config`: the cache's ModelConfig; `sliding`: the engine
    keeps sliding-window accounting (engine/core/builder.uses_sliding_groups). No pool holds more
    than the engine can use (max_num_seqs full-length requests, plus the null block).

    - Without sliding accounting: one pool, num_kv_blocks or what the budget holds.
    - A model mixing windows (two groups): the sliding pool gets what a running batch can hold
      (scheduler/sliding_window.num_blocks_needed), never more than the global pool (a request
      never holds more sliding blocks than global ones); the global pool gets num_kv_blocks, or the
      rest of the budget (both pools shrink alike when it cannot hold that many, `split_budget`).
    - Every layer slides (`every_layer_slides`): the cache, num_kv_blocks or what the budget
      holds, is the sliding pool; the global pool holds no memory (prefix hashes and table
      lengths), sized never to run short.
    """
    bs, num_kv_blocks = engine.block_size, engine.num_kv_blocks
    max_useful = engine.max_num_seqs * -(-max_model_len // bs) + 1
    sizing = dict(block_size=bs, dtype=dtype, kv_cache_dtype=engine.kv_cache_dtype, max_useful_blocks=max_useful,
                  tp=tp, scale_layout=scale_layout)
    if not sliding or every_layer_slides(config, sliding):
        cache = num_kv_blocks if num_kv_blocks is not None else blocks_in_budget(config, budget, **sizing)
        return (max_useful, cache) if sliding else (cache, 0)
    needed = num_blocks_needed(window=config.sliding_window, block_size=bs, max_num_seqs=engine.max_num_seqs,
                               max_num_batched_tokens=engine.max_num_batched_tokens, max_model_len=max_model_len)
    if num_kv_blocks is not None:
        return num_kv_blocks, max(2, min(num_kv_blocks, needed))
    return split_budget(config, budget, sliding_blocks_needed=needed, **sizing)


def kv_bytes_per_token(config: ModelConfig, dtype: str, kv_cache_dtype: str = "auto",
                       num_layers: int | None = None, *, scale_layout: str = "token", block_size: int = 16,
                       shards: int = 1) -> int:
    """K and V bytes of one token over all layers (or `num_layers` of them): the model dtype's
    (`dtype` by name), or an 8-bit cache's values plus their scales (in `scale_layout`, the
    backend's: pallas_kernels/kv_quant.scale_layout); the rule is models/kv_bytes.py's."""
    return kv_bytes.kv_bytes_per_token(config, jnp.dtype(dtype).itemsize, kv_cache_dtype, num_layers,
                                       scale_layout=scale_layout, block_size=block_size, shards=shards)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: str, kv_cache_dtype: str = "auto",
                    num_layers: int | None = None, *, scale_layout: str = "token", shards: int = 1) -> int:
    return block_size * kv_bytes_per_token(config, dtype, kv_cache_dtype, num_layers, scale_layout=scale_layout,
                                           block_size=block_size, shards=shards)


def cache_budget(device, kv_cache_bytes: int, memory_fraction: float) -> int:
    """The cache's bytes: the CPU budget, or memory_fraction of what an accelerator has free."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            return int((limit - stats.get("bytes_in_use", 0)) * memory_fraction)
    return kv_cache_bytes


def blocks_in_budget(config: ModelConfig, budget: int, *, block_size: int, dtype: str, kv_cache_dtype: str,
                     max_useful_blocks: int, tp: int = 1, scale_layout: str = "token") -> int:
    """One cache group's blocks in a byte budget (per device: each of `tp` devices holds 1 / tp of
    a block): at least 2 (the null block and one), at most max_useful_blocks."""
    per_block = bytes_per_block(config, block_size, dtype, kv_cache_dtype, scale_layout=scale_layout,
                                shards=tp) // tp
    return max(2, min(budget // per_block, max_useful_blocks))


def num_blocks_for(
    config: ModelConfig, *, block_size: int, dtype: str, num_kv_blocks: int | None,
    kv_cache_bytes: int, memory_fraction: float, max_useful_blocks: int, device=None,
    kv_cache_dtype: str = "auto", scale_layout: str = "token",
) -> int:
    """The cache size in blocks (including the null block) of one cache group.

    Explicit `num_kv_blocks` wins. On an accelerator, `memory_fraction` of the memory still free
    (after the weights are placed); on the CPU, the `kv_cache_bytes` budget. Never more than the
    engine can use (max_num_seqs full-length requests, plus the null block).
    """
    if num_kv_blocks is not None:
        return num_kv_blocks
    return blocks_in_budget(config, cache_budget(device, kv_cache_bytes, memory_fraction), block_size=block_size,
                            dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_useful_blocks=max_useful_blocks,
                            scale_layout=scale_layout)


def split_budget(config: ModelConfig, budget: int, *, block_size: int, dtype: str, kv_cache_dtype: str,
                 max_useful_blocks: int, sliding_blocks_needed: int, tp: int = 1,
                 scale_layout: str = "token") -> tuple[int, int]:
    """A two-group cache's pools in a byte budget (per device: each of `tp` devices holds 1 / tp of
    a block), the sliding one sized for `sliding_blocks_needed` (`pool_sizes`): (global blocks,
    sliding blocks)."""
    per_global, per_sliding = (
        bytes_per_block(config, block_size, dtype, kv_cache_dtype, config.num_layers_of_kind(kind),
                        scale_layout=scale_layout, shards=tp) // tp
        for kind in ("full_attention", "sliding_attention"))
    num_global = (budget - sliding_blocks_needed * per_sliding) // per_global
    if num_global < sliding_blocks_needed:
        num_global = budget // (per_global + per_sliding)
    num_global = max(2, min(num_global, max_useful_blocks))
    return num_global, max(2, min(sliding_blocks_needed, num_global))


def scaled_sharding(sharding, kv_cache_dtype: str, layout: str = "token") -> ScaledCache:
    """The sharding of one ScaledCache whose values have `sharding` (a NamedSharding of the
    [L, blocks, block_size, Hkv, D] values, or head-major [L, blocks, Hkv, block_size, D]): the
    scales split alike, the values' shape without D, on the heads, or (the page layout, token-major
    only) [L, blocks, W] on the row, one piece per shard."""
    spec = _values_spec(sharding)
    scale_spec = spec[:4] if layout == "token" else (*spec[:2], spec[3])
    return ScaledCache(sharding, NamedSharding(sharding.mesh, PartitionSpec(*scale_spec)), kv_cache_dtype, layout)


def kv_shards(sharding) -> int:
    """How many devices split the kv heads under `sharding` (the values' NamedSharding, split on
    the heads alone; 1 for none)."""
    if sharding is None:
        return 1
    axes = [a for entry in _values_spec(sharding) for a in (entry if isinstance(entry, tuple) else (entry,))]
    return int(math.prod(sharding.mesh.shape[a] for a in axes if a is not None))


def _values_spec(sharding) -> tuple:
    """The values' 5-D PartitionSpec as 5 entries (trailing None filled)."""
    spec = tuple(sharding.spec)
    return spec + (None,) * (5 - len(spec))


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: str, *,
                      bits: bool = False, sharding=None, kv_cache_dtype: str = "auto",
                      num_sliding_blocks: int = 0, scale_layout: str = "token",
                      kv_layout: str = "token_major") -> tuple:
    """Zeroed (k_cache, v_cache); bits=True stores a 16-bit dtype as uint16 (same bytes);
    kv_layout "head_major" (the xla path's, `kv_layout_for`): pages [Hkv, block_size, D].
    `sharding` (a NamedSharding splitting the KV-head axis, models/sharding.py): each device
    allocates only its own shard. kv_cache_dtype "int8" / "fp8_e4m3": each of K and V is a
    ScaledCache (values and scales in `scale_layout`, the attention backend's:
    pallas_kernels/kv_quant.py; on a mesh both split on KV heads).
    num_sliding_blocks > 0 (a model mixing windows): the two groups, (k_global, v_global,
    k_sliding, v_sliding), the global layers' over num_blocks and the sliding layers' over
    num_sliding_blocks."""
    if num_sliding_blocks:
        if not config.mixes_windows:
            raise ValueError(f"allocate_kv_cache: num_sliding_blocks={num_sliding_blocks} needs a model that "
                             f"mixes sliding-window and global layers; {config.name!r} does not")
        return sum((_allocate(config, config.num_layers_of_kind(kind), n, block_size, dtype, bits,
                              sharding, kv_cache_dtype, scale_layout, kv_layout)
                    for kind, n in (("full_attention", num_blocks), ("sliding_attention", num_sliding_blocks))),
                   ())
    return _allocate(config, config.num_layers, num_blocks, block_size, dtype, bits, sharding, kv_cache_dtype,
                     scale_layout, kv_layout)


def kv_shape(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int, kv_layout: str) -> tuple:
    """One cache array's shape: [L, blocks, block_size, Hkv, D], or head-major [L, blocks, Hkv, block_size, D]."""
    check_kv_layout(kv_layout)
    return CacheShapes(num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, kv_layout).stacked_shape


def _allocate(config: ModelConfig, num_layers: int, num_blocks: int, block_size: int, dtype: str, bits: bool,
              sharding, kv_cache_dtype: str, scale_layout: str, kv_layout: str) -> tuple:
    shape = kv_shape(config, num_layers, num_blocks, block_size, kv_layout)
    if kv_cache_dtype != "auto":
        scaled = lambda: allocate_scaled(shape, kv_cache_dtype, scale_layout, kv_shards(sharding))  # noqa: E731
        if sharding is None:
            return scaled(), scaled()
        split = scaled_sharding(sharding, kv_cache_dtype, scale_layout)
        zeros = jax.jit(lambda: (scaled(), scaled()), out_shardings=(split, split))
        return zeros()
    if bits and jnp.dtype(dtype).itemsize == 2:
        dtype = jnp.uint16
    if sharding is None:
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    zeros = jax.jit(lambda: (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                    out_shardings=(sharding, sharding))
    return zeros()
