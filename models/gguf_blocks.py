"""GGUF block types served in their own quantization (EngineConfig.quantization="gguf"): Q8_0,
Q4_0 and Q4_1 read from the file's raw bytes into models/quant.QuantizedWeight with `block=32`
(int8 codes [rows, cols], float32 block scales and offsets [rows, cols / 32]: Q4_1's block
minimums, -0.0 for the others), with no float copy of the weights made; and the served layout (q/k/v and gate/up
fused along the output rows, models/served_layout.py) built from them.

Block layouts (gguf.quants; the decode here is bit-identical to its numpy one, tests/models/
test_gguf_q4.py):
  Q8_0 (34 bytes)  float16 d, 32 x int8 q               w = d * q
  Q4_0 (18 bytes)  float16 d, 16 bytes of nibbles        w = d * (q - 8), q in 0..15
  Q4_1 (20 bytes)  float16 d, float16 m, 16 bytes        w = d * q + m
The nibbles: byte j of a block holds value j in its low 4 bits and value j + 16 in its high 4.
d * q is exact in float32 (an 11-bit float16 significand times a 4- or 8-bit integer), so Q4_1's
one rounding is the + m, wherever it is computed.

Stored: one int8 per value (Q4_0 as q - 8 in -8..7, the same form as Q8_0; Q4_1 as q in 0..15)
plus float32 scales and offsets (Q4_1's minimums; -0.0 for Q8_0 and Q4_0, which the CPU's fast
product form needs, models/quant.py 5.): 1.25 bytes per weight. Packed nibbles would be
0.5 + scales, but XLA:CPU does not fuse the unpacking into the product and runs
it several times slower (BUILD_NOTES.md "Quantization", experiments/bench/q4_forms.py).
Other types (F32/F16/BF16, Q5_0/Q5_1, the K-quants) have no block form here and are dequantized
to the model's dtype as before (`load_gguf` logs the quantized ones, once per file).
"""

from __future__ import annotations

import numpy as np

from models.quant import QuantizedWeight
from models.weights import unpermute_rows

BLOCK = 32
# type name -> bytes per 32-value block
NATIVE_TYPES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def block_weight(path: str, tensor, dtype: str) -> QuantizedWeight:
    """A Q8_0 / Q4_0 / Q4_1 tensor [rows, cols] as int8 codes and float32 block scales (numpy)."""
    kind = tensor.tensor_type.name
    rows, cols = (int(n) for n in reversed(tensor.shape))
    raw = np.asarray(tensor.data).reshape(-1)
    size = NATIVE_TYPES[kind]
    if cols % BLOCK or raw.size * raw.itemsize != rows * cols // BLOCK * size:
        raise ValueError(f"{path}: {kind} tensor {tensor.name} holds {raw.size * raw.itemsize} bytes, expected "
                         f"{rows * cols // BLOCK * size} for [{rows}, {cols}]")
    blocks = raw.view(np.uint8).reshape(rows, cols // BLOCK, size)

    def half(at):  # the float16 at byte `at` of every block, as float32
        return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

    d = half(0)
    # Q8_0 and Q4_0 get offsets of -0.0 (x + -0.0 is x bit for bit, negative zeros included):
    # the product's fast form on XLA:CPU needs an offset, and a constant one miscompiles there
    # (models/quant.py, 5.).
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return QuantizedWeight(q, d, dtype_name=dtype, block=BLOCK, offset=np.full_like(d, -0.0))
    nibbles = blocks[..., 2 if kind == "Q4_0" else 4:]  # [rows, cols / 32, 16]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols).astype(np.int8)
    if kind == "Q4_0":
        return QuantizedWeight(q - np.int8(8), d, dtype_name=dtype, block=BLOCK, offset=np.full_like(d, -0.0))
    return QuantizedWeight(q, d, dtype_name=dtype, block=BLOCK, offset=half(2))


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Block weights [o_k, i] stacked along their rows (a fused product: qkv_proj, gate_up_proj);
    a part with no offset gets -0.0 (exact: d * q + -0.0 is d * q)."""
    if len(weights) == 1:
        return weights[0]
    offset = None
    if any(w.offset is not None for w in weights):
        offset = np.concatenate([w.offset if w.offset is not None else np.full_like(w.scale, -0.0) for w in weights])
    first = weights[0]
    return QuantizedWeight(np.concatenate([w.q for w in weights]), np.concatenate([w.scale for w in weights]),
                           first.dtype_name, block=first.block, offset=offset)


def unpermute_weight(w: QuantizedWeight, heads: int) -> QuantizedWeight:
    """unpermute_rows on a block weight: its rows (codes, scales, offsets) reordered alike."""
    offset = None if w.offset is None else unpermute_rows(w.offset, heads)
    return QuantizedWeight(unpermute_rows(w.q, heads), unpermute_rows(w.scale, heads), w.dtype_name,
                           block=w.block, offset=offset)


# The served layout's fused products and the GGUF tensors (our loader names) they are built from.
FUSED = {"qkv_proj": ("q", "k", "v"), "o_proj": ("o",), "gate_up_proj": ("gate", "up"), "down_proj": ("down",)}
FUSED_BIASES = ("q_bias", "k_bias", "v_bias")


def served_products(natives: dict[str, QuantizedWeight], floats: dict[str, np.ndarray], config,
                    where: str) -> dict:
    """One layer's served products (models/served_layout.py: out-major [o, i], q/k/v and gate/up
    fused along o) from its tensors in HF [out, in] layout: a product whose parts are all block
    weights is one block weight; one with any part in float is float (its block parts, none here
    by construction: `load_gguf` reads a group natively only when all of it is). Shapes checked."""
    e, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    h, k = config.num_heads, config.num_kv_heads
    shapes = {"q": (h * d, e), "k": (k * d, e), "v": (k * d, e), "o": (e, h * d), "gate": (f, e), "up": (f, e),
              "down": (e, f), "q_bias": (h * d,), "k_bias": (k * d,), "v_bias": (k * d,)}
    out = {}
    for served, parts in FUSED.items():
        if not all(p in natives or p in floats for p in parts):
            continue  # a mixture of experts: no gate/up/down
        for p in parts:
            got = tuple((natives.get(p) if p in natives else floats[p]).shape)
            if got != shapes[p]:
                raise ValueError(f"{where}: tensor {p} has shape {got}, expected {shapes[p]}")
        if all(p in natives for p in parts):
            out[served] = concat_rows([natives[p] for p in parts])
        else:
            out[served] = np.concatenate([floats[p] for p in parts])
    if config.attention_bias:
        for b in FUSED_BIASES:
            if b not in floats or floats[b].shape != shapes[b]:
                raise ValueError(f"{where}: tensor {b} is missing or has shape "
                                 f"{getattr(floats.get(b), 'shape', None)}, expected {shapes[b]}")
        out["bqkv"] = np.concatenate([floats[b] for b in FUSED_BIASES])
    return out
