"""Sampling inside the compiled step: penalties, greedy or temperature sampling with top-k, top-p
and min-p filters, per-request seeds, and logprobs.

1. Logprobs are the log-softmax of the raw logits (before penalties and temperature), as in vLLM.
2. Penalties (only when some row uses one): repetition (CTRL-style, over prompt and output),
   then frequency and presence (OpenAI's, over the output).
3. Greedy rows take the argmax of the penalized logits.
4. Other rows divide by their temperature, apply top-k, top-p and min-p (only when some row uses a
   filter: it sorts the vocabulary), and take argmax(logits + Gumbel noise). The noise of a row
   comes from fold_in(key(seed), output index), so a request's tokens depend on its seed alone,
   never on what else is in the batch.
5. Everything the host needs is packed into one float32 array [S, 2 + 2 * num_logprobs]: the
   sampled id, its logprob, the top ids, their logprobs (ids < 2^24 are exact in float32), so a
   step makes one device-to-host copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _apply_penalties(logits, inputs, vocab_size: int):
    hist = inputs.penalty_tokens  # [S, H]: output ids, prompt ids + vocab, -1 none
    rows = jnp.arange(hist.shape[0])[:, None]
    is_output = (hist >= 0) & (hist < vocab_size)
    out_ids = jnp.where(is_output, hist, vocab_size)  # vocab_size = dropped
    counts = jnp.zeros(logits.shape, jnp.float32).at[rows, out_ids].add(1.0, mode="drop")
    any_ids = jnp.where(hist >= 0, hist % vocab_size, vocab_size)
    seen = jnp.zeros(logits.shape, jnp.bool_).at[rows, any_ids].set(True, mode="drop")
    rep = inputs.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - inputs.frequency_penalty[:, None] * counts
    return logits - inputs.presence_penalty[:, None] * (counts > 0)


def _apply_filters(logits, inputs):
    """top-k, top-p and min-p on temperature-scaled logits [S, V]; removed entries become -inf."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(inputs.top_k > 0, jnp.minimum(inputs.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs_sorted = jax.nn.softmax(sorted_desc, axis=-1)
    # top-p keeps the smallest prefix of the sorted tokens whose mass reaches top_p.
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    keep_sorted = mass_before < inputs.top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth, pth)
    # min-p keeps tokens with p >= min_p * p_max, i.e. logit >= max + log(min_p).
    min_logit = sorted_desc[:, :1] + jnp.log(jnp.maximum(inputs.min_p[:, None], 1e-38))
    threshold = jnp.where(inputs.min_p[:, None] > 0, jnp.maximum(threshold, min_logit), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _gumbel(seeds, steps, vocab: int):
    def one(seed, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.gumbel(key, (vocab,), jnp.float32)

    return jax.vmap(one)(seeds, steps)


def sample(logits, inputs, *, num_logprobs: int):
    """logits float32 [S, V] -> packed float32 [S, 2 + 2 * num_logprobs] (see the module doc)."""
    vocab = logits.shape[-1]
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    penalized = jax.lax.cond(inputs.flags[2] > 0, lambda x: _apply_penalties(x, inputs, vocab),
                             lambda x: x, logits)
    greedy_ids = jnp.argmax(penalized, axis=-1)

    def random_ids(x):
        temp = jnp.where(inputs.temperature > 0, inputs.temperature, 1.0)[:, None]
        scaled = x / temp
        scaled = jax.lax.cond(inputs.flags[1] > 0, lambda y: _apply_filters(y, inputs), lambda y: y, scaled)
        return jnp.argmax(scaled + _gumbel(inputs.rng_seeds, inputs.rng_steps, vocab), axis=-1)

    sampled = jax.lax.cond(inputs.flags[0] > 0, random_ids, lambda x: greedy_ids, penalized)
    token_ids = jnp.where(inputs.temperature > 0, sampled, greedy_ids)
    token_logprob = jnp.take_along_axis(logprobs, token_ids[:, None], axis=-1)[:, 0]
    parts = [token_ids.astype(jnp.float32)[:, None], token_logprob[:, None]]
    if num_logprobs:
        def top(x):
            vals, ids = jax.lax.top_k(x, num_logprobs)
            return jnp.concatenate([ids.astype(jnp.float32), vals], axis=-1)

        zeros = lambda x: jnp.zeros((x.shape[0], 2 * num_logprobs), jnp.float32)
        parts.append(jax.lax.cond(inputs.flags[3] > 0, top, zeros, logprobs))
    return jnp.concatenate(parts, axis=-1)
