"""Ragged paged attention in pure jnp, the loop form: the kernels' reference and the page loop every
xla form runs (xla_forms.py picks the form per compiled bucket; xla_split.py is the split form).

Layout: q [T, Hq, D]; k_cache, v_cache [L, num_blocks, block_size, Hkv, D] (all layers stacked;
a single-layer [num_blocks, block_size, Hkv, D] cache is the L = 1 case), or with head-major
pages (kv_layout "head_major", the engine's on this path) [L, num_blocks, Hkv, block_size, D]; the
query heads of kv head h are h * G .. h * G + G - 1 with G = Hq // Hkv (GQA).

Once per step, `prepare_loop` (through prepare_attention_metadata) cuts the token axis into query
blocks of `block_q` rows, each inside one sequence (metadata.py), gives each block its page range,
and stores the block tables per query block, [NB, max_blocks_per_seq padded to pages_per_step],
plus the loop's first and last step.

Walkthrough of one layer's call:
  1. Gather q into [NB, block_q, Hkv, G, D]: float32 scaled by sm_scale, or, over a bfloat16
     cache of a bfloat16 model, left in bfloat16 with the scale applied to the scores.
  2. A while loop walks the block tables `pages_per_step` pages at a time, from the first page any
     block needs to the last page of the longest real context (a device value: padding blocks and
     short contexts cost nothing past that). Each step gathers only those pages of each block's
     sequence, [NB, pages_per_step * block_size, Hkv, D], straight from the stacked cache viewed
     as [L * num_blocks, block_size, Hkv, D] (a bitcast) at rows layer * num_blocks + page id:
     no per-layer slice or copy of the cache, and the whole context is never materialized.
     Head-major pages are gathered per (page, kv head), each a contiguous [block_size, D] row of
     the cache viewed as [L * num_blocks * Hkv, block_size * D], straight into [NB, Hkv,
     pages_per_step * block_size, D]: the products' operand order, with no transpose (the
     token-major page's K and V are transposed for the products, the step's largest attention
     ops on the CPU: BUILD_NOTES.md "CPU attention forms", head-major pages).
     A 16-bit cache is gathered as its bits (kv_write.as_bits; XLA:CPU would otherwise convert
     the whole cache to float32 to gather from it) and converted after the gather; a uint16
     cache (the bits of a 16-bit cache, kv_write.py) is read as q's dtype. Pages stay in
     bfloat16 when the model is bfloat16 (`compute_dtype`): Q . K and P . V take bfloat16 operands
     and sum in float32, P rounded to bfloat16 for its product, as the Pallas TPU and GPU kernels
     do; a float32 copy of every gathered page would be written and read again (BUILD_NOTES.md
     "CPU attention forms", stop 49: the fixed workload at 32 requests 1.10-1.11x faster in
     bfloat16). Other caches are converted to float32 (8-bit ones dequantized) after the gather.
  3. Online softmax in float32 (running max m, sum denom, accumulator acc), masked causally by
     position, by the sliding window, and to the block's real rows. Head-major pages compute in
     [NB, Hkv, bq, G, ..] order, P . V a product. Token-major pages: for one-token rows (block_q
     1: the decode rows) P . V is a multiply and a sum over the kv positions, not a product:
     XLA:CPU computes the product as V^T . P^T (the [D, kv] side has more rows than G) and writes
     every gathered V page transposed first, the step's largest attention op; the sum reads V as
     gathered (BUILD_NOTES.md "CPU attention forms", stop 41: the fixed workload at 32
     requests 1.27x faster in bfloat16, 1.09x in float32).
  4. out = acc / l, gathered back to [T, Hq, D]; padding tokens get zeros.
More than ROW_LOOP_MAX one-token rows run in groups of ROW_GROUP rows, a loop over the groups up
to the last real row (a device count), each group's page loop up to its own longest context: a
bucket's padded sequences (S = 64 for a step of 16 decodes and a prompt chunk) cost nothing, where
one vectorized loop over every row gathered pages for all 64 (BUILD_NOTES.md "CPU attention
forms", stop 42: that step's attention 1.7x faster). Up to ROW_LOOP_MAX rows run in one loop: a
32-row decode step as two groups of 16 was 3-6 % slower in bfloat16 (stop 50).
With md.rows_kernel "native" (an engine on the CPU, xla_forms.rows_kernel) the one-token rows of
float32, bfloat16 and 8-bit head-major caches run in cpu_native.py's kernel instead (`_native_rows`):
each row's pages read in place, the rows on every core; the page loop above is its reference.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_native, metadata, validation
from pallas_kernels.kv_quant import ScaledCache, dequantize_kv
from pallas_kernels.kv_write import as_bits, from_bits

ROW_GROUP = 16  # one-token rows per group of the row loop (_row_groups)
ROW_LOOP_MAX = 32  # the most one-token rows run in one page loop, without groups


def prepare_loop(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    shapes: validation.BatchShapes,
    *,
    sliding_window: int | None,
    block_q: int | None,
    pages_per_step: int,
) -> metadata.AttentionMetadata:
    """The loop form's AttentionMetadata (inputs already validated by prepare_attention_metadata;
    pages_per_step from xla_forms.choose_pages_per_step)."""
    bq = block_q or metadata.choose_block_q(shapes.num_tokens, shapes.max_num_seqs, shapes.group)
    pps = pages_per_step

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


class PagedKV:
    """One layer's K/V pages as rows of the whole stacked cache (free views, never a copy).
    An 8-bit cache (kv_quant.ScaledCache) brings its scale pages [L * num_blocks, bs, Hkv]
    ([L * num_blocks, Hkv, bs] head-major)."""

    def __init__(self, k_pages, v_pages, page_base, dtype, block_size, scales=None, kv_cache_dtype="auto",
                 kv_layout="token_major", q_dtype=None, num_blocks=None, native_pages=None):
        self.k_pages, self.v_pages = k_pages, v_pages  # [L * num_blocks, *page_shape] (bits)
        self.page_base = page_base  # int (static) or int32[]: layer * num_blocks
        self.num_blocks = num_blocks or k_pages.shape[0]  # pages per layer
        # What the native rows kernel reads (cpu_native.py): the pages as stored where not given.
        self.native_pages = native_pages or (k_pages, v_pages)
        self.dtype = dtype  # the dtype the pages hold (the float type for a uint16 cache)
        self.block_size = block_size
        self.scales = scales  # None, or (k, v) scale pages (bfloat16 bits) of an 8-bit cache
        self.kv_cache_dtype = kv_cache_dtype
        self.head_major = kv_layout == "head_major"
        self.num_kv_heads = k_pages.shape[1 if self.head_major else 2]
        # The products' operand dtype: bfloat16 pages read by a bfloat16 query stay bfloat16;
        # everything else (float32, float16, an 8-bit cache, a float32 query) is float32.
        bf16 = scales is None and jnp.dtype(dtype) == jnp.bfloat16 and jnp.dtype(q_dtype or dtype) == jnp.bfloat16
        self.compute_dtype = jnp.bfloat16 if bf16 else jnp.float32

    @classmethod
    def of(cls, k_cache, v_cache, cache: validation.CacheShapes, layer, q_dtype, block_size):
        page_shape = (cache.num_layers * cache.num_blocks, *cache.page_shape)
        if isinstance(k_cache, ScaledCache):
            pages = lambda c: (jnp.reshape(c.values, page_shape), jnp.reshape(c.scales, page_shape[:-1]))  # noqa: E731
            (k_pages, k_scales), (v_pages, v_scales) = pages(k_cache), pages(v_cache)
            return cls(k_pages, v_pages, validation.layer_index(layer) * cache.num_blocks, k_pages.dtype,
                       block_size, (k_scales, v_scales), k_cache.kv_cache_dtype, kv_layout=cache.kv_layout,
                       q_dtype=q_dtype, num_blocks=cache.num_blocks)
        dtype = jnp.asarray(k_cache).dtype
        if dtype == jnp.uint16:
            dtype = q_dtype
        # The native kernel reads a bfloat16 cache as it is (its bits would be a copy of the cache).
        return cls(jnp.reshape(as_bits(k_cache), page_shape), jnp.reshape(as_bits(v_cache), page_shape),
                   validation.layer_index(layer) * cache.num_blocks, dtype, block_size, kv_layout=cache.kv_layout,
                   q_dtype=q_dtype, num_blocks=cache.num_blocks,
                   native_pages=(jnp.reshape(k_cache, page_shape), jnp.reshape(v_cache, page_shape)))

    def query(self, qb, sm_scale):
        """A query block in the products' operand dtype and the scale its scores still take: float32
        scaled by sm_scale (score scale None), or bfloat16 as given (q's dtype is the cache's) with
        sm_scale applied to the float32 scores, as the Pallas kernels do."""
        if self.compute_dtype == jnp.float32:
            return qb.astype(jnp.float32) * jnp.float32(sm_scale), None
        return qb.astype(self.compute_dtype), sm_scale

    def gather(self, ids):
        """ids int32[..., P] page ids within the layer -> K, V [..., P * bs, Hkv, D] in
        `compute_dtype` (head-major pages: [..., Hkv, P * bs, D])."""
        ids = ids + self.page_base
        if self.head_major:  # row (page, head) of the [pages * Hkv, bs * D] view, heads before pages
            heads = jnp.arange(self.num_kv_heads, dtype=jnp.int32)[:, None]
            ids = ids[..., None, :] * self.num_kv_heads + heads  # [..., Hkv, P]

        def read(pages, scales):
            if self.head_major:
                pages = jnp.reshape(pages, (-1, *pages.shape[2:]))  # [pages * Hkv, bs(, D)]
                scales = None if scales is None else jnp.reshape(scales, (-1, scales.shape[-1]))
            if scales is None:
                x = from_bits(take_pages(pages, ids), self.dtype).astype(self.compute_dtype)
            else:  # dequantized after the gather: only the pages read are converted
                x = dequantize_kv(take_pages(pages, ids), take_pages(scales, ids), self.kv_cache_dtype)
            if self.head_major:  # [..., Hkv, P, bs, D]
                return x.reshape(*ids.shape[:-1], ids.shape[-1] * self.block_size, x.shape[-1])
            return x.reshape(*ids.shape[:-1], ids.shape[-1] * self.block_size, *x.shape[-2:])

        k_scales, v_scales = self.scales or (None, None)
        return read(self.k_pages, k_scales), read(self.v_pages, v_scales)


def take_pages(pages, ids):
    """pages [P, ...] at ids int32[...] -> [..., *pages.shape[1:]], each page gathered as one row of
    the pool's 2-D view [P, page elements] (a free reshape): XLA:CPU copies whole rows 1.2-3x
    faster than the same pages as [1, bs, Hkv, D] slices of the 4-D pool (BUILD_NOTES.md "CPU
    attention forms")."""
    rows = jnp.reshape(pages, (pages.shape[0], -1))[ids]
    return jnp.reshape(rows, (*ids.shape, *pages.shape[1:]))


def page_loop(qb, tables, first_step, last_step, row_pos, row_ok, kv: PagedKV, *, pages_per_step,
              sliding_window, soft_cap, score_scale=None):
    """Online-softmax attention of query blocks over their pages, pages_per_step pages a step.

    qb [NB, bq, Hkv, G, D] in kv.compute_dtype (PagedKV.query: float32 already scaled by sm_scale,
    or bfloat16 with score_scale, sm_scale, applied to the scores); tables int32[NB, columns] (a
    multiple of pages_per_step); loop steps [first_step, last_step) (device values); row_pos,
    row_ok [NB, bq]: each row's kv position and whether it is real. Returns float32
    [NB, bq, Hkv, G, D], 0 for rows that see nothing.
    """
    nb, bq, hkv, g, d = qb.shape
    kv_step = pages_per_step * kv.block_size
    head = kv.head_major  # head-major pages: [NB, Hkv, bq, G, ..] order, both products plain
    qx = jnp.swapaxes(qb, 1, 2) if head else qb

    def body(step, carry):
        m, denom, acc = carry
        ids = jax.lax.dynamic_slice_in_dim(tables, step * pages_per_step, pages_per_step, axis=1)
        k, v = kv.gather(ids)  # [NB, kv_step, Hkv, D] (head-major: [NB, Hkv, kv_step, D])
        s = jnp.einsum("nhqgd,nhkd->nhqgk" if head else "nqhgd,nkhd->nqhgk", qx, k,
                       preferred_element_type=jnp.float32)
        if score_scale is not None:
            s = s * jnp.float32(score_scale)
        if soft_cap is not None:
            s = jnp.float32(soft_cap) * jnp.tanh(s / jnp.float32(soft_cap))
        kv_pos = step * kv_step + jnp.arange(kv_step, dtype=jnp.int32)
        ok = (kv_pos[None, None, :] <= row_pos[:, :, None]) & row_ok[:, :, None]
        if sliding_window is not None:
            ok &= kv_pos[None, None, :] > row_pos[:, :, None] - sliding_window
        s = jnp.where(ok[:, None, :, None, :] if head else ok[:, :, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        denom = alpha * denom + jnp.sum(p, axis=-1)
        pk = p.astype(v.dtype)  # P in the pages' dtype for its product (a no-op in float32)
        if head:
            pv = jnp.einsum("nhqgk,nhkd->nhqgd", pk, v, preferred_element_type=jnp.float32)
        elif bq == 1:  # one-token rows: P . V as a multiply and a sum over the kv positions
            pv = jnp.sum(pk.astype(jnp.float32)[..., None] * jnp.swapaxes(v, 1, 2)[:, None, :, None, :, :], axis=-2)
        else:
            pv = jnp.einsum("nqhgk,nkhd->nqhgd", pk, v, preferred_element_type=jnp.float32)
        acc = alpha[..., None] * acc + pv
        return m_new, denom, acc

    lead = qx.shape[:4]  # (NB, bq, Hkv, G), or (NB, Hkv, bq, G) head-major
    init = (jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32), jnp.zeros((*lead, d), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(first_step, last_step, body, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    return jnp.swapaxes(out, 1, 2) if head else out


def _row_groups(qb, md: metadata.AttentionMetadata, row_pos, row_ok, kv: PagedKV, *, pages_per_step,
                **options):
    """One-token rows in groups of ROW_GROUP, a fori_loop over the groups up to the last real
    row's (a device count), each group's page loop up to its own longest context: a bucket's
    padded rows (S = 64 for a step of 16 decodes) cost nothing. [NB, 1, Hkv, G, D]."""
    nb = qb.shape[0]
    pad = -nb % ROW_GROUP
    if pad:  # rows past nb are not real (q_lens 0): they are never read back
        qb, row_pos, row_ok = (jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1)) for x in (qb, row_pos, row_ok))
    tables = jnp.pad(md.tables, ((0, pad), (0, 0)))
    hi = (jnp.pad(md.blocks.kv_lens, (0, pad)) + kv.block_size - 1) // kv.block_size  # pages each row reads
    rows = jnp.arange(nb + pad, dtype=jnp.int32)
    real = row_ok[:, 0]
    num_groups = (jnp.max(jnp.where(real, rows + 1, 0)) + ROW_GROUP - 1) // ROW_GROUP

    def body(i, out):
        group = lambda x: jax.lax.dynamic_slice_in_dim(x, i * ROW_GROUP, ROW_GROUP, axis=0)  # noqa: E731
        last = (jnp.max(jnp.where(group(real), group(hi), 0)) + pages_per_step - 1) // pages_per_step
        o = page_loop(group(qb), group(tables), jnp.minimum(md.first_step, last), last, group(row_pos),
                      group(row_ok), kv, pages_per_step=pages_per_step, **options)
        return jax.lax.dynamic_update_slice_in_dim(out, o, i * ROW_GROUP, axis=0)

    out = jax.lax.fori_loop(0, num_groups, body, jnp.zeros(qb.shape, jnp.float32))
    return out[:nb]


def _native_rows(qb, md: metadata.AttentionMetadata, row_pos, row_ok, kv: PagedKV, *, sliding_window, soft_cap,
                 score_scale):
    """One-token rows through the native CPU kernel (cpu_native.py), each over the kv positions
    it sees ([end - window, end) with a sliding window), its pages read in place. [NB, 1, Hkv, G,
    D] float32, as page_loop returns."""
    end = jnp.where(row_ok[:, 0], row_pos[:, 0] + 1, 0)
    start = jnp.zeros_like(end) if sliding_window is None else jnp.maximum(end - sliding_window, 0)
    out = cpu_native.decode_rows(qb[:, 0], *kv.native_pages, md.tables, start, end, kv.page_base,
                                 scale=1.0 if score_scale is None else score_scale, soft_cap=soft_cap,
                                 num_blocks=kv.num_blocks, scales=kv.scales, kv_cache_dtype=kv.kv_cache_dtype)
    return out[:, None]


def blocks_attention(q, kv: PagedKV, md: metadata.AttentionMetadata, *, sm_scale, sliding_window,
                     soft_cap):
    """Every query block of md in one vectorized page loop; [T, Hq, D] in q.dtype, zeros for
    tokens outside md.blocks (padding, and in the split form the chunks' tokens)."""
    T, Hq, D = q.shape
    Hkv, G, bq, nb = md.num_kv_heads, md.group, md.block_q, md.num_query_blocks
    blocks = md.blocks
    qb = metadata.gather_query_blocks(q, blocks, block_q=bq)  # [NB, bq, Hq, D]
    qb, score_scale = kv.query(qb.reshape(nb, bq, Hkv, G, D), sm_scale)
    rows = jnp.arange(bq, dtype=jnp.int32)
    row_pos = blocks.first_pos[:, None] + rows[None, :]  # [NB, bq]
    row_ok = rows[None, :] < blocks.q_lens[:, None]  # [NB, bq]
    options = dict(pages_per_step=md.pages_per_step, sliding_window=sliding_window, soft_cap=soft_cap,
                   score_scale=score_scale)
    if bq == 1 and md.rows_kernel == "native" and cpu_native.reads(kv.dtype, kv.kv_cache_dtype, kv.head_major):
        out = _native_rows(qb, md, row_pos, row_ok, kv, sliding_window=sliding_window, soft_cap=soft_cap,
                           score_scale=score_scale)
    elif bq == 1 and nb > ROW_LOOP_MAX:
        out = _row_groups(qb, md, row_pos, row_ok, kv, **options)
    else:
        out = page_loop(qb, md.tables, md.first_step, md.last_step, row_pos, row_ok, kv, **options)
    out = out.reshape(nb, bq, Hq, D).astype(q.dtype)
    return metadata.scatter_query_blocks(out, blocks)
