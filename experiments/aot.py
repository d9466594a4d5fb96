"""Check a deployment before you have the hardware: the engine's steps compiled for a TPU or GPU
target from this CPU, with the memory they need and what the target's peaks make of them.

    python -m experiments.aot --target=h200 --model=random:llama3-8b
    python -m experiments.aot --target=v5e-8 --model=random:llama3-8b --tensor_parallel_size=8 \
        --output_json=/tmp/v5e8.json
    python -m experiments.aot --target=v6e-4 --model=path/to/hf_folder_with_config.json

1. The model's shape comes from its config alone (`random:<preset>`, a Hugging Face folder
   holding only config.json, a GGUF, a jaxserve checkpoint): no weights are read or allocated.
2. The engine is configured from the same knobs the server takes (tensor parallelism, dtype,
   buckets, the KV cache size or its memory fraction, the attention backend: by default the
   target's Pallas kernel), and every bucket's step is compiled by the target's compiler for its
   compile-only devices (experiments/lab/aot_build.py; the compilers come with `make aot-setup`).
3. The report, per device: the bytes of the weights, the KV cache, the request table and the
   compiler's temporaries (from `memory_analysis`), their total against the device's memory and
   whether it fits, the largest KV cache that fits beside the rest, the compile seconds per
   bucket, the collectives per layer in the compiled HLO, and where `cost_analysis` answers (TPU)
   FLOPs and bytes per step with the roofline step time and decode tok/s per decode bucket;
   experiments.capacity's prediction for the same model and target beside it, with the ratios.
   A configuration that does not fit is a report that says so, not a crash.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence

from absl import app, flags

from engine.config import EngineConfig
from engine.speculative_config import SpeculativeConfig
from experiments import capacity as capacity_tool
from experiments.lab.aot_build import compile_for_target, save
from experiments.lab.aot_results import Build
from experiments.lab.targets import TARGETS
from models.config import ModelConfig

GIB = 2**30
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def report(build: Build, model: ModelConfig, config: EngineConfig) -> dict:
    """The JSON report (keys `fits`, `hbm_bytes`, `per_device_bytes`, `max_kv_tokens`, `buckets`)."""
    tp = build.tensor_parallel_size
    predicted = None
    if build.platform != "cpu":
        device = TARGETS[build.target].device
        cap = capacity_tool.capacity(model, device, dtype=build.dtype, tensor_parallel_size=tp,
                                     max_model_len=build.max_model_len, output_len=1,
                                     block_size=build.block_size,
                                     kv_cache_memory_fraction=config.kv_cache_memory_fraction,
                                     quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype)
        predicted = {
            "weights_per_device": cap.weight_bytes / tp,
            "kv_bytes_per_token_per_device": cap.kv_bytes_per_token / tp,
            "num_blocks": cap.num_blocks,
            "weights_ratio": build.weights_bytes / (cap.weight_bytes / tp),
            "kv_bytes_per_token_ratio": (build.kv_bytes_per_block / build.block_size)
            / (cap.kv_bytes_per_token / tp),
        }
    buckets = [{f.name: getattr(b, f.name) for f in dataclasses.fields(b) if f.name != "executable"}
               for b in build.buckets]
    if build.platform != "cpu":  # the calculator's decode rate beside each decode bucket
        itemsize = capacity_tool.DTYPE_BYTES[build.dtype]
        for b in buckets:
            if b["padded_tokens"] == b["padded_seqs"]:
                point = capacity_tool.decode_step(model, cap.device, itemsize, b["padded_seqs"],
                                                  build.max_model_len / 2, tp, config.quantization,
                                                  config.kv_cache_dtype)
                b["capacity_decode_tok_s"] = point.aggregate_tok_s
    return {
        "target": build.target, "platform": build.platform, "model": model.name,
        "dtype": build.dtype, "quantization": config.quantization, "kv_cache_dtype": config.kv_cache_dtype,
        "attention_backend": build.attention_backend,
        "layer_loop": build.layer_loop, "tensor_parallel_size": tp,
        "data_parallel_size": config.data_parallel_size, "max_model_len": build.max_model_len,
        "block_size": build.block_size, "num_blocks": build.num_blocks,
        "kv_tokens": (build.num_blocks - 1) * build.block_size,
        "hbm_bytes": build.hbm_bytes, "usable_bytes": build.usable_bytes, "fits": build.fits,
        "per_device_bytes": {"weights": build.weights_bytes, "kv_cache": build.kv_cache_bytes,
                             "request_table": build.table_bytes, "temp": build.temp_bytes,
                             "draft": build.draft_bytes, "total": build.total_bytes,
                             "cache_copies": build.cache_copy_bytes,
                             "kv_cache_laid_out": build.kv_cache_laid_out_bytes or build.kv_cache_bytes},
        "max_kv_blocks": build.max_kv_blocks,
        "max_kv_tokens": max(0, build.max_kv_blocks - 1) * build.block_size,
        "buckets": buckets,
        "capacity_prediction": predicted,
        "kv_transfer_programs": build.transfers,
        "draft": build.draft,
    }


def format_report(r: dict) -> str:
    d = r["per_device_bytes"]
    lines = [
        f"{r['model']} on {r['target']} ({r['platform']}, {r['dtype']}"
        f"{', weights ' + r['quantization'] if r['quantization'] else ''}"
        f"{', KV ' + r['kv_cache_dtype'] if r['kv_cache_dtype'] != 'auto' else ''}, {r['attention_backend']}, "
        f"tensor parallel {r['tensor_parallel_size']}, layers {r['layer_loop']})",
        f"  per device: weights {d['weights'] / GIB:.2f} GiB, KV cache {d['kv_cache'] / GIB:.2f} GiB "
        f"({r['num_blocks']} blocks, {r['kv_tokens']} tokens), request table "
        f"{d['request_table'] / GIB:.3f} GiB, temporaries {d['temp'] / GIB:.2f} GiB",
        f"  total {d['total'] / GIB:.2f} GiB of {r['usable_bytes'] / GIB:.2f} GiB usable "
        f"({r['hbm_bytes'] / GIB:.2f} GiB HBM): {'FITS' if r['fits'] else 'DOES NOT FIT'}",
        f"  largest KV cache beside the rest: {r['max_kv_tokens']} tokens",
        *([f"  the kernels' layout pads the KV cache to {d['kv_cache_laid_out'] / GIB:.2f} GiB "
           f"({d['kv_cache_laid_out'] / d['kv_cache']:.2f}x its values and scales): counted in the total and "
           "the largest cache (docs/tpu_gpu.md)"]
          if d.get("kv_cache_laid_out", 0) > 1.001 * d["kv_cache"] else []),
        *([f"  XLA copies the KV cache around the kernels in each step: {d['cache_copies'] / 2**20:.1f} MiB of "
           "the temporaries, growing with the pool (counted per block above; docs/tpu_gpu.md)"]
          if d.get("cache_copies") else []),
        "  bucket      T     S     L  compile s   temp MiB   GFLOP/step  roofline ms   decode tok/s  "
        "capacity tok/s  collectives/layer",
        f"  (capacity tok/s: experiments.capacity's decode rate at context {r['max_model_len'] // 2})",
    ]
    for b in r["buckets"]:
        if b["error"]:
            lines.append(f"        {b['padded_tokens']:6d} {b['padded_seqs']:5d} {b['padded_logits']:5d} "
                         f"{b['compile_s']:10.2f} {'-':>10}  refused: {b['error']}")
            continue
        coll = ", ".join(f"{k} {v:g}" for k, v in b["collectives_per_layer"].items() if v) or "-"
        gflop = f"{b['flops'] / 1e9:11.1f}" if b["flops"] is not None else f"{'-':>11}"
        roof = f"{b['roofline_step_s'] * 1e3:11.3f}" if b["roofline_step_s"] else f"{'-':>11}"
        tok = f"{b['decode_tok_s']:13.0f}" if b["decode_tok_s"] else f"{'-':>13}"
        cap_tok = f"{b['capacity_decode_tok_s']:14.0f}" if b.get("capacity_decode_tok_s") else f"{'-':>14}"
        lines.append(f"        {b['padded_tokens']:6d} {b['padded_seqs']:5d} {b['padded_logits']:5d} "
                     f"{b['compile_s']:10.2f} {b['temp_bytes'] / 2**20:10.1f} {gflop}  {roof}  {tok}  {cap_tok}  {coll}")
    if r["draft"]:
        dr = r["draft"]
        lines.append(f"  draft ({dr['method']}, {dr['model']}): weights {dr['weights_bytes'] / GIB:.3f} GiB, "
                     f"KV cache {dr['kv_cache_bytes'] / GIB:.3f} GiB; programs (T/S: compile s): " + ", ".join(
                         f"{p.get('padded_tokens', '-')}/{p['padded_seqs']}: "
                         + (f"refused ({p['error']})" if p["error"] else f"{p['compile_s']:.2f}")
                         for p in dr["programs"]))
    if r["kv_transfer_programs"]:
        lines.append("  disaggregation's KV programs (blocks: compile s): " + ", ".join(
            f"{t['program']} {t['blocks']}: {t['compile_s']:.2f}" for t in r["kv_transfer_programs"]))
    p = r["capacity_prediction"]
    if p:
        lines.append(f"  experiments.capacity: weights {p['weights_per_device'] / GIB:.2f} GiB per device "
                     f"(compiled / predicted {p['weights_ratio']:.3f}), KV per token "
                     f"{p['kv_bytes_per_token_per_device']:.0f} B (ratio {p['kv_bytes_per_token_ratio']:.3f}), "
                     f"{p['num_blocks']} blocks predicted")
    return "\n".join(lines)


def define_flags() -> None:
    flags.DEFINE_enum("target", "h200", [*TARGETS, "cpu"], "Deployment target (experiments/lab/targets.py).")
    flags.DEFINE_string("model", "random:llama3-8b", "random:<preset>, a HF folder (config.json is "
                        "enough), a GGUF or a jaxserve checkpoint.")
    flags.DEFINE_integer("tensor_parallel_size", 1, "Devices one model is split over.")
    flags.DEFINE_integer("data_parallel_size", 1, "Replicas (each compiles the same programs).")
    flags.DEFINE_integer("expert_parallel_size", 1, "Expert-parallel groups on the model axis (MoE).")
    flags.DEFINE_bool("prompt_scoring_bucket", _DEFAULTS["prompt_scoring_bucket"],
                      "Also compile the largest token bucket with a logit row per token (prompt scoring).")
    flags.DEFINE_string("dtype", None, "Weights and KV dtype; default: the platform's.")
    flags.DEFINE_integer("max_num_seqs", _DEFAULTS["max_num_seqs"], "Most requests per step.")
    flags.DEFINE_integer("max_num_batched_tokens", _DEFAULTS["max_num_batched_tokens"], "Token budget per step.")
    flags.DEFINE_integer("max_model_len", None, "Longest request; default: min(model context, 4096).")
    flags.DEFINE_integer("block_size", _DEFAULTS["block_size"], "Tokens per KV block.")
    flags.DEFINE_integer("num_kv_blocks", None, "Explicit KV cache size in blocks (with the null block).")
    flags.DEFINE_float("kv_cache_memory_fraction", _DEFAULTS["kv_cache_memory_fraction"],
                       "Of the memory the weights leave, for the KV cache.")
    flags.DEFINE_list("token_buckets", None, "Padded token counts; default: derived.")
    flags.DEFINE_list("seq_buckets", None, "Padded request counts; default: derived.")
    flags.DEFINE_string("attention_backend", "auto", "auto (the target's Pallas kernel), xla, pallas.")
    flags.DEFINE_string("speculative_config", None, "JSON, as the server takes it (ngram, draft_model "
                        "with the draft's model spec, draft_head with the head's folder).")
    flags.DEFINE_string("disaggregation", None, "As the server takes it, e.g. prefill:2,decode:2: "
                        "also compiles the KV gather and scatter between the pools.")
    flags.DEFINE_bool("enable_lora", False, "Compile with LoRA adapter slots (engine/lora/).")
    flags.DEFINE_integer("max_loras", 1, "With --enable_lora: adapter slots on the device.")
    flags.DEFINE_integer("max_lora_rank", 16, "With --enable_lora: the slots' rank.")
    flags.DEFINE_string("lora_product", None, "With --enable_lora: gather, ragged or masked (models/lora.py); "
                        "default: the target platform's.")
    flags.DEFINE_bool("roofline", True, "On TPU, also compile each bucket unrolled at two and three layer "
                      "periods: FLOPs and bytes of every layer (XLA's cost analysis counts a scan's body "
                      "once); about doubles the compile time.")
    flags.DEFINE_string("output_json", "", "Write the report here.")
    flags.DEFINE_string("quantization", None, "Weights quantized at load: int8 | fp8 (models/quant.py).")
    flags.DEFINE_string("quantization_smoothing", None, "With int8/fp8: a smoothing alpha in [0, 1] or off "
                        "(models/smoothing.py); unset: the platform's default (EngineConfig).")
    flags.DEFINE_string("kv_cache_dtype", "auto", "auto | int8 | fp8_e4m3 (an 8-bit cache with a scale per token and kv head).")
    flags.DEFINE_string("save_executables", "", "Write every compiled step and a manifest here, "
                        "for the server's --load_executables.")


def engine_config_from_flags(f) -> EngineConfig:
    try:
        spec = SpeculativeConfig.from_value(json.loads(f.speculative_config)) if f.speculative_config else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative_config is not JSON ({e})") from None
    ints = lambda xs: tuple(int(x) for x in xs) if xs else None  # noqa: E731
    return EngineConfig(
        model=f.model, dtype=f.dtype, tensor_parallel_size=f.tensor_parallel_size,
        data_parallel_size=f.data_parallel_size, expert_parallel_size=f.expert_parallel_size,
        prompt_scoring_bucket=f.prompt_scoring_bucket, max_num_seqs=f.max_num_seqs,
        max_num_batched_tokens=f.max_num_batched_tokens, max_model_len=f.max_model_len,
        block_size=f.block_size, num_kv_blocks=f.num_kv_blocks,
        kv_cache_memory_fraction=f.kv_cache_memory_fraction, token_buckets=ints(f.token_buckets),
        seq_buckets=ints(f.seq_buckets), attention_backend=f.attention_backend,
        speculative_config=spec, disaggregation=f.disaggregation, enable_lora=f.enable_lora,
        max_loras=f.max_loras, max_lora_rank=f.max_lora_rank, lora_product=f.lora_product,
        quantization=f.quantization, quantization_smoothing=f.quantization_smoothing,
        kv_cache_dtype=f.kv_cache_dtype)


def draft_configs(config: EngineConfig):
    """(the draft model's ModelConfig, the draft head's DraftHeadConfig) the speculative config
    names, from their configs alone (no weights)."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("draft_model", "draft_head"):
        return None, None
    if spec.method == "draft_model":
        return capacity_tool.model_config_for(spec.model), None
    from engine.spec_decode.draft_head import read_head_config

    return None, read_head_config(spec.model)


def main(argv: Sequence[str]) -> None:
    del argv
    f = flags.FLAGS
    try:
        config = engine_config_from_flags(f)
        model = capacity_tool.model_config_for(f.model)
        draft_model, draft_head = draft_configs(config)
        build = compile_for_target(config, model, f.target, draft_model=draft_model, draft_head=draft_head,
                                   roofline=f.roofline)
    except ValueError as e:
        sys.exit(f"experiments.aot: {e}")
    r = report(build, model, config)
    print(format_report(r))
    if f.save_executables:
        save(build, f.save_executables)
        print(f"wrote {len(build.buckets)} executables and their manifest to {f.save_executables}")
    if f.output_json:
        with open(f.output_json, "w") as out:
            json.dump(r, out, indent=1)
        print(f"wrote {f.output_json}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
