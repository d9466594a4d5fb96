"""The engine with the Pallas attention kernel (interpret mode on the CPU) samples the same tokens
as with the `xla` path (the same random:tiny weights: the mechanism, not the numerics, is the
point here; tests/pallas_kernels checks every kernel against a float64 oracle), and Pallas on the
CPU without interpret mode is a clear error at construction."""

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import TINY_KNOBS, run_to_completion


def test_pallas_interpret_engine_matches_xla(tiny_engine):
    from engine.core.llm_engine import LLMEngine

    knobs = dict(TINY_KNOBS, attention_backend="pallas", interpret=True, token_buckets=(1, 16, 64),
                 seq_buckets=(4,), max_num_seqs=4, prompt_scoring_bucket=False)
    pallas = LLMEngine(EngineConfig(**knobs), progress=False)
    assert pallas.attention_backend == "pallas_gpu"
    prompts = [[(5 * k + 3) % 250 + 2 for k in range(n)] for n in (7, 23, 40)]
    # Seeded sampling at a high temperature: random:tiny's greedy tokens are too peaked to tell
    # kernels apart, sampled ones follow every logit.
    requests = [(f"k{i}", p, SamplingParams(temperature=40.0, seed=i, max_tokens=8, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = run_to_completion(pallas, requests)
    want = run_to_completion(tiny_engine, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
    assert len({tuple(got[rid].outputs[0].token_ids) for rid, _, _ in requests}) == 3


def test_pallas_on_the_cpu_without_interpret_is_a_clear_error_at_construction():
    from engine.frontends.llm import LLM

    with pytest.raises(ValueError, match="interpret=True"):
        LLM("random:tiny", attention_backend="pallas", max_num_seqs=2, max_num_batched_tokens=16,
            max_model_len=64, compilation_cache_dir=None, progress=False)
