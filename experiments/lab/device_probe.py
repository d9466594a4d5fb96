"""A few-second probe of a JAX device's memory bandwidth and matmul FLOP/s.

The capacity calculator (experiments/capacity.py) predicts from a device's bandwidth and peak
FLOP/s; spec sheets give them for accelerators, this measures them where there is no sheet (the
CPU) or to check one. Each figure is the best of several runs: like a spec sheet's, it is what the
device can do, and other work on a shared machine only lowers it.
"""

from __future__ import annotations

import dataclasses
import math
import time


@dataclasses.dataclass(frozen=True)
class Probe:
    bandwidth: float  # bytes / s: the best of three streaming kernels over the same weights
    peak_flops: float  # FLOP / s of a square matmul
    numpy_copy_bandwidth: float  # bytes / s (read + write) of a numpy copy, for reference
    platform: str
    dtype: str


def _best_seconds(fn, repeats: int) -> float:
    fn()  # compile, warm the caches
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_device(dtype: str = "float32", weight_mib: int = 256, matmul_n: int = 2048,
                   repeats: int = 8) -> Probe:
    """Bandwidth and FLOP/s of JAX's default device, best of `repeats` (peak capability, as a
    spec sheet quotes it: other work on the machine only lowers the figures). Bandwidth is the
    best that a matrix-vector product in either layout (what a batch-1 decode runs) or a sum
    attains over `weight_mib` MiB of weights; FLOP/s is a `matmul_n`^3 matmul."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    itemsize = jnp.dtype(dtype).itemsize
    rows = 4096
    cols = weight_mib * 1024 * 1024 // (itemsize * rows)
    key = jax.random.key(0)
    w = jax.random.normal(key, (rows, cols), dtype)
    x, y = jnp.ones((1, rows), dtype), jnp.ones((rows, 1), dtype)
    wt = w.T.copy()
    kernels = (
        (jax.jit(lambda x, w: x @ w), (x, w)),
        (jax.jit(lambda wt, y: wt @ y), (wt, y)),
        (jax.jit(lambda w: jnp.sum(w, dtype=jnp.float32)), (w,)),
    )
    stream_s = min(_best_seconds(lambda f=f, a=a: f(*a).block_until_ready(), repeats)
                   for f, a in kernels)
    a = jax.random.normal(key, (matmul_n, matmul_n), dtype)
    matmul = jax.jit(lambda a: a @ a)
    matmul_s = _best_seconds(lambda: matmul(a).block_until_ready(), repeats)
    host = np.ones(weight_mib * 1024 * 1024 // 4, np.float32)
    out = np.empty_like(host)
    copy_s = _best_seconds(lambda: np.copyto(out, host), repeats)
    return Probe(bandwidth=rows * cols * itemsize / stream_s, peak_flops=2 * matmul_n**3 / matmul_s,
                 numpy_copy_bandwidth=2 * host.nbytes / copy_s,
                 platform=jax.devices()[0].platform, dtype=dtype)
