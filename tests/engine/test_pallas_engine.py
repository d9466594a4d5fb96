"""The engine with the Pallas attention kernel (interpret mode on the CPU) gives the same greedy
tokens as with the `xla` path, on the default model."""

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_to_completion


def test_pallas_interpret_engine_matches_xla(engine):
    from engine.llm_engine import LLMEngine

    pallas = LLMEngine(EngineConfig(
        model="default", attention_backend="pallas", interpret=True, max_num_seqs=2,
        max_num_batched_tokens=32, max_model_len=64, num_kv_blocks=9, token_buckets=(32,),
        seq_buckets=(2,), compilation_cache_dir=None), progress=False)
    assert pallas.attention_backend == "pallas_gpu"
    tok = engine.tokenizer
    prompts = [tok.encode("The capital of France is", add_special_tokens=False),
               tok.encode("1, 2, 3, 4,", add_special_tokens=False)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = [(f"k{i}", p, params) for i, p in enumerate(prompts)]
    got = run_to_completion(pallas, requests)
    want = run_to_completion(engine, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids


def test_pallas_on_the_cpu_without_interpret_is_a_clear_error_at_construction():
    import pytest

    from engine.llm import LLM

    with pytest.raises(ValueError, match="interpret=True"):
        LLM("random:tiny", attention_backend="pallas", max_num_seqs=2, max_num_batched_tokens=16,
            max_model_len=64, compilation_cache_dir=None, progress=False)
