"""Ragged paged attention in pure jnp: the CPU production path and the kernels' reference.

Layout: q [T, Hq, D]; k_pages, v_pages [num_blocks, block_size, Hkv, D] (one layer); the query
heads of kv head h are h * G .. h * G + G - 1 with G = Hq // Hkv (GQA).

Walkthrough of one call:
  1. Cut the token axis into query blocks of `block_q` rows, each inside one sequence
     (metadata.py); gather q into [NB, block_q, Hkv, G, D].
  2. A while loop walks the block tables `pages_per_step` pages at a time, from the first page any
     block needs to the last page of the longest real context (a device value: padding blocks and
     short contexts cost nothing past that). Each step gathers only those pages of each block's
     sequence, [NB, pages_per_step * block_size, Hkv, D]; the whole context is never materialized.
  3. Online softmax in float32 (running max m, sum denom, accumulator acc), masked causally by
     position, by the sliding window, and to the block's real rows.
  4. out = acc / l, gathered back to [T, Hq, D]; padding tokens get zeros.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import metadata, validation


def choose_pages_per_step(block_size: int, max_blocks_per_seq: int) -> int:
    """About 128 kv positions per loop step: fewer, larger gathers and dots on the CPU."""
    return max(1, min(max_blocks_per_seq, 128 // block_size))


def ragged_paged_attention_xla(
    q,
    k_pages,
    v_pages,
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
):
    """Public entry of the jnp path: validates shapes (ValueError) and returns [T, Hq, D]."""
    shapes = validation.check_attention_inputs(
        q, k_pages, v_pages, seq_lens, block_tables, query_start_loc, num_seqs
    )
    validation.check_options(sm_scale, sliding_window, soft_cap, "xla")
    q, k_pages, v_pages, block_tables = map(jnp.asarray, (q, k_pages, v_pages, block_tables))
    T, Hq, D = q.shape
    Hkv, G, bs = shapes.num_kv_heads, shapes.group, shapes.block_size
    mb = shapes.max_blocks_per_seq
    bq = block_q or metadata.choose_block_q(T, shapes.max_num_seqs, G)
    pps = pages_per_step or choose_pages_per_step(bs, mb)
    kv_step = pps * bs

    md = metadata.compute_block_metadata(
        seq_lens, query_start_loc, num_seqs, num_tokens=T, block_q=bq
    )
    lo, hi = metadata.kv_page_range(md, block_size=bs, sliding_window=sliding_window)
    nb = md.q_lens.shape[0]
    real = md.q_lens > 0
    first_step = jnp.min(jnp.where(real, lo, mb)) // pps
    last_step = (jnp.max(jnp.where(real, hi, 0)) + pps - 1) // pps
    first_step = jnp.minimum(first_step, last_step)

    qb = metadata.gather_query_blocks(q, md, block_q=bq)  # [NB, bq, Hq, D]
    qb = qb.astype(jnp.float32).reshape(nb, bq, Hkv, G, D) * jnp.float32(sm_scale)
    tables = block_tables.astype(jnp.int32)[md.seq_ids]  # [NB, max_blocks_per_seq]
    rows = jnp.arange(bq, dtype=jnp.int32)
    row_pos = md.first_pos[:, None] + rows[None, :]  # [NB, bq]
    row_ok = rows[None, :] < md.q_lens[:, None]  # [NB, bq]

    def body(step, carry):
        m, denom, acc = carry
        page_idx = step * pps + jnp.arange(pps, dtype=jnp.int32)
        ids = tables[:, jnp.minimum(page_idx, mb - 1)]  # [NB, pps]
        k = k_pages[ids].reshape(nb, kv_step, Hkv, D).astype(jnp.float32)
        v = v_pages[ids].reshape(nb, kv_step, Hkv, D).astype(jnp.float32)
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
    _, denom, acc = jax.lax.fori_loop(first_step, last_step, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    out = out.reshape(nb, bq, Hq, D).astype(q.dtype)
    return metadata.scatter_query_blocks(out, md)
