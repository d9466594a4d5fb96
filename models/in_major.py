"""Float32 layer weights held in-major on the CPU: the served layout's out-major products [o, i]
stored transposed, [i, o], and multiplied as x . wt.

XLA:CPU runs a float32 dot of 2 or more rows as a YNNPACK fusion, which packs the weight for its
kernel on every call. Packing an out-major weight (the contracted axis minor) needs a transpose on
the way; an in-major one does not. Measured on this 2-core CPU (the default model's four layer
products x 30 layers, each fed by the last, `python -m experiments.bench.quant_forms`;
BUILD_NOTES.md "CPU attention forms", stop 45): 8 rows 49.2 -> 27.4 ms, 32 rows 80.3 -> 53.3 ms,
256 rows 321.3 -> 298.5 ms, one row equal (XLA's own loop).
bfloat16 products are equal in both layouts, and quantized weights keep out-major (their one-row
form fuses the convert only into x . q^T), so only float32 is held this way.

`InMajorWeight` answers shape, dtype and ndim as the out-major weight it stands for, so code that
asks a weight for them is unchanged; `product` takes the served layout's einsum spec as
QuantizedWeight.product does. `hold_in_major` wraps a served layout's float32 2-D layer products
(one device: a mesh's shards keep their out-major specs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

IN_MAJOR_PRODUCTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InMajorWeight:
    """An out-major weight [o, i] stored as its transpose wt [i, o]."""

    wt: jax.Array  # [i, o]

    @property
    def dtype(self):
        return self.wt.dtype

    @property
    def shape(self):
        return self.wt.shape[::-1]

    @property
    def ndim(self):
        return self.wt.ndim

    def product(self, spec: str, x: jax.Array) -> jax.Array:
        """x [t, i] times this [o, i] weight -> float32 [t, o]; spec is the served layout's einsum
        ("te,ne->tn", "tf,ef->te", ...), which must contract x's and the weight's last axes."""
        check_out_major(spec, self.shape, "an in-major")
        return jnp.dot(x.astype(self.dtype), self.wt, preferred_element_type=jnp.float32)


def check_out_major(spec: str, shape: tuple, kind: str) -> None:
    """A ValueError unless `spec` is an out-major product x[t, i] . w[o, i] of a 2-D weight of
    `shape` (the served layout's einsums; `kind` names the weight in the message)."""
    inputs, out = spec.split("->")
    lhs, rhs = inputs.split(",")
    if len(lhs) != 2 or len(rhs) != 2 or lhs[1] != rhs[1] or out != lhs[0] + rhs[0] or len(shape) != 2:
        raise ValueError(f"{kind} weight takes an out-major product x[t, i] . w[o, i]; got "
                         f"spec {spec!r} for a weight of shape {tuple(shape)}")


def hold_in_major(params: dict) -> dict:
    """A served layout (a list of layers) with its float32 2-D layer products held in-major;
    anything else (quantized, 16-bit, stacked, experts) as it is."""
    layers = params["layers"]
    if not isinstance(layers, list):
        return params

    def held(name, w):
        if name in IN_MAJOR_PRODUCTS and isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.float32:
            return InMajorWeight(jnp.swapaxes(w, 0, 1))
        return w

    return {**params, "layers": [{k: held(k, w) for k, w in layer.items()} for layer in layers]}
