"""Deployment targets for compiling from the CPU: each a small data entry, and its compile-only devices.

A target is a device kind (its figures in experiments/lab/capacity_devices.py: HBM, bandwidth,
peak bf16 FLOP/s) times a count: a TPU slice by libtpu's topology name, or N GPUs described by
the GpuTargetConfig text proto XLA's GPU compiler reads (compute capability, SMs, shared memory,
registers, memory size and bandwidth; the figures are the cards' public specifications).

`compile_only_devices(target)` gives JAX devices of that target without the hardware:
`jax.experimental.topologies.get_topology_desc` with libtpu (TPU) or the CUDA PJRT plugin (GPU),
both from the optional extra `aot` (`make aot-setup`). `jit(...).lower(...).compile()` on them
runs the real device compiler (Mosaic and XLA:TPU; Triton, ptxas and XLA:GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from experiments.lab.capacity_devices import DeviceSpec, device_spec


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """What XLA's GpuTargetConfig says of a card (gpu_device_info fields)."""

    description: str
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    fpus_per_core: int
    shared_memory_per_block_optin: int
    shared_memory_per_core: int
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int  # bytes the driver reports
    memory_bandwidth: int  # bytes / s

    def target_config(self) -> str:
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{self.description}"
"""


MIB = 1 << 20
# NVIDIA's architecture whitepapers and datasheets: Hopper (sm_90: 132 SMs on the SXM parts,
# 228 KB shared memory per SM of which 227 KB per block, 50 MB L2, 1.98 GHz boost) and Ampere
# A100 (sm_80: 108 SMs, 164 KB / 163 KB, 40 MB L2, 1.41 GHz). Memory sizes as the driver reports
# them (H200 143,771 MiB; H100 and A100 80GB 81,559 MiB).
GPUS = {
    "h200": GpuInfo("NVIDIA H200", (9, 0), 132, 128, 232448, 233472, 50 * MIB, 1.98,
                    143771 * MIB, 4_800_000_000_000),
    "h100": GpuInfo("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 232448, 233472, 50 * MIB, 1.98,
                    81559 * MIB, 3_352_320_000_000),
    "a100": GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 166912, 167936, 40 * MIB, 1.41,
                    81559 * MIB, 2_039_000_000_000),
}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    device: str  # a key of capacity_devices.DEVICES (and of GPUS for a GPU)
    num_devices: int
    topology: str  # libtpu's topology name, or the GPU "1x1xN" topology

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def spec(self) -> DeviceSpec:
        return device_spec(self.device)

    @property
    def hbm_bytes(self) -> int:
        """Per device: what the runtime can hand out (the driver's figure on a GPU)."""
        if self.kind == "gpu":
            return GPUS[self.device].device_memory_size
        return int(self.spec.hbm_bytes)


def _tpu(name: str, device: str, n: int, topology: str) -> Target:
    return Target(name, device, n, topology)


TARGETS: dict[str, Target] = {
    **{f"{g}" if n == 1 else f"{g}x{n}": Target(f"{g}" if n == 1 else f"{g}x{n}", g, n, f"1x1x{n}")
       for g in GPUS for n in (1, 2, 4, 8)},
    "v5e-1": _tpu("v5e-1", "v5e", 1, "v5e:1x1"),
    "v5e-4": _tpu("v5e-4", "v5e", 4, "v5e:2x2"),
    "v5e-8": _tpu("v5e-8", "v5e", 8, "v5e:2x4"),
    "v6e-1": _tpu("v6e-1", "v6e", 1, "v6e:1x1"),
    "v6e-4": _tpu("v6e-4", "v6e", 4, "v6e:2x2"),
    "v6e-8": _tpu("v6e-8", "v6e", 8, "v6e:2x4"),
    # v5p-8: four chips (eight TensorCores paired as megacores, one JAX device a chip).
    "v5p-8": _tpu("v5p-8", "v5p", 4, "v5p:2x2x1"),
}


def target(name: str) -> Target:
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    return TARGETS[name]


@functools.cache
def compile_only_devices(name: str) -> tuple:
    """The target's devices, compile-only (no hardware); ValueError naming the missing extra."""
    from jax.experimental import topologies

    # libtpu takes a machine-wide lock file by default: compiling for a TPU target in two
    # processes at once (pytest-xdist workers, two experiments.aot runs) would fail in the second.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    t = target(name)
    try:
        if t.kind == "tpu":
            kwargs = {"chips_per_host_bounds": (1, 1, 1)} if t.num_devices == 1 else {}
            topo = topologies.get_topology_desc(topology_name=t.topology, platform="tpu", **kwargs)
        else:
            topo = topologies.get_topology_desc(platform="cuda", topology=t.topology,
                                                target_config=GPUS[t.device].target_config())
    except Exception as e:  # the plugin missing or refusing: say which extra brings it
        raise ValueError(f"target {name}: no compile-only {t.kind.upper()} devices ({e}); install "
                         "the device compilers with `make aot-setup` (the `aot` extra)") from None
    devices = tuple(topo.devices)
    if len(devices) != t.num_devices:
        raise ValueError(f"target {name}: topology {t.topology} gave {len(devices)} devices, "
                         f"expected {t.num_devices}")
    return devices
