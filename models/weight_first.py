"""Float32 out-major products on the CPU computed weight-first: y^T = w . x^T, then transposed.

XLA:CPU runs a float32 dot of 2 or more rows as a YNNPACK fusion, which packs its right-hand
operand for the kernel on every call. In the usual form y = x . w^T that operand is the weight
(every call repacks the whole matrix: an out-major [o, i] one through a transpose); in y^T =
w . x^T it is the activations, t rows, and the weight streams through as the left-hand operand.
The two transposes of the activations (x^T in, y^T out) are behind optimization barriers so that
XLA does not fold them back into the x . w^T dot. Measured on this 2-core CPU (the default
model's four layer products x 30 layers, each fed by the last, medians of 20 interleaved rounds,
BUILD_NOTES.md "CPU attention forms", stop 48):

  rows                     1      8      32     256
  x . wt, wt in-major      17.3   27.8   54.5   296.0 ms   (stop 45's form, models/in_major.py)
  weight-first             17.9   23.7   46.9   282.8 ms

and the default model's lm_head (its tied [49152, 576] embedding) 15.8 -> ~11 ms at 32 rows.
One row stays x . w^T (XLA's own loop, no packing); bfloat16 is slower weight-first (41 -> 97 ms at
32 rows: YNNPACK's bfloat16 kernels), so it and quantized weights (models/quant.py) keep their
forms. Every platform but the CPU takes the plain product (`jax.lax.platform_dependent`: a compile
for a TPU or GPU on a CPU host gets theirs). The arithmetic is the same dot products, summed in
another order: float32 rounding differs, nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def out_major(spec: str, shape: tuple) -> bool:
    """Whether `spec` is an out-major product x[t, i] . w[o, i] of a 2-D weight of `shape`."""
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    return len(lhs) == 2 and len(rhs) == 2 and lhs[1] == rhs[1] and out == lhs[0] + rhs[0] and len(shape) == 2


def check_out_major(spec: str, shape: tuple, kind: str) -> None:
    """A ValueError unless `spec` is an out-major product x[t, i] . w[o, i] of a 2-D weight of
    `shape` (the served layout's einsums; `kind` names the weight in the message)."""
    if not out_major(spec, shape):
        raise ValueError(f"{kind} weight takes an out-major product x[t, i] . w[o, i]; got "
                         f"spec {spec!r} for a weight of shape {tuple(shape)}")


def takes_weight_first(spec: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `float32_product` runs weight-first on the CPU: a float32 2-D weight in an out-major
    product of 2 or more rows."""
    return (w.dtype == jnp.float32 and x.dtype == jnp.float32 and x.ndim == 2 and x.shape[0] >= 2
            and out_major(spec, w.shape))


def _weight_first(x, w):
    xt = jax.lax.optimization_barrier(jnp.swapaxes(x, 0, 1))  # [i, t]
    yt = jnp.dot(w, xt, preferred_element_type=jnp.float32)  # [o, t]
    return jnp.swapaxes(jax.lax.optimization_barrier(yt), 0, 1)


def float32_product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [t, i] . w [o, i] -> float32 [t, o] (`spec` out-major, `takes_weight_first`): weight-first
    on the CPU, the plain product elsewhere."""
    def plain(x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(x, w, cpu=_weight_first, default=plain)
