"""On the CPU, the options every step's compile is given: the vector width of XLA:CPU's own loops.

XLA:CPU emits its fusions and its one-row products (a matrix times a vector, with an int8 weight's
convert fused in) as LLVM loops, which by default prefer 256-bit vectors, also on a CPU with
AVX-512. Its matrix kernels (YNNPACK, Eigen) are built apart and do not take the option. Measured
on stop 51's Intel Xeon (2 cores, AVX-512; BUILD_NOTES.md "Quantization", stop 51):

  the default model's 120 one-row int8 weight-only layer products (a scratch chain):
      13.1 ms at XLA's 256 bits, 9.7 ms at 512;
  the fixed workload at N = 1, same-run command, two rounds alternated with the commit before:
      int8 weights + int8 cache 43.4 / 42.5 -> 57.6 / 56.5 tok/s, a bfloat16 model with int8
      weights 41.4 / 40.7 -> 66.2 / 63.6, float32 29.7 / 29.0 -> 29.9 / 29.4.

`EngineConfig.cpu_vector_width` says which width an engine on the CPU compiles for:

  auto   (default) 512 for the buckets of one token row, where the CPU has AVX-512
         (/proc/cpuinfo's avx512f); XLA's default (256 bits) for the other buckets and on other
         CPUs. Larger buckets keep the default because 512 bits bought nothing there: in two
         alternated rounds of the same-run command, N = 8 and 32 ran 2-5 % slower with 512 than
         without in 10 of 12 arm pairs (within the noise of one round; BUILD_NOTES.md). Measured
         on an Intel Xeon only: an AMD EPYC (Zen 4, whose AVX-512 units are 256 bits wide) is not
         measured, and "256" gives back XLA's default there;
  256    XLA's default, for every bucket;
  512    512-bit vectors asked for, for every bucket (LLVM keeps to what the CPU has).

The widths sum a dot's products in another order: float rounding differs, nothing else. Other
platforms take no option from this (engine/core/builder.py gives it to a CPU engine's compiles
only).
"""

from __future__ import annotations

import functools

from engine.config import CPU_VECTOR_WIDTHS

OPTION = "xla_cpu_prefer_vector_width"


@functools.cache
def cpuinfo(field: str) -> str:
    """The first `field` line's value in Linux's /proc/cpuinfo ("model name", "flags"); "" where
    there is none (other systems)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.split(":", 1)[0].strip() == field), "")
    except OSError:
        return ""


def has_avx512() -> bool:
    """Whether this machine's CPU has AVX-512 (/proc/cpuinfo's flags; elsewhere False)."""
    return "avx512f" in cpuinfo("flags").split()


def compiler_options(width: str, rows: int) -> dict[str, int] | None:
    """The XLA:CPU compile options for a program of `rows` token rows (a bucket's padded tokens)
    under `width` (EngineConfig.cpu_vector_width); None: XLA's defaults."""
    if width not in CPU_VECTOR_WIDTHS:
        raise ValueError(f"cpu_vector_width must be one of {', '.join(CPU_VECTOR_WIDTHS)}; got {width!r}")
    if width == "auto":
        if rows != 1 or not has_avx512():
            return None
        width = "512"
    return {OPTION: int(width)}
