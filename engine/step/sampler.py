"""Sampling inside the compiled step: penalties, greedy or temperature sampling with top-k, top-p
and min-p filters, per-request seeds, and logprobs, over L logit rows (one per sampled position).

Each logit row belongs to a request-table slot (`inputs.logits_slots`); its sampling values and
penalty state are gathered from the table on the device (request_table.py).

1. Logprobs are the log-softmax of the raw logits (before penalties and temperature), as in vLLM,
   computed only in a step where some row wants them (flags[3]: a request's logprobs, or prompt
   scoring); otherwise the packed logprob columns are zeros and the host reads none. Then (each
   only when some row uses it) the slot's logit-bias row is added (logit_bias, allowed_token_ids,
   single-token bad_words) and the host-filled token mask of constrained rows (structured output)
   sets every disallowed logit to -inf, before anything below.
2. Penalties (only when some row uses one): repetition (CTRL-style, over prompt and output),
   then frequency and presence (OpenAI's, over the output), from the table's token counts.
3. Greedy rows take the argmax of the penalized logits.
4. Other rows divide by their temperature, apply top-k, top-p and min-p (only when some row uses a
   filter: it sorts the vocabulary), and take argmax(logits + Gumbel noise). The noise of a row
   comes from fold_in(key(seed), output index), so a request's tokens depend on its seed alone,
   never on what else is in the batch.
5. Every sampled token is added to its slot's output counts (the next step's penalties).
   With speculative decoding (num_speculative_tokens > 0; engine/spec_decode/verify.py), a row's
   penalties also count the drafts before it in its request, and only the kept tokens (the
   longest prefix whose samples equal the drafts, plus one) are counted.
   Prompt-scoring rows (`logits_targets` >= 0: prompt logprobs) report their prompt token and
   its logprob instead of a sample, and are not counted.
6. Everything the host needs is packed into one float32 array [L, 2 + 2 * num_logprobs]: the
   sampled id, its logprob, the top ids, their logprobs (ids < 2^24 are exact in float32), so a
   step makes one device-to-host copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from engine.spec_decode.verify import draft_rows, earlier_draft_counts, kept_rows
from engine.step.request_table import SAMPLING_FIELDS, TableState
from models.layers import argmax


@dataclasses.dataclass
class _Rows:
    """The table's sampling values gathered for each logit row."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    seed: jax.Array


def _apply_penalties(logits, rows: _Rows, table: TableState, slots, draft_counts=None):
    counts = table.output_counts[slots]  # [L, V]
    if draft_counts is not None:  # the drafts before a row are its outputs if accepted
        counts = counts + draft_counts()
    counts = counts.astype(jnp.float32)
    seen = table.prompt_mask[slots] | (counts > 0)
    rep = rows.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty[:, None] * counts
    return logits - rows.presence_penalty[:, None] * (counts > 0)


def _apply_filters(logits, rows: _Rows):
    """top-k, top-p and min-p on temperature-scaled logits [L, V]; removed entries become -inf."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(rows.top_k > 0, jnp.minimum(rows.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    # top-p keeps the smallest prefix of the sorted tokens whose mass reaches top_p.
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = mass_before < rows.top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    # min-p keeps tokens with p >= min_p * p_max, i.e. logit >= max + log(min_p).
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(rows.min_p[:, None], 1e-38))
    threshold = jnp.where(rows.min_p[:, None] > 0, jnp.maximum(threshold, min_logit), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _apply_token_mask(logits, inputs):
    """-inf where a constrained row's packed mask bit is 0 (rows with mask_index L keep all)."""
    num_rows, vocab = logits.shape
    index = inputs.mask_index
    words = inputs.token_mask[jnp.minimum(index, num_rows - 1)]  # [L, W]
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [L, W, 32], bit j of word w
    allowed = bits.reshape(num_rows, -1)[:, :vocab] != 0
    allowed = allowed | (index >= num_rows)[:, None]
    return jnp.where(allowed, logits, -jnp.inf)


def _gumbel(seeds, steps, vocab: int):
    def one(seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(one)(seeds, steps)


def sample(logits, inputs, table: TableState, *, num_logprobs: int, num_speculative_tokens: int = 0):
    """logits float32 [L, V] -> (table with counts updated, packed float32 [L, 2 + 2k])."""
    vocab = logits.shape[-1]
    slots = inputs.logits_slots  # padding rows hold R: gathers clamp, the count update drops them
    capacity = table.temperature.shape[0]
    gather_slots = jnp.minimum(slots, capacity - 1)
    rows = _Rows(**{name: getattr(table, name)[gather_slots] for name, _, _ in SAMPLING_FIELDS})
    raw_logits = logits  # logprobs are of the raw logits (below, only when some row wants them)
    k = num_speculative_tokens
    draft_counts = None
    if k:
        is_draft, draft_ids = draft_rows(slots, inputs.logits_indices, inputs.input_ids, capacity,
                                         inputs.logits_targets)
        draft_counts = lambda: earlier_draft_counts(slots, draft_ids, vocab, k)  # noqa: E731
    logits = jax.lax.cond(inputs.flags[5] > 0, lambda x: x + table.logit_bias[gather_slots],
                          lambda x: x, logits)
    logits = jax.lax.cond(inputs.flags[4] > 0, lambda x: _apply_token_mask(x, inputs), lambda x: x, logits)
    penalized = jax.lax.cond(inputs.flags[2] > 0,
                             lambda x: _apply_penalties(x, rows, table, gather_slots, draft_counts),
                             lambda x: x, logits)
    greedy_ids = argmax(penalized)

    def random_ids(x):
        temp = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
        scaled = x / temp
        scaled = jax.lax.cond(inputs.flags[1] > 0, lambda y: _apply_filters(y, rows), lambda y: y, scaled)
        return argmax(scaled + _gumbel(rows.seed, inputs.logits_steps, vocab))

    sampled = jax.lax.cond(inputs.flags[0] > 0, random_ids, lambda x: greedy_ids, penalized)
    token_ids = jnp.where(rows.temperature > 0, sampled, greedy_ids).astype(jnp.int32)
    # Prompt-scoring rows report their prompt token (its logprob below) and are no outputs.
    scoring = inputs.logits_targets >= 0
    token_ids = jnp.where(scoring, inputs.logits_targets, token_ids)
    counted = jnp.where(scoring, capacity, slots)
    if k:  # rows after a rejected draft are not outputs: their tokens are not counted
        kept = kept_rows(slots, is_draft, draft_ids, token_ids, k, capacity)
        table = table.count_tokens(jnp.where(kept, counted, capacity), token_ids)
    else:
        table = table.count_tokens(counted, token_ids)
    parts = [token_ids.astype(jnp.float32)[:, None]]
    parts.append(jax.lax.cond(inputs.flags[3] > 0, _logprobs(num_logprobs), _no_logprobs(num_logprobs),
                              raw_logits, token_ids))
    return table, jnp.concatenate(parts, axis=-1)


def _logprobs(num_logprobs: int):
    """(logits [L, V], token_ids [L]) -> float32 [L, 1 + 2 * num_logprobs]: each token's logprob,
    then the top ids and their logprobs."""
    def fn(logits, token_ids):
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        parts = [jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)]
        if num_logprobs:
            vals, ids = jax.lax.top_k(logprobs, num_logprobs)
            parts += [ids.astype(jnp.float32), vals]
        return jnp.concatenate(parts, axis=-1)

    return fn


def _no_logprobs(num_logprobs: int):
    """_logprobs' shape, zeros: no row of the step wants logprobs (flags[3] is 0), so the host
    reads none (step_result.read_result), and the log-softmax over the vocabulary is skipped
    (~0.5 ms of an 8-row step on the CPU, the default model; BUILD_NOTES.md "Quantization", stop 46)."""
    return lambda logits, token_ids: jnp.zeros((logits.shape[0], 1 + 2 * num_logprobs), jnp.float32)
