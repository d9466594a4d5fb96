"""Per-step attention metadata, computed once in XLA and shared by every layer and every kernel.

Two levels:
  `AttentionMetadata` (what `prepare_attention_metadata` returns, one per step): everything that
    depends only on the batch and on the backend's static choices (block_q, pages_per_step,
    split count, the padded block-table layout, each query block's page range). A model computes
    it once per step and passes it to every layer's `ragged_paged_attention` call; it is a pytree,
    so it can cross a jit boundary or be closed over by a `lax.scan` body over layers.
  `BlockMetadata` (inside it): the query blocks themselves.

The flat token axis (T tokens, sequences back to back as `query_start_loc` says) is cut into
query blocks of `block_q` tokens, each inside ONE sequence: a sequence with q_len tokens owns
cdiv(q_len, block_q) blocks, the last one partial. The number of blocks is a device value; the
static bound `num_query_blocks(T, S, block_q)` sizes the arrays, and blocks past the real ones
have `q_lens == 0` (kernels skip them and write zeros).

Walkthrough:
  Once per step (prepare):
  1. `compute_block_metadata` turns (seq_lens, query_start_loc, num_seqs) into `BlockMetadata`.
  2. `kv_page_range` gives each block the pages [lo, hi) it reads; `loop_step_range` the loop
     steps any block needs; the backend lays out its block tables (`AttentionMetadata.tables`).
  Per layer (attention):
  3. `gather_query_blocks` copies q into [NB, block_q, Hq, D] rows (a T-sized gather, cheap next
     to reading the KV pages), so a kernel reads whole aligned blocks and never overlaps another
     block's tokens.
  4. A kernel writes [NB, block_q, Hq, D]; `scatter_query_blocks` gathers it back to [T, Hq, D]
     and zeroes padding tokens (index >= query_start_loc[num_seqs]).
  The Pallas kernels use `pack_query_blocks` / `unpack_query_blocks`, the same gathers with the
  query heads of one kv head stacked as rows: [NB, Hkv, block_q * group, D].
"""

import dataclasses

import jax
import jax.numpy as jnp

BLOCK_Q_CANDIDATES = (1, 2, 4, 8, 16, 32)


def num_query_blocks(num_tokens: int, max_num_seqs: int, block_q: int) -> int:
    """Static upper bound on the query blocks of any batch with <= T tokens and <= S sequences.

    sum_s cdiv(q_s, bq) <= (sum_s q_s + S (bq - 1)) / bq, and each block holds >= 1 token.
    """
    bound = (num_tokens + max_num_seqs * (block_q - 1)) // block_q
    return max(1, min(num_tokens, bound))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMetadata:
    """Device metadata of the query blocks; NB = num_query_blocks(T, S, block_q)."""

    seq_ids: jax.Array  # int32[NB] sequence of each block (0 for padding blocks)
    q_starts: jax.Array  # int32[NB] flat token index of the block's first row
    q_lens: jax.Array  # int32[NB] real rows in the block, 0..block_q (0: padding block)
    first_pos: jax.Array  # int32[NB] kv position of the block's first row
    kv_lens: jax.Array  # int32[NB] seq_lens of the block's sequence (0 for padding blocks)
    token_blocks: jax.Array  # int32[T] block holding each token (any valid index for padding)
    token_rows: jax.Array  # int32[T] row of each token inside its block
    token_live: jax.Array  # bool[T] token index < query_start_loc[num_seqs]


def compute_block_metadata(seq_lens, query_start_loc, num_seqs, *, num_tokens: int, block_q: int):
    """Builds BlockMetadata in XLA; shapes are static, the counts are device values."""
    seq_lens = jnp.asarray(seq_lens).astype(jnp.int32)
    qsl = jnp.asarray(query_start_loc).astype(jnp.int32)
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    max_num_seqs = seq_lens.shape[0]
    nb = num_query_blocks(num_tokens, max_num_seqs, block_q)

    live = jnp.arange(max_num_seqs, dtype=jnp.int32) < num_seqs
    q_lens_seq = jnp.where(live, qsl[1:] - qsl[:-1], 0)  # int32[S]
    blocks_seq = (q_lens_seq + block_q - 1) // block_q  # int32[S]
    blk_end = jnp.cumsum(blocks_seq, dtype=jnp.int32)  # int32[S]
    blk_start = blk_end - blocks_seq

    b = jnp.arange(nb, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(blk_end, b, side="right"), max_num_seqs - 1)
    seq = seq.astype(jnp.int32)
    real = b < blk_end[-1]
    local = b - blk_start[seq]
    q_starts = qsl[seq] + local * block_q
    q_lens = jnp.where(real, jnp.clip(qsl[seq + 1] - q_starts, 0, block_q), 0)
    first_pos = seq_lens[seq] - q_lens_seq[seq] + local * block_q

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    num_live_tokens = qsl[num_seqs]
    tok_seq = jnp.minimum(jnp.searchsorted(qsl[1:], t, side="right"), max_num_seqs - 1)
    tok_local = t - qsl[tok_seq]
    token_live = t < num_live_tokens
    token_blocks = jnp.where(token_live, blk_start[tok_seq] + tok_local // block_q, 0)
    token_rows = jnp.where(token_live, tok_local % block_q, 0)
    return BlockMetadata(
        seq_ids=jnp.where(real, seq, 0),
        q_starts=jnp.where(real, q_starts, 0),
        q_lens=q_lens.astype(jnp.int32),
        first_pos=jnp.where(real, first_pos, 0),
        kv_lens=jnp.where(real, seq_lens[seq], 0),
        token_blocks=jnp.clip(token_blocks, 0, nb - 1).astype(jnp.int32),
        token_rows=token_rows.astype(jnp.int32),
        token_live=token_live,
    )


def _static(**kwargs):
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """One step's batch metadata for every layer's ragged_paged_attention call.

    Array fields are device values computed in XLA (NB = num_query_blocks(T, S, block_q)); the
    static fields are Python values, part of the pytree structure (a jit cache key).
    """

    blocks: BlockMetadata  # the query blocks (see BlockMetadata)
    lo: jax.Array  # int32[NB] first block-table column (page) each query block reads
    hi: jax.Array  # int32[NB] one past the last column it reads (lo == hi: nothing to read)
    first_step: jax.Array  # int32[] first loop step (of pages_per_step pages) any block reads
    last_step: jax.Array  # int32[] one past the last loop step any block reads
    # Block tables in the backend's layout, entries are page ids within one layer:
    #   xla         int32[NB, max_blocks_per_seq padded to pages_per_step] (row = query block)
    #   pallas_gpu  int32[S, max_blocks_per_seq padded to pages_per_step] (row = sequence)
    #   pallas_tpu  int32[S * max_blocks_per_seq] (row-major, for SMEM)
    # Padded columns are 0 (the null block) and always masked.
    tables: jax.Array
    backend: str = _static()  # "xla" | "pallas_gpu" | "pallas_tpu"
    num_tokens: int = _static()  # T
    max_num_seqs: int = _static()  # S
    max_blocks_per_seq: int = _static()  # block_tables' columns before padding
    num_q_heads: int = _static()
    num_kv_heads: int = _static()
    head_dim: int | None = _static()  # None: taken from q per call
    block_size: int = _static()  # tokens per page
    block_q: int = _static()  # query tokens per query block
    group_pad: int = _static()  # query heads per kv head as the kernel lays them out (>= G)
    pages_per_step: int = _static()  # pages per kv loop step (1 for pallas_tpu)
    num_kv_splits: int = _static()  # pallas_gpu split-K partitions of the kv loop (1: none)
    sliding_window: int | None = _static()  # window the page ranges were cut for (None: full)
    # The xla path's form (xla_forms.py): "loop" (every query block in one vectorized page loop)
    # or "split" (blocks / tables above are the one-token rows, `chunks` the prefill chunks).
    form: str = _static(default="loop")
    # How the xla path runs its one-token rows (xla_forms.ROWS_KERNELS): "jnp" (the page loop) or
    # "native" (cpu_native.py's kernel, where it reads the cache; elsewhere the page loop).
    rows_kernel: str = _static(default="jnp")
    chunks: object = None  # xla_split.ChunkMetadata for form "split", else None

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_query_blocks(self) -> int:
        """NB, the static number of query blocks."""
        return self.blocks.q_lens.shape[0]


def kv_page_range(md: BlockMetadata, *, block_size: int, sliding_window: int | None):
    """Pages [lo, hi) of each block's sequence that hold kv positions the block attends to.

    The last row attends up to first_pos + q_len - 1; with a window W the first row attends from
    first_pos - W + 1. Padding blocks get an empty range.
    """
    hi = jnp.where(md.q_lens > 0, (md.first_pos + md.q_lens + block_size - 1) // block_size, 0)
    if sliding_window is None:
        lo = jnp.zeros_like(hi)
    else:
        lo = jnp.maximum(md.first_pos - sliding_window + 1, 0) // block_size
        lo = jnp.minimum(lo, hi)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def loop_step_range(md: BlockMetadata, lo, hi, *, pages_per_step: int, max_blocks_per_seq: int):
    """Loop steps [first, last) of pages_per_step pages that cover every real block's [lo, hi)."""
    real = md.q_lens > 0
    last = (jnp.max(jnp.where(real, hi, 0)) + pages_per_step - 1) // pages_per_step
    first = jnp.min(jnp.where(real, lo, max_blocks_per_seq)) // pages_per_step
    return jnp.minimum(first, last).astype(jnp.int32), last.astype(jnp.int32)


def pad_columns(tables, multiple: int):
    """Pads [rows, columns] block tables with 0 (the null block) to a multiple of `multiple`."""
    columns = tables.shape[1]
    padded = -(-columns // multiple) * multiple
    if padded == columns:
        return tables
    return jnp.pad(tables, ((0, 0), (0, padded - columns)))


def build_attention_metadata(
    seq_lens,
    block_tables,
    query_start_loc,
    num_seqs,
    *,
    shapes,
    backend: str,
    block_q: int,
    group_pad: int,
    pages_per_step: int,
    num_kv_splits: int,
    sliding_window: int | None,
    layout_tables,
    blocks: BlockMetadata | None = None,
) -> AttentionMetadata:
    """The backend-independent part of prepare: blocks, page ranges, loop steps.

    shapes is a validation.BatchShapes; layout_tables(block_tables int32[S, mb], blocks) returns
    the backend's `tables` array. `blocks` replaces the query blocks compute_block_metadata cuts
    (the xla split form's one-token rows).
    """
    if blocks is None:
        blocks = compute_block_metadata(
            seq_lens, query_start_loc, num_seqs, num_tokens=shapes.num_tokens, block_q=block_q
        )
    lo, hi = kv_page_range(blocks, block_size=shapes.block_size, sliding_window=sliding_window)
    first_step, last_step = loop_step_range(
        blocks,
        lo,
        hi,
        pages_per_step=pages_per_step,
        max_blocks_per_seq=shapes.max_blocks_per_seq,
    )
    tables = layout_tables(jnp.asarray(block_tables).astype(jnp.int32), blocks)
    return AttentionMetadata(
        blocks=blocks,
        lo=lo,
        hi=hi,
        first_step=first_step,
        last_step=last_step,
        tables=tables,
        backend=backend,
        num_tokens=shapes.num_tokens,
        max_num_seqs=shapes.max_num_seqs,
        max_blocks_per_seq=shapes.max_blocks_per_seq,
        num_q_heads=shapes.num_q_heads,
        num_kv_heads=shapes.num_kv_heads,
        head_dim=shapes.head_dim,
        block_size=shapes.block_size,
        block_q=block_q,
        group_pad=group_pad,
        pages_per_step=pages_per_step,
        num_kv_splits=num_kv_splits,
        sliding_window=sliding_window,
    )


def gather_query_blocks(q, md: BlockMetadata, *, block_q: int):
    """q[T, Hq, D] -> [NB, block_q, Hq, D]; rows past a block's q_len repeat valid tokens."""
    rows = md.q_starts[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]
    return q[jnp.clip(rows, 0, q.shape[0] - 1)]


def choose_block_q(
    num_tokens: int,
    max_num_seqs: int,
    rows_per_query: int,
    *,
    row_multiple: int = 1,
    fetch_cost_rows: int = 20,
) -> int:
    """Query tokens per block minimizing a static cost model of padded work.

    A block costs its rows (block_q * rows_per_query, the query heads sharing one kv head) plus
    fetching its pages once, worth `fetch_cost_rows` rows (20 fits the `xla` path on a 2-core
    CPU: a [T=288, S=34] mixed batch measured 83, 56, 41, 34, 41 ms for block_q 1..16, and this
    model picks 8). Decode batches (T == S) pick 1 unless a kernel needs its row count to be a
    multiple of `row_multiple` (TPU sublanes, Triton's minimum dot size).
    """

    def cost(bq: int) -> int:
        rows = bq * rows_per_query + fetch_cost_rows
        return num_query_blocks(num_tokens, max_num_seqs, bq) * rows

    fits = [bq for bq in BLOCK_Q_CANDIDATES if (bq * rows_per_query) % row_multiple == 0]
    return min(fits or [BLOCK_Q_CANDIDATES[-1]], key=cost)


def pack_query_blocks(q, md: BlockMetadata, *, block_q: int, num_kv_heads: int, group_pad: int):
    """q[T, Hq, D] -> [NB, Hkv, block_q * group_pad, D], the Pallas kernels' query layout.

    Row r of kv head h holds query token r // group_pad of the block and query head
    h * G + r % group_pad; the group_pad - G extra heads (a power-of-two pad for Triton) are 0.
    """
    qb = gather_query_blocks(q, md, block_q=block_q)  # [NB, bq, Hq, D]
    nb, _, hq, d = qb.shape
    group = hq // num_kv_heads
    qb = qb.reshape(nb, block_q, num_kv_heads, group, d)
    if group_pad > group:
        qb = jnp.pad(qb, ((0, 0), (0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    return qb.transpose(0, 2, 1, 3, 4).reshape(nb, num_kv_heads, block_q * group_pad, d)


def unpack_query_blocks(out, md: BlockMetadata, *, block_q: int, group: int):
    """Inverse of pack_query_blocks: [NB, Hkv, block_q * group_pad, D] -> [T, Hq, D]."""
    nb, hkv, rows, d = out.shape
    out = out.reshape(nb, hkv, block_q, rows // block_q, d)[:, :, :, :group]
    out = out.transpose(0, 2, 1, 3, 4).reshape(nb, block_q, hkv * group, d)
    return scatter_query_blocks(out, md)


def scatter_query_blocks(out_blocks, md: BlockMetadata):
    """[NB, block_q, Hq, D] -> [T, Hq, D]: one gather; padding tokens get zeros."""
    out = out_blocks[md.token_blocks, md.token_rows]
    return jnp.where(md.token_live[:, None, None], out, jnp.zeros((), out.dtype))
