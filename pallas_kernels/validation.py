"""Trace-time checks of the ragged paged-attention contract, shared by every implementation.

Shapes (one layer):
  q               [T, num_q_heads, head_dim]                  float (float32 or bfloat16)
  k_pages/v_pages [num_blocks, block_size, num_kv_heads, head_dim]   same dtype as each other
  seq_lens        int32[S]           kv length of each sequence after this step's tokens are written
  block_tables    int32[S, max_blocks_per_seq]   entries past a sequence's blocks are 0 (null block)
  query_start_loc int32[S + 1]       cumulative query offsets into the token axis
  num_seqs        int32[] or int32[1]  real sequences (a device value)

Every failure is a ValueError naming the argument and the shapes it saw.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

BACKENDS = ("xla", "pallas_gpu", "pallas_tpu")


@dataclasses.dataclass(frozen=True)
class AttentionShapes:
    """Static sizes of one ragged paged-attention call (all Python ints)."""

    num_tokens: int  # T, padded token count
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int  # pages in the cache, block 0 included
    block_size: int  # tokens per page
    max_num_seqs: int  # S, padded sequence count
    max_blocks_per_seq: int

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


def _shape_str(**arrays) -> str:
    return ", ".join(f"{name}{tuple(np.shape(x))}" for name, x in arrays.items())


def check_attention_inputs(
    q, k_pages, v_pages, seq_lens, block_tables, query_start_loc, num_seqs
) -> AttentionShapes:
    """Validates ranks, dtypes and sizes; returns the static sizes or raises ValueError."""
    shapes = _shape_str(
        q=q,
        k_pages=k_pages,
        v_pages=v_pages,
        seq_lens=seq_lens,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        num_seqs=num_seqs,
    )
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim]; got {shapes}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim]; got {shapes}"
        )
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages must match k_pages in shape and dtype; got {shapes}, "
            f"dtypes k_pages={k_pages.dtype} v_pages={v_pages.dtype}"
        )
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point; got dtype {q.dtype} ({shapes})")
    if not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"k_pages must be floating point; got dtype {k_pages.dtype} ({shapes})")
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"q and k_pages disagree on head_dim; got {shapes}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q's num_q_heads must be a multiple of k_pages' num_kv_heads; got {shapes}"
        )
    for name, x in (
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("num_seqs", num_seqs),
    ):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got dtype {x.dtype} ({shapes})")
    if seq_lens.ndim != 1:
        raise ValueError(f"seq_lens must be [S]; got {shapes}")
    max_num_seqs = seq_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != max_num_seqs:
        raise ValueError(
            f"block_tables must be [S, max_blocks_per_seq] with S=len(seq_lens); got {shapes}"
        )
    if query_start_loc.shape != (max_num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [S + 1] with S=len(seq_lens); got {shapes}")
    if np.shape(num_seqs) not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar of shape [] or [1]; got {shapes}")
    if num_tokens == 0 or max_num_seqs == 0 or block_tables.shape[1] == 0:
        raise ValueError(f"T, S and max_blocks_per_seq must be positive; got {shapes}")
    return AttentionShapes(
        num_tokens=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_blocks_per_seq=block_tables.shape[1],
    )


def check_options(sm_scale, sliding_window, soft_cap, backend) -> None:
    """Validates the static keyword options."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    if not isinstance(sm_scale, (int, float)) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float; got {sm_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or a positive int; got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, (int, float)) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float; got {soft_cap!r}")
