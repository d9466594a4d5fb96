"""Speculative decoding with the draft head (engine/spec_decode/draft_head.py) on random:tiny.

The head is trained here by `python -m experiments.train_draft` itself (random:tiny, a few
prompts, a few optimizer steps, in a subprocess: its absl flags are global), and the engine loads
it from the saved folder as `speculative_config={"method": "draft_head", "model": <folder>}`.
Whatever the head drafts, verification keeps the target's tokens: greedy and seeded outputs must
equal those of the same compiled engine with drafting off (`spec_off`), alone and in a batch of
16, through preemption, prefix caching and aborts, with no compile after warm-up. A temperature
of 8 gives rejections (random:tiny's logits are very peaked).
"""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_head import (
    DraftHeadConfig,
    DraftHeadProposer,
    draft_chain,
    init_params,
    load_head,
    save_head,
    shared_from_target,
)
from tests.engine.conftest import TINY_KNOBS, run_to_completion, scheduler_as
from tests.engine.test_spec_decode_tiny import (
    _prompts,
    same_tokens_on_and_off,
    same_tokens_through_preemption_and_prefix_caching,
)

# Trains a head, then serves it: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = dict(method="draft_head", num_speculative_tokens=3, disable_by_batch_size=None,
            disable_by_token_share=1.0, min_acceptance_rate=0.0)


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory):
    """(folder, stdout) of train_draft on random:tiny at a toy size."""
    out = tmp_path_factory.mktemp("head") / "tiny"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train_draft", "--model=random:tiny", f"--out={out}",
         "--num_prompts=6", "--num_eval_prompts=2", "--output_len=12", "--max_num_seqs=8",
         "--steps=8", "--batch_size=16", "--draft_vocab_size=64", "--intermediate_size=32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


@pytest.fixture(scope="module")
def head_engine(trained_head):
    from engine.core.llm_engine import LLMEngine

    knobs = dict(TINY_KNOBS, token_buckets=(4, 16, 64), speculative_config=dict(SPEC, model=str(trained_head[0])))
    engine = LLMEngine(EngineConfig(**knobs), progress=False)
    yield engine
    engine.step()  # the last finishes reach the runner's table
    assert len(engine.runner.table) == 0


def test_train_draft_end_to_end_saves_a_head_that_loads(trained_head):
    folder, stdout = trained_head
    assert "held-out top-1 acceptance" in stdout
    meta = json.loads((folder / "draft_head.json").read_text())
    held_out = meta["summary"]["held_out"]
    assert 0.0 <= held_out["top1_acceptance"] <= 1.0 and held_out["num_positions"] > 0
    assert 1.0 <= held_out["mean_accepted_length"] <= 4.0
    assert meta["summary"]["command"].startswith("python -m experiments.train_draft --model=random:tiny")
    cfg, params, vocab_map, summary = load_head(folder)
    assert summary == meta["summary"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size) == (64, 32, 64)
    assert vocab_map.shape == (64,) and len(set(vocab_map.tolist())) == 64
    assert params["fc"].shape == (128, 64) and params["layer"]["w_down"].shape == (32, 64)


def _check_hidden_rows(engine):
    """Wraps the proposer: before each proposal, every greedy request's kept hidden row must give
    (through the target's final norm and lm_head) the very token the request last received."""
    proposer = engine.spec.proposer
    full = shared_from_target(engine.runner.params, np.arange(engine.runner.sample_vocab_size))
    checked = [0]
    propose = proposer.propose

    def checking(requests):
        hidden = np.asarray(engine.runner.hidden) if engine.runner.hidden is not None else None
        for r in requests:
            row = engine.runner.hidden_rows.get(r.req_id)
            if row is None or r.sampling.temperature > 0:
                continue
            logits = np.asarray(draft_logits(full, hidden[row]))
            assert int(np.argmax(logits)) == r.output_token_ids[-1], r.req_id
            checked[0] += 1
        return propose(requests)

    proposer.propose = checking
    return checked, lambda: setattr(proposer, "propose", propose)


def draft_logits(shared, hidden_row):
    from models.llama import rms_norm

    return rms_norm(jnp.asarray(hidden_row)[None], shared["final_norm"], 1e-5) @ shared["lm_draft"]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=8.0, seed=4, max_tokens=20, ignore_eos=True, logprobs=1),
], ids=["greedy", "seeded"])
def test_draft_head_gives_the_same_tokens_alone_and_in_a_batch_of_16(head_engine, params):
    prompts = _prompts(head_engine.model_config.vocab_size, seed=7)
    checked, restore = _check_hidden_rows(head_engine)
    try:
        drafted, accepted, after = same_tokens_on_and_off(head_engine, prompts, params)
    finally:
        restore()
    assert after.method == "draft_head" and drafted > 0 and accepted > 0
    assert accepted < drafted  # rejections rolled back (the toy head is a poor drafter)
    if params.temperature == 0:
        assert checked[0] > 50  # the kept hidden rows were checked on every drafting step


def test_draft_head_through_preemption_prefix_caching_and_aborts_compiles_nothing(head_engine):
    from tests.scheduler.conftest import _check_invariants

    engine = head_engine
    same_tokens_through_preemption_and_prefix_caching(engine, seed=8)
    before = engine.get_stats().num_compilations

    # 120 requests with random aborts, stop strings, stop ids and penalties in a small pool.
    rng = np.random.default_rng(3)
    vocab = engine.model_config.vocab_size
    many = _prompts(vocab, n=120, seed=9)
    with scheduler_as(engine, num_kv_blocks=41) as sched:
        pending, aborted, finished = list(range(120)), 0, 0
        while pending or engine.has_unfinished_requests():
            while pending and len(engine._requests) < 24:
                i = pending.pop()
                p = SamplingParams(temperature=float(rng.choice([0.0, 8.0])), seed=i,
                                   max_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                                   stop=[engine.tokenizer.decode([int(rng.integers(40, 120))])] if i % 3 == 0 else [],
                                   stop_token_ids=[int(rng.integers(2, vocab))] if i % 3 == 1 else [],
                                   frequency_penalty=0.5 if i % 5 == 0 else 0.0)
                engine.add_request(f"z{i}", many[i] * 2, p)
            finished += sum(out.finished for out in engine.step())
            if rng.random() < 0.1 and engine._requests:
                aborted += engine.abort_request(sorted(engine._requests)[0])
        assert finished + aborted == 120 and aborted > 3
        assert sched.stats.num_preemptions > 0
        engine.step()
        _check_invariants(sched)
        assert sched.stats.num_used_blocks == 0 and len(engine.runner.table) == 0
    assert engine.get_stats().num_compilations == before


def test_stats_and_switches_are_the_common_ones(head_engine):
    from engine.metrics import ServerMetrics
    from engine.spec_decode.base import make_spec_decoder
    from engine.speculative_config import SpeculativeConfig

    engine = head_engine
    prompts = _prompts(engine.model_config.vocab_size, seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = SpeculativeConfig(method="draft_head", model="unused-here", num_speculative_tokens=3,
                               disable_by_batch_size=4, min_acceptance_rate=0.0)
    spec = engine.spec
    engine.spec = make_spec_decoder(config, engine.runner, max_num_batched_tokens=engine.config.max_num_batched_tokens,
                                    proposer=spec.proposer)
    try:
        run_to_completion(engine, [(f"sw{i}", p, params) for i, p in enumerate(prompts)])
        stats = engine.get_stats().spec_decode
    finally:
        engine.spec = spec
    assert stats.method == "draft_head" and stats.num_switch_offs >= 1 and stats.num_drafts > 0
    assert stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts
    text = ServerMetrics().render(engine.get_stats())
    assert "jaxserve:spec_decode_num_draft_tokens_total" in text


def test_chain_feeds_its_own_drafts_and_the_proposer_matches_it(head_engine):
    """Own-draft drafting equals teacher forcing with those drafts as the fed tokens; the engine's
    compiled proposal equals draft_chain on the same rows, cut where the confidence (running
    product of top-1 probabilities) falls under the threshold; a request that did not sample in
    the last step gets no drafts."""
    proposer = head_engine.spec.proposer
    cfg, params, shared = proposer.cfg, proposer.params, proposer.shared
    rng = np.random.default_rng(0)
    feature = jnp.asarray(rng.normal(size=(5, cfg.hidden_size)) * 3, jnp.float32)
    first = jnp.asarray(rng.integers(0, 256, 5), jnp.int32)
    logits, own, _ = draft_chain(params, shared, cfg, feature, first[:, None], 3)
    confidence = np.cumprod(np.asarray(jax.nn.softmax(logits, axis=-1)).max(axis=-1), axis=1)
    fed = jnp.concatenate([first[:, None], own[:, :2]], axis=1)
    _, forced, _ = draft_chain(params, shared, cfg, feature, fed, 3)
    np.testing.assert_array_equal(own, forced)
    assert set(np.asarray(own).ravel().tolist()) <= set(np.asarray(shared["vocab_map"]).tolist())

    from scheduler import Request

    runner = head_engine.runner
    saved = runner.hidden, runner.hidden_rows
    hidden = jnp.zeros((proposer._hidden_shape.shape), jnp.float32).at[3:8].set(feature)
    a, b, c = Request("a", [1, 2], 9), Request("b", [5], 9), Request("c", [7], 9)
    a.output_token_ids.append(int(first[0]))
    b.output_token_ids.append(int(first[4]))
    runner.hidden, runner.hidden_rows = hidden, {"a": 3, "b": 7}
    threshold = proposer.min_confidence
    try:
        proposer.min_confidence = 0.0
        drafts = proposer.propose([a, c, b])
        proposer.min_confidence = float(np.median(confidence[[0, 4]]))
        cut = proposer.propose([a, c, b])
    finally:
        runner.hidden, runner.hidden_rows = saved
        proposer.min_confidence = threshold
    assert drafts == [np.asarray(own[0]).tolist(), [], np.asarray(own[4]).tolist()]
    keep = [(confidence[i] >= np.median(confidence[[0, 4]])).sum() for i in (0, 4)]
    assert cut == [drafts[0][: keep[0]], [], drafts[2][: keep[1]]] and 0 < sum(keep) < 6


def test_bad_heads_are_refused_naming_the_key(head_engine, tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model"):
        EngineConfig(speculative_config=dict(method="draft_head"))
    with pytest.raises(ValueError, match="speculative_config.model=.*not a draft head folder"):
        load_head(tmp_path)
    # A head trained for another target (hidden size 32 vs random:tiny's 64).
    import dataclasses

    from models.config import preset_config

    other = dataclasses.replace(preset_config("tiny"), hidden_size=32)
    cfg = DraftHeadConfig.for_target(other, draft_vocab_size=16)
    save_head(tmp_path / "other", cfg, init_params(cfg, jax.random.key(0)), np.arange(16))
    cfg, params, vocab_map, _ = load_head(tmp_path / "other")
    with pytest.raises(ValueError, match="speculative_config.model: the head was trained for hidden size 32"):
        DraftHeadProposer(head_engine.runner, cfg, params, vocab_map, 3, precompile=False)
    # A target runner that does not keep its hidden states.
    with pytest.raises(ValueError, match="keep_hidden"):
        DraftHeadProposer(object(), cfg, params, vocab_map, 3, precompile=False)


def test_lm_draft_is_the_targets_own_head_in_every_layout():
    """An untied target: the head's truncated lm_head is the target's lm_head at the draft ids,
    whether the target's params are the loaders' layout (lm_head [e, v]) or the served one
    (output_proj [v, e], what a runner holds)."""
    import dataclasses

    from engine.spec_decode.draft_head import shared_from_target
    from models.config import preset_config
    from models.random_weights import random_params
    from models.served_layout import fuse_projections

    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False)
    loader = random_params(config, seed=3)
    ids = np.array([5, 1, 77, 30], np.int32)
    expected = np.asarray(loader["lm_head"])[:, ids]
    for params in (loader, fuse_projections(loader)):
        np.testing.assert_allclose(np.asarray(shared_from_target(params, ids)["lm_draft"]), expected)
