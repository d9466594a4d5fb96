"""Speculative decoding parts on their own: the n-gram lookup, the two switches, the config, and
verification on synthetic distributions (the rejection-sampling chi-square test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from engine.config import EngineConfig
from engine.spec_decode.ngram import NgramProposer, longest_suffix_match
from engine.spec_decode.switch import AcceptanceTracker, LoadSwitch
from engine.spec_decode.verify import draft_rows, earlier_draft_counts, kept_rows, rejection_sample
from engine.speculative_config import SpeculativeConfig
from scheduler import Request


def test_ngram_takes_the_longest_suffix_within_min_max_and_its_latest_full_continuation():
    t = np.array([1, 2, 3, 9, 9, 9, 7, 2, 3, 8, 8, 8, 1, 2, 3], np.int32)
    # [1, 2, 3] occurred at 0..2 (continuation 9 9 9); [2, 3] also at 7..8, but shorter.
    assert longest_suffix_match(t, 1, 3, 3) == 3
    # max 2: the suffix [2, 3] matches twice; the latest (7..8) wins: continuation 8 8 8.
    assert longest_suffix_match(t, 1, 2, 3) == 9
    # min 4: no suffix of 4 tokens occurred before.
    assert longest_suffix_match(t, 4, 5, 3) is None
    assert longest_suffix_match(np.array([4, 5, 6], np.int32), 1, 3, 2) is None
    # A latest match whose continuation is shorter than k gives way to an earlier full one.
    t = np.array([5, 1, 2, 3, 4, 5, 6, 5], np.int32)
    assert longest_suffix_match(t, 1, 1, 3) == 1 and longest_suffix_match(t, 1, 1, 1) == 6


def test_ngram_proposer_follows_growing_requests_and_caps_drafts_at_k():
    proposer = NgramProposer(2, 1, 3)
    request = Request("a", [1, 2, 3, 4, 1, 2], 10)
    assert proposer.propose([request]) == [[3, 4]]
    request.output_token_ids += [3, 4, 1]
    other = Request("b", [7, 8, 9], 10)
    assert proposer.propose([request, other]) == [[2, 3], []]
    reused = Request("a", [6, 6], 10)  # a new request under an old id is looked up afresh
    assert proposer.propose([reused]) == [[6]]


def test_load_switch_has_hysteresis_and_counts_switch_offs():
    switch = LoadSwitch(k=3, disable_by_batch_size=8, disable_by_token_share=0.5,
                        enable_hysteresis=0.75, max_num_batched_tokens=256)
    assert [switch.update(n) for n in (1, 8, 9, 8, 7, 6, 9, 2)] == [
        True, True, False, False, False, True, False, True]
    assert switch.num_switch_offs == 2 and switch.num_steps_off == 4
    # The token share: 40 rows * 4 tokens > half of 256 even with no batch-size limit.
    switch = LoadSwitch(k=3, disable_by_batch_size=None, disable_by_token_share=0.5,
                        enable_hysteresis=0.75, max_num_batched_tokens=256)
    assert [switch.update(n) for n in (32, 33, 25, 24)] == [True, False, False, True]


def test_acceptance_tracker_disables_low_acceptance_and_probes_again():
    tracker = AcceptanceTracker(min_acceptance_rate=0.3, alpha=0.5, probe_interval=3)
    assert tracker.wants_drafts("a")
    for _ in range(3):
        tracker.observe("a", 4, 0)  # EMA 0.5, 0.25 (disabled), 0.125
    assert tracker.num_request_disables == 1
    assert [tracker.wants_drafts("a") for _ in range(6)] == [False, False, True, False, False, True]
    tracker.observe("a", 4, 4)  # a good probe: 0.5625, back on
    assert tracker.wants_drafts("a") and tracker.wants_drafts("b")
    tracker.forget("a")
    assert tracker.ema("a") is None


@pytest.mark.parametrize("bad, match", [
    (dict(method="eagle9"), "speculative_config.method"),
    (dict(num_speculative_tokens=0), "speculative_config.num_speculative_tokens"),
    (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max"),
    (dict(method="draft_model"), "speculative_config.model"),
    (dict(method="draft_head"), "speculative_config.model"),
    (dict(disable_by_token_share=0), "disable_by_token_share"),
    (dict(min_acceptance_rate=1.5), "min_acceptance_rate"),
    (dict(num_speculative_tokens=3, lookahead=2), "unknown key"),
])
def test_bad_speculative_config_names_the_knob(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=bad)


def test_speculative_config_from_a_dict_and_the_budget_check():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5)
    assert EngineConfig().speculative_config is None
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=4, speculative_config={"num_speculative_tokens": 4})
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        EngineConfig(speculative_config="ngram")


def test_draft_rows_kept_rows_and_earlier_draft_counts():
    # Two requests: slot 0 with 2 drafts (tokens 5, 6 at input 1, 2), slot 3 a plain decode,
    # then padding (slot R = 8).
    slots = jnp.array([0, 0, 0, 3, 8, 8], jnp.int32)
    indices = jnp.array([0, 1, 2, 3, 0, 0], jnp.int32)
    inputs = jnp.array([4, 5, 6, 7, 0, 0], jnp.int32)
    is_draft, ids = draft_rows(slots, indices, inputs, 8)
    assert is_draft.tolist() == [True, True, False, False, False, False]
    assert ids.tolist() == [5, 6, -1, -1, -1, -1]
    # Samples 5 (= draft), 9 (!= 6), 2: rows 0, 1 kept; row 2 follows a rejection.
    kept = kept_rows(slots, is_draft, ids, jnp.array([5, 9, 2, 1, 0, 0]), 3, 8)
    assert kept.tolist() == [True, True, False, True, False, False]
    counts = earlier_draft_counts(slots, ids, 10, 3)
    assert counts[1].tolist() == [0] * 5 + [1, 0, 0, 0, 0]
    assert counts[2, 5] == 1 and counts[2, 6] == 1 and counts[2].sum() == 2
    assert counts[0].sum() == 0 and counts[3].sum() == 0


V, K, N = 4, 2, 20_000


@jax.jit
def _speculative_chains(target, draft, key):
    """N independent generations of 3 tokens after token 0, each by speculative steps of K drafts
    from the `draft` Markov chain verified against the `target` chain; also the drafts alone."""
    def one(key):
        def step(carry, key):
            out, n = carry
            last = out[jnp.maximum(n - 1, 0)] * (n > 0)  # token 0 starts the chain
            kd, ku, kg = jax.random.split(key, 3)
            d1 = jax.random.categorical(jax.random.fold_in(kd, 1), jnp.log(draft[last]))
            d2 = jax.random.categorical(jax.random.fold_in(kd, 2), jnp.log(draft[d1]))
            drafts = jnp.stack([d1, d2]).astype(jnp.int32)
            p = jnp.stack([target[last], target[d1], target[d2]])[None]
            q = jnp.stack([draft[last], draft[d1]])[None]
            u = jax.random.uniform(ku, (1, K))
            g = jax.random.gumbel(kg, (1, K + 1, V))
            tokens, num_accepted = rejection_sample(p, q, drafts[None], u, g)
            emit = jnp.arange(K + 1) <= num_accepted[0]
            idx = jnp.where(emit, n + jnp.arange(K + 1), out.shape[0])
            out = out.at[idx].set(tokens[0], mode="drop")
            return (out, n + num_accepted[0] + 1), drafts

        (out, _), drafts = jax.lax.scan(step, (jnp.zeros(3 * (K + 1), jnp.int32), 0), jax.random.split(key, 3))
        return out[:3], jnp.concatenate([drafts[0], drafts[1][:1]])

    return jax.vmap(one)(jax.random.split(key, N))


def test_rejection_sampling_preserves_the_target_distribution_of_the_first_3_tokens():
    rng = np.random.default_rng(0)
    target = rng.dirichlet(np.ones(V), V).astype(np.float32)
    draft = rng.dirichlet(np.ones(V) * 0.5, V).astype(np.float32)  # deliberately different
    draft[:, 2] = 0  # a token the draft never proposes still comes out at its target rate
    draft /= draft.sum(1, keepdims=True)
    samples, drafts_only = _speculative_chains(jnp.asarray(target), jnp.asarray(draft), jax.random.key(7))
    samples, drafts_only = np.asarray(samples), np.asarray(drafts_only)

    def chain_probs(m):
        m = m.astype(np.float64)
        return np.einsum("a,ab,bc->abc", m[0], m, m).ravel()  # P(x1, x2, x3) after token 0

    expected = chain_probs(target) * N
    big = expected >= 5  # cells expected fewer than 5 times are pooled into one (chi-square rule)

    def pvalue(tokens):
        cells = tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]
        observed = np.bincount(cells, minlength=V**3)
        obs = np.append(observed[big], observed[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        return sps.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

    assert big.sum() >= 20 and np.bincount(samples[:, 0], minlength=V)[2] > 0
    assert pvalue(samples) > 0.01
    # The test has power: the drafts alone follow the draft chain, far from the target's.
    assert pvalue(drafts_only) < 1e-6
