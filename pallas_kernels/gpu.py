"""Ragged paged attention as a Pallas Triton (GPU) kernel, with a split-K variant for decode.

Layout
  q_blocks  [NB, Hkv, R, D], R = block_q * Gp rows: row r of kv head h is query token r // Gp of
            the block and query head h * G + r % Gp, where Gp = G rounded up to a power of two
            (Triton tensors have power-of-two sizes; the extra heads are zeros, then dropped).
  k_cache, v_cache [L, num_blocks, block_size, Hkv, D] (all layers stacked; a single-layer
            4-D cache is L = 1), read in place as [L * num_blocks * block_size, Hkv, D] (a free
            row-major view). The layer is folded into the row index: row = (layer * num_blocks +
            page id) * block_size + offset, with layer an int32[1] input (a Python int or a
            traced scalar, e.g. the index of a lax.scan over layers), so no layer is sliced or
            copied out of the cache. Each loop step reads pages_per_step pages: page ids are
            gathered from the block table per kv row (a vector gather), then the K and V rows
            themselves with one gathered load each.
  out       [NB, Hkv, R, D]; split-K writes [NB, Hkv, splits, R, D] plus per-row max m and sum l
            [NB, Hkv, splits, R], merged in XLA.
  An 8-bit cache (kv_quant.ScaledCache): the values as above (int8, or uint8 holding e4m3 bits)
            and scale rows [L * num_blocks * block_size, Hkv] (uint16: bfloat16 bits), gathered
            at the same rows; the values are decoded to q's dtype (exact: int8 and e4m3 values are
            bfloat16 numbers) and the scales applied to the scores (K) and to P (V).
  Row chunks: a program takes C rows of its block's R (C = R unless Triton's tiles of R rows would
            not fit the shared memory of sm_80 and sm_90, `row_chunk` in gpu_tiles.py: C halves
            until they do), so a large block (block_q x Gp rows, float32) still compiles; the
            chunks of a block read the same pages.
  Metadata (global memory, from AttentionMetadata, prepared once per step by `prepare_gpu`):
  block tables [S, max_blocks_per_seq padded to pages_per_step], and per query block its
  sequence, real rows, kv position of row 0, page range [lo, hi). block_q, pages_per_step and the
  split count are static choices made there too.

Walkthrough (grid = (NB, Hkv * R / C, splits); one program per query block, kv head, row chunk
and kv split)
  1. Read the block's metadata; this split covers steps [start, end) of the block's page range.
  2. For each step: gather page ids and then K, V rows [K = pages_per_step * block_size, D];
     scores [R, K] = q . k^T * sm_scale in float32 (8-bit: times each kv row's K scale); soft
     cap; mask (causal by position, window, never past the block's last real position); online
     softmax carried in registers (m, l, acc); acc += (P, 8-bit: times each row's V scale) . v.
  3. Write acc / l (zero where nothing was seen); split-K also writes m and l, and XLA merges the
     splits: out = sum_s l_s e^(m_s - M) o_s / sum_s l_s e^(m_s - M).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import kv_quant, metadata, validation
from pallas_kernels.gpu_tiles import _MIN_ROWS, row_chunk_or_refuse

_TARGET_PROGRAMS = 256  # split-K fills roughly this many programs (about 2 per SM on an H100)
_MAX_SPLITS = 16


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _gpu_kernel(
    layer_ref,  # int32[1] layer of the stacked cache this call reads
    tables_ref,  # int32[S, max_blocks_per_seq (padded to a multiple of pages_per_step)]
    seq_ref,  # int32[NB] sequence of each query block
    q_len_ref,  # int32[NB] real query tokens of each block (0: padding block)
    pos_ref,  # int32[NB] kv position of each block's first query token
    lo_ref,  # int32[NB] first page the block reads
    hi_ref,  # int32[NB] one past the last page it reads
    q_ref,  # [C, D] this program's queries (block b, kv head h, row chunk c)
    k_ref,  # [L * num_blocks * block_size, Hkv, D] all layers' K rows
    v_ref,  # [L * num_blocks * block_size, Hkv, D] all layers' V rows
    *refs,  # 8-bit cache only: ks_ref, vs_ref uint16 [L * num_blocks * block_size, Hkv] their
    #         scales; then o_ref [C, D] output rows (of split s under split-K), and split-K only:
    #         m_ref f32[C], l_ref f32[C]
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group_pad: int,
    block_size: int,
    num_blocks: int,
    pages_per_step: int,
    num_splits: int,
    row_chunks: int,
    precision,
    kv_cache_dtype: str | None,  # None: a float cache; "int8" | "fp8_e4m3": an 8-bit one
):
    scaled = kv_cache_dtype is not None
    ks_ref, vs_ref, o_ref, *stat_refs = refs if scaled else (None, None, *refs)
    rows, head_dim = q_ref.shape  # C rows of the block's R = C * row_chunks
    b = pl.program_id(0)
    if row_chunks == 1:
        h, row0 = pl.program_id(1), 0
    else:
        h = pl.program_id(1) // row_chunks
        row0 = lax.rem(pl.program_id(1), row_chunks) * rows  # the chunk's first row in the block
    row_base = layer_ref[0] * (num_blocks * block_size)  # first K/V row of this layer
    seq, first_pos = seq_ref[b], pos_ref[b]
    kv_end = first_pos + q_len_ref[b]  # no row reads kv positions >= kv_end
    kv_step = pages_per_step * block_size
    lo_step = lo_ref[b] // pages_per_step
    hi_step = (hi_ref[b] + pages_per_step - 1) // pages_per_step
    if num_splits > 1:
        per_split = (hi_step - lo_step + num_splits - 1) // num_splits
        start = lo_step + pl.program_id(2) * per_split
        end = jnp.minimum(hi_step, start + per_split)
    else:
        start, end = lo_step, hi_step

    q = q_ref[...]  # [C, D]
    row_pos = first_pos + lax.div(row0 + jnp.arange(rows, dtype=jnp.int32), group_pad)  # [C]
    col = jnp.arange(kv_step, dtype=jnp.int32)  # [K]
    page_col = lax.div(col, block_size)  # [K] page of each kv row within the step
    offset = lax.rem(col, block_size)  # [K]

    def body(i, carry):
        m, denom, acc = carry
        page_ids = tables_ref[seq, i * pages_per_step + page_col]  # [K] vector gather
        kv_rows = row_base + page_ids * block_size + offset  # [K] rows of this layer's pages
        k = k_ref[kv_rows, h, :]  # [K, D]
        v = v_ref[kv_rows, h, :]  # [K, D]
        if scaled:  # decoded to q's dtype exactly; the scales [K] apply to scores and P
            k, v = (kv_quant.values_to_float32(x, kv_cache_dtype).astype(q.dtype) for x in (k, v))
            k_scale, v_scale = (kv_quant.scales_to_float32(r[kv_rows, h]) for r in (ks_ref, vs_ref))
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale  # [C, K]
        if scaled:
            s = s * k_scale[None, :]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = (i * kv_step + col)[None, :]  # [1, K]
        mask = (kv_pos <= row_pos[:, None]) & (kv_pos < kv_end)
        if sliding_window is not None:
            mask &= kv_pos > row_pos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [C]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        denom = alpha * denom + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            (p * v_scale[None, :] if scaled else p).astype(v.dtype),
            v,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return m_new, denom, alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    m, denom, acc = lax.fori_loop(start, end, body, init)
    o_ref[...] = (acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]).astype(o_ref.dtype)
    if num_splits > 1:
        m_ref, l_ref = stat_refs
        m_ref[...] = m
        l_ref[...] = denom


def _gpu_pallas_call(
    scalars, q_blocks, k_rows, v_rows, scale_rows=(), *, num_splits, chunk_rows, interpret, **static
):
    """pallas_call over grid (NB, Hkv * R / chunk_rows, num_splits); returns out or (out, m, l)
    for split-K.

    scalars = (layer, tables, seq, q_len, pos, lo, hi); k_rows, v_rows [L * nb * bs, Hkv, D];
    scale_rows: an 8-bit cache's (k, v) scales [L * nb * bs, Hkv], else ().
    """
    nb, num_kv_heads, rows, head_dim = q_blocks.shape
    chunks = rows // chunk_rows
    whole = pl.BlockSpec()  # the whole array: metadata and the paged cache
    if chunks == 1:
        index = lambda b, h, s: (b, h, 0)
    else:  # grid axis 1 is kv head * chunks + chunk
        index = lambda b, hc, s: (b, hc // chunks, hc % chunks)
    q_spec = pl.BlockSpec((None, None, chunk_rows, head_dim), lambda b, h, s: (*index(b, h, s), 0))
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype)
        out_specs = q_spec
    else:
        split_shape = (nb, num_kv_heads, num_splits, rows)

        def split_index(b, h, s):
            b, h, c = index(b, h, s)
            return b, h, s, c

        out_shape = (
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        )
        out_specs = (
            pl.BlockSpec(
                (None, None, None, chunk_rows, head_dim), lambda b, h, s: (*split_index(b, h, s), 0)
            ),
            pl.BlockSpec((None, None, None, chunk_rows), split_index),
            pl.BlockSpec((None, None, None, chunk_rows), split_index),
        )
    return pl.pallas_call(
        functools.partial(_gpu_kernel, num_splits=num_splits, row_chunks=chunks, **static),
        grid=(nb, num_kv_heads * chunks, num_splits),
        in_specs=[whole] * len(scalars) + [q_spec] + [whole] * (2 + len(scale_rows)),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*scalars, q_blocks, k_rows, v_rows, *scale_rows)


def _merge_splits(out, m, denom, dtype):
    """Merges split-K partials [NB, Hkv, splits, R, (D)] into [NB, Hkv, R, D]."""
    m_max = jnp.max(m, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    weight = jnp.where(denom > 0.0, denom * jnp.exp(m - m_max), 0.0)  # [NB, Hkv, splits, R]
    total = jnp.sum(weight, axis=2)
    merged = jnp.sum(weight[..., None] * out, axis=2)
    return (merged / jnp.where(total == 0.0, 1.0, total)[..., None]).astype(dtype)


def default_num_splits(num_query_blocks: int, num_kv_heads: int, max_steps: int) -> int:
    """Split the kv loop when the grid is too small to fill the GPU (decode-heavy batches)."""
    programs = num_query_blocks * num_kv_heads
    splits = min(_MAX_SPLITS, max_steps, max(1, _TARGET_PROGRAMS // programs))
    return 1 << (splits.bit_length() - 1)  # a power of two, <= splits


def _check_power_of_two(name: str, size: int, detail: str) -> None:
    if size != _next_power_of_2(size) or size < 16:
        raise ValueError(f"pallas_gpu needs a power-of-two {name} >= 16; got {detail}")


def prepare_gpu(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    shapes: validation.BatchShapes,
    *,
    sliding_window: int | None,
    block_q: int | None = None,
    pages_per_step: int | None = None,
    num_kv_splits: int | None = None,
) -> metadata.AttentionMetadata:
    """The Triton kernel's AttentionMetadata (inputs validated by prepare_attention_metadata).

    num_kv_splits=None picks split-K from the static grid size (default_num_splits); 1 turns it
    off.
    """
    _check_power_of_two("block_size", shapes.block_size, f"block_size={shapes.block_size}")
    if shapes.head_dim is not None:
        _check_power_of_two("head_dim", shapes.head_dim, f"head_dim={shapes.head_dim}")
    group_pad = _next_power_of_2(shapes.group)
    bq = block_q or metadata.choose_block_q(
        shapes.num_tokens, shapes.max_num_seqs, group_pad, row_multiple=_MIN_ROWS
    )
    bq = max(bq, _MIN_ROWS // group_pad)
    pps = pages_per_step or max(1, 64 // shapes.block_size)  # 64 kv rows per step
    nb = metadata.num_query_blocks(shapes.num_tokens, shapes.max_num_seqs, bq)
    max_steps = -(-shapes.max_blocks_per_seq // pps)
    splits = num_kv_splits or default_num_splits(nb, shapes.num_kv_heads, max_steps)
    return metadata.build_attention_metadata(
        seq_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        shapes=shapes,
        backend="pallas_gpu",
        block_q=bq,
        group_pad=group_pad,
        pages_per_step=pps,
        num_kv_splits=splits,
        sliding_window=sliding_window,
        # Whole steps only: extra columns point at the null block and are masked.
        layout_tables=lambda tables, blocks: metadata.pad_columns(tables, pps),
    )


def ragged_paged_attention_gpu(
    q,
    k_cache,
    v_cache,
    md: metadata.AttentionMetadata,
    *,
    layer=None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool = False,
):
    """One layer of the Triton kernel: validates shapes (ValueError), returns [T, Hq, D].

    k_cache, v_cache: [L, num_blocks, block_size, Hkv, D] with layer a Python int or a traced
    int32 scalar in [0, L), or [num_blocks, block_size, Hkv, D] with layer=None; or an 8-bit
    cache, a kv_quant.ScaledCache each (values of those shapes, scales without D).
    interpret=True runs the kernel with Pallas' generic interpreter on the CPU.
    """
    k_cache, v_cache, scales, kv_cache_dtype = kv_quant.split_cache(k_cache, v_cache)
    cache = validation.check_layer_inputs(q, k_cache, v_cache, md, layer, "pallas_gpu",
                                          eight_bit=kv_cache_dtype is not None)
    validation.check_options(sm_scale, sliding_window, soft_cap, "pallas_gpu")
    validation.check_window_fits(md, sliding_window)
    _check_power_of_two(
        "head_dim", cache.head_dim, f"q{tuple(q.shape)}, k_cache{tuple(k_cache.shape)}"
    )
    q = jnp.asarray(q)
    bs = md.block_size
    layer_arr = jnp.reshape(jnp.asarray(validation.layer_index(layer), jnp.int32), (1,))
    blocks = md.blocks
    scalars = (layer_arr, md.tables, blocks.seq_ids, blocks.q_lens, blocks.first_pos, md.lo, md.hi)
    q_blocks = metadata.pack_query_blocks(
        q, blocks, block_q=md.block_q, num_kv_heads=md.num_kv_heads, group_pad=md.group_pad
    )
    # All layers' K/V rows: a free row-major view of the stacked (or 4-D) cache.
    flat = (cache.num_layers * cache.num_blocks * bs, md.num_kv_heads, cache.head_dim)
    is_f32 = q.dtype == jnp.float32 or jnp.result_type(k_cache) == jnp.float32
    rows = md.block_q * md.group_pad
    # An 8-bit cache's tiles are converted to q's dtype before the dots (itemsize 1 never wins).
    itemsize = max(q.dtype.itemsize, jnp.dtype(jnp.result_type(k_cache)).itemsize)
    chunk = row_chunk_or_refuse(md, rows, cache.head_dim, itemsize, is_f32, q.dtype,
                                eight_bit=kv_cache_dtype is not None)
    result = _gpu_pallas_call(
        scalars,
        q_blocks,
        jnp.reshape(k_cache, flat),
        jnp.reshape(v_cache, flat),
        tuple(jnp.reshape(x, flat[:-1]) for x in scales),
        num_splits=md.num_kv_splits,
        chunk_rows=chunk,
        interpret=interpret,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        group_pad=md.group_pad,
        block_size=bs,
        num_blocks=cache.num_blocks,
        pages_per_step=md.pages_per_step,
        # float32 inputs: full-precision dots, not TF32.
        precision=lax.Precision.HIGHEST if is_f32 else None,
        kv_cache_dtype=kv_cache_dtype,
    )
    if md.num_kv_splits > 1:
        result = _merge_splits(*result, q.dtype)
    return metadata.unpack_query_blocks(result, blocks, block_q=md.block_q, group=md.group)
