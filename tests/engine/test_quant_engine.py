"""The engine with int8 weights and an int8 KV cache (random:tiny): greedy output equals the dense
oracle with the same quantization, alone, batched, chunked with prefix caching, and preempted; the
cache's scales are donated with it; knobs refused by name.

The engine pins the int8 x int8 form for every bucket (quantization_activation_rows=0): the CPU's
per-bucket rule runs one-row steps weight-only, another rounding than the batched buckets, so
batch invariance holds per form, and across forms only outside near-ties (the default-model
quality test, tests/models/test_quant_quality.py). The weight-only form is checked against the
dense oracle at the model level (tests/models/test_quant.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from models.llama import forward_dense
from pallas_kernels.kv_quant import ScaledCache
from tests.engine.conftest import TINY_KNOBS, run_to_completion, scheduler_as

KNOBS = dict(TINY_KNOBS, quantization="int8", quantization_activation_rows=0, kv_cache_dtype="int8",
             token_buckets=(1, 64), max_model_len=128, prompt_scoring_bucket=False)
NEW_TOKENS = 10
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((40, 23, 9, 33, 17, 50))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    from engine.core.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(**KNOBS), progress=False)


@pytest.fixture(scope="module")
def together(engine):
    with scheduler_as(engine, enable_prefix_caching=False):
        outs = run_to_completion(engine, [(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    tokens = [outs[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]
    forward = jax.jit(lambda p, ids: forward_dense(p, engine.model_config, ids, kv_cache_dtype="int8"))
    for p, toks in zip(PROMPTS, tokens):
        ids = np.zeros(64, np.int32)
        ids[: len(p) + NEW_TOKENS] = p + toks
        logits = np.asarray(forward(engine.runner.params, jnp.asarray(ids)))
        assert toks == np.argmax(logits[len(p) - 1 : len(p) - 1 + NEW_TOKENS], axis=-1).tolist()
    return tokens


def test_the_engine_serves_int8_weights_and_an_int8_cache(engine):
    k_cache, v_cache = engine.runner.kv_cache
    assert isinstance(k_cache, ScaledCache) and k_cache.values.dtype == jnp.int8
    assert engine.runner.params["layers"][0]["qkv_proj"].q.dtype == jnp.int8
    # smoothed (models/smoothing.py, the CPU's int8 x int8 default): the tied table holds its factors
    assert engine.runner.params["embed"].input_scale is not None
    stats = engine.get_stats()
    config = engine.model_config
    assert stats.weight_bytes_per_device[0] < 0.3 * config.num_params * 4  # tiny: scales are 6 %
    # values 1 byte, one bfloat16 scale per token and kv head, blocks x block_size tokens
    per_token = 2 * config.num_layers * config.num_kv_heads * (config.head_dim + 2)
    assert stats.kv_cache_bytes_per_device[0] == engine.runner.shapes.num_blocks * 16 * per_token


def test_batched_equals_dense_and_alone(engine, together):
    with scheduler_as(engine, enable_prefix_caching=False):
        for i in (0, 2):
            out = run_to_completion(engine, [(f"a{i}", PROMPTS[i], GREEDY)])[f"a{i}"]
            assert out.outputs[0].token_ids == together[i]


def test_chunked_prefix_cached_and_preempted(engine, together):
    shared = [PROMPTS[5][:32] + p for p in PROMPTS[:3]]  # two full blocks in common
    with scheduler_as(engine, enable_prefix_caching=False):
        base = run_to_completion(engine, [(f"b{i}", p, GREEDY) for i, p in enumerate(shared)])
    with scheduler_as(engine, enable_prefix_caching=True, max_num_batched_tokens=16) as sched:
        first = run_to_completion(engine, [("c0", shared[0], GREEDY)])
        rest = run_to_completion(engine, [(f"c{i}", p, GREEDY) for i, p in enumerate(shared) if i])
        assert sched.stats.prefix_cache_hits > 0
    rest.update(first)
    assert [rest[f"c{i}"].outputs[0].token_ids for i in range(3)] == [base[f"b{i}"].outputs[0].token_ids
                                                                     for i in range(3)]
    with scheduler_as(engine, enable_prefix_caching=False, num_kv_blocks=9) as sched:
        outs = run_to_completion(engine, [(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert sched.stats.num_preemptions > 0
    assert [outs[f"s{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == together


def test_the_cache_and_its_scales_are_donated(engine):
    from engine.step.buckets import Bucket

    hlo = engine.runner._compiled[Bucket(64, 16, 16)].as_text()
    # K and V values, K and V scales, and the request table's arrays alias outputs.
    assert hlo.count("may-alias") + hlo.count("must-alias") >= 4 + 10


@pytest.mark.parametrize("knobs,match", [
    (dict(quantization="int4"), "quantization must be one of int8, fp8"),
    (dict(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype must be one of auto, int8, fp8_e4m3"),
    (dict(quantization_activation_rows=4), "needs quantization"),
    (dict(quantization="int8", quantization_activation_rows=-1), "non-negative"),
    (dict(quantization="gguf", disaggregation="prefill:1,decode:1"), "not implemented with disaggregation"),
    (dict(quantization="gguf", quantization_activation_rows=0), "gguf blocks are weight-only"),
    (dict(quantization="gguf", tensor_parallel_size=2), "not implemented on a mesh"),
    (dict(quantization="gguf", data_parallel_size=2), "not implemented on a mesh"),
])
def test_knobs_are_refused_by_name(knobs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="random:tiny", **knobs)


@pytest.mark.extended  # make test-extended: about 25 s of interpreted kernels on 2 cores, each
@pytest.mark.parametrize("backend, layout", [("pallas_gpu", "token"), ("pallas_tpu", "page")])
def test_the_pallas_kernels_serve_the_8bit_cache_as_the_xla_path_does(engine, backend, layout, monkeypatch):
    """attention_backend="pallas" (a kernel in interpret mode on the CPU: the Triton one, or the
    TPU one by patching the builder's pick) writes and reads the int8 cache in its backend's scale
    layout: seeded high-temperature samples (which follow every logit) equal the xla engine's; the
    kernels' numerics against the oracle are tests/pallas_kernels' (default tier)."""
    from engine.core import builder
    from engine.core.llm_engine import LLMEngine

    if backend == "pallas_tpu":
        monkeypatch.setattr(builder, "resolve_backend", lambda *_: "pallas_tpu")
    # Small buckets (interpreted kernels compile slowly): prompts of 9 and 23 tokens prefill in
    # 16-token chunks beside the other's decode.
    pallas = LLMEngine(EngineConfig(**dict(KNOBS, attention_backend="pallas", interpret=True, seq_buckets=(4,),
                                           max_num_seqs=4, token_buckets=(4, 16), max_num_batched_tokens=16)),
                       progress=False)
    cache = pallas.runner.kv_cache[0]
    assert pallas.attention_backend == backend and isinstance(cache, ScaledCache) and cache.layout == layout
    requests = [(f"p{i}", p, SamplingParams(temperature=40.0, seed=i, max_tokens=6, ignore_eos=True))
                for i, p in enumerate(PROMPTS[1:3])]
    got, want = run_to_completion(pallas, requests), run_to_completion(engine, requests)
    for rid, _, _ in requests:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids


def test_gguf_quantization_needs_a_gguf_file():
    from engine.core.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="quantization='gguf' serves a GGUF file's own blocks"):
        LLMEngine(EngineConfig(**dict(TINY_KNOBS, quantization="gguf")), progress=False)


@pytest.mark.extended  # make test-extended: two default-model engines, about 30 s on 2 cores
def test_the_default_model_serves_as_shipped_in_its_own_blocks():
    """quantization="gguf": the default model's token_embd (Q8_0) and its 210 Q4_1 layer matrices
    are served in their blocks (int8 codes, float32 scales per 32 values, Q4_1's minimums; q/k/v
    and gate/up fused), the tied lm_head's product dequantizing inside; greedy tokens equal the
    float32 engine's and the weights shrink from float32 to 1.25 bytes a value (int8 codes, a
    float32 scale and offset per 32)."""
    from engine.frontends.llm import LLM
    from models.quant import QuantizedWeight

    knobs = dict(max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(1, 16), seq_buckets=(2,),
                 max_model_len=128, compilation_cache_dir=None, progress=False, prompt_scoring_bucket=False)
    prompts = ["The capital of France is", "Explain in two sentences why the sky is blue."]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    tokens, weight_bytes = {}, {}
    for quantization in (None, "gguf"):
        llm = LLM("default", quantization=quantization, **knobs)
        tokens[quantization] = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy, use_tqdm=False)]
        weight_bytes[quantization] = llm.engine.get_stats().weight_bytes_per_device[0]
        params = llm.engine.runner.params
    embed = params["embed"]
    assert isinstance(embed, QuantizedWeight) and embed.block == 32 and embed.q.dtype == jnp.int8
    assert not jnp.any(embed.offset)  # Q8_0: zero offsets
    products = [layer[k] for layer in params["layers"] for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    assert len(products) == 120 and all(isinstance(w, QuantizedWeight) and w.offset is not None for w in products)
    assert tokens["gguf"] == tokens[None]
    vocab, hidden = embed.shape
    layer_values = sum(w.q.size for w in products)
    assert weight_bytes[None] - weight_bytes["gguf"] == (vocab * hidden + layer_values) * (4 - 1 - 8 / 32)


@pytest.mark.extended  # make test-extended: one default-model engine and its calibration, about 40 s on 2 cores
def test_a_bfloat16_default_model_with_int8_weights_keeps_the_reference_greedy_outside_near_ties():
    """--dtype=bfloat16 --quantization=int8 (the products as in float32, int8 x int8 from 2 rows;
    norms, activations and the KV cache bfloat16), served on the fixture prompts together: each
    prompt's 16 greedy tokens equal transformers' float32 reference until the first divergence,
    and that divergence is at a near-tie (the reference's top-2 margin under 0.5, the bf16
    report's margin; BUILD_NOTES.md "Quantization", stop 49)."""
    from engine.frontends.llm import LLM
    from experiments.lab.reference_fixture import load_reference
    from models.quant import QuantizedWeight

    meta, _ = load_reference()
    llm = LLM("default", dtype="bfloat16", quantization="int8", max_num_seqs=8, max_num_batched_tokens=64,
              token_buckets=(1, 8, 64), seq_buckets=(8,), max_model_len=512, progress=False,
              prompt_scoring_bucket=False)
    products = [layer["gate_up_proj"] for layer in llm.engine.runner.params["layers"]]
    assert all(isinstance(w, QuantizedWeight) and w.dtype == jnp.bfloat16 for w in products)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([p["prompt_token_ids"] for p in meta["prompts"]], greedy, use_tqdm=False)
    equal = 0
    for prompt, out in zip(meta["prompts"], outs):
        got, want, margins = list(out.outputs[0].token_ids), prompt["greedy_token_ids"], prompt["greedy_top2_margins"]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if first is None:
            equal += 1
        else:
            assert margins[first] < 0.5, f"{prompt['name']} left the reference at step {first}, margin {margins[first]}"
    assert equal >= 1, "no prompt kept the reference's 16 tokens"
