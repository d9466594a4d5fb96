"""The quantized product forms against float32, per row count: what the per-bucket rule is built on.

    python -m experiments.bench.quant_forms [--rows=1,2,4,8,16,32,64 --repeats=15 --layers=30]

The weight products of `--layers` layers of the default model's shapes (qkv_proj [960, 576],
o_proj [576, 576], gate_up_proj [3072, 576], down_proj [576, 1536], out-major as served), one
jitted function per (form, rows), each product fed by the previous one's output so none is
skipped. Forms (models/quant.py): float32 (as served: out-major, weight-first on the CPU from 2
rows, models/weight_first.py); float32 x . w^T (the plain product, what accelerators run); int8 weight-only (the weights
converted inside the dot); int8 x int8 -> int32 with dynamic per-row activation scales, and with one activation scale
per 64 input channels of a row ("g64"); fp8 weight-only. The forms of
one row count are timed in turn, `--repeats` rounds, medians in ms; the ratio column is float32 /
form (above 1: faster). The engine's rule (engine/config.py QUANT_ACTIVATION_ROWS) is the
smallest row count from which the int8 x int8 form beats weight-only.
"""

from __future__ import annotations

from absl import app, flags

from experiments.lab.timing import median_ms

_ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16", "32", "64"], "Rows per product.")
_REPEATS = flags.DEFINE_integer("repeats", 15, "Timed rounds per row count.")
_LAYERS = flags.DEFINE_integer("layers", 30, "Layers of products per call.")

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
FORMS = ("float32", "float32 x . w^T", "int8 weight-only", "int8 x int8", "int8 x int8 g64", "fp8 weight-only")


def build(num_layers: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.quant import quantize_weight

    rng = np.random.default_rng(0)
    floats = [{k: jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for k, s in SHAPES.items()}
              for _ in range(num_layers)]
    weights = {"float32": floats,
               "float32 x . w^T": floats,
               "int8 weight-only": [{k: quantize_weight(w, "int8") for k, w in d.items()} for d in floats],
               "int8 x int8": [{k: quantize_weight(w, "int8", activation_rows=0) for k, w in d.items()}
                               for d in floats],
               "int8 x int8 g64": [{k: quantize_weight(w, "int8", activation_rows=0, activation_group=64)
                                    for k, w in d.items()} for d in floats],
               "fp8 weight-only": [{k: quantize_weight(w, "fp8") for k, w in d.items()} for d in floats]}

    def plain(spec, x, w):  # the product without the CPU's weight-first form
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)

    def run(layers, x, proj=None):
        if proj is None:
            from models.layers import proj

        for d in layers:
            h = proj("te,ne->tn", x, d["qkv_proj"])[:, :576]
            x = x + proj("tn,en->te", h, d["o_proj"])
            g = proj("te,ne->tn", x, d["gate_up_proj"])
            x = x + proj("tf,ef->te", jax.nn.silu(g[:, :1536]) * g[:, 1536:], d["down_proj"])
        return x

    fn = jax.jit(run)
    return {form: (jax.jit(lambda layers, x: run(layers, x, plain)) if form == "float32 x . w^T" else fn, w)
            for form, w in weights.items()}


def main(argv):
    del argv
    import jax.numpy as jnp
    import numpy as np

    fns = build(_LAYERS.value)
    print(f"| rows | {' | '.join(FORMS)} (ms) | x . w^T / float32 | float32 / int8 weight-only | "
          "float32 / int8 x int8 |")
    print("|" + " --- |" * (len(FORMS) + 4))
    for rows in map(int, _ROWS.value):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 576), np.float32))
        med = median_ms(fns, x, FORMS, _REPEATS.value)
        print(f"| {rows} | {' | '.join(f'{med[f]:.2f}' for f in FORMS)} | "
              f"{med['float32 x . w^T'] / med['float32']:.2f} | {med['float32'] / med['int8 weight-only']:.2f} | {med['float32'] / med['int8 x int8']:.2f} |",
              flush=True)


if __name__ == "__main__":
    app.run(main)
