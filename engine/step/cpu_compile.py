"""On the CPU, the options every step's compile is given: the vector width of XLA:CPU's own loops.

XLA:CPU emits its fusions and its one-row products (a matrix times a vector, with an int8 weight's
convert fused in) as LLVM loops, which by default prefer 256-bit vectors, also on a CPU with
AVX-512. Its matrix kernels (YNNPACK, Eigen) are built apart and do not take the option. Measured
on stop 51's Intel Xeon (2 cores, AVX-512; BUILD_NOTES.md "Quantization", stop 51):

  the default model's 120 one-row int8 weight-only layer products (a scratch chain):
      13.1 ms at XLA's 256 bits, 9.7 ms at 512;
  the fixed workload at N = 1 (`experiments.bench.offline --dataset=fixed --num_requests=1`):
      int8 weights + int8 cache 42.8 -> 57.6 tok/s, float32 29.0 -> 30.1;
  at N = 8 and 32 every dtype within the run-to-run noise (-2 % to +5 %).

`EngineConfig.cpu_vector_width` says which width an engine on the CPU compiles for:

  auto   (default) 512 where the CPU has AVX-512 (/proc/cpuinfo's avx512f), else XLA's default
         (256 bits); measured on an Intel Xeon only: on an AMD EPYC (Zen 4, whose AVX-512 units
         are 256 bits wide) it is not measured, and "256" gives back XLA's default there;
  256    XLA's default, also where the CPU has AVX-512;
  512    512-bit vectors asked for (LLVM keeps to what the CPU has).

The widths sum a dot's products in another order: float rounding differs, nothing else. Other
platforms take no option from this (`compiler_options` is for a CPU engine's compiles only).
"""

from __future__ import annotations

import functools

from engine.config import CPU_VECTOR_WIDTHS

OPTION = "xla_cpu_prefer_vector_width"


@functools.cache
def has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512 (Linux's /proc/cpuinfo; elsewhere False)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512f" in flags


def compiler_options(width: str) -> dict[str, int] | None:
    """The XLA:CPU compile options for `width` (EngineConfig.cpu_vector_width); None: XLA's
    defaults."""
    if width not in CPU_VECTOR_WIDTHS:
        raise ValueError(f"cpu_vector_width must be one of {', '.join(CPU_VECTOR_WIDTHS)}; got {width!r}")
    if width == "auto":
        if not has_avx512():
            return None
        width = "512"
    return {OPTION: int(width)}
