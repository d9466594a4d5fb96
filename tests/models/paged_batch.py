"""Builds paged-forward inputs by hand for model tests (the engine has its own batch builder)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    input_ids: object
    positions: object
    slot_mapping: object
    query_start_loc: object
    seq_lens: object
    block_tables: object
    logits_indices: object
    num_seqs: object


def make_batch(chunks, block_tables, block_size, *, pad_tokens=0, pad_seqs=0, max_blocks=None):
    """chunks: list of (token_ids, start_position) per sequence; block_tables: list of block ids."""
    ids, pos, slots, qsl, lens, logit_idx = [], [], [], [0], [], []
    for (tokens, start), table in zip(chunks, block_tables):
        for i, t in enumerate(tokens):
            p = start + i
            ids.append(t)
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        qsl.append(len(ids))
        lens.append(start + len(tokens))
        logit_idx.append(len(ids) - 1)
    num_seqs = len(chunks)
    ids += [0] * pad_tokens
    pos += [0] * pad_tokens
    slots += [i % block_size for i in range(pad_tokens)]  # the null block 0
    qsl += [qsl[-1]] * pad_seqs
    lens += [0] * pad_seqs
    logit_idx += [0] * pad_seqs
    width = max_blocks or max(len(t) for t in block_tables)
    bt = np.zeros((num_seqs + pad_seqs, width), np.int32)
    for i, t in enumerate(block_tables):
        bt[i, : len(t)] = t
    i32 = lambda a: jnp.asarray(np.asarray(a, np.int32))
    return Batch(i32(ids), i32(pos), i32(slots), i32(qsl), i32(lens), jnp.asarray(bt),
                 i32(logit_idx), jnp.asarray(num_seqs, jnp.int32))
