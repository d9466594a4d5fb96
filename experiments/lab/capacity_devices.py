"""The capacity calculator's device figures (experiments/capacity.py): per chip, HBM, bandwidth,
peak FLOP/s and the fraction of HBM the runtime hands JAX.

- `DEVICES`: spec-sheet figures for the accelerators (sources beside each entry) and this 2-core
  development machine's measured ones; `device_spec` looks one up, with overrides.
- `device_from_probe`: a `DeviceSpec` of JAX's default device from `measure_device`'s figures
  (experiments/lab/device_probe.py), for a machine that is not in the table.
"""

from __future__ import annotations

import dataclasses
import os

from experiments.lab.device_probe import Probe

GB = 1e9


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
    # Google Cloud TPU v5p docs: 95 GB HBM2e at 2,765 GB/s, 459 TFLOP/s bf16 per chip.
    "v5p": DeviceSpec("v5p", "tpu", 95 * GB, 2765 * GB, 459e12, 1.0),
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
