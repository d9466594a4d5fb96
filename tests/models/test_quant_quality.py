"""Quantized serving keeps the default model's quality (experiments/quant_quality.py): greedy
agreement with transformers' float32 reference outside near-ties (a reference top-2 margin below
0.5, the bf16 report's) and perplexity on held-out text within 3 % of float32 (fp8: 5 %); and the
engine's int8 weights are at most 0.27x float32's bytes.

Both quality tests are `-m slow` (a dense forward of the default model per configuration costs
15-25 s on the 2-core CI machine, and `make test` has no room for it): the first checks int8
weights in both product forms (int8 x int8, the CPU's form from 2 rows; weight-only, its one-row
form) and the int8 KV cache on the three shortest fixture prompts and 128 held-out tokens (one
padded length: one compile per configuration), the second all five prompts and 512 tokens. The
weight bytes run in the default suite.

The int8 x int8 form runs smoothed (models/smoothing.py, alpha 0.5: the engine's default on the
CPU) and meets the goals: 2.3 % perplexity on 512 held-out tokens and 2.5 % on the first 128,
every clear position. Unsmoothed (asserted as measured, BUILD_NOTES.md "Quantization") it keeps
62 of 65 clear positions (42 of 43 on the three shortest prompts), 1.7 % / 2.6 % perplexity here
(3.5 % on 2,048 tokens); its bounds (4 %, 6 %) guard against getting worse. fp8 weights
(weight-only; the tables stay float, models/quant.py) meet both goals: every clear position,
0.8 % perplexity on 512 tokens (with an fp8 tied lm_head they missed 2 of 65). The fp8 KV cache
(K and V held in a rotated head basis, pallas_kernels/kv_quant.py rotate_heads) is within 1 %
and keeps every clear position with the rotation computed as the product by the matrix (served
since stop 46); computed as a fast Walsh-Hadamard transform (stops 42-45, equal to 1e-6) it kept
64 of 65: long_context step 6 (reference margin 0.555) sits at the line. So a failure of that
agreement after a change of arithmetic means that position moved, not that the cache broke:
read its margin (BUILD_NOTES.md "Quantization", stop 46).
"""

import pytest

from experiments.quant_quality import Evaluator, compare

NEAR_TIE = 0.5


@pytest.fixture(scope="module")
def evaluator():
    return Evaluator()


def _check(results, name, max_ratio, agreement=True):
    r = results[name]
    if agreement:
        assert r["clear_agree"] == r["clear_positions"], (name, r["prompts"])
    assert r["perplexity_ratio"] <= max_ratio, (name, r["perplexity_ratio"])


@pytest.mark.slow
def test_int8_weights_and_int8_cache_keep_the_default_model_quality(evaluator):
    shortest = sorted(range(len(evaluator.meta["prompts"])),
                      key=lambda i: len(evaluator.meta["prompts"][i]["prompt_token_ids"]))[:3]
    results = compare(["int8-smooth", "int8", "int8-weight-only", "kv-int8"], near_tie=NEAR_TIE, ppl_tokens=128,
                      prompts=shortest, evaluator=evaluator)
    print({name: (r["clear_agree"], r["perplexity_ratio"], r["kl"]) for name, r in results.items()})
    assert results["float32"]["clear_agree"] == results["float32"]["clear_positions"]
    _check(results, "int8-smooth", 1.03)  # the engine's int8 x int8 form on the CPU
    _check(results, "int8-weight-only", 1.03)
    _check(results, "kv-int8", 1.03)
    _check(results, "int8", 1.06, agreement=False)  # unsmoothed: as measured (module docstring)


@pytest.mark.slow
def test_every_configuration_on_every_prompt(evaluator):
    results = compare(["int8-smooth", "int8", "int8-weight-only", "fp8", "kv-int8", "kv-fp8_e4m3"],
                      near_tie=NEAR_TIE, ppl_tokens=512, evaluator=evaluator)
    print({name: (r["clear_agree"], r["perplexity_ratio"], r["kl"]) for name, r in results.items()})
    _check(results, "int8-smooth", 1.03)
    _check(results, "int8-weight-only", 1.03)
    _check(results, "kv-int8", 1.03)
    _check(results, "int8", 1.04, agreement=False)  # unsmoothed: 62 of 65 (module docstring)
    _check(results, "fp8", 1.05)
    # The fp8 cache (K and V in the rotated basis, kv_quant.rotate_heads): every clear position,
    # one of them at the line (module docstring).
    _check(results, "kv-fp8_e4m3", 1.05)


def test_the_engine_reports_int8_weights_at_most_027x_float32():
    """0.2532 on the default model's shapes (int8 values, float32 scales and norms, and on the CPU
    the int32 code sums its u8 x s8 product reads, models/int8_dot.py: 136.3 of 538.1 MB)."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine

    # The default model's shapes with random weights (drawn by numpy, no GGUF to read): the bytes
    # depend on the shapes only.
    # (quantization_smoothing off: its calibration pass costs 3 s here and adds 576 float32 factors)
    engine = LLMEngine(EngineConfig(model="random:smollm2-135m", quantization="int8", precompile=False,
                                    quantization_smoothing="off",
                                    max_num_seqs=1, max_num_batched_tokens=16, token_buckets=(16,),
                                    seq_buckets=(1,), num_kv_blocks=300, compilation_cache_dir=None),
                       progress=False)
    float32_bytes = engine.model_config.num_params * 4
    ratio = engine.get_stats().weight_bytes_per_device[0] / float32_bytes
    assert 0.25 < ratio <= 0.27, ratio
