"""LoRA adapters under each speculative decoding method and with structured output (random:tiny),
against each adapter's merged model (W + scale * B A; tests/engine/lora_cases.py).

The proposers draft without the adapter and the target verifies with it: the n-gram proposer
reads the tokens, the draft head reads the adapted model's hidden states through weights made
for the base, the draft model is a base model with its own KV cache (no adapter slots). Drafts
only change how many tokens a step keeps, never which, so greedy output under an adapter must be
the merged model's token for token, alone and in a batch of the base model and four adapters:
- one LoRA target runner (four slots, k = 3, keep_hidden for the head) under three engines
  (LLMEngine.from_parts, each its own scheduler and proposer, as test_spec_decode_draft.py does);
- the head is made, not trained: its block adds nothing and its input is the target's own state,
  so it drafts the last token again (accepted where the output repeats, rejected elsewhere);
- structured output: constrained rows (JSON schema, regex) under adapters, beside a row that
  drafts, give the merged model's greedy choice among the tokens the grammar allows at each
  position (the grammar's masks replayed on the host), and text that satisfies the grammar.
"""

import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.structured_output.masks import MaskFiller
from engine.structured_params import StructuredOutputsParams
from tests.engine.lora_cases import KNOBS, SCHEMA, build_setup, check_greedy, run_jobs

K = 3
SPEC = dict(num_speculative_tokens=K, disable_by_batch_size=None, disable_by_token_share=1.0,
            min_acceptance_rate=0.0)
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return build_setup(tmp_path_factory.mktemp("adapters"), num_adapters=4)


def _repeat_head(runner):
    """A draft head that proposes the row's last token k times: fc passes the target's state
    through (its token half zeroed), the attention and MLP outputs are zero, and lm_draft is the
    target's whole lm_head, so each chain step's argmax is the target's at the last position."""
    from engine.spec_decode.draft_head import DraftHeadConfig, DraftHeadProposer, init_params

    config = runner.model_config
    cfg = DraftHeadConfig.for_target(config, draft_vocab_size=config.vocab_size, intermediate_size=32,
                                     target="random:tiny", num_speculative_tokens=K)
    params = init_params(cfg, jax.random.key(0))
    params["fc"] = params["fc"].at[cfg.hidden_size:].set(0.0)
    params["layer"]["wo"] = jnp.zeros_like(params["layer"]["wo"])
    params["layer"]["w_down"] = jnp.zeros_like(params["layer"]["w_down"])
    return DraftHeadProposer(runner, cfg, params, np.arange(runner.sample_vocab_size, dtype=np.int32), K)


@pytest.fixture(scope="module")
def engines():
    """method -> an engine over one LoRA target runner (four slots, k = 3, keeping its hidden
    states for the head), each with its own scheduler (LLMEngine.from_parts, as
    test_spec_decode_draft.py does); the draft model has a runner of its own, without adapter
    slots."""
    from engine.core.builder import build_draft_proposer, build_parts, scheduler_config_for
    from engine.core.llm_engine import LLMEngine
    from scheduler import Scheduler

    parts = build_parts(EngineConfig(**KNOBS, max_loras=4, speculative_config=dict(SPEC, method="ngram")),
                        keep_hidden=True, progress=False)
    runner = parts.runner
    made = {}
    for method, proposer in (("ngram", None), ("draft_head", _repeat_head(runner)), ("draft_model", "draft")):
        config = EngineConfig(**KNOBS, max_loras=4, speculative_config=dict(
            SPEC, method=method, model=None if method == "ngram" else "random:tiny",
            draft_confidence_threshold=0.0))
        if proposer == "draft":
            proposer = build_draft_proposer(config, runner.shapes, parts, dtype=parts.dtype,
                                            backend=parts.attention_backend, platform="cpu",
                                            max_model_len=parts.max_model_len, progress=False)
            assert proposer.runner.lora is None  # the draft never sees an adapter
        scheduler = Scheduler(scheduler_config_for(config, max_model_len=parts.max_model_len,
                                                   num_blocks=parts.scheduler.config.num_blocks))
        made[method] = LLMEngine.from_parts(config, scheduler=scheduler, runner=runner, tokenizer=parts.tokenizer,
                                            proposer=proposer, lora_manager=parts.lora_manager)
    yield made
    assert len(runner.table) == 0 and not runner.lora.slot_of_req
    assert len(made["draft_model"].spec.proposer.runner.table) == 0


@pytest.mark.parametrize("method", ["ngram", "draft_head", "draft_model"])
def test_drafts_without_the_adapter_keep_the_merged_models_greedy_output(setup, engines, method):
    engine = engines[method]
    before = engine.get_stats().spec_decode
    prompts, loras = setup["prompts"], setup["requests"]
    alone, _ = run_jobs(engine, [("alone", prompts[1], loras[0])], GREEDY)
    check_greedy(setup, 1, prompts[1], alone["alone"], NEW_TOKENS)
    jobs = [("base", prompts[0], None)] + [(f"m{i}", prompts[i + 1], loras[i]) for i in range(4)]
    outs, most = run_jobs(engine, jobs, GREEDY)
    assert most == 4  # the base model and four adapters in the same steps
    check_greedy(setup, 0, prompts[0], outs["base"], NEW_TOKENS)
    for i in range(4):
        check_greedy(setup, i + 1, prompts[i + 1], outs[f"m{i}"], NEW_TOKENS)
    assert outs["m0"].outputs[0].token_ids == alone["alone"].outputs[0].token_ids
    # m0 found alone's first block in the prefix cache (same adapter, same prompt): its K/V, and
    # the draft model's there (base-draft K/V, right under any adapter), were reused
    assert outs["m0"].metrics.num_cached_tokens == 16
    stats = engine.get_stats().spec_decode
    assert stats.method == method
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0  # drafts were verified with adapters
    if method != "ngram":
        assert 0 < accepted < drafted  # some kept, some rejected


REGEX = r"[0-9]{3}-[a-z]{2,4}"


def _masked_greedy(engine, setup, which, prompt, so, tokens) -> list[int]:
    """The merged model's greedy token at each position of `tokens` among those the grammar
    allows there (its state advanced by the tokens before), teacher forced."""
    state = engine.compile_grammar(so).new_state()
    vocab = engine.runner.sample_vocab_size
    logp = setup["reference"](which, prompt, tokens)[:, :vocab]
    width = -(-vocab // 32)
    filler = MaskFiller(1)
    choices = []
    for i, token in enumerate(tokens):
        mask = np.zeros((1, width), np.int32)
        filler.fill([state], np.zeros(1, np.int64), mask)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        choices.append(int(np.argmax(np.where(allowed, logp[i], -np.inf))))
        assert state.accept([token])
    assert state.finished
    return choices


def test_structured_output_under_adapters_is_the_merged_models_constrained_greedy(setup, engines):
    engine = engines["draft_model"]
    prompts, loras = setup["prompts"], setup["requests"]
    json_so, regex_so = StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)
    constrained = {"json0": (1, json_so, prompts[1], loras[0]), "regex1": (2, regex_so, prompts[2], loras[1]),
                   "json3": (4, json_so, prompts[3], loras[3]), "regex_base": (0, regex_so, prompts[4], None)}
    jobs = [(rid, prompt, lora, SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so))
            for rid, (_, so, prompt, lora) in constrained.items()]
    jobs += [("free0", prompts[4], loras[0], GREEDY)]  # drafts beside the constrained rows
    before = engine.get_stats().spec_decode.num_draft_tokens
    outs, most = run_jobs(engine, jobs)
    assert most == 3
    assert engine.get_stats().spec_decode.num_draft_tokens > before
    check_greedy(setup, 1, prompts[4], outs["free0"], NEW_TOKENS)
    for rid, (which, so, prompt, _) in constrained.items():
        out = outs[rid].outputs[0]
        assert out.error is None and out.finish_reason == "stop", (rid, out.text)
        if so.regex:
            assert re.fullmatch(REGEX, out.text), (rid, out.text)
        else:
            jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids == _masked_greedy(engine, setup, which, prompt, so, out.token_ids), rid
