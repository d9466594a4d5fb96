"""The capacity calculator (experiments/capacity.py): its numbers by hand, and against measurement."""

import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from experiments import capacity

ROOT = pathlib.Path(__file__).resolve().parents[2]
GB = 1e9


def _llama3_8b_params() -> int:
    layers, hidden, ffn, heads, kv_heads, head_dim, vocab = 32, 4096, 14336, 32, 8, 128, 128256
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attn + 3 * hidden * ffn + 2 * hidden) + 2 * vocab * hidden + hidden


@pytest.mark.parametrize("model, dtype, params, kv_bytes", [
    # Llama-3-8B: 32 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes.
    ("random:llama3-8b", "bfloat16", _llama3_8b_params(), 32 * 8 * 128 * 2 * 2),
    # SmolLM2-135M (the default model's shape): 30 layers x 3 KV heads x 64 dims, tied embeddings.
    ("random:smollm2-135m", "float32", 134_515_008, 30 * 3 * 64 * 2 * 4),
    # Qwen2-shaped tiny: 2 layers x 4 KV heads x 16 dims (no GQA), q/k/v biases not counted.
    ("random:tiny-qwen2", "bfloat16", 115_008, 2 * 4 * 16 * 2 * 2),
])
def test_weight_and_kv_bytes(model, dtype, params, kv_bytes):
    device = "cpu" if dtype == "float32" else "h200"
    r = capacity.capacity(model, device, dtype=dtype)
    assert r.num_params == params
    assert r.weight_bytes == params * capacity.DTYPE_BYTES[dtype]
    assert r.kv_bytes_per_token == kv_bytes


def test_llama3_8b_on_h200_acceptance_numbers():
    r = capacity.capacity("random:llama3-8b", "h200", dtype="bfloat16")
    assert r.weight_bytes == pytest.approx(16.1 * GB, rel=0.02)
    assert r.kv_bytes_per_token == 131_072
    # 0.85 of (0.75 x 141 GB - weights), in 16-token blocks; block 0 is the null block; each
    # 4096-token request (3584 prompt + 512 output) holds 256 blocks.
    budget = 0.85 * (0.75 * 141 * GB - r.weight_bytes)
    blocks = int(budget // (16 * 131_072))
    assert r.num_blocks == blocks
    assert r.fit_paged == r.fit_contiguous == (blocks - 1) // 256 == 141
    # Memory-bound at batch 1: the streamed weights (all but the untied input embedding) and
    # one request's KV at its mean context, over 4.8 TB/s.
    streamed = r.weight_bytes - 128256 * 4096 * 2
    one = r.point(1)
    assert one.bound == "memory"
    assert one.step_s == pytest.approx((streamed + 3840 * 131_072) / 4.8e12)
    # At 4k context KV reads grow as fast as flops: never compute-bound; with no KV the
    # crossover is peak / bandwidth (2 bytes and 2 flops per parameter).
    assert r.crossover_batch is None
    assert r.crossover_batch_no_kv == pytest.approx(989e12 / 4.8e12)


def test_the_cli_prints_the_acceptance_numbers():
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.capacity", "--model=random:llama3-8b", "--device=h200",
         "--dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "16,060,522,496 (16.06 GB)" in out
    assert "KV bytes per token:     131,072" in out
    assert "users that fit at 4,096-token context" in out and "paged 141, contiguous 141" in out


def test_default_model_config_is_read_without_weights():
    config = capacity.model_config_for("default")
    assert config.num_params == capacity.model_config_for("random:smollm2-135m").num_params
    assert config.kv_bytes_per_token(4) == 46_080


def test_paged_fits_more_than_contiguous_on_a_sharegpt_like_mix():
    # ShareGPT-like: log-normal prompt and reply lengths (medians ~ 90 and 250 tokens), capped
    # by max_model_len as the dataset filter does.
    rng = np.random.default_rng(0)
    max_model_len = 2048
    lengths = np.minimum(rng.lognormal(4.5, 1.0, 1000) + rng.lognormal(5.5, 0.8, 1000),
                         max_model_len).astype(int).tolist()
    num_blocks = 32768 // 16 + 1
    paged = capacity.requests_that_fit(num_blocks, lengths, 16, max_model_len, "paged")
    contiguous = capacity.requests_that_fit(num_blocks, lengths, 16, max_model_len, "contiguous")
    assert contiguous == 16
    mean_blocks = np.mean([math.ceil(n / 16) for n in lengths])
    assert paged == pytest.approx(2048 / mean_blocks, rel=0.1)
    assert paged > 3 * contiguous


def test_requests_that_fit_counts_blocks_and_the_null_block():
    assert capacity.requests_that_fit(9, [32], 16, 64, "paged") == 4  # 8 usable blocks, 2 each
    assert capacity.requests_that_fit(9, [33], 16, 64, "paged") == 2  # 3 blocks each
    assert capacity.requests_that_fit(9, [32], 16, 64, "contiguous") == 2  # 4 blocks reserved
    assert capacity.requests_that_fit(9, [16, 48], 16, 64, "paged") == 4  # 1 + 3 + 1 + 3
    assert capacity.requests_that_fit(1, [16], 16, 64, "paged") == 0
    with pytest.raises(ValueError, match="allocation"):
        capacity.requests_that_fit(9, [16], 16, 64, "buddy")


def test_tensor_parallel_and_a_model_too_big_for_one_chip():
    v5e = capacity.capacity("random:llama3-8b", "v5e")
    assert not v5e.weights_fit and v5e.fit_paged == 0
    assert "do not fit" in capacity.format_report(v5e)
    v5e4 = capacity.capacity("random:llama3-8b", "v5e", tensor_parallel_size=4)
    assert v5e4.weights_fit and v5e4.fit_paged > 0
    h1 = capacity.capacity("random:llama3-8b", "h100")
    h2 = capacity.capacity("random:llama3-8b", "h100", tensor_parallel_size=2)
    assert h2.point(1).step_s == pytest.approx(h1.point(1).step_s / 2)
    assert h2.fit_paged > 2 * h1.fit_paged  # the second chip's memory is all KV


def test_decode_curve_is_flat_past_the_crossover_on_short_contexts():
    r = capacity.capacity("random:smollm2-135m", "cpu", prompt_len=64, output_len=64,
                          batches=[1, 2, 4, 8, 16, 32, 64], slo_itl_ms=40)
    cross = r.crossover_batch
    assert cross is not None and 1 < cross < 64
    for p in r.decode:
        assert p.bound == ("compute" if p.batch > cross else "memory")
        assert p.per_user_tok_s == pytest.approx(1 / p.step_s)
    agg = [p.aggregate_tok_s for p in r.decode]
    assert agg == sorted(agg)
    assert agg[-1] == pytest.approx(agg[-2], rel=0.05)  # compute-bound: B / (B x flops / peak)
    assert r.slo_batch == max(p.batch for p in r.decode if p.step_s <= 0.040)


def test_measure_device_returns_positive_figures():
    probe = capacity.measure_device(weight_mib=4, matmul_n=128, repeats=1)
    assert probe.bandwidth > 0 and probe.peak_flops > 0 and probe.numpy_copy_bandwidth > 0
    spec = capacity.device_from_probe(probe)
    assert spec.kind == "cpu" and spec.bandwidth == probe.bandwidth


# ---------------------------------------------------------------- against measurement

COMPARISON = ROOT / "experiments" / "results" / "capacity_vs_bench.json"


def test_prediction_against_the_measured_cpu_sweep():
    """The committed comparison (`python -m experiments.capacity --model=default --device=cpu
    --compare_sweep=experiments/results/bench.json --json=...`): recomputed from its measured
    numbers and device figures, it still says what was written down, and the single-user decode
    rate is within 2x of the prediction."""
    saved = json.loads(COMPARISON.read_text())
    device = capacity.DeviceSpec(**saved["device"])
    assert device == capacity.DEVICES["cpu"]  # the table holds the figures the ratio used
    again = capacity.compare_with_measured(saved["measured"], "random:smollm2-135m", device,
                                           saved["dtype"])
    for key in ("single_user", "at_knee"):
        for field in ("measured_tok_s", "predicted_tok_s", "ratio"):
            assert again[key][field] == pytest.approx(saved[key][field], rel=1e-6), (key, field)
    assert 0.5 <= saved["single_user"]["ratio"] <= 2.0
    assert 0.5 <= saved["at_knee"]["ratio"] <= 2.0
    # The knee: the predicted curve bends at the crossover, the measured one later (the CPU's
    # FLOP/s grow with the batch; the model uses the peak from the first token on).
    from experiments.bench.sweep import find_knee

    loads = [p["concurrency"] for p in saved["predicted"]]
    predicted_knee = loads[find_knee(loads, [p["aggregate_tok_s"] for p in saved["predicted"]])]
    assert predicted_knee <= saved["measured"]["knee_concurrency"]
    assert saved["crossover_batch"] <= predicted_knee


@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-gqa3", "random:tiny-mixtral", "random:tiny-qwen3"])
@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_quantized_weight_bytes_are_the_served_weights_bytes(model, quantization):
    """The calculator's bytes are those of the weights the runner serves (quantized at load:
    models/quant.py), counted leaf by leaf on their abstract shapes: untied and MoE models too."""
    import jax

    from engine.step.program import served_params_spec

    config = capacity.model_config_for(model)
    for dtype in ("bfloat16", "float32"):
        served = served_params_spec(config, dtype=dtype, layer_loop="unrolled", placement=None,
                                    quantization=quantization)
        served_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(served))
        assert capacity.weight_bytes(config, capacity.DTYPE_BYTES[dtype], quantization) == served_bytes


def test_quantized_weights_and_an_8bit_cache_on_h200():
    """Llama-3-8B: int8 weights are 0.50x bfloat16's bytes plus their scales (fp8 the same but its
    tables in bfloat16); an 8-bit cache holds
    head_dim + 2 bytes per token and KV head (0.508x bfloat16's at head_dim 128), so more blocks
    fit, and decode at batch 1 streams half the weight bytes."""
    base = capacity.capacity("random:llama3-8b", "h200", dtype="bfloat16")
    quant = capacity.capacity("random:llama3-8b", "h200", dtype="bfloat16", quantization="int8",
                              kv_cache_dtype="int8")
    assert 0.50 < quant.weight_bytes / base.weight_bytes < 0.502
    assert quant.kv_bytes_per_token == 32 * 8 * 2 * (128 + 2) == 66_560
    budget = 0.85 * (0.75 * 141 * GB - quant.weight_bytes)
    assert quant.num_blocks == int(budget // (16 * 66_560)) and quant.fit_paged > 1.9 * base.fit_paged
    streamed = quant.weight_bytes - (128256 * 4096 + 4 * 128256)  # not the untied input embedding
    assert quant.point(1).memory_s == pytest.approx((streamed + 3840 * 66_560) / 4.8e12)
    assert quant.point(1).compute_s == base.point(1).compute_s
    fp8 = capacity.capacity("random:llama3-8b", "h200", dtype="bfloat16", quantization="fp8",
                            kv_cache_dtype="fp8_e4m3")
    # fp8 keeps the two tables (untied) in bfloat16: 2 bytes a value against int8's 1 + a scale per row.
    assert fp8.weight_bytes - quant.weight_bytes == 2 * 128256 * (4096 - 4)
    assert fp8.kv_bytes_per_token == quant.kv_bytes_per_token
    assert "weights int8, KV cache int8" in capacity.format_report(quant)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        capacity.capacity("random:llama3-8b", "h200", kv_cache_dtype="fp8_e5m2")


def test_the_calculator_and_its_kv_bytes_rule_import_no_jax():
    """The calculator sizes a cache by the engine's own rule (models/kv_bytes.py) without jax."""
    code = ("import sys, experiments.capacity, models.kv_bytes; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
