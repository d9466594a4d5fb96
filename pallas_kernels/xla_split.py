"""The xla path's split form: a flat batch cut into its one-token rows and its prefill chunks.

Why: the loop form (xla.py) cuts every sequence into query blocks of one static block_q and runs
them all in one vectorized page loop, so its work is the static bound num_query_blocks(T, S,
block_q) times block_q rows, each block fetching its whole context; in a mixed batch a decode row
pads to block_q rows and every block of a prefill chunk fetches the chunk's pages again. The
split form does the two kinds apart (BUILD_NOTES.md "CPU attention forms" has the measurements):

  rows    every sequence with exactly one query token (a decode) is one row of one vectorized
          page loop over S rows, block_q = 1, tables row = sequence (no gather of the tables).
          This is md.blocks / md.tables / md.first_step / md.last_step of the split form's
          AttentionMetadata, run by xla.blocks_attention.
  chunks  every sequence with more query tokens is cut into chunks of `block_q` (static, larger)
          tokens, and a lax.fori_loop over the REAL chunks (a device count) runs each chunk's
          own page loop up to its own last page (a prefill chunk's early rows never wait on the
          longest context in the batch), then writes the chunk's real rows into the output with
          a masked dynamic_update_slice. Work follows the real chunks, never the static bound.
          Two tiers: a sequence's whole `block_q`-token chunks are the body tier; what is left
          (a short prompt, or the tail of a long one: < block_q tokens) is cut into chunks of
          `tail_block_q` (smaller) tokens, the tail tier, a second loop of the same kind. So 32
          prompts of 8 tokens run 32 chunks of 16 rows, not of 64 (BUILD_NOTES.md "CPU attention
          forms": 3-5x dense attention with one tier of 64, 1.2-1.3x with the tail tier).

Both parts are exact (the same online softmax in float32 as the loop form); `combine` takes each
token from its part and zeroes padding tokens. A step with no chunk in any tier (most decode
steps) skips the chunks' part and the combine (xla_forms.py: a lax.cond on the chunk count).
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import metadata, validation
from pallas_kernels.xla import PagedKV, page_loop


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkMetadata:
    """The prefill chunks of a split-form step; NC = static bound on chunks (arrays' size)."""

    seq_ids: jax.Array  # int32[NC] sequence of each chunk (0 past the real ones)
    q_starts: jax.Array  # int32[NC] flat token index of the chunk's first row
    q_lens: jax.Array  # int32[NC] real rows, 1..block_q (0 past the real chunks)
    first_pos: jax.Array  # int32[NC] kv position of the chunk's first row
    first_step: jax.Array  # int32[NC] first loop step (of pages_per_step pages) the chunk reads
    last_step: jax.Array  # int32[NC] one past its last loop step
    num_chunks: jax.Array  # int32[] real chunks
    tables: jax.Array  # int32[S, max_blocks_per_seq padded to pages_per_step] (row = sequence)
    in_rows: jax.Array  # bool[T] the token is a one-token row (taken from the rows part)
    live: jax.Array  # bool[T] token index < query_start_loc[num_seqs]
    block_q: int = _static()  # tokens per chunk
    pages_per_step: int = _static()


def num_chunks_bound(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static bound on the chunks of any batch: only sequences with >= 2 tokens have chunks."""
    return metadata.num_query_blocks(num_tokens, max(1, min(max_num_seqs, num_tokens // 2)), block_q)


def prepare_split(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    shapes: validation.BatchShapes,
    *,
    sliding_window: int | None,
    pages_per_step: int,
    chunk_block_q: int,
    chunk_pages_per_step: int,
    tail_block_q: int | None = None,
) -> metadata.AttentionMetadata:
    """The split form's AttentionMetadata: md.blocks are the rows, md.chunks the chunk tiers (a
    tuple of ChunkMetadata: the body and, when tail_block_q < chunk_block_q, the tail tier)."""
    T, S = shapes.num_tokens, shapes.max_num_seqs
    seq_lens = jnp.asarray(seq_lens).astype(jnp.int32)
    qsl = jnp.asarray(query_start_loc).astype(jnp.int32)
    n = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    tables = jnp.asarray(block_tables).astype(jnp.int32)
    live_seq = jnp.arange(S, dtype=jnp.int32) < n
    q_lens_seq = jnp.where(live_seq, qsl[1:] - qsl[:-1], 0)  # int32[S]
    is_row = q_lens_seq == 1

    t = jnp.arange(T, dtype=jnp.int32)
    live = t < qsl[n]
    tok_seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), S - 1).astype(jnp.int32)
    in_rows = live & is_row[tok_seq]
    rows = metadata.BlockMetadata(
        seq_ids=jnp.arange(S, dtype=jnp.int32),
        q_starts=jnp.where(is_row, qsl[:-1], 0),
        q_lens=is_row.astype(jnp.int32),
        first_pos=jnp.where(is_row, seq_lens - 1, 0),
        kv_lens=jnp.where(is_row, seq_lens, 0),
        token_blocks=jnp.where(in_rows, tok_seq, 0),
        token_rows=jnp.zeros((T,), jnp.int32),
        token_live=in_rows,
    )
    md = metadata.build_attention_metadata(
        seq_lens,
        tables,
        qsl,
        n,
        shapes=shapes,
        backend="xla",
        block_q=1,
        group_pad=shapes.group,
        pages_per_step=pages_per_step,
        num_kv_splits=1,
        sliding_window=sliding_window,
        layout_tables=lambda tbl, blocks: metadata.pad_columns(tbl, pages_per_step),
        blocks=rows,
    )
    chunk_q = jnp.where(q_lens_seq > 1, q_lens_seq, 0)  # the tokens each sequence puts in chunks
    tail_bq = min(tail_block_q or chunk_block_q, chunk_block_q)
    body_q = chunk_q if tail_bq == chunk_block_q else chunk_q // chunk_block_q * chunk_block_q
    tiers = [(chunk_block_q, jnp.zeros_like(chunk_q), body_q)]  # (block_q, offset, tokens) per tier
    if tail_bq < chunk_block_q:
        tiers.append((tail_bq, body_q, chunk_q - body_q))
    tables = metadata.pad_columns(tables, chunk_pages_per_step)
    chunks = tuple(
        _chunk_metadata(seq_lens, qsl, q_lens_seq, offset, tokens, tables, in_rows, live, shapes=shapes,
                        block_q=bq, pages_per_step=chunk_pages_per_step, sliding_window=sliding_window)
        for bq, offset, tokens in tiers)
    return dataclasses.replace(md, form="split", chunks=chunks)


def _chunk_metadata(seq_lens, qsl, q_lens_seq, offset, tokens, tables, in_rows, live, *, shapes,
                    block_q, pages_per_step, sliding_window) -> ChunkMetadata:
    """One tier: each sequence's `tokens` query tokens from its `offset` (int32[S] each) cut into
    chunks of block_q."""
    S, bs = shapes.max_num_seqs, shapes.block_size
    nc = num_chunks_bound(shapes.num_tokens, S, block_q)
    per_seq = (tokens + block_q - 1) // block_q
    end = jnp.cumsum(per_seq, dtype=jnp.int32)
    start = end - per_seq
    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(end, c, side="right"), S - 1).astype(jnp.int32)
    real = c < end[-1]
    local = offset[seq] + (c - start[seq]) * block_q  # the chunk's first token within its sequence
    q_starts = qsl[seq] + local
    q_lens = jnp.where(real, jnp.clip(qsl[seq] + offset[seq] + tokens[seq] - q_starts, 0, block_q), 0)
    first_pos = seq_lens[seq] - q_lens_seq[seq] + local
    hi = (first_pos + q_lens + bs - 1) // bs  # pages [lo, hi) the chunk reads
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        lo = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0) // bs, hi)
    return ChunkMetadata(
        seq_ids=jnp.where(real, seq, 0),
        q_starts=jnp.where(real, q_starts, 0),
        q_lens=q_lens.astype(jnp.int32),
        first_pos=jnp.where(real, first_pos, 0),
        first_step=jnp.where(real, lo // pages_per_step, 0).astype(jnp.int32),
        last_step=jnp.where(real, (hi + pages_per_step - 1) // pages_per_step, 0).astype(jnp.int32),
        num_chunks=end[-1].astype(jnp.int32),
        tables=tables,
        in_rows=in_rows,
        live=live,
        block_q=block_q,
        pages_per_step=pages_per_step,
    )


def chunks_attention(q, kv: PagedKV, tiers: tuple, *, sm_scale, sliding_window, soft_cap):
    """Every tier's chunks (md.chunks); [T, Hq, D] in q.dtype holding the chunks' tokens (other
    tokens: zeros). The tiers hold disjoint tokens."""
    out = jnp.zeros((q.shape[0] + max(ch.block_q for ch in tiers), *q.shape[1:]), q.dtype)
    for ch in tiers:
        out = _tier_attention(q, kv, ch, out, sm_scale=sm_scale, sliding_window=sliding_window,
                              soft_cap=soft_cap)
    return out[: q.shape[0]]


def _tier_attention(q, kv: PagedKV, ch: ChunkMetadata, out, *, sm_scale, sliding_window, soft_cap):
    """Each real chunk of one tier in turn (a fori_loop over ch.num_chunks), written into out
    ([T + at least block_q, Hq, D]: a chunk's rows may run past T)."""
    T, Hq, D = q.shape
    Hkv = kv.num_kv_heads
    G, bq = Hq // Hkv, ch.block_q
    q_pad = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))  # a chunk's rows may run past T
    rows = jnp.arange(bq, dtype=jnp.int32)

    def body(c, out):
        start = ch.q_starts[c]
        qb = jax.lax.dynamic_slice_in_dim(q_pad, start, bq, axis=0)
        qb, score_scale = kv.query(qb.reshape(1, bq, Hkv, G, D), sm_scale)
        table = jax.lax.dynamic_slice_in_dim(ch.tables, ch.seq_ids[c], 1, axis=0)  # [1, cols]
        row_ok = rows < ch.q_lens[c]
        o = page_loop(qb, table, ch.first_step[c], ch.last_step[c],
                      (ch.first_pos[c] + rows)[None, :], row_ok[None, :], kv,
                      pages_per_step=ch.pages_per_step, sliding_window=sliding_window,
                      soft_cap=soft_cap, score_scale=score_scale)
        o = o.reshape(bq, Hq, D).astype(q.dtype)
        old = jax.lax.dynamic_slice_in_dim(out, start, bq, axis=0)
        o = jnp.where(row_ok[:, None, None], o, old)
        return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=0)

    return jax.lax.fori_loop(0, ch.num_chunks, body, out)


def combine(rows_out, chunks_out, md: metadata.AttentionMetadata):
    """Each token from its part ([T, Hq, D] each); padding tokens get zeros."""
    ch = md.chunks[0]
    out = jnp.where(ch.in_rows[:, None, None], rows_out, chunks_out)
    return jnp.where(ch.live[:, None, None], out, jnp.zeros((), out.dtype))
