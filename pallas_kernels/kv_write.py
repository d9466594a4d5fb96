"""Writing this step's K/V into the paged cache: one scatter per array, in place under donation.

Layout: k_cache, v_cache [L, num_blocks, block_size, Hkv, D] (all layers stacked) with `layer` a
Python int or a traced int32 scalar (a lax.scan over layers), or a single-layer
[num_blocks, block_size, Hkv, D] cache with layer=None (treated as L = 1, layer 0: a free
reshape). k, v [T, Hkv, D]; slot_mapping int32[T] with slot = block_id * block_size + offset
within one layer.

The cache is viewed as [L * num_blocks * block_size, Hkv, D] (a free row-major reshape) and
scattered at rows layer * num_blocks * block_size + slot with mode="drop": a slot outside
[0, num_blocks * block_size) writes nothing (it is sent past the end of the whole array, so it
can never land in another layer). That matters for negative slots, which plain indexing would
wrap to the end of the cache (slot -1 would silently overwrite the last slot of the last block, a
live block). The engine points padding tokens into the null block 0; dropping out-of-range slots
is the second line of defence. Call it inside a jit that donates the cache (or on a lax.scan
carry) so XLA updates the buffers in place (tests/pallas_kernels/test_kv_write.py checks that no
copy is made, for a static and for a traced layer).

Head-major pages (kv_layout "head_major", the xla path's: [L, num_blocks, Hkv, block_size, D])
are scattered per (token, kv head): the cache viewed as [L * num_blocks * Hkv * block_size, D],
token t's head h at row ((layer * num_blocks + block) * Hkv + h) * block_size + offset; a dropped
slot drops all its heads' rows.

A 16-bit float cache (bfloat16, float16) is scattered as its bits (`as_bits`, uint16): XLA:CPU
has no bfloat16 scatter and otherwise converts the whole stacked cache to float32 and back
around it, in every layer (about a second per layer for the default model). A cache may also BE
those bits (uint16; the runner keeps the xla path's 16-bit cache so, since XLA:CPU copies the
whole cache to turn a scattered uint16 array back into bfloat16): then k and v must be the 16-bit
float type whose bits it holds, and only their bits are stored.

An 8-bit cache (kv_quant.ScaledCache for K and for V) is written by quantizing each new token's
K and V per kv head and scattering the values and the scales (both integer arrays) at the same
rows, on the xla and pallas_gpu paths; on pallas_tpu the quantized values and scales are written
by the Mosaic kernels (tpu_kv_write.write_scaled_kv_tpu).
"""

import jax
import jax.numpy as jnp

from pallas_kernels import validation
from pallas_kernels.kv_quant import ScaledCache, check_scaled_pair, quantize_kv, scale_layout

_BITS = {2: jnp.uint16}
_BACKENDS = ("xla", "pallas_tpu", "pallas_gpu")


def as_bits(x):
    """A 16-bit float array as uint16 (a free bitcast); other dtypes unchanged."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize in _BITS:
        return jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize])
    return x


def from_bits(x, dtype):
    """Undoes as_bits for an array that was `dtype`."""
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def write_kv(k_cache, v_cache, k, v, slot_mapping, layer=None, *, backend="xla", interpret=False,
             kv_layout="token_major"):
    """Returns (k_cache, v_cache) with k[t], v[t] at slot_mapping[t] of `layer` (out-of-range dropped).

    backend: the attention backend that reads the cache ("xla", "pallas_tpu", "pallas_gpu"); the
    write takes the form that keeps the cache in the layout that backend reads: "pallas_tpu"
    writes with a Mosaic kernel of DMAs (tpu_kv_write.py: with the scatter, XLA copies both whole
    caches before every layer's attention kernel), the others scatter. interpret: run the TPU
    kernel in interpret mode (the CPU tests). kv_layout: the pages' layout (validation.KV_LAYOUTS;
    "head_major" is the xla path's).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"write_kv backend must be one of {sorted(_BACKENDS)}; got {backend!r}")
    validation.check_kv_layout(kv_layout, backend)
    scaled = isinstance(k_cache, ScaledCache) or isinstance(v_cache, ScaledCache)
    if scaled:  # an 8-bit cache (kv_quant.py): values and scales, both scattered here
        check_scaled_pair(k_cache, v_cache, scale_layout(backend))
        k, v, slot_mapping = map(jnp.asarray, (k, v, slot_mapping))
        cache = validation.check_cache(k_cache.values, v_cache.values, layer, eight_bit=True, kv_layout=kv_layout)
    else:
        k_cache, v_cache, k, v, slot_mapping = map(jnp.asarray, (k_cache, v_cache, k, v, slot_mapping))
        cache = validation.check_cache(k_cache, v_cache, layer, kv_layout=kv_layout)
    num_tokens = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    expected = (num_tokens, cache.num_kv_heads, cache.head_dim)
    if slot_mapping.ndim != 1 or k.shape != expected or v.shape != expected:
        raise ValueError(
            f"write_kv wants k, v [T, Hkv, D] and slot_mapping [T] matching k_cache"
            f"{tuple(k_cache.shape)}; got k{tuple(k.shape)}, v{tuple(v.shape)}, "
            f"slot_mapping{tuple(slot_mapping.shape)}"
        )
    if not scaled and k_cache.dtype == jnp.uint16:
        validation.check_bits_values(k, "k")
        validation.check_bits_values(v, "v", "v_cache")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be integer; got dtype {slot_mapping.dtype}")
    layer_slots = cache.num_blocks * cache.block_size
    total_slots = cache.num_layers * layer_slots
    # Out-of-range slots go past the end of the whole array so that mode="drop" discards them
    # instead of wrapping (negative) or spilling into the next layer (>= layer_slots).
    slots = slot_mapping.astype(jnp.int32)
    rows = validation.layer_index(layer) * layer_slots + slots
    in_range = (slots >= 0) & (slots < layer_slots)
    if backend == "pallas_tpu" and (scaled or k_cache.dtype != jnp.uint16):
        from pallas_kernels.tpu_kv_write import write_kv_tpu, write_scaled_kv_tpu

        layer_arr = jnp.reshape(jnp.asarray(validation.layer_index(layer), jnp.int32), (1,))
        if scaled:
            return write_scaled_kv_tpu(k_cache, v_cache, k, v, jnp.where(in_range, slots, -1), layer_arr,
                                       cache.stacked_shape, interpret=interpret)
        k_out, v_out = write_kv_tpu(validation.stacked_view(k_cache, cache), validation.stacked_view(v_cache, cache),
                                    k, v, jnp.where(in_range, slots, -1), layer_arr, interpret=interpret)
        return k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
    rows = jnp.where(in_range, rows, total_slots)
    if rows.shape[0] == 1:
        # One token: XLA rewrites a one-index scatter as a dynamic-update-slice, which it then
        # does not run in place next to the attention's gathers (the whole stacked cache is
        # copied per layer: seconds per step on the CPU). A second, dropped row keeps it a scatter.
        rows = jnp.concatenate([rows, jnp.full((1,), total_slots, jnp.int32)])
        k, v = (jnp.concatenate([x, jnp.zeros_like(x)]) for x in (k, v))
    flat_shape = (total_slots, cache.num_kv_heads, cache.head_dim)
    if kv_layout == "head_major":  # a row per (slot, head): [T, Hkv] rows of the [.., D] view
        rows, k, v, flat_shape = _head_rows(rows, k, v, cache, total_slots)
    if scaled:
        return tuple(_scatter_scaled(c, x, rows, flat_shape) for c, x in ((k_cache, k), (v_cache, v)))

    def scatter(c, x):
        x = x if c.dtype == jnp.uint16 else x.astype(c.dtype)
        bits = as_bits(c).reshape(flat_shape).at[rows].set(as_bits(x), mode="drop")
        return from_bits(bits.reshape(c.shape), c.dtype)

    return scatter(k_cache, k), scatter(v_cache, v)


def _head_rows(rows, k, v, cache: validation.CacheShapes, total_slots: int):
    """Head-major pages: the token rows (a dropped one is total_slots) -> rows of the cache viewed
    as [total_slots * Hkv, 1, D], one per (token, head), and k, v as [T * Hkv, 1, D] to match."""
    bs, hkv = cache.block_size, cache.num_kv_heads
    page, offset = rows // bs, rows % bs  # page counts layers' pages too: layer * num_blocks + block
    heads = jnp.arange(hkv, dtype=jnp.int32)
    head_rows = (page[:, None] * hkv + heads[None, :]) * bs + offset[:, None]  # [T, Hkv]
    head_rows = jnp.where((rows < total_slots)[:, None], head_rows, total_slots * hkv).reshape(-1)
    flat = lambda x: jnp.reshape(x, (-1, 1, x.shape[-1]))  # noqa: E731
    return head_rows, flat(k), flat(v), (total_slots * hkv, 1, cache.head_dim)


def _scatter_scaled(c: ScaledCache, x, rows, flat_shape) -> ScaledCache:
    """x [T, Hkv, D] quantized per token and kv head, values and scales scattered at `rows`."""
    values, scales = quantize_kv(x, c.kv_cache_dtype)
    new_values = c.values.reshape(flat_shape).at[rows].set(values, mode="drop")
    new_scales = c.scales.reshape(flat_shape[:-1]).at[rows].set(scales, mode="drop")
    return ScaledCache(new_values.reshape(c.values.shape), new_scales.reshape(c.scales.shape), c.kv_cache_dtype,
                       c.layout)
