"""Ragged paged attention in pure jnp: the CPU production path and the kernels' reference.

Layout: q [T, Hq, D]; k_cache, v_cache [L, num_blocks, block_size, Hkv, D] (all layers stacked;
a single-layer [num_blocks, block_size, Hkv, D] cache is the L = 1 case); the query heads of kv
head h are h * G .. h * G + G - 1 with G = Hq // Hkv (GQA).

Once per step, `prepare_xla` (through prepare_attention_metadata) cuts the token axis into query
blocks of `block_q` rows, each inside one sequence (metadata.py), gives each block its page range,
and stores the block tables per query block, [NB, max_blocks_per_seq padded to pages_per_step],
plus the loop's first and last step.

Walkthrough of one layer's call:
  1. Gather q into [NB, block_q, Hkv, G, D] (scaled by sm_scale, float32).
  2. A while loop walks the block tables `pages_per_step` pages at a time, from the first page any
     block needs to the last page of the longest real context (a device value: padding blocks and
     short contexts cost nothing past that). Each step gathers only those pages of each block's
     sequence, [NB, pages_per_step * block_size, Hkv, D], straight from the stacked cache viewed
     as [L * num_blocks, block_size, Hkv, D] (a bitcast) at rows layer * num_blocks + page id:
     no per-layer slice or copy of the cache, and the whole context is never materialized.
     A 16-bit cache is gathered as its bits (kv_write.as_bits; XLA:CPU would otherwise convert
     the whole cache to float32 to gather from it) and converted after the gather; a uint16
     cache (the bits of a 16-bit cache, kv_write.py) is read as q's dtype.
  3. Online softmax in float32 (running max m, sum denom, accumulator acc), masked causally by
     position, by the sliding window, and to the block's real rows.
  4. out = acc / l, gathered back to [T, Hq, D]; padding tokens get zeros.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import metadata, validation
from pallas_kernels.kv_write import as_bits, from_bits


def choose_pages_per_step(block_size: int, max_blocks_per_seq: int) -> int:
    """About 128 kv positions per loop step: fewer, larger gathers and dots on the CPU."""
    return max(1, min(max_blocks_per_seq, 128 // block_size))


def prepare_xla(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    shapes: validation.BatchShapes,
    *,
    sliding_window: int | None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
) -> metadata.AttentionMetadata:
    """The xla path's AttentionMetadata (inputs already validated by prepare_attention_metadata)."""
    bq = block_q or metadata.choose_block_q(shapes.num_tokens, shapes.max_num_seqs, shapes.group)
    pps = pages_per_step or choose_pages_per_step(shapes.block_size, shapes.max_blocks_per_seq)

    def layout_tables(tables, blocks):  # int32[NB, mb padded to pps]: one row per query block
        return metadata.pad_columns(tables, pps)[blocks.seq_ids]

    return metadata.build_attention_metadata(
        seq_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        shapes=shapes,
        backend="xla",
        block_q=bq,
        group_pad=shapes.group,
        pages_per_step=pps,
        num_kv_splits=1,
        sliding_window=sliding_window,
        layout_tables=layout_tables,
    )


def ragged_paged_attention_xla(
    q,
    k_cache,
    v_cache,
    md: metadata.AttentionMetadata,
    *,
    layer=None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """One layer of the jnp path: validates shapes (ValueError) and returns [T, Hq, D] in q.dtype.

    k_cache, v_cache: [L, num_blocks, block_size, Hkv, D] with layer a Python int or a traced
    int32 scalar in [0, L), or [num_blocks, block_size, Hkv, D] with layer=None.
    """
    cache = validation.check_layer_inputs(q, k_cache, v_cache, md, layer, "xla")
    validation.check_options(sm_scale, sliding_window, soft_cap, "xla")
    validation.check_window_fits(md, sliding_window)
    q = jnp.asarray(q)
    T, Hq, D = q.shape
    Hkv, G, bq, pps = md.num_kv_heads, md.group, md.block_q, md.pages_per_step
    nb, num_blocks = md.num_query_blocks, cache.num_blocks
    kv_step = pps * md.block_size
    blocks = md.blocks
    # All layers' pages as rows of one array: free views, never a copy of the cache.
    page_shape = (cache.num_layers * num_blocks, md.block_size, Hkv, D)
    k_pages = jnp.reshape(as_bits(k_cache), page_shape)
    v_pages = jnp.reshape(as_bits(v_cache), page_shape)
    cache_dtype = jnp.asarray(k_cache).dtype
    if cache_dtype == jnp.uint16:
        validation.check_bits_values(q, "q")
        cache_dtype = q.dtype
    page_base = validation.layer_index(layer) * num_blocks  # int (static) or int32[] (traced)

    qb = metadata.gather_query_blocks(q, blocks, block_q=bq)  # [NB, bq, Hq, D]
    qb = qb.astype(jnp.float32).reshape(nb, bq, Hkv, G, D) * jnp.float32(sm_scale)
    rows = jnp.arange(bq, dtype=jnp.int32)
    row_pos = blocks.first_pos[:, None] + rows[None, :]  # [NB, bq]
    row_ok = rows[None, :] < blocks.q_lens[:, None]  # [NB, bq]

    def body(step, carry):
        m, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(md.tables, step * pps, pps, axis=1)  # [NB, pps]
        ids = ids + page_base
        k = from_bits(k_pages[ids], cache_dtype).reshape(nb, kv_step, Hkv, D).astype(jnp.float32)
        v = from_bits(v_pages[ids], cache_dtype).reshape(nb, kv_step, Hkv, D).astype(jnp.float32)
        s = jnp.einsum("nqhgd,nkhd->nqhgk", qb, k)  # [NB, bq, Hkv, G, kv_step]
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        kv_pos = step * kv_step + jnp.arange(kv_step, dtype=jnp.int32)
        ok = (kv_pos[None, None, :] <= row_pos[:, :, None]) & row_ok[:, :, None]
        if sliding_window is not None:
            ok &= kv_pos[None, None, :] > row_pos[:, :, None] - sliding_window
        s = jnp.where(ok[:, :, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        denom = alpha * denom + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("nqhgk,nkhd->nqhgd", p, v)
        return m_new, denom, acc

    init = (
        jnp.full((nb, bq, Hkv, G), -jnp.inf, jnp.float32),
        jnp.zeros((nb, bq, Hkv, G), jnp.float32),
        jnp.zeros((nb, bq, Hkv, G, D), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(md.first_step, md.last_step, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    out = out.reshape(nb, bq, Hq, D).astype(q.dtype)
    return metadata.scatter_query_blocks(out, blocks)
