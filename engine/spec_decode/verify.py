"""Verification of drafts inside the compiled step (jax).

A decode row with d drafts has 1 + d consecutive logit rows (the last 1 + d tokens of the row):
logit row j (0 <= j < d) predicts the position of draft j + 1, which is the next input token;
the last one predicts the bonus position. The rows of one request are recognised on the device
by their request-table slot (consecutive logit rows with the same slot), so no extra input field
is needed.

Point-mass drafts (ngram, and any greedy proposer): every logit row is sampled exactly as without
speculation (its own rng step, fold_in(seed, output index)) and the row keeps the longest prefix
whose samples equal the drafts plus the first sample that differs. For greedy rows this is prefix
matching with a bonus token. For temperature > 0 it is rejection sampling with q = one-hot(draft):
the draft survives with probability p(draft) = min(1, p/q), and a rejected position's sample is a
sample of p conditioned on not being the draft, i.e. norm(max(p - q, 0)). Coupling to the
non-speculative stream also makes a seeded request produce the same tokens with speculation on or
off, alone or in any batch.

Drafts with a full distribution q (a sampled draft model) use `rejection_sample`: accept draft j
with probability min(1, p_j(d) / q_j(d)), resample the first rejection from norm(max(p - q, 0)),
and sample the bonus from p when every draft was accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.layers import argmax


def _shift(x, m: int, fill):
    """x[j - m] at j (fill where j < m), for any m (also m >= len(x))."""
    return jnp.concatenate([jnp.full((m,), fill, x.dtype), x])[: x.shape[0]]


def draft_rows(logits_slots, logits_indices, input_ids, capacity: int, logits_targets=None):
    """(is_draft bool[L]: the next input token of this logit row is a draft it verifies,
    draft_ids int32[L]: that token, -1 elsewhere). Prompt-scoring rows (logits_targets >= 0)
    are followed by rows of their own request too, but verify nothing."""
    nxt = jnp.concatenate([logits_slots[1:], jnp.full((1,), capacity, logits_slots.dtype)])
    is_draft = (nxt == logits_slots) & (logits_slots < capacity)
    if logits_targets is not None:
        is_draft &= logits_targets < 0
    nxt_ids = input_ids[jnp.minimum(logits_indices + 1, input_ids.shape[0] - 1)]
    return is_draft, jnp.where(is_draft, nxt_ids, -1)


def earlier_draft_counts(logits_slots, draft_ids, vocab: int, k: int):
    """int32[L, V]: per logit row, how often each token occurs among the drafts before it in its
    row (the outputs it follows if they are accepted: penalties must count them)."""
    num_rows = logits_slots.shape[0]
    counts = jnp.zeros((num_rows, vocab), jnp.int32)
    rows = jnp.arange(num_rows)
    for m in range(1, k + 1):
        same = _shift(logits_slots, m, -1) == logits_slots
        ids = _shift(draft_ids, m, -1)
        counts = counts.at[rows, jnp.where(same & (ids >= 0), ids, vocab)].add(1, mode="drop")
    return counts


def kept_rows(logits_slots, is_draft, draft_ids, token_ids, k: int, capacity: int):
    """bool[L]: the logit row's token is kept (every earlier draft of its row was accepted)."""
    rejected = is_draft & (token_ids != draft_ids)
    kept = logits_slots < capacity
    for m in range(1, k + 1):
        same = _shift(logits_slots, m, -1) == logits_slots
        kept &= ~(same & _shift(rejected, m, False))
    return kept


def rejection_sample(target_probs, draft_probs, draft_ids, uniforms, gumbel):
    """Speculative sampling with a full draft distribution q.

    target_probs f32[N, K+1, V] (p at each draft position and the bonus position),
    draft_probs f32[N, K, V] (q), draft_ids i32[N, K] (drawn from q), uniforms f32[N, K] in [0, 1),
    gumbel f32[N, K+1, V]. Returns (tokens i32[N, K+1]: valid up to and including index
    num_accepted, num_accepted i32[N])."""
    num_drafts = draft_ids.shape[1]
    p_draft = jnp.take_along_axis(target_probs[:, :num_drafts], draft_ids[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
    accept = uniforms * q_draft < p_draft  # u < p / q, without dividing by a zero q
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    residual = jnp.maximum(target_probs[:, :num_drafts] - draft_probs, 0.0)
    # p == q leaves no residual mass; never reached then (u * q < p always), p is a safe stand-in.
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs[:, :num_drafts])
    resample_probs = jnp.concatenate([residual, target_probs[:, num_drafts:]], axis=1)
    resampled = argmax(jnp.log(resample_probs) + gumbel)
    padded = jnp.concatenate([draft_ids, jnp.zeros_like(draft_ids[:, :1])], axis=1)
    positions = jnp.arange(num_drafts + 1)[None, :]
    tokens = jnp.where(positions < num_accepted[:, None], padded, resampled)
    return tokens, num_accepted.astype(jnp.int32)


def uniform_and_gumbel(seeds, steps, shape_v: int):
    """Per row: a uniform (acceptance) and Gumbel noise (resampling) from fold_in(seed, step),
    on streams apart from the sampler's (salted), so they never correlate with its noise."""
    def one(seed, step):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 0x5bec)
        ku, kg = jax.random.split(key)
        return jax.random.uniform(ku, (), jnp.float32), jax.random.gumbel(kg, (shape_v,), jnp.float32)

    return jax.vmap(one)(seeds, steps)
