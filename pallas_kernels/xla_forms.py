"""The xla path (the CPU): which attention form each compiled bucket runs, and the dispatch.

Forms (all exact, float32 online softmax; the measurements behind the rule are in BUILD_NOTES.md
"CPU attention forms"):
  "loop"   xla.py: every query block (block_q tokens of one sequence) in one vectorized page
           loop that stops at the longest real context. The reference form.
  "split"  xla_split.py: the one-token rows (decodes) in one vectorized page loop, the prefill
           chunks one after another, each up to its own last page.

The one-token rows of either form run in the jnp page loop ("jnp") or, where it is built and asked
for, in the native CPU kernel ("native", cpu_native.py: the rows' pages read in place, the rows
spread over XLA's threads): `rows_kernel` in prepare_xla, else the `rows_kernel(...)` context the
metadata is prepared in (the engine lowers its buckets inside one; outside any, "jnp").

The rule (`choose_form`) reads only static shapes, so a bucket compiles one form and never
recompiles, and nothing is chosen by a device value: num_tokens T == 1 runs "loop" (a single
row: both forms are the same loop), every other bucket "split". A decode row costs a page loop
row, not a block_q-row block, and a prefill chunk's pages are fetched once per chunk of
CHUNK_BLOCK_Q tokens and only up to the chunk's own position.
"""

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import metadata, validation, xla_split
from pallas_kernels.kv_quant import ScaledCache, check_scaled_pair
from pallas_kernels.xla import PagedKV, blocks_attention, prepare_loop

FORMS = ("loop", "split")
ROWS_KERNELS = ("jnp", "native")  # how the one-token rows run (module docstring)
_ROWS_KERNEL: contextvars.ContextVar[str] = contextvars.ContextVar("rows_kernel", default="jnp")
ROW_KV_POSITIONS = 64  # kv positions per loop step of the vectorized loops (rows and blocks)
CHUNK_BLOCK_Q = 64  # tokens per prefill chunk of the split form (its body tier)
CHUNK_TAIL_BLOCK_Q = 16  # tokens per chunk of what is left of a sequence (its tail tier)
CHUNK_KV_POSITIONS = 128  # kv positions per loop step of a chunk's page loop


def choose_form(num_tokens: int, max_num_seqs: int) -> str:
    """The static rule: "loop" for a one-token bucket, "split" otherwise."""
    del max_num_seqs  # the rule does not need it (every S measured agreed)
    return "loop" if num_tokens == 1 else "split"


@contextlib.contextmanager
def rows_kernel(kernel: str):
    """Within: metadata prepared without an explicit rows_kernel runs its one-token rows with
    `kernel` (one of ROWS_KERNELS)."""
    token = _ROWS_KERNEL.set(_checked_rows_kernel(kernel))
    try:
        yield
    finally:
        _ROWS_KERNEL.reset(token)


def _checked_rows_kernel(kernel: str) -> str:
    if kernel not in ROWS_KERNELS:
        raise ValueError(f"rows_kernel must be one of {ROWS_KERNELS}; got {kernel!r}")
    return kernel


def choose_pages_per_step(block_size: int, max_blocks_per_seq: int, kv_positions: int) -> int:
    """About kv_positions kv positions per loop step, at least one page, at most the table."""
    return max(1, min(max_blocks_per_seq, kv_positions // block_size))


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
    form: str | None = None,
    chunk_block_q: int | None = None,
    chunk_pages_per_step: int | None = None,
    chunk_tail_block_q: int | None = None,
    rows_kernel: str | None = None,
) -> metadata.AttentionMetadata:
    """The xla path's AttentionMetadata in the bucket's form (inputs already validated).

    form None applies choose_form, or "loop" when block_q is given; block_q (loop form only) and pages_per_step (the vectorized
    loop of either form), chunk_block_q, chunk_pages_per_step and chunk_tail_block_q (split form) override the
    static choices; rows_kernel (ROWS_KERNELS) the `rows_kernel(...)` context's.
    """
    kernel = _ROWS_KERNEL.get() if rows_kernel is None else _checked_rows_kernel(rows_kernel)
    if form is None:  # a block_q is a loop-form block size: asking for one asks for the loop form
        form = "loop" if block_q is not None else choose_form(shapes.num_tokens, shapes.max_num_seqs)
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS} (or None: the bucket's rule); got {form!r}")
    for name, value in (("chunk_block_q", chunk_block_q), ("chunk_tail_block_q", chunk_tail_block_q)):
        if value is not None and form != "split":
            raise ValueError(f"{name} is the split form's option; got {name}={value}, form={form!r}")
    if block_q is not None and form != "loop":
        raise ValueError(f"block_q is the loop form's option; the split form's rows are one "
                         f"token each (got block_q={block_q}, form={form!r})")
    mb, bs = shapes.max_blocks_per_seq, shapes.block_size
    pps = pages_per_step or choose_pages_per_step(bs, mb, ROW_KV_POSITIONS)
    args = (seq_lens, block_tables, query_start_loc, num_seqs, shapes)
    if form == "loop":
        md = prepare_loop(*args, sliding_window=sliding_window, block_q=block_q, pages_per_step=pps)
        return dataclasses.replace(md, rows_kernel=kernel)
    md = xla_split.prepare_split(
        *args,
        sliding_window=sliding_window,
        pages_per_step=pps,
        chunk_block_q=chunk_block_q or CHUNK_BLOCK_Q,
        tail_block_q=chunk_tail_block_q or CHUNK_TAIL_BLOCK_Q,
        chunk_pages_per_step=chunk_pages_per_step or choose_pages_per_step(bs, mb, CHUNK_KV_POSITIONS),
    )
    return dataclasses.replace(md, rows_kernel=kernel)


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
    kv_layout: str = "token_major",
):
    """One layer of the jnp path in md.form: validates shapes (ValueError) and returns
    [T, Hq, D] in q.dtype.

    k_cache, v_cache: [L, num_blocks, block_size, Hkv, D] with layer a Python int or a traced
    int32 scalar in [0, L), or [num_blocks, block_size, Hkv, D] with layer=None; kv_layout
    "head_major": [.., num_blocks, Hkv, block_size, D] (xla.py).
    """
    scaled = isinstance(k_cache, ScaledCache) or isinstance(v_cache, ScaledCache)
    if scaled:  # an 8-bit cache: values and scales (kv_quant.py), dequantized after each gather
        check_scaled_pair(k_cache, v_cache, "token")
        cache = validation.check_layer_inputs(q, k_cache.values, v_cache.values, md, layer, "xla", eight_bit=True,
                                              kv_layout=kv_layout)
    else:
        cache = validation.check_layer_inputs(q, k_cache, v_cache, md, layer, "xla", kv_layout=kv_layout)
    validation.check_options(sm_scale, sliding_window, soft_cap, "xla")
    validation.check_window_fits(md, sliding_window)
    q = jnp.asarray(q)
    if not scaled and jnp.asarray(k_cache).dtype == jnp.uint16:
        validation.check_bits_values(q, "q")
    kv = PagedKV.of(k_cache, v_cache, cache, layer, q.dtype, md.block_size)
    options = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    rows = blocks_attention(q, kv, md, **options)
    if md.form == "loop":
        return rows
    # A step without prefill chunks (most decode steps) skips the chunks' buffers and the combine:
    # the rows' output already holds zeros for every other token.
    any_chunk = sum(ch.num_chunks for ch in md.chunks) > 0
    return jax.lax.cond(any_chunk, lambda rows: xla_split.combine(
        rows, xla_split.chunks_attention(q, kv, md.chunks, **options), md), lambda rows: rows, rows)
