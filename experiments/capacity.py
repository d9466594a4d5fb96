"""Capacity calculator: what a model needs and what a device gives, before running anything.

    python -m experiments.capacity --model=random:llama3-8b --device=h200 --dtype=bfloat16
    python -m experiments.capacity --model=default --device=cpu --measure

1. The model's shape comes from its config alone (`random:<preset>`: models/config.py's presets;
   "default", a GGUF file, a HF folder or a jaxserve checkpoint: its metadata, no weights loaded).
2. Memory: weight bytes = parameters x the dtype's size, or with `quantization` (int8, fp8) the
   quantized matrices at 1 byte plus a float32 scale per output row; KV bytes per token
   2 x layers x KV heads x head_dim x size, or with an 8-bit `kv_cache_dtype` (int8, fp8_e4m3)
   head_dim bytes plus a scale per token and KV head (bfloat16; on a TPU float32 in rows per page
   padded to 128 lanes: models/kv_bytes.py, the rule the
   engine allocates by; weights: experiments/lab/capacity_bytes.py). The KV budget is
   what the engine would give the cache (engine/step/kv_cache.py): on an accelerator
   `kv_cache_memory_fraction` of the memory JAX may use (`memory_fraction` of HBM: 0.75 on a GPU,
   JAX's default preallocation) less the weights; on the CPU the `kv_cache_bytes` budget.
3. Requests that fit at once: paged allocation holds ceil((prompt + output) / block_size) blocks
   per request at its longest; contiguous allocation reserves max_model_len per request. Block 0
   is the engine's null block and holds nothing. A model mixing sliding-window and global layers
   (Gemma 2/3) has a block group per kind (scheduler/sliding_window.py): its sliding layers hold
   only the ceil((W - 1) / block_size) + 1 blocks their window reads (`kv_bytes_held`), so paged
   fits more requests than with one block table for every layer (`fit_paged_one_group`).
4. Decode, one step over a batch of B requests at context c (the mean over a request's decode,
   prompt + output / 2): time = max(bytes / bandwidth, flops / peak) with
   bytes = streamed weights + B x c x KV bytes per token, and
   flops = B x (2 x matmul parameters + 4 x layers x heads x head_dim x c) (projections and the
   two attention products). Quantized weights and an 8-bit cache change the bytes, not the flops
   (the products dequantize, or quantize activations, at the model dtype's peak). Per-user rate = 1 / time; aggregate = B / time. With tensor
   parallelism bytes, flops, bandwidth and peak all divide across the chips (communication is
   ignored).
5. The crossover is the batch where flops / peak overtakes bytes / bandwidth. KV reads grow with
   B as fast as attention flops, so at long contexts decode may never become compute-bound: then
   there is no crossover and the memory fit is the limit.

What the model ignores (why a measurement is slower): kernel launch and Python step overheads,
prefill chunks sharing steps with decodes, padding to buckets, sampling, the host<->device
copies, and attainable bandwidth and FLOP/s below the spec sheet's peak.

Where it lives: steps 1-5 (`capacity()`), the comparison with a measured concurrency sweep
(`compare_with_measured`) and the command line are here; the device figures (`DEVICES`, and
`device_from_probe` for this machine) are in experiments/lab/capacity_devices.py; the report
(`CapacityReport`, `DecodePoint`) and its text and plot (`format_report`, `plot`) are in
experiments/lab/capacity_report.py; bytes per weight by dtype in experiments/lab/capacity_bytes.py,
per KV token in models/kv_bytes.py (neither imports jax). Every name is importable from this
module (the notebook's `from experiments import capacity`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Sequence

from absl import app, flags

from engine.config import EngineConfig
from experiments.lab.capacity_bytes import QUANTIZATIONS, untied_embedding_bytes, weight_bytes
from experiments.lab.capacity_devices import DEVICES, GB, DeviceSpec, device_from_probe, device_spec
from experiments.lab.capacity_report import CapacityReport, DecodePoint, format_report, plot
from experiments.lab.device_probe import Probe, measure_device
from models.config import ModelConfig, preset_config
from models.kv_bytes import KV_CACHE_DTYPES, kv_bytes_per_token, scale_layout_for
from scheduler.sliding_window import window_blocks

# The engine's own defaults for the cache (block size, memory fraction, the CPU byte budget).
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

__all__ = [
    "DEVICES", "DTYPE_BYTES", "ENGINE_DEFAULTS", "GB", "KV_CACHE_DTYPES", "QUANTIZATIONS", "CapacityReport",
    "DecodePoint", "DeviceSpec", "Probe", "blocks_for", "capacity", "compare_with_measured", "crossover_batch",
    "decode_step", "define_flags", "device_from_probe", "device_spec", "format_report", "kv_budget_bytes",
    "kv_bytes_held", "kv_bytes_per_token", "main", "matmul_params", "measure_device", "measured_from_sweep",
    "model_config_for", "plot", "requests_that_fit", "weight_bytes",
]


def model_config_for(model: str) -> ModelConfig:
    """The model's config without its weights."""
    if model.startswith("random:"):
        return preset_config(model.split(":", 1)[1])
    from models.checkpoint import MARKER, is_checkpoint
    from models.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path) and is_checkpoint(path):
        with open(os.path.join(path, MARKER)) as f:
            cfg = dict(json.load(f)["config"])
        cfg.pop("rope_scaling", None)  # the shape does not depend on it
        return ModelConfig(**cfg)
    if os.path.isdir(path):
        from models.hf_config import read_hf_config

        return read_hf_config(path)
    from models.gguf_loader import gguf_config, open_gguf

    return gguf_config(path, open_gguf(path))


def matmul_params(config: ModelConfig) -> int:
    """Parameters a decode step multiplies by (and so streams): all but an untied input embedding,
    of which only the batch's rows are gathered."""
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.num_params - untied_embedding


def _kv_per_token(config: ModelConfig, itemsize: int, kv_cache_dtype: str, device: DeviceSpec, block_size: int,
                  tensor_parallel_size: int) -> int:
    """models/kv_bytes.py's bytes per token, an 8-bit cache's scales in the device's layout."""
    return kv_bytes_per_token(config, itemsize, kv_cache_dtype, scale_layout=scale_layout_for(device.kind),
                              block_size=block_size, shards=tensor_parallel_size)


def decode_step(config: ModelConfig, device: DeviceSpec, itemsize: int, batch: int,
                context_len: float, tensor_parallel_size: int = 1, quantization: str | None = None,
                kv_cache_dtype: str = "auto", block_size: int = ENGINE_DEFAULTS["block_size"]) -> DecodePoint:
    """One decode step of `batch` requests that each attend over `context_len` tokens."""
    weights = weight_bytes(config, itemsize, quantization) - untied_embedding_bytes(config, itemsize, quantization)
    kv = batch * context_len * _kv_per_token(config, itemsize, kv_cache_dtype, device, block_size,
                                             tensor_parallel_size)
    attention_flops = 4 * config.num_layers * config.num_heads * config.head_dim * context_len
    flops = batch * (2 * matmul_params(config) + attention_flops)
    memory_s = (weights + kv) / (tensor_parallel_size * device.bandwidth)
    compute_s = flops / (tensor_parallel_size * device.peak_flops)
    step = max(memory_s, compute_s)
    return DecodePoint(batch, step, memory_s, compute_s, 1.0 / step, batch / step)


def crossover_batch(config: ModelConfig, device: DeviceSpec, itemsize: int,
                    context_len: float, quantization: str | None = None,
                    kv_cache_dtype: str = "auto", block_size: int = ENGINE_DEFAULTS["block_size"]) -> float | None:
    """The batch where compute time overtakes memory time (tensor parallelism cancels out);
    None when KV reads grow at least as fast as flops, so decode never becomes compute-bound."""
    one = decode_step(config, device, itemsize, 1, context_len, quantization=quantization,
                      kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    kv = _kv_per_token(config, itemsize, kv_cache_dtype, device, block_size, 1)
    weights_s = one.memory_s - context_len * kv / device.bandwidth
    kv_s_per_request = one.memory_s - weights_s
    slope = one.compute_s - kv_s_per_request
    return weights_s / slope if slope > 0 else None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_bytes_held(config: ModelConfig, num_tokens: int, itemsize: int, block_size: int,
                  sliding_groups: bool = True, kv_cache_dtype: str = "auto", scale_layout: str = "token",
                  shards: int = 1) -> int:
    """KV bytes one request of num_tokens holds between steps: every layer's blocks with one group;
    with a group per layer kind (sliding_groups, a model mixing windows) the sliding layers hold
    only the blocks their window reads (scheduler/sliding_window.window_blocks). An 8-bit cache
    counts its values and scales (kv_bytes_per_token, the scales in `scale_layout`)."""
    blocks = blocks_for(num_tokens, block_size)
    per_token = kv_bytes_per_token(config, itemsize, kv_cache_dtype, scale_layout=scale_layout,
                                   block_size=block_size, shards=shards)
    per_layer_block = block_size * per_token // config.num_layers
    if not (sliding_groups and config.has_sliding_layers):
        return blocks * config.num_layers * per_layer_block
    held = min(blocks, window_blocks(config.sliding_window, block_size))
    return per_layer_block * (blocks * config.num_layers_of_kind("full_attention")
                              + held * config.num_layers_of_kind("sliding_attention"))


def requests_that_fit(num_blocks: int, lengths: Sequence[int], block_size: int,
                      max_model_len: int, allocation: str = "paged") -> int:
    """How many requests of `lengths` (prompt + output tokens, taken in order and cycled) are
    resident at once when each holds its blocks at its longest. Block 0 is the null block."""
    if allocation not in ("paged", "contiguous"):
        raise ValueError(f"allocation must be paged or contiguous, got {allocation!r}")
    free = num_blocks - 1
    if not lengths or free <= 0:
        return 0
    if allocation == "contiguous":
        return free // blocks_for(max_model_len, block_size)
    per_cycle = sum(blocks_for(min(n, max_model_len), block_size) for n in lengths)
    count = (free // per_cycle) * len(lengths)
    free -= (free // per_cycle) * per_cycle
    for n in lengths:
        need = blocks_for(min(n, max_model_len), block_size)
        if need > free:
            break
        free -= need
        count += 1
    return count


def kv_budget_bytes(device: DeviceSpec, weight_bytes: float, tensor_parallel_size: int,
                    kv_cache_memory_fraction: float, kv_cache_bytes: int) -> float:
    """What the engine gives the cache (engine/step/kv_cache.py num_blocks_for), all chips together."""
    if device.kind == "cpu":
        return float(kv_cache_bytes)
    usable = tensor_parallel_size * device.hbm_bytes * device.memory_fraction
    return (usable - weight_bytes) * kv_cache_memory_fraction if usable > weight_bytes else 0.0


def capacity(model: str | ModelConfig, device: str | DeviceSpec = "h200", *, dtype: str | None = None,
             tensor_parallel_size: int = 1, max_model_len: int | None = None,
             prompt_len: int | None = None, output_len: int = 512,
             block_size: int = ENGINE_DEFAULTS["block_size"],
             kv_cache_memory_fraction: float = ENGINE_DEFAULTS["kv_cache_memory_fraction"],
             kv_cache_bytes: int = ENGINE_DEFAULTS["kv_cache_bytes"],
             batches: Sequence[int] | None = None, slo_itl_ms: float | None = None,
             quantization: str | None = None, kv_cache_dtype: str = "auto") -> CapacityReport:
    """The calculator as a function (the notebook's entry); see the module docstring.
    quantization (None | "int8" | "fp8") and kv_cache_dtype ("auto" | "int8" | "fp8_e4m3") are
    the engine's knobs of the same names."""
    config = model_config_for(model) if isinstance(model, str) else model
    spec = device_spec(device) if isinstance(device, str) else device
    if spec.bandwidth <= 0 or spec.peak_flops <= 0:
        raise ValueError(f"device {spec.name!r} has no bandwidth / FLOP/s figures; measure them "
                         "(measure_device) or pass a DeviceSpec")
    dtype = dtype or ("float32" if spec.kind == "cpu" else "bfloat16")
    itemsize = DTYPE_BYTES[dtype]
    max_model_len = max_model_len or min(config.max_position_embeddings, 4096)
    prompt_len = max_model_len - output_len if prompt_len is None else prompt_len
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len}, {output_len}")
    weights = weight_bytes(config, itemsize, quantization)
    kvb = _kv_per_token(config, itemsize, kv_cache_dtype, spec, block_size, tensor_parallel_size)
    budget = kv_budget_bytes(spec, weights, tensor_parallel_size, kv_cache_memory_fraction,
                             kv_cache_bytes)
    num_blocks = max(0, int(budget // (block_size * kvb)))
    total = prompt_len + output_len
    fit_paged = fit_one_group = requests_that_fit(num_blocks, [total], block_size, max_model_len, "paged")
    if config.has_sliding_layers:  # sliding accounting: the sliding layers hold their window only
        fit_paged = int(budget // kv_bytes_held(config, min(total, max_model_len), itemsize, block_size,
                                                kv_cache_dtype=kv_cache_dtype, scale_layout=scale_layout_for(spec.kind),
                                                shards=tensor_parallel_size))
    fit_contiguous = requests_that_fit(num_blocks, [total], block_size, max_model_len, "contiguous")
    context_len = prompt_len + output_len / 2
    quant = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    cross = crossover_batch(config, spec, itemsize, context_len, block_size=block_size, **quant)
    if batches is None:
        top = max(fit_paged, 1, 2 * math.ceil(cross) if cross else 1)
        batches = [2**i for i in range(int(math.log2(min(top, 4096))) + 1)]
        if fit_paged > batches[-1] and fit_paged <= 4096:
            batches.append(fit_paged)
    decode = [decode_step(config, spec, itemsize, b, context_len, tensor_parallel_size, block_size=block_size,
                          **quant)
              for b in sorted(set(batches))]
    slo_batch = None
    if slo_itl_ms is not None:
        ok = [p.batch for p in decode if p.step_s * 1000 <= slo_itl_ms and p.batch <= max(fit_paged, 1)]
        slo_batch = max(ok) if ok else None
    return CapacityReport(
        model=config.name, device=spec, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len, prompt_len=prompt_len, output_len=output_len,
        block_size=block_size, num_params=config.num_params, weight_bytes=weights,
        kv_bytes_per_token=kvb, kv_budget_bytes=budget,
        kv_cache_memory_fraction=kv_cache_memory_fraction, num_blocks=num_blocks,
        fit_paged=fit_paged, fit_contiguous=fit_contiguous, context_len=context_len,
        fit_paged_one_group=fit_one_group,
        crossover_batch=cross,
        crossover_batch_no_kv=crossover_batch(config, spec, itemsize, 0, block_size=block_size, **quant),
        decode=decode, slo_itl_ms=slo_itl_ms, slo_batch=slo_batch, **quant)


# ---------------------------------------------------------------- against a measured sweep


def measured_from_sweep(sweep: dict) -> dict:
    """The numbers of a concurrency sweep (experiments.bench.sweep's JSON) that the calculator predicts:
    per point the output throughput and 1000 / TPOT p50 (one user's decode rate between tokens),
    the mean prompt and output tokens per request, and the knee."""
    if sweep.get("kind") != "concurrency":
        raise ValueError("a concurrency sweep is needed")
    points = []
    for p in sweep["points"]:
        m = p["metrics"]
        points.append({"concurrency": int(p["load"]), "output_tok_s": m["output_throughput"],
                       "tpot_ms_p50": m["tpot_ms"]["median"], "itl_ms_p50": m["itl_ms"]["median"],
                       "itl_ms_p95": m["itl_ms"]["p95"]})
    first = sweep["points"][0]["metrics"]
    return {
        "points": points,
        "prompt_len": round(first["total_input_tokens"] / first["completed"]),
        "output_len": round(first["total_output_tokens"] / first["completed"]),
        "knee_concurrency": None if sweep.get("knee_load") is None else int(sweep["knee_load"]),
    }


def compare_with_measured(measured: dict, model: str | ModelConfig, device: DeviceSpec,
                          dtype: str | None = None) -> dict:
    """Prediction against `measured` (measured_from_sweep's shape): single-user decode rate
    (predicted per-user rate at batch 1 against 1000 / TPOT p50 at concurrency 1), the aggregate
    at the measured knee, and the crossover against the knee. Ratios are measured / predicted."""
    points = measured["points"]
    if points[0]["concurrency"] != 1:
        raise ValueError("the sweep must start at concurrency 1")
    report = capacity(model, device, dtype=dtype, prompt_len=measured["prompt_len"],
                      output_len=measured["output_len"], batches=[p["concurrency"] for p in points])
    single_measured = 1000.0 / points[0]["tpot_ms_p50"]
    single_predicted = report.point(1).per_user_tok_s
    out = {
        "device": dataclasses.asdict(report.device), "dtype": report.dtype,
        "predicted": [{"concurrency": p.batch, "aggregate_tok_s": p.aggregate_tok_s,
                       "per_user_tok_s": p.per_user_tok_s, "bound": p.bound} for p in report.decode],
        "single_user": {"measured_tok_s": single_measured, "predicted_tok_s": single_predicted,
                        "ratio": single_measured / single_predicted},
        "crossover_batch": report.crossover_batch,
    }
    knee = measured.get("knee_concurrency")
    if knee is not None:
        at_knee = next(p for p in points if p["concurrency"] == knee)
        predicted = report.point(knee).aggregate_tok_s
        out["at_knee"] = {"concurrency": knee, "measured_tok_s": at_knee["output_tok_s"],
                          "predicted_tok_s": predicted, "ratio": at_knee["output_tok_s"] / predicted}
    return out


# ---------------------------------------------------------------- the command line


def define_flags() -> None:
    """The entry point's flags, defined only when run as a program: importing this module (the
    notebook does, beside experiments that define flags of the same names) defines none."""
    flags.DEFINE_string("model", "random:llama3-8b", "random:<preset>, default, a GGUF, a HF folder.")
    flags.DEFINE_enum("dtype", None, list(DTYPE_BYTES), "Weights and KV dtype; default: float32 "
                      "on the CPU, bfloat16 on accelerators (as the engine).")
    flags.DEFINE_enum("device", "h200", list(DEVICES), "Device figures to use.")
    flags.DEFINE_integer("tensor_parallel_size", 1, "Chips the model is sharded over.")
    flags.DEFINE_enum("quantization", None, [q for q in QUANTIZATIONS if q], "Weights quantized "
                      "per output row (EngineConfig.quantization); default: none.")
    flags.DEFINE_enum("kv_cache_dtype", "auto", list(KV_CACHE_DTYPES), "The KV cache's dtype "
                      "(EngineConfig.kv_cache_dtype): auto is the model dtype.")
    flags.DEFINE_integer("max_model_len", None, "Contiguous reservation per request; default: "
                         "min(model context, 4096), as the engine.")
    flags.DEFINE_integer("prompt_len", None, "Prompt tokens; default: max_model_len - output_len.")
    flags.DEFINE_integer("output_len", 512, "Output tokens per request.")
    flags.DEFINE_integer("block_size", ENGINE_DEFAULTS["block_size"], "Tokens per KV block.")
    flags.DEFINE_float("kv_cache_memory_fraction", ENGINE_DEFAULTS["kv_cache_memory_fraction"],
                       "Of the memory left after the weights, for the KV cache.")
    flags.DEFINE_float("memory_fraction", None, "Of HBM JAX may use; default: the device's.")
    flags.DEFINE_float("slo_itl_ms", None, "Also report the largest batch whose step is under this.")
    flags.DEFINE_bool("measure", False, "Probe this machine's bandwidth and FLOP/s (a few seconds).")
    flags.DEFINE_string("plot", "", "Write the throughput / per-user rate plot here (PNG).")
    flags.DEFINE_string("json", "", "Write the report (or the comparison) here (JSON).")
    flags.DEFINE_string("compare_sweep", "", "A concurrency sweep's JSON (make bench writes one): "
                        "compare the prediction with it on its own workload.")


def main(argv: Sequence[str]) -> None:
    del argv
    fv = flags.FLAGS
    overrides = {"memory_fraction": fv.memory_fraction}
    if fv.measure:
        dtype = fv.dtype or ("float32" if fv.device == "cpu" else "bfloat16")
        probe = measure_device(dtype)
        print(f"probe ({probe.platform}, {probe.dtype}): streaming {probe.bandwidth / GB:.2f} GB/s, "
              f"matmul {probe.peak_flops / 1e9:.1f} GFLOP/s, numpy copy "
              f"{probe.numpy_copy_bandwidth / GB:.2f} GB/s (read + write)")
        overrides.update(bandwidth=probe.bandwidth, peak_flops=probe.peak_flops)
    if fv.compare_sweep:
        with open(fv.compare_sweep) as f:
            measured = measured_from_sweep(json.load(f))
        result = compare_with_measured(measured, fv.model, device_spec(fv.device, **overrides), fv.dtype)
        result = {"command": " ".join(["python -m experiments.capacity", *sys.argv[1:]]),
                  "model": fv.model, "measured": measured, **result}
        print(json.dumps({k: result[k] for k in ("single_user", "at_knee", "crossover_batch")
                          if k in result}, indent=1))
        if fv.json:
            with open(fv.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
            print(f"wrote {fv.json}")
        return
    report = capacity(
        fv.model, device_spec(fv.device, **overrides), dtype=fv.dtype,
        tensor_parallel_size=fv.tensor_parallel_size, max_model_len=fv.max_model_len,
        prompt_len=fv.prompt_len, output_len=fv.output_len, block_size=fv.block_size,
        kv_cache_memory_fraction=fv.kv_cache_memory_fraction, slo_itl_ms=fv.slo_itl_ms,
        quantization=fv.quantization, kv_cache_dtype=fv.kv_cache_dtype)
    print(format_report(report), end="")
    if fv.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot([report], fv.plot)
        print(f"wrote {fv.plot}")
    if fv.json:
        with open(fv.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"wrote {fv.json}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
