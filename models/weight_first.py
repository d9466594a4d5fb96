"""Float32 and bfloat16 out-major products on the CPU computed weight-first: y^T = w . x^T, then
transposed.

XLA:CPU runs a float32 dot of 2 or more rows as a YNNPACK fusion, which packs its right-hand
operand for the kernel on every call. In the usual form y = x . w^T that operand is the weight
(every call repacks the whole matrix: an out-major [o, i] one through a transpose); in y^T =
w . x^T it is the activations, t rows, and the weight streams through as the left-hand operand.
The two transposes of the activations (x^T in, y^T out) are behind optimization barriers so that
XLA does not fold them back into the x . w^T dot. Measured in float32 on stop 48's 2-core AMD
EPYC (the default model's four layer products x 30 layers, each fed by the last, medians of 20
interleaved rounds, BUILD_NOTES.md "CPU attention forms", stop 48):

  rows                     1      8      32     256
  x . wt, wt in-major      17.3   27.8   54.5   296.0 ms   (stop 45's form, models/in_major.py)
  weight-first             17.9   23.7   46.9   282.8 ms

and the default model's lm_head (its tied [49152, 576] embedding) 15.8 -> ~11 ms at 32 rows.
One row stays x . w^T (XLA's own loop, no packing).

bfloat16 takes it from 2 to BF16_MAX_ROWS rows, with x^T behind a flat reshape: where XLA:CPU
sees the transpose feeding the dot it widens both operands to float32 (the whole weight, every
call: 2.3x slower, stop 48). The same chain in bfloat16 on a 2-core Intel Xeon (stop 49, medians
of 15 interleaved rounds; x . w^T -> weight-first): 2 rows 24.1 -> 15.3 ms, 8 rows 22.7 -> 16.0,
16 rows 24.6 -> 18.2, 32 rows 23.2 -> 21.3, 64 rows 29.6 -> 26.5, but 128 rows 43.6 -> 46.7 and
256 rows 61.2 -> 78.0, so larger products keep x . w^T. Quantized weights (models/quant.py) keep
their own forms (int8 weight-only weight-first was 7-8x slower); an int8 x int8 product takes a
weight-first form where the table says so for ("int8", rows) (models/int8_dot.py).

Which form is faster depends on the machine: float32 at 32 rows was 1.38x faster weight-first on
stop 48's AMD EPYC and 1.19x slower on stop 50's Intel Xeon. So the rule above is the static one;
an engine on the CPU measures both forms on its own weights at start-up
(engine/step/product_forms.py) and lowers its buckets inside `product_forms(table)`, whose
entries (dtype, rows) -> weight-first or not take precedence over the rule.

Every platform but the CPU takes the plain product (`jax.lax.platform_dependent`: a compile for a
TPU or GPU on a CPU host gets theirs). The arithmetic is the same dot products, summed in another
order: float32 rounding differs, nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars

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


BF16_MAX_ROWS = 64  # the most rows a bfloat16 product runs weight-first (module docstring)
FLOAT_DTYPES = ("float32", "bfloat16")  # the dtypes whose products have both forms

# The forms being lowered: {(dtype name, rows): weight-first?} (measured or forced,
# engine/step/product_forms.py), or None: the static rule. Set around a trace by `product_forms`.
_FORMS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("product_forms", default=None)


@contextlib.contextmanager
def product_forms(table: dict | None):
    """Within: a product of (dtype name, rows) in `table` takes the form it names (True:
    weight-first, False: plain) instead of the static rule; None: the static rule."""
    token = _FORMS.set(table)
    try:
        yield
    finally:
        _FORMS.reset(token)


def lowered_form(key: tuple[str, int]) -> bool | None:
    """The form the `product_forms` table being lowered names for (dtype name, rows): True
    weight-first, False plain, None not in it (or no table)."""
    table = _FORMS.get()
    return None if table is None or key not in table else bool(table[key])


def static_rule(dtype, rows: int) -> bool:
    """The built-in rule: float32 from 2 rows, bfloat16 from 2 to BF16_MAX_ROWS rows."""
    return rows >= 2 and (dtype == jnp.float32 or (dtype == jnp.bfloat16 and rows <= BF16_MAX_ROWS))


def takes_weight_first(spec: str, x: jax.Array, w: jax.Array) -> bool:
    """Whether `weight_first_product` runs weight-first on the CPU: a 2-D float32 or bfloat16
    weight in an out-major product of 2 or more rows, as the `product_forms` table being lowered
    says for (dtype, rows), else as `static_rule` does."""
    if x.ndim != 2 or x.shape[0] < 2 or x.dtype != w.dtype or not out_major(spec, w.shape):
        return False
    form = lowered_form((jnp.dtype(w.dtype).name, x.shape[0]))  # static_rule refuses non-floats
    return static_rule(w.dtype, x.shape[0]) if form is None else form


def _weight_first(x, w):
    if x.dtype == jnp.bfloat16:  # x^T through a flat view: a visible transpose widens the dot
        xt = jax.lax.optimization_barrier(jnp.swapaxes(x, 0, 1).reshape(-1)).reshape(x.shape[1], x.shape[0])
    else:
        xt = jax.lax.optimization_barrier(jnp.swapaxes(x, 0, 1))  # [i, t]
    yt = jnp.dot(w, xt, preferred_element_type=jnp.float32)  # [o, t]
    return jnp.swapaxes(jax.lax.optimization_barrier(yt), 0, 1)


def weight_first_product(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [t, i] . w [o, i] -> float32 [t, o] (`spec` out-major, `takes_weight_first`): weight-first
    on the CPU, the plain product elsewhere."""
    def plain(x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(x, w, cpu=_weight_first, default=plain)
