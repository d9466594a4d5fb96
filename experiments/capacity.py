"""Capacity calculator: what a model needs and what a device gives, before running anything.

    python -m experiments.capacity --model=random:llama3-8b --device=h200 --dtype=bfloat16
    python -m experiments.capacity --model=default --device=cpu --measure

1. The model's shape comes from its config alone (`random:<preset>`: models/config.py's presets;
   "default", a GGUF file, a HF folder or a jaxserve checkpoint: its metadata, no weights loaded).
2. Memory: weight bytes = parameters x the dtype's size; KV bytes per token from
   `ModelConfig.kv_bytes_per_token` (2 x layers x KV heads x head_dim x size). The KV budget is
   what the engine would give the cache (engine/kv_cache.py): on an accelerator
   `kv_cache_memory_fraction` of the memory JAX may use (`memory_fraction` of HBM: 0.75 on a GPU,
   JAX's default preallocation) less the weights; on the CPU the `kv_cache_bytes` budget.
3. Requests that fit at once: paged allocation holds ceil((prompt + output) / block_size) blocks
   per request at its longest; contiguous allocation reserves max_model_len per request. Block 0
   is the engine's null block and holds nothing.
4. Decode, one step over a batch of B requests at context c (the mean over a request's decode,
   prompt + output / 2): time = max(bytes / bandwidth, flops / peak) with
   bytes = streamed weights + B x c x KV bytes per token, and
   flops = B x (2 x matmul parameters + 4 x layers x heads x head_dim x c) (projections and the
   two attention products). Per-user rate = 1 / time; aggregate = B / time. With tensor
   parallelism bytes, flops, bandwidth and peak all divide across the chips (communication is
   ignored).
5. The crossover is the batch where flops / peak overtakes bytes / bandwidth. KV reads grow with
   B as fast as attention flops, so at long contexts decode may never become compute-bound: then
   there is no crossover and the memory fit is the limit.

What the model ignores (why a measurement is slower): kernel launch and Python step overheads,
prefill chunks sharing steps with decodes, padding to buckets, sampling, the host<->device
copies, and attainable bandwidth and FLOP/s below the spec sheet's peak.
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
from experiments.device_probe import Probe, measure_device
from models.config import ModelConfig, preset_config

GB = 1e9
# The engine's own defaults for the cache (block size, memory fraction, the CPU byte budget).
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str  # gpu | tpu | cpu
    hbm_bytes: float  # per chip
    bandwidth: float  # HBM bytes / s per chip
    peak_flops: float  # dense bf16 FLOP / s per chip (cpu: float32, measured)
    memory_fraction: float  # of HBM the runtime hands JAX (GPU: XLA_PYTHON_CLIENT_MEM_FRACTION)


# Spec-sheet figures per chip; FLOP/s are dense bf16 (the sheets' "with sparsity" numbers halved).
DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity.
    "h200": DeviceSpec("h200", "gpu", 141 * GB, 4.8e12, 989e12, 0.75),
    # NVIDIA H100 SXM datasheet: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity.
    "h100": DeviceSpec("h100", "gpu", 80 * GB, 3.35e12, 989e12, 0.75),
    # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s, BF16 312 TFLOPS (624 with sparsity).
    "a100": DeviceSpec("a100", "gpu", 80 * GB, 2.039e12, 312e12, 0.75),
    # Google Cloud TPU v5e docs: 16 GB HBM2 at 819 GB/s, 197 TFLOP/s bf16 per chip.
    "v5e": DeviceSpec("v5e", "tpu", 16 * GB, 819 * GB, 197e12, 1.0),
    # Google Cloud TPU v6e (Trillium) docs: 32 GB HBM at 1,638 GB/s, 918 TFLOP/s bf16 per chip.
    "v6e": DeviceSpec("v6e", "tpu", 32 * GB, 1638 * GB, 918e12, 1.0),
    # The 2-core development machine (AMD EPYC, KVM, 23 GB RAM), float32: the best of 5 runs of
    # measure_device() (BUILD_NOTES.md, "Capacity calculator against measurement"; the runs are
    # in experiments/results/capacity_vs_bench.json). Rerun with --measure on another machine.
    "cpu": DeviceSpec("cpu", "cpu", 23 * GB, 24.38 * GB, 68.14e9, 1.0),
}

def device_spec(name: str, **overrides) -> DeviceSpec:
    """The table's figures for `name`, with `overrides` (None: keep) applied."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r} (known: {', '.join(DEVICES)})")
    return dataclasses.replace(DEVICES[name], **{k: v for k, v in overrides.items() if v is not None})


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
        return ModelConfig.from_hf_folder(path)
    from models.gguf_loader import gguf_metadata, open_gguf

    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    return ModelConfig.from_gguf_metadata(meta, name=str(meta.get("general.name") or model),
                                          tensor_names={t.name for t in reader.tensors})


def matmul_params(config: ModelConfig) -> int:
    """Parameters a decode step multiplies by (and so streams): all but an untied input embedding,
    of which only the batch's rows are gathered."""
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    return config.num_params - untied_embedding


@dataclasses.dataclass(frozen=True)
class DecodePoint:
    batch: int
    step_s: float
    memory_s: float  # bytes / bandwidth
    compute_s: float  # flops / peak
    per_user_tok_s: float
    aggregate_tok_s: float

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


def decode_step(config: ModelConfig, device: DeviceSpec, itemsize: int, batch: int,
                context_len: float, tensor_parallel_size: int = 1) -> DecodePoint:
    """One decode step of `batch` requests that each attend over `context_len` tokens."""
    weights = matmul_params(config) * itemsize
    kv = batch * context_len * config.kv_bytes_per_token(itemsize)
    attention_flops = 4 * config.num_layers * config.num_heads * config.head_dim * context_len
    flops = batch * (2 * matmul_params(config) + attention_flops)
    memory_s = (weights + kv) / (tensor_parallel_size * device.bandwidth)
    compute_s = flops / (tensor_parallel_size * device.peak_flops)
    step = max(memory_s, compute_s)
    return DecodePoint(batch, step, memory_s, compute_s, 1.0 / step, batch / step)


def crossover_batch(config: ModelConfig, device: DeviceSpec, itemsize: int,
                    context_len: float) -> float | None:
    """The batch where compute time overtakes memory time (tensor parallelism cancels out);
    None when KV reads grow at least as fast as flops, so decode never becomes compute-bound."""
    one = decode_step(config, device, itemsize, 1, context_len)
    weights_s = matmul_params(config) * itemsize / device.bandwidth
    kv_s_per_request = one.memory_s - weights_s
    slope = one.compute_s - kv_s_per_request
    return weights_s / slope if slope > 0 else None


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


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


@dataclasses.dataclass
class CapacityReport:
    model: str
    device: DeviceSpec
    dtype: str
    tensor_parallel_size: int
    max_model_len: int
    prompt_len: int
    output_len: int
    block_size: int
    num_params: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: float  # all chips together; <= 0: the weights do not fit
    kv_cache_memory_fraction: float
    num_blocks: int  # including the null block
    fit_paged: int
    fit_contiguous: int
    context_len: float  # mean context over a request's decode
    crossover_batch: float | None
    crossover_batch_no_kv: float | None  # the same with no KV reads (a very short context)
    decode: list[DecodePoint]
    slo_itl_ms: float | None = None
    slo_batch: int | None = None  # largest batch (<= fit_paged) whose step meets the SLO

    @property
    def weights_fit(self) -> bool:
        return self.kv_budget_bytes > 0

    def point(self, batch: int) -> DecodePoint:
        return next(p for p in self.decode if p.batch == batch)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for p, point in zip(d["decode"], self.decode):
            p["bound"] = point.bound
        return d


def kv_budget_bytes(device: DeviceSpec, weight_bytes: float, tensor_parallel_size: int,
                    kv_cache_memory_fraction: float, kv_cache_bytes: int) -> float:
    """What the engine gives the cache (engine/kv_cache.py num_blocks_for), all chips together."""
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
             batches: Sequence[int] | None = None, slo_itl_ms: float | None = None) -> CapacityReport:
    """The calculator as a function (the notebook's entry); see the module docstring."""
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
    weight_bytes = config.num_params * itemsize
    kvb = config.kv_bytes_per_token(itemsize)
    budget = kv_budget_bytes(spec, weight_bytes, tensor_parallel_size, kv_cache_memory_fraction,
                             kv_cache_bytes)
    num_blocks = max(0, int(budget // (block_size * kvb)))
    total = prompt_len + output_len
    fit_paged = requests_that_fit(num_blocks, [total], block_size, max_model_len, "paged")
    fit_contiguous = requests_that_fit(num_blocks, [total], block_size, max_model_len, "contiguous")
    context_len = prompt_len + output_len / 2
    cross = crossover_batch(config, spec, itemsize, context_len)
    if batches is None:
        top = max(fit_paged, 1, 2 * math.ceil(cross) if cross else 1)
        batches = [2**i for i in range(int(math.log2(min(top, 4096))) + 1)]
        if fit_paged > batches[-1] and fit_paged <= 4096:
            batches.append(fit_paged)
    decode = [decode_step(config, spec, itemsize, b, context_len, tensor_parallel_size)
              for b in sorted(set(batches))]
    slo_batch = None
    if slo_itl_ms is not None:
        ok = [p.batch for p in decode if p.step_s * 1000 <= slo_itl_ms and p.batch <= max(fit_paged, 1)]
        slo_batch = max(ok) if ok else None
    return CapacityReport(
        model=config.name, device=spec, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
        max_model_len=max_model_len, prompt_len=prompt_len, output_len=output_len,
        block_size=block_size, num_params=config.num_params, weight_bytes=weight_bytes,
        kv_bytes_per_token=kvb, kv_budget_bytes=budget,
        kv_cache_memory_fraction=kv_cache_memory_fraction, num_blocks=num_blocks,
        fit_paged=fit_paged, fit_contiguous=fit_contiguous, context_len=context_len,
        crossover_batch=cross, crossover_batch_no_kv=crossover_batch(config, spec, itemsize, 0),
        decode=decode, slo_itl_ms=slo_itl_ms, slo_batch=slo_batch)


def format_report(r: CapacityReport) -> str:
    chips = f" x {r.tensor_parallel_size}" if r.tensor_parallel_size > 1 else ""
    d = r.device
    lines = [
        f"model {r.model}: {r.num_params / 1e9:.3f} B parameters, {r.dtype}",
        f"device {d.name}{chips}: {d.hbm_bytes / GB:.0f} GB, {d.bandwidth / GB:,.1f} GB/s, "
        + (f"{d.peak_flops / 1e12:,.0f} TFLOP/s" if d.peak_flops >= 1e12 else f"{d.peak_flops / 1e9:,.1f} GFLOP/s")
        + " per chip",
        f"weight bytes:           {r.weight_bytes:,} ({r.weight_bytes / GB:.2f} GB)",
        f"KV bytes per token:     {r.kv_bytes_per_token:,}",
    ]
    if not r.weights_fit:
        need = math.ceil(r.weight_bytes / (d.hbm_bytes * d.memory_fraction))
        lines.append(f"the weights do not fit in {d.memory_fraction:g} of {r.tensor_parallel_size} "
                     f"chip(s): use --tensor_parallel_size={max(need, r.tensor_parallel_size + 1)} or more")
        return "\n".join(lines) + "\n"
    if d.kind == "cpu":
        how = "the engine's CPU budget (kv_cache_bytes)"
    else:
        how = f"{r.kv_cache_memory_fraction:g} x ({d.memory_fraction:g} x HBM - weights)"
    total = r.prompt_len + r.output_len
    lines += [
        f"KV budget:              {r.kv_budget_bytes / GB:.2f} GB, {how}: {r.num_blocks:,} blocks "
        f"of {r.block_size} tokens ({(r.num_blocks - 1) * r.block_size:,} tokens)",
        f"users that fit at {total:,}-token context ({r.prompt_len} prompt + {r.output_len} output): "
        f"paged {r.fit_paged:,}, contiguous {r.fit_contiguous:,} (max_model_len {r.max_model_len:,} "
        "reserved each)",
        f"decode at mean context {r.context_len:,.0f} tokens:",
        "  batch | step (ms) | bound   | per user (tok/s) | aggregate (tok/s)",
    ]
    for p in r.decode:
        lines.append(f"  {p.batch:5d} | {p.step_s * 1000:9.2f} | {p.bound:7s} | "
                     f"{p.per_user_tok_s:16,.1f} | {p.aggregate_tok_s:17,.0f}")
    if r.crossover_batch is None:
        lines.append("crossover: none (KV reads grow as fast as flops: decode stays memory-bound "
                     "at this context)")
    else:
        where = "within" if r.crossover_batch <= r.fit_paged else "beyond"
        lines.append(f"crossover (compute overtakes bandwidth): batch {r.crossover_batch:,.1f} "
                     f"({where} the paged memory fit)")
    if r.crossover_batch_no_kv is not None:
        lines.append(f"crossover with no KV reads (very short contexts): batch {r.crossover_batch_no_kv:,.1f}")
    if r.slo_itl_ms is not None:
        lines.append(f"largest batch with a step under {r.slo_itl_ms:g} ms: {r.slo_batch}")
    return "\n".join(lines) + "\n"


def plot(reports: Sequence[CapacityReport], path: str | None = None, title: str = ""):
    """Aggregate and per-user decode rate against concurrency, one line per report; returns the
    figure (written to `path` and closed when given)."""
    import matplotlib.pyplot as plt

    fig, (ax_agg, ax_user) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in reports:
        label = f"{r.model} on {r.device.name}" + (f" x {r.tensor_parallel_size}" if r.tensor_parallel_size > 1 else "")
        xs = [p.batch for p in r.decode]
        line, = ax_agg.plot(xs, [p.aggregate_tok_s for p in r.decode], "o-", label=label)
        ax_user.plot(xs, [p.per_user_tok_s for p in r.decode], "o-", color=line.get_color(), label=label)
        for ax in (ax_agg, ax_user):
            if r.crossover_batch is not None:
                ax.axvline(r.crossover_batch, color=line.get_color(), linestyle="--", alpha=0.5)
            if r.fit_paged:
                ax.axvline(r.fit_paged, color=line.get_color(), linestyle=":", alpha=0.5)
    for ax, ylabel in ((ax_agg, "aggregate decode tokens / s"), (ax_user, "per-user tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests (batch)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(title or "predicted decode rate (dashed: crossover; dotted: paged memory fit)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig


# ---------------------------------------------------------------- against a measured sweep


def measured_from_sweep(sweep: dict) -> dict:
    """The numbers of a concurrency sweep (experiments.sweep's JSON) that the calculator predicts:
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


# ---------------------------------------------------------------- this machine


def device_from_probe(probe: Probe, name: str = "this machine") -> DeviceSpec:
    """A DeviceSpec of JAX's default device with the probe's figures; its memory is what the
    runtime reports (already net of JAX's preallocation fraction), or the RAM on the CPU."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceSpec(name, "cpu", float(ram), probe.bandwidth, probe.peak_flops, 1.0)
    limit = (device.memory_stats() or {}).get("bytes_limit", 0)
    kind = "tpu" if device.platform == "tpu" else "gpu"
    return DeviceSpec(name, kind, float(limit), probe.bandwidth, probe.peak_flops, 1.0)


def define_flags() -> None:
    """The entry point's flags, defined only when run as a program: importing this module (the
    notebook does, beside experiments that define flags of the same names) defines none."""
    flags.DEFINE_string("model", "random:llama3-8b", "random:<preset>, default, a GGUF, a HF folder.")
    flags.DEFINE_enum("dtype", None, list(DTYPE_BYTES), "Weights and KV dtype; default: float32 "
                      "on the CPU, bfloat16 on accelerators (as the engine).")
    flags.DEFINE_enum("device", "h200", list(DEVICES), "Device figures to use.")
    flags.DEFINE_integer("tensor_parallel_size", 1, "Chips the model is sharded over.")
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
        kv_cache_memory_fraction=fv.kv_cache_memory_fraction, slo_itl_ms=fv.slo_itl_ms)
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
