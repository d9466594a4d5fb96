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
  Metadata (global memory, from AttentionMetadata, prepared once per step by `prepare_gpu`):
  block tables [S, max_blocks_per_seq padded to pages_per_step], and per query block its
  sequence, real rows, kv position of row 0, page range [lo, hi). block_q, pages_per_step and the
  split count are static choices made there too.

Walkthrough (grid = (NB, Hkv, splits); one program per query block, kv head and kv split)
  1. Read the block's metadata; this split covers steps [start, end) of the block's page range.
  2. For each step: gather page ids and then K, V rows [K = pages_per_step * block_size, D];
     scores [R, K] = q . k^T * sm_scale in float32; soft cap; mask (causal by position, window,
     never past the block's last real position); online softmax carried in registers (m, l, acc).
  3. Write acc / l (zero where nothing was seen); split-K also writes m and l, and XLA merges the
     splits: out = sum_s l_s e^(m_s - M) o_s / sum_s l_s e^(m_s - M).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import metadata, validation

_MIN_ROWS = 16  # Triton's dot wants every dimension >= 16
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
    q_ref,  # [R, D] this program's queries (block b, kv head h)
    k_ref,  # [L * num_blocks * block_size, Hkv, D] all layers' K rows
    v_ref,  # [L * num_blocks * block_size, Hkv, D] all layers' V rows
    o_ref,  # [R, D] output rows (of split s under split-K)
    *stat_refs,  # split-K only: m_ref f32[R], l_ref f32[R]
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group_pad: int,
    block_size: int,
    num_blocks: int,
    pages_per_step: int,
    num_splits: int,
    precision,
):
    b, h = pl.program_id(0), pl.program_id(1)
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

    rows, head_dim = q_ref.shape
    q = q_ref[...]  # [R, D]
    row_pos = first_pos + lax.div(jnp.arange(rows, dtype=jnp.int32), group_pad)  # [R]
    col = jnp.arange(kv_step, dtype=jnp.int32)  # [K]
    page_col = lax.div(col, block_size)  # [K] page of each kv row within the step
    offset = lax.rem(col, block_size)  # [K]

    def body(i, carry):
        m, denom, acc = carry
        page_ids = tables_ref[seq, i * pages_per_step + page_col]  # [K] vector gather
        kv_rows = row_base + page_ids * block_size + offset  # [K] rows of this layer's pages
        k = k_ref[kv_rows, h, :]  # [K, D]
        v = v_ref[kv_rows, h, :]  # [K, D]
        s = lax.dot_general(
            q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale  # [R, K]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = (i * kv_step + col)[None, :]  # [1, K]
        mask = (kv_pos <= row_pos[:, None]) & (kv_pos < kv_end)
        if sliding_window is not None:
            mask &= kv_pos > row_pos[:, None] - sliding_window
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [R]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        denom = alpha * denom + jnp.sum(p, axis=1)
        pv = lax.dot_general(
            p.astype(v.dtype),
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


def _gpu_pallas_call(scalars, q_blocks, k_rows, v_rows, *, num_splits, interpret, **static):
    """pallas_call over grid (NB, Hkv, num_splits); returns out or (out, m, l) for split-K.

    scalars = (layer, tables, seq, q_len, pos, lo, hi); k_rows, v_rows [L * nb * bs, Hkv, D].
    """
    nb, num_kv_heads, rows, head_dim = q_blocks.shape
    whole = pl.BlockSpec()  # the whole array: metadata and the paged cache
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0))
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q_blocks.shape, q_blocks.dtype)
        out_specs = q_spec
    else:
        split_shape = (nb, num_kv_heads, num_splits, rows)
        out_shape = (
            jax.ShapeDtypeStruct((*split_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
            jax.ShapeDtypeStruct(split_shape, jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        )
    return pl.pallas_call(
        functools.partial(_gpu_kernel, num_splits=num_splits, **static),
        grid=(nb, num_kv_heads, num_splits),
        in_specs=[whole] * len(scalars) + [q_spec, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(*scalars, q_blocks, k_rows, v_rows)


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
    int32 scalar in [0, L), or [num_blocks, block_size, Hkv, D] with layer=None.
    interpret=True runs the kernel with Pallas' generic interpreter on the CPU.
    """
    cache = validation.check_layer_inputs(q, k_cache, v_cache, md, layer, "pallas_gpu")
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
    result = _gpu_pallas_call(
        scalars,
        q_blocks,
        jnp.reshape(k_cache, flat),
        jnp.reshape(v_cache, flat),
        num_splits=md.num_kv_splits,
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
    )
    if md.num_kv_splits > 1:
        result = _merge_splits(*result, q.dtype)
    return metadata.unpack_query_blocks(result, blocks, block_q=md.block_q, group=md.group)
