"""The int8 x int8 -> int32 product of quantized activations and weights, in the form each platform
runs fastest (models/quant.py QuantizedWeight.product, activations quantized).

xq [t, i] int8 (a row's activations, quantized), q [o, i] int8 (an out-major weight's codes) ->
int32 [t, o] = xq . q^T, exact.

On XLA:CPU the product is a YNNPACK fusion. Its int8 kernels take unsigned activations times
signed weights (the VNNI instruction's u8 x s8 form); given s8 x s8 it runs a slower path. So the
CPU form shifts the activations into u8, xu = xq + 128 (the bits of xq with the sign bit flipped),
and takes back 128 * sum_i q[o, i], which the shift added to every row:

    xq . q^T = xu . q^T - 128 * rowsum(q)        (all int32, exact: |xu . q^T| <= 255 * 127 * i)

Measured on this 2-core CPU (the default model's 120 layer products with their activation
quantization, `python -m experiments.bench.quant_forms`; BUILD_NOTES.md "Quantization", stop 45):
8 rows 30.3 -> 24.0 ms, 16 rows 39.7 -> 27.0 ms, 32 rows 55.3 -> 37.9 ms.

Weight-first (measured per row count at start-up, engine/step/product_forms.py; the table being
lowered says ("int8", rows) -> True): the s8 x s8 dot as y^T = q . xq^T, transposed back, so that
YNNPACK packs the few activation rows rather than the whole weight on every call. On stop 51's
Intel Xeon the bfloat16 default model's int8 products as served (quantization and scales
included) took 13.1 against 16.1 ms at 8 rows and 16.3 against 20.1 ms at 32 (BUILD_NOTES.md
"Quantization", stop 51); not measured on the AMD EPYC where the u8 x s8 form was chosen, so
without a measurement the form below stays.

The correction's sums come from one of two places:
  given     `code_sums` int32 [o] = sum_i q[o, i], computed once from the weight (the CPU's
            single-device layer loop holds them: models/quant.py `hold_code_sums`): the dot is
            the t rows alone, xu . q^T - 128 * code_sums. One row fewer than the next form, which
            YNNPACK's kernel charges for (the bare chain of the 120 products, scratch, quiet
            machine: 8.70 against 9.42 ms at 8 rows, 15.97 against 16.97 ms at 32).
  computed  the same dot from the weight codes it already reads (the appended row of 128s), so
            nothing is stored beside the weights and it is right on every device of a mesh (a
            row-parallel weight's local columns, whose sums are the shard's): a mesh runs this.

jax's dot_general converts mixed integer operands to the result type before the dot on the CPU,
so the mixed dot is a primitive of its own (`_U8S8_DOT`) lowered straight to a stablehlo dot of
ui8 x i8 -> i32. XLA:CPU hands it to YNNPACK where YNNPACK takes the shape; elsewhere (or with
YNNPACK's dot fusion turned off by XLA_FLAGS) it converts both operands to int32 first: exact, but
slower than s8 x s8 (and the other mixed order, u8 weights times s8 activations, failed its
compile in a scratch run). So the form is used only for shapes YNNPACK takes, both outer sizes
> 1 and some size >= 8 (`_ynn_takes`); other shapes, and other platforms, run the s8 x s8 dot (one
row padded with a zero row on the CPU, where a one-row int8 dot is slow).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir

from models.weight_first import lowered_form

_SHIFT = 128


def _abstract(xu, q):
    if xu.dtype != jnp.uint8 or q.dtype != jnp.int8 or xu.ndim != 2 or q.ndim != 2 or xu.shape[1] != q.shape[1]:
        raise TypeError(f"u8s8_dot takes uint8 [t, i] and int8 [o, i]; got {xu.dtype}{list(xu.shape)} "
                        f"and {q.dtype}{list(q.shape)}")
    return jax.core.ShapedArray((xu.shape[0], q.shape[0]), jnp.int32)


def _lower(ctx, xu, q):
    (out,) = ctx.avals_out
    dims = stablehlo.DotDimensionNumbers.get(lhs_batching_dimensions=[], rhs_batching_dimensions=[],
                                             lhs_contracting_dimensions=[1], rhs_contracting_dimensions=[1])
    result = ir.RankedTensorType.get(out.shape, ir.IntegerType.get_signless(32))
    return [stablehlo.dot_general(result, xu, q, dims)]


_U8S8_DOT = Primitive("jaxserve_u8s8_dot")
_U8S8_DOT.def_abstract_eval(_abstract)
_U8S8_DOT.def_impl(jax.jit(_U8S8_DOT.bind))  # eager calls (tests) compile the one dot
mlir.register_lowering(_U8S8_DOT, _lower)


def _ynn_takes(rows: int, i: int, o: int) -> bool:
    """Whether XLA:CPU's YNNPACK fusion takes a [rows, i] x [o, i] dot (its dot support rules:
    no vector operand, and not every size below 8)."""
    return rows > 1 and o > 1 and max(rows, i, o) >= 8


def codes_product(xq: jax.Array, q: jax.Array, acc) -> jax.Array:
    """xq [t, i] . q[o, i]^T of 8-bit codes of one type (int8, or fp8 as models/quant.py's fp8 x
    fp8 form), accumulated in `acc`; one row padded with a zero row (XLA:CPU runs a one-row 8-bit
    dot on a slow path)."""
    rows = xq.shape[0]
    if rows == 1:
        xq = jnp.concatenate([xq, jnp.zeros_like(xq)])
    return jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=acc)[:rows]


def _s8s8(xq, q, code_sums=None):
    del code_sums  # the s8 x s8 dot needs no correction
    return codes_product(xq, q, jnp.int32)


def _u8s8(xq, q, code_sums=None):
    rows = xq.shape[0]
    xu = jax.lax.bitcast_convert_type(xq, jnp.uint8) ^ np.uint8(0x80)  # xq + 128
    if code_sums is not None:
        if rows == 1:  # YNNPACK takes no vector operand: the row twice, one result kept
            xu = jnp.concatenate([xu, xu])
        return _U8S8_DOT.bind(xu, q)[:rows] - _SHIFT * code_sums[None, :]
    xu = jnp.concatenate([xu, jnp.full((1, xu.shape[1]), _SHIFT, jnp.uint8)])
    y = _U8S8_DOT.bind(xu, q)
    return y[:rows] - y[rows:]


def _weight_first_s8s8(xq, q, code_sums=None):
    """y^T = q . xq^T, s8 x s8 -> int32, transposed back: YNNPACK packs the t activation rows, not
    the weight (models/weight_first.py's float form; behind barriers so XLA does not fold it back
    into xq . q^T)."""
    del code_sums
    x = jax.lax.optimization_barrier(xq)  # contracted on its last axis: no transposed copy of it
    yt = jax.lax.dot_general(q, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)  # [o, t]
    return jnp.swapaxes(jax.lax.optimization_barrier(yt), 0, 1)


def int8_product(xq: jax.Array, q: jax.Array, code_sums: jax.Array | None = None) -> jax.Array:
    """xq [t, i] int8 . q[o, i]^T int8 -> int32 [t, o], exact (module docstring). code_sums int32
    [o]: q's sums over i, if held (the CPU form then needs no correction row); they must be q's.
    On the CPU, t >= 2 rows run weight-first where the product form table being lowered says so
    for ("int8", t) (models/weight_first.py product_forms; measured at start-up,
    engine/step/product_forms.py)."""
    if code_sums is not None and (code_sums.shape != q.shape[:1] or code_sums.dtype != jnp.int32):
        raise ValueError(f"code_sums must be int32 [{q.shape[0]}] (the weight's sums over its input); got "
                         f"{code_sums.dtype}{list(code_sums.shape)}")
    if xq.shape[0] >= 2 and lowered_form(("int8", xq.shape[0])):
        return jax.lax.platform_dependent(xq, q, cpu=_weight_first_s8s8, default=_s8s8)
    if not _ynn_takes(max(xq.shape[0] + (code_sums is None), 2), q.shape[1], q.shape[0]):
        return _s8s8(xq, q)
    # The platform the step is lowered for (a compile for a TPU on a CPU host takes the TPU's).
    return jax.lax.platform_dependent(xq, q, code_sums, cpu=_u8s8, default=_s8s8)
