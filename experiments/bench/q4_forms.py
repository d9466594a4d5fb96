"""Candidate product forms for a GGUF Q4_1 weight on XLA:CPU, against float32 and int8 per channel.

    python -m experiments.bench.q4_forms [--rows=1,8,32 --repeats=5 --layers=30]

The weight products of `--layers` layers of the default model's shapes (qkv_proj [960, 576],
o_proj [576, 576], gate_up_proj [3072, 576], down_proj [576, 1536], out-major as served), one
jitted function per (form, rows), each product fed by the previous one's output (as
experiments/bench/quant_forms.py). A Q4_1 weight is codes q in 0..15 with float32 d and m per 32
inputs of a row, w = d * q + m. Forms:

  float32          x . w^T (the dequantized weights)
  int8 wo / int8x8 models/quant.py's per-channel int8: weight-only, and int8 x int8 per row
  q4 int8 codes    q held as int8 [o, i], dequantized inside the step, x . deq(q)^T  (a)
  Q4_1 served      the same codes as models/quant.py serves them (QuantizedWeight with block=32,
                   offset=m; its form per row count: x . dequantized^T at one row, from two the
                   "split" form x . (d q)^T + blocksum(x) . m^T, padded to 8 rows)
  q4 packed        q as nibbles uint8 [o, i / 2] (GGUF's order), unpacked inside the step  (b)
  q4 packed split  the packed nibbles in the split form
  q4 uint4         q stored as jnp.uint4 [o, i]  (c), and "q4 uint4 split"
  q4_0 plain       Q4_0's weight (signed codes q - 8 as int8, no m): x . (d (q - 8))^T
  Q4_0 served      the same as models/quant.py serves it (zero offsets, as the GGUF loader
                   stores them: from two rows the split form with + blocksum(x) . 0, which
                   XLA:CPU needs to fuse the scaling into the dot)
  q4 barrier       (a) with the dequantized weight materialized first (optimization_barrier)
  q4 act blocks    x quantized per row to int8, int32 dots per 32-block (batched over blocks),
                   times sx d, plus blocksum(x) . m^T  (d; not exact: x is rounded)

`--head`: the default model's tied lm_head instead (its one product x . embed^T, embed
[49152, 576]; served as Q8_0, which has the Q4_0 form without offset).
Medians in ms of `--repeats` rounds, the forms of one row count timed in turn.
"""

from __future__ import annotations

from absl import app, flags

from experiments.lab.timing import median_ms

_ROWS = flags.DEFINE_list("rows", ["1", "8", "32"], "Rows per product.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed rounds per row count.")
_LAYERS = flags.DEFINE_integer("layers", 30, "Layers of products per call.")
_FORMS = flags.DEFINE_list("forms", [], "Forms to time (default: all).")
_HEAD = flags.DEFINE_boolean("head", False, "Time the tied lm_head's one product [49152, 576] instead of the layers.")

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536)}
FORMS = ("float32", "int8 wo", "int8x8", "q4 int8 codes", "q4 packed", "q4 packed split", "q4 uint4",
         "q4 uint4 split", "q4 barrier", "q4 act blocks", "q4_0 plain", "Q4_1 served", "Q4_0 served")
B = 32


def _deq(q, d, m):
    import jax.numpy as jnp

    o, i = q.shape
    w = q.astype(jnp.float32).reshape(o, i // B, B) * d[..., None] + m[..., None]
    return w.reshape(o, i)


def _blocksum(x):
    t, i = x.shape
    return x.reshape(t, i // B, B).sum(-1)


def _unpack(p):
    import jax.numpy as jnp

    o, half = p.shape
    p = p.reshape(o, half // 16, 16)
    return jnp.concatenate([p & 15, p >> 4], axis=-1).reshape(o, half * 2)


def product(form, x, w):
    import jax
    import jax.numpy as jnp

    if form in ("float32",):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    if form in ("int8 wo", "int8x8"):
        return w.product("te,ne->tn", x)
    q, d, m = w
    if form in ("q4 int8 codes", "q4 uint4"):
        return jnp.dot(x, _deq(q, d, m).T, preferred_element_type=jnp.float32)
    if form == "q4 packed":
        return jnp.dot(x, _deq(_unpack(q), d, m).T, preferred_element_type=jnp.float32)
    if form == "q4 barrier":
        return jnp.dot(x, jax.lax.optimization_barrier(_deq(q, d, m)).T, preferred_element_type=jnp.float32)
    if form in ("Q4_1 served", "Q4_0 served"):
        from models.quant import QuantizedWeight

        offset = m if form == "Q4_1 served" else jnp.full_like(d, -0.0)  # Q4_0, as models/gguf_blocks.py
        return QuantizedWeight(q, d, block=B, offset=offset).product("te,ne->tn", x)
    if form in ("q4 uint4 split", "q4 packed split", "q4_0 plain"):
        q = _unpack(q) if form == "q4 packed split" else q
        o, i = q.shape
        wd = (q.astype(jnp.float32).reshape(o, i // B, B) * d[..., None]).reshape(o, i)
        y = jnp.dot(x, wd.T, preferred_element_type=jnp.float32)
        return y if form == "q4_0 plain" else y + jnp.dot(_blocksum(x), m.T)
    if form == "q4 act blocks":
        from models.quant import quantize_rows

        t, i = x.shape
        o = q.shape[0]
        xq, sx = quantize_rows(x, "int8")
        xq = xq.reshape(t, i // B, B)
        acc = jax.lax.dot_general(xq, q.reshape(o, i // B, B), (((2,), (2,)), ((1,), (1,))),
                                  preferred_element_type=jnp.int32)  # [G, t, o]
        y = jnp.einsum("gto,og->to", acc.astype(jnp.float32), d) * sx
        return y + jnp.dot(_blocksum(x), m.T)
    raise ValueError(form)


def build(num_layers: int, forms):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.quant import quantize_weight

    shapes = {"head": (49152, 576)} if _HEAD.value else SHAPES
    rng = np.random.default_rng(0)
    codes = [{k: rng.integers(0, 16, s).astype(np.uint8) for k, s in shapes.items()} for _ in range(num_layers)]
    dm = [{k: (rng.random((s[0], s[1] // B), np.float32) * 0.01, rng.random((s[0], s[1] // B), np.float32) * -0.05)
           for k, s in shapes.items()} for _ in range(num_layers)]
    floats = [{k: np.asarray(_deq(jnp.asarray(c[k]), *map(jnp.asarray, dm[n][k]))) for k in shapes}
              for n, c in enumerate(codes)]

    def packed(c):
        o, i = c.shape
        c = c.reshape(o, i // B, 2, 16)
        return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(o, i // 2)

    def q4(store):
        return [{k: (store(c[k]), jnp.asarray(dm[n][k][0]), jnp.asarray(dm[n][k][1])) for k in shapes}
                for n, c in enumerate(codes)]

    weights = {
        "float32": lambda: [{k: jnp.asarray(w) for k, w in d.items()} for d in floats],
        "int8 wo": lambda: [{k: quantize_weight(w, "int8") for k, w in d.items()} for d in floats],
        "int8x8": lambda: [{k: quantize_weight(w, "int8", activation_rows=0) for k, w in d.items()} for d in floats],
        "q4 int8 codes": lambda: q4(lambda c: jnp.asarray(c.astype(np.int8))),
        "Q4_1 served": lambda: q4(lambda c: jnp.asarray(c.astype(np.int8))),
        "q4 packed": lambda: q4(lambda c: jnp.asarray(packed(c))),
        "q4 packed split": lambda: q4(lambda c: jnp.asarray(packed(c))),
        "q4 uint4": lambda: q4(lambda c: jnp.asarray(c).astype(jnp.uint4)),
        "q4 uint4 split": lambda: q4(lambda c: jnp.asarray(c).astype(jnp.uint4)),
        "q4_0 plain": lambda: q4(lambda c: jnp.asarray((c.astype(np.int16) - 8).astype(np.int8))),
        "Q4_0 served": lambda: q4(lambda c: jnp.asarray((c.astype(np.int16) - 8).astype(np.int8))),
        "q4 barrier": lambda: q4(lambda c: jnp.asarray(c.astype(np.int8))),
        "q4 act blocks": lambda: q4(lambda c: jnp.asarray(c.astype(np.int8))),
    }

    def make(form):
        def run(layers, x):
            if _HEAD.value:
                return product(form, x, layers[0]["head"])
            for d in layers:
                h = product(form, x, d["qkv_proj"])[:, :576]
                x = x + product(form, h, d["o_proj"])
                g = product(form, x, d["gate_up_proj"])
                x = x + product(form, jax.nn.silu(g[:, :1536]) * g[:, 1536:], d["down_proj"])
            return x
        return jax.jit(run)

    return {form: (make(form), weights[form]()) for form in forms}


def main(argv):
    del argv
    import jax.numpy as jnp
    import numpy as np

    forms = _FORMS.value or list(FORMS)
    fns = build(1 if _HEAD.value else _LAYERS.value, forms)
    print(f"| rows | {' | '.join(forms)} (ms) |")
    print("|" + " --- |" * (len(forms) + 1))
    for rows in map(int, _ROWS.value):
        x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 576), np.float32))
        med = median_ms(fns, x, forms, _REPEATS.value)
        print(f"| {rows} | {' | '.join(f'{med[f]:.1f}' for f in forms)} |", flush=True)


if __name__ == "__main__":
    app.run(main)
