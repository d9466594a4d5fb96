"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Layout
  q_blocks  [NB, Hkv, R, D] VMEM blocks, R = block_q * G rows: row r of kv head h is query token
            r // G of the block, query head h * G + r % G (metadata.pack_query_blocks).
  k_cache, v_cache [L, num_blocks, block_size, Hkv, D] (all layers stacked; a single-layer 4-D
            cache is passed as L = 1, a free reshape) stay in HBM (memory space pl.ANY); the
            kernel copies the pages it needs, one whole page (all kv heads) per async copy from
            the HBM ref indexed in place at [layer, page]: no layer is sliced or copied out.
  out       [NB, Hkv, R, D], gathered back to [T, Hq, D] in XLA.
  An 8-bit cache (kv_quant.ScaledCache): the values as above (int8, or uint8 holding e4m3 bits)
            plus scale arrays in the page layout (kv_quant.py "Scale layouts"), [L, num_blocks, W]
            uint32 (float32 bits), also in HBM: one lane-dense row per page, copied beside the
            page's values (one DMA), and a kv head's K and V are dequantized in VMEM before the
            two dots.
  Scalar prefetch (SMEM): the layer (int32[1]: a Python int or a traced scalar, e.g. the index
  of a lax.scan over layers), then from AttentionMetadata (prepared once per step by
  `prepare_tpu`): block tables flattened to [S * max_blocks_per_seq], and per query block its
  sequence, real rows, kv position of row 0, and the page range [lo, hi) it reads.

Walkthrough (grid = (NB,), one query block per step; "parallel": steps are independent)
  1. Zero the online-softmax scratch (m = -inf, l = 0, acc = 0), one slice per kv head.
  2. Start the async copy of page lo of this block's sequence into slot 0 of the double buffer.
  3. For page j in [lo, hi): start copying page j + 1 into the other slot, wait for page j, and
     for each kv head: scores [R, block_size] = q . k^T * sm_scale (float32), soft cap, mask
     (causal by position, window, never past the block's last real position), update m, l, acc.
     With an 8-bit cache, K and V of the head are first decoded to float32 (kv_quant
     values_to_float32), times their per-token scale (the head's block_size lanes of the page's
     scale row, turned into a [block_size, 1] column by a masked lane sum), in q's dtype.
  4. Write acc / l (zero where a row saw nothing: padding blocks run no page at all).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant, metadata, validation

_ROW_MULTIPLE = 8  # sublanes of a TPU vreg: R = block_q * G is padded-free when a multiple of 8
# Mosaic's default scoped VMEM limit on v5e (v6e: 32 MiB): kernels estimated under it compile with
# the default; larger ones ask for their estimate plus a quarter (at least v6e's 32 MiB) up to
# _VMEM_CAP, the VMEM of the smallest current TPU core (v7x: 64 MiB; v5e and v6e have 128 MiB,
# v5p 95 MiB).
_DEFAULT_SCOPED_VMEM = 16 << 20
_VMEM_CAP = 64 << 20


def _tpu_kernel(
    # Scalar prefetch, SMEM.
    layer_ref,  # int32[1] layer of the stacked cache this call reads
    tables_ref,  # int32[S * max_blocks_per_seq] block tables, row-major
    seq_ref,  # int32[NB] sequence of each query block
    q_len_ref,  # int32[NB] real query tokens of each block (0: padding block)
    pos_ref,  # int32[NB] kv position of each block's first query token
    lo_ref,  # int32[NB] first page (index into the block table row) the block reads
    hi_ref,  # int32[NB] one past the last page it reads
    # Inputs.
    q_ref,  # VMEM [Hkv, R, D] this block's queries
    *refs,  # the inputs, output and scratch below (an 8-bit cache adds its scale arrays)
    #   k_hbm     HBM [L, num_blocks, block_size, Hkv, D] all layers' K pages
    #   v_hbm     HBM [L, num_blocks, block_size, Hkv, D] all layers' V pages
    #   (8-bit)   ks_hbm, vs_hbm HBM uint32 [L, num_blocks, W] their scale rows (page layout)
    #   o_ref     VMEM [Hkv, R, D] (output)
    #   k_buf     VMEM [2, block_size, Hkv, D] double-buffered K page ([2, 1, block_size, D]: heads_major)
    #   v_buf     VMEM [2, block_size, Hkv, D] double-buffered V page
    #   (8-bit)   ks_buf, vs_buf VMEM uint32 [2, 1, W] their pages' scale rows
    #   sems      DMA semaphores [2 (K, V) or 4 (K, V, K scales, V scales), 2 (slot)]
    #   m_scr     VMEM f32[Hkv, R, 1] running max
    #   l_scr     VMEM f32[Hkv, R, 1] running sum
    #   acc_scr   VMEM f32[Hkv, R, D] running numerator
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    max_blocks_per_seq: int,
    heads_major: bool,
    kv_cache_dtype: str | None,  # None: a float cache; "int8" | "fp8_e4m3": an 8-bit one
):
    if kv_cache_dtype is None:
        k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, m_scr, l_scr, acc_scr = refs
        pages = ((k_hbm, k_buf), (v_hbm, v_buf))
    else:
        k_hbm, v_hbm, ks_hbm, vs_hbm, o_ref, k_buf, v_buf, ks_buf, vs_buf, sems, m_scr, l_scr, acc_scr = refs
        pages = ((k_hbm, k_buf), (v_hbm, v_buf), (ks_hbm, ks_buf), (vs_hbm, vs_buf))
    b = pl.program_id(0)
    layer = layer_ref[0]
    seq, lo, hi = seq_ref[b], lo_ref[b], hi_ref[b]
    first_pos = pos_ref[b]
    kv_end = first_pos + q_len_ref[b]  # no row reads kv positions >= kv_end
    num_kv_heads, rows, _ = q_ref.shape
    block_size = k_buf.shape[2] if heads_major else k_buf.shape[1]

    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    def page_copies(j, slot):
        page = tables_ref[seq * max_blocks_per_seq + j]
        # A page of values is [block_size, Hkv, D]; a page's scales one row [1, W] of a 2-D plane.
        at = lambda hbm: hbm.at[layer, page] if hbm.ndim == 5 else hbm.at[layer, pl.ds(page, 1)]  # noqa: E731
        return [pltpu.make_async_copy(at(hbm), buf.at[slot], sems.at[i, slot])
                for i, (hbm, buf) in enumerate(pages)]

    @pl.when(lo < hi)
    def _():
        for copy in page_copies(lo, 0):
            copy.start()

    # Row r is query token r // G. With x = kv_pos - first_pos (an integer), "x <= r // G" is
    # "x * G <= r" and "x > r // G - W" is "(x + W) * G > r": no vector integer division.
    row = lax.broadcasted_iota(jnp.int32, (rows, block_size), 0)
    col = lax.broadcasted_iota(jnp.int32, (rows, block_size), 1)

    def body(j, carry):
        slot = lax.rem(j - lo, 2)

        @pl.when(j + 1 < hi)
        def _():
            for copy in page_copies(j + 1, 1 - slot):
                copy.start()

        for copy in page_copies(j, slot):
            copy.wait()

        kv_pos = j * block_size + col  # [R, block_size]
        x = kv_pos - first_pos
        mask = (x * group <= row) & (kv_pos < kv_end)
        if sliding_window is not None:
            mask &= (x + sliding_window) * group > row
        if kv_cache_dtype is not None:  # this page's scale rows, float32 [1, W]
            k_scales, v_scales = (kv_quant.scales_to_float32(buf[slot]) for buf in (ks_buf, vs_buf))
        for h in range(num_kv_heads):
            q = q_ref[h]  # [R, D]
            k = k_buf[slot, h] if heads_major else k_buf[slot, :, h, :]  # [block_size, D]
            v = v_buf[slot, h] if heads_major else v_buf[slot, :, h, :]  # [block_size, D]
            if kv_cache_dtype is not None:
                k = _dequantize(k, k_scales, h, block_size, kv_cache_dtype, q.dtype)
                v = _dequantize(v, v_scales, h, block_size, kv_cache_dtype, q.dtype)
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            s = s * sm_scale  # [R, block_size]
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(mask, s, -jnp.inf)
            m_prev = m_scr[h]  # [R, 1]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            l_scr[h] = alpha * l_scr[h] + jnp.sum(p, axis=1, keepdims=True)
            acc_scr[h] = alpha * acc_scr[h] + lax.dot_general(
                p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
            )
            m_scr[h] = m_new
        return carry

    lax.fori_loop(lo, hi, body, 0)
    denom = l_scr[...]
    o_ref[...] = (acc_scr[...] / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def _dequantize(values, scale_row, head, block_size, kv_cache_dtype, dtype):
    """One kv head's 8-bit page values [block_size, D] times their scales -> [block_size, D] dtype.
    scale_row: the page's float32 scale row [1, W], kv head h's at lanes h * block_size + t; token
    t's is put in row t of a column by a masked lane sum over [block_size, W] (no lane slice at an
    unaligned offset, no transpose)."""
    shape = (block_size, scale_row.shape[1])
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    token = lax.broadcasted_iota(jnp.int32, shape, 0)
    picked = jnp.where(lane == token + head * block_size, jnp.broadcast_to(scale_row, shape), 0.0)
    column = jnp.sum(picked, axis=1, keepdims=True)  # [block_size, 1]
    return (kv_quant.values_to_float32(values, kv_cache_dtype) * column).astype(dtype)


def _tile_bytes(shape, dtype) -> int:
    """VMEM bytes of an array under Mosaic's tiling: the last two dims padded to (8 sublanes x
    the dtype's packing, 128 lanes)."""
    itemsize = jnp.dtype(dtype).itemsize
    *lead, rows, cols = shape
    sublanes = 8 * max(1, 4 // itemsize)
    padded = -(-rows // sublanes) * sublanes * (-(-cols // 128) * 128)
    return int(np.prod(lead, dtype=np.int64)) * padded * itemsize


def vmem_bytes(num_kv_heads, rows, head_dim, block_size, q_dtype, cache_dtype, scaled=False) -> int:
    """An upper estimate of the kernel's VMEM: the q and out blocks (double-buffered), the K and V
    page buffers (and an 8-bit cache's scale pages), the softmax scratch and the [R, block_size]
    temporaries of one kv head."""
    q_block = _tile_bytes((num_kv_heads, rows, head_dim), q_dtype)
    pages = _tile_bytes(page_buffer_shape(num_kv_heads, block_size, head_dim), cache_dtype)
    if scaled:
        pages += _tile_bytes((2, 1, kv_quant.page_scale_width(block_size, num_kv_heads)), jnp.uint32)
    stats = _tile_bytes((num_kv_heads, rows, 1), jnp.float32)
    acc = _tile_bytes((num_kv_heads, rows, head_dim), jnp.float32)
    temps = 8 * _tile_bytes((rows, block_size), jnp.float32)
    temps += 2 * _tile_bytes((block_size, head_dim), jnp.float32)
    return 4 * q_block + 2 * pages + 2 * stats + acc + temps


def vmem_limit(num_kv_heads, rows, head_dim, block_size, q_dtype, cache_dtype, scaled=False) -> int | None:
    """The scoped VMEM limit to compile with: None (Mosaic's default) when the estimate fits it;
    ValueError naming the knobs when it does not fit _VMEM_CAP."""
    need = vmem_bytes(num_kv_heads, rows, head_dim, block_size, q_dtype, cache_dtype, scaled)
    if need <= _DEFAULT_SCOPED_VMEM:
        return None
    if need > _VMEM_CAP:
        raise ValueError(
            f"pallas_tpu: {num_kv_heads} kv heads x {rows} query rows x head_dim {head_dim} with "
            f"pages of block_size={block_size} in {jnp.dtype(cache_dtype).name} need about "
            f"{need / 2**20:.1f} MiB of VMEM, over the {_VMEM_CAP >> 20} MiB a TPU core has: "
            "lower block_size (EngineConfig.block_size) or block_q (prepare_attention_metadata), "
            "shard the kv heads (EngineConfig.tensor_parallel_size), or use bfloat16"
        )
    return min(_VMEM_CAP, max(need + need // 4, 2 * _DEFAULT_SCOPED_VMEM))


def heads_major(num_kv_heads: int) -> bool:
    """Whether the kernels see the cache as [L, num_blocks, 1, block_size, D]: with one kv head (a
    device's share under tensor parallelism, e.g. 8 kv heads over 8 chips) XLA lays the cache out
    with (block_size, D) as its tiled minor dims, and this view is that layout bit for bit; the
    [..., block_size, 1, D] view would make Mosaic tile (1, D) -- a relayout copy of both caches
    (and twice their bytes in bfloat16's packed tiles) where XLA and the kernels meet."""
    return num_kv_heads == 1


def page_buffer_shape(num_kv_heads, block_size, head_dim) -> tuple[int, ...]:
    """The double-buffered VMEM page of the attention kernel (one whole page, every kv head)."""
    if heads_major(num_kv_heads):
        return (2, 1, block_size, head_dim)
    return (2, block_size, num_kv_heads, head_dim)


def kernel_view(cache):
    """The stacked cache [L, num_blocks, block_size, Hkv, D] as the TPU kernels read and write it
    (`heads_major`: a free reshape)."""
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    if heads_major(num_kv_heads):
        return cache.reshape(num_layers, num_blocks, 1, block_size, head_dim)
    return cache


def _tpu_pallas_call(scalars, q_blocks, k_cache, v_cache, scales=(), *, interpret, kv_cache_dtype=None,
                     **static):
    """pallas_call over grid (NB,); scalars = (layer, tables, seq, q_len, pos, lo, hi).

    k_cache, v_cache [L, num_blocks, block_size, Hkv, D], left in HBM (as `kernel_view`); an
    8-bit cache (kv_cache_dtype) passes its values there and scales = (k_scales, v_scales)
    [L, num_blocks, W] uint32 (the page layout).
    """
    nb, num_kv_heads, rows, head_dim = q_blocks.shape
    block_size = k_cache.shape[2]
    k_cache, v_cache = kernel_view(k_cache), kernel_view(v_cache)
    page = page_buffer_shape(num_kv_heads, block_size, head_dim)
    limit = vmem_limit(num_kv_heads, rows, head_dim, block_size, q_blocks.dtype, k_cache.dtype,
                       scaled=bool(scales))
    block = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, *_: (b, 0, 0, 0))
    scale_pages = [pltpu.VMEM((2, 1, s.shape[-1]), s.dtype) for s in scales]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(nb,),
        in_specs=[block] + [pl.BlockSpec(memory_space=pl.ANY)] * (2 + len(scales)),
        out_specs=block,
        scratch_shapes=[
            pltpu.VMEM(page, k_cache.dtype),
            pltpu.VMEM(page, v_cache.dtype),
            *scale_pages,
            pltpu.SemaphoreType.DMA((2 + len(scales), 2)),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
            pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_tpu_kernel, heads_major=heads_major(num_kv_heads),
                          kv_cache_dtype=kv_cache_dtype, **static),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=limit
        ),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(*scalars, q_blocks, k_cache, v_cache, *scales)


def prepare_tpu(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    shapes: validation.BatchShapes,
    *,
    sliding_window: int | None,
    block_q: int | None = None,
) -> metadata.AttentionMetadata:
    """The TPU kernel's AttentionMetadata (inputs validated by prepare_attention_metadata)."""
    bq = block_q or metadata.choose_block_q(
        shapes.num_tokens, shapes.max_num_seqs, shapes.group, row_multiple=_ROW_MULTIPLE
    )
    return metadata.build_attention_metadata(
        seq_lens,
        block_tables,
        query_start_loc,
        num_seqs,
        shapes=shapes,
        backend="pallas_tpu",
        block_q=bq,
        group_pad=shapes.group,
        pages_per_step=1,
        num_kv_splits=1,
        sliding_window=sliding_window,
        layout_tables=lambda tables, blocks: tables.reshape(-1),  # SMEM wants 1-D
    )


def ragged_paged_attention_tpu(
    q,
    k_cache,
    v_cache,
    md: metadata.AttentionMetadata,
    *,
    layer=None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: bool | pltpu.InterpretParams = False,
):
    """One layer of the TPU kernel: validates shapes (ValueError), returns [T, Hq, D].

    k_cache, v_cache: [L, num_blocks, block_size, Hkv, D] with layer a Python int or a traced
    int32 scalar in [0, L), or [num_blocks, block_size, Hkv, D] with layer=None; or an 8-bit
    cache, a kv_quant.ScaledCache each in the "page" scale layout (values of those shapes, scales
    [L, num_blocks, W] or [num_blocks, W]; another layout is a ValueError).
    interpret=True runs TPU interpret mode (pltpu.InterpretParams(), which simulates HBM, VMEM,
    DMAs and semaphores on the CPU); pass an InterpretParams to choose its checks.
    """
    k_cache, v_cache, scales, kv_cache_dtype = kv_quant.split_cache(k_cache, v_cache, "page")
    cache = validation.check_layer_inputs(q, k_cache, v_cache, md, layer, "pallas_tpu",
                                          eight_bit=kv_cache_dtype is not None)
    scales = tuple(jnp.reshape(s, (*cache.stacked_shape[:2], s.shape[-1])) for s in scales)
    validation.check_options(sm_scale, sliding_window, soft_cap, "pallas_tpu")
    validation.check_window_fits(md, sliding_window)
    q = jnp.asarray(q)
    if interpret is True:
        interpret = pltpu.InterpretParams()
    layer_arr = jnp.reshape(jnp.asarray(validation.layer_index(layer), jnp.int32), (1,))
    blocks = md.blocks
    scalars = (layer_arr, md.tables, blocks.seq_ids, blocks.q_lens, blocks.first_pos, md.lo, md.hi)
    q_blocks = metadata.pack_query_blocks(
        q, blocks, block_q=md.block_q, num_kv_heads=md.num_kv_heads, group_pad=md.group
    )
    out = _tpu_pallas_call(
        scalars,
        q_blocks,
        validation.stacked_view(k_cache, cache),
        validation.stacked_view(v_cache, cache),
        scales,
        interpret=interpret,
        kv_cache_dtype=kv_cache_dtype,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap),
        group=md.group,
        max_blocks_per_seq=md.max_blocks_per_seq,
    )
    return metadata.unpack_query_blocks(out, blocks, block_q=md.block_q, group=md.group)
