"""Speculative decoding with a draft model (random:tiny drafting for random:tiny, its own runner
and KV cache over the target's block tables): the same tokens as without drafts, greedy and
seeded, alone and in a batch of 16, through preemption and prefix caching, without recompiles.

The draft has the target's weights, so greedy drafts are always accepted (every step takes the
path where the draft catches up on its last draft) and sampled ones (temperature 8) often are not.
"""

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import TINY_KNOBS
from tests.engine.test_spec_decode_tiny import (
    _prompts,
    same_tokens_on_and_off,
    same_tokens_through_preemption_and_prefix_caching,
)

DRAFT_KNOBS = dict(
    TINY_KNOBS, token_buckets=(4, 16, 64),
    speculative_config=dict(method="draft_model", model="random:tiny", num_speculative_tokens=3,
                            disable_by_batch_size=None, disable_by_token_share=1.0,
                            min_acceptance_rate=0.0),
)


@pytest.fixture(scope="module")
def draft_engine(tiny_spec_engine):
    """The target's compiled runner is tiny_spec_engine's (same knobs, k = 3): only the draft's
    runner compiles here. The two engines take turns and leave the runner's table empty."""
    import types

    from engine.core.builder import build_draft_proposer, scheduler_config_for
    from engine.core.llm_engine import LLMEngine
    from scheduler import Scheduler

    config = EngineConfig(**DRAFT_KNOBS)
    target = tiny_spec_engine
    # Requests that finished in the target's last step leave its runner's table only with the
    # next step: flush them, or their slots stay taken under the draft engine's scheduler.
    assert not target.has_unfinished_requests()
    target.step()
    proposer = build_draft_proposer(config, target.runner.shapes, types.SimpleNamespace(tokenizer=target.tokenizer),
                                    dtype=target.dtype, backend=target.attention_backend, platform="cpu",
                                    max_model_len=target.max_model_len, progress=False)
    scheduler = Scheduler(scheduler_config_for(config, max_model_len=target.max_model_len,
                                               num_blocks=target.scheduler.config.num_blocks))
    engine = LLMEngine.from_parts(config, scheduler=scheduler, runner=target.runner,
                                  tokenizer=target.tokenizer, proposer=proposer)
    engine.model_config = target.model_config
    yield engine
    engine.step()  # the last finishes reach both runners
    assert len(target.runner.table) == 0 and len(proposer.runner.table) == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=8.0, seed=4, max_tokens=20, ignore_eos=True, logprobs=1),
], ids=["greedy", "seeded"])
def test_draft_model_gives_the_same_tokens_alone_and_in_a_batch_of_16(draft_engine, params):
    prompts = _prompts(draft_engine.model_config.vocab_size, seed=5)
    drafted, accepted, after = same_tokens_on_and_off(draft_engine, prompts, params)
    assert after.method == "draft_model" and drafted > 0
    if params.temperature == 0:
        assert accepted == drafted  # the draft is the target
    else:
        assert 0 < accepted < drafted


def test_draft_model_through_preemption_and_prefix_caching(draft_engine):
    engine = draft_engine
    same_tokens_through_preemption_and_prefix_caching(engine, seed=6)
    assert len(engine.spec.proposer.runner.table) == 0  # the draft's table followed every leave
