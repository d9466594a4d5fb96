"""The capacity calculator's result (experiments/capacity.py) and its two renderings.

- `DecodePoint`: one decode step at one batch size: its time, which of bytes / bandwidth and
  flops / peak bounds it, and the per-user and aggregate rates that follow.
- `CapacityReport`: everything `capacity()` computes for one model on one device (`to_dict` for
  the JSON file).
- `format_report`: the text the command line prints: sizes, the KV budget and how it was taken,
  the users that fit paged and contiguous, the decode table, the crossover and the SLO batch.
- `plot`: aggregate and per-user decode rate against concurrency, one line per report, with the
  crossover (dashed) and the paged memory fit (dotted).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from experiments.lab.capacity_devices import GB, DeviceSpec


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
    # paged with one block table for every layer (differs from fit_paged for a model mixing
    # sliding-window and global layers, whose sliding layers keep only their window's blocks)
    fit_paged_one_group: int | None = None
    quantization: str | None = None  # weights: None (the dtype), "int8", "fp8"
    kv_cache_dtype: str = "auto"  # "auto" (the dtype), "int8", "fp8_e4m3"

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


def format_report(r: CapacityReport) -> str:
    chips = f" x {r.tensor_parallel_size}" if r.tensor_parallel_size > 1 else ""
    d = r.device
    lines = [
        f"model {r.model}: {r.num_params / 1e9:.3f} B parameters, {r.dtype}"
        + (f", weights {r.quantization}" if r.quantization else "")
        + (f", KV cache {r.kv_cache_dtype}" if r.kv_cache_dtype != "auto" else ""),
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
        "reserved each)" + ("" if r.fit_paged_one_group in (None, r.fit_paged) else
                            f"; paged with one block table for every layer {r.fit_paged_one_group:,}"),
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
