"""Writing this step's K/V into the paged cache: one scatter per array, in place under donation.

Layout: k_pages, v_pages [num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D]; slot_mapping int32[T]
with slot = block_id * block_size + offset. The pages are viewed as [num_blocks * block_size,
Hkv, D] (a free row-major reshape) and scattered with mode="drop": a slot outside
[0, num_blocks * block_size) writes nothing. That matters for negative slots, which plain indexing
would wrap to the end of the cache (slot -1 would silently overwrite the last slot of the last
block, a live block). The engine points padding tokens into the null block 0; dropping negative
slots is the second line of defence. Call it inside a jit that donates the cache so XLA updates
the buffers in place (tests/pallas_kernels/test_kv_write.py checks that no copy is made).
"""

import jax.numpy as jnp


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Returns (k_pages, v_pages) with k[t], v[t] stored at slot_mapping[t] (out-of-range dropped)."""
    k_pages, v_pages, k, v, slot_mapping = map(jnp.asarray, (k_pages, v_pages, k, v, slot_mapping))
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            "k_pages and v_pages must both be [num_blocks, block_size, Hkv, D]; got "
            f"k_pages{tuple(k_pages.shape)}, v_pages{tuple(v_pages.shape)}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    num_tokens = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    expected = (num_tokens, num_kv_heads, head_dim)
    if slot_mapping.ndim != 1 or k.shape != expected or v.shape != expected:
        raise ValueError(
            f"write_kv wants k, v [T, Hkv, D] and slot_mapping [T] matching k_pages"
            f"{tuple(k_pages.shape)}; got k{tuple(k.shape)}, v{tuple(v.shape)}, "
            f"slot_mapping{tuple(slot_mapping.shape)}"
        )
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be integer; got dtype {slot_mapping.dtype}")
    num_slots = num_blocks * block_size
    # Negative slots are mapped past the end so that mode="drop" discards them instead of wrapping.
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where(slots < 0, num_slots, slots)
    flat_shape = (num_slots, num_kv_heads, head_dim)
    k_flat = k_pages.reshape(flat_shape).at[slots].set(k.astype(k_pages.dtype), mode="drop")
    v_flat = v_pages.reshape(flat_shape).at[slots].set(v.astype(v_pages.dtype), mode="drop")
    return k_flat.reshape(k_pages.shape), v_flat.reshape(v_pages.shape)
