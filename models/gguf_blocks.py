"""GGUF block types served in their own quantization (EngineConfig.quantization="gguf"): Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K read from the file's raw
bytes into models/quant.QuantizedWeight with `block=32` (Q2_K, Q3_K, Q6_K: 16): int8 codes [rows,
cols], float32 block scales and offsets [rows, cols / block] (the block minimums of Q4_1 / Q5_1 /
Q2_K / Q4_K / Q5_K, -0.0 for the others), with no float copy of the weights made; and the served
layout (q/k/v and gate/up fused along the output rows, models/served_layout.py) built from them.

Block layouts (gguf.quants; the decode here is bit-identical to its numpy one, tests/models/
test_gguf_q4.py):
  Q8_0 (34 bytes / 32)   float16 d, 32 x int8 q                        w = d * q
  Q4_0 (18 bytes / 32)   float16 d, 16 bytes of nibbles                w = d * (q - 8), q in 0..15
  Q4_1 (20 bytes / 32)   float16 d, float16 m, 16 bytes of nibbles     w = d * q + m
  Q5_0 (22 bytes / 32)   float16 d, 4 bytes qh, 16 bytes of nibbles    w = d * (q - 16), q in 0..31
  Q5_1 (24 bytes / 32)   float16 d, float16 m, qh, nibbles             w = d * q + m
  Q4_K (144 bytes / 256) float16 d, float16 dmin, 12 bytes of 6-bit sub-block scales sc and
                         minimums mn (8 of each), 128 bytes of nibbles: 8 blocks of 32,
                         w = (d * sc) * q - dmin * mn, q in 0..15
  Q5_K (176 bytes / 256) as Q4_K, plus 32 bytes of fifth bits: q in 0..31
  Q6_K (210 bytes / 256) 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc (one
                         per 16 values), float16 d: w = (d * sc) * (q - 32), q in 0..63
  Q2_K (84 bytes / 256)  16 bytes of 4-bit sc (low nibble) and mn (high) per 16 values, 64 bytes
                         of 2-bit codes, float16 d, float16 dmin: w = (d * sc) * q - dmin * mn, q in 0..3
  Q3_K (110 bytes / 256) 32 bytes of high bits (hmask), 64 of low 2-bit codes, 12 bytes of sixteen
                         6-bit scales sc, float16 d: w = (d * (sc - 32)) * q, q = low - (0 if the
                         high bit is set else 4), in -4..3
The nibbles of a 32-value block: byte j holds value j in its low 4 bits and value j + 16 in its
high 4 (Q4_K / Q5_K: each 32 bytes hold two blocks, the low nibbles the first); the fifth bit of
value j is bit j of qh (Q5_K: bit b of byte j of the 32, for block b of the super-block). d * q is
exact in float32 (an 11-bit float16 significand times an integer of at most 8 bits; Q4_K / Q5_K's
d * sc of at most 17 bits times 5), so the one rounding is the + m (- dmin * mn), wherever it is
computed; a K-quant block's scale is d * sc and its offset -(dmin * mn), exact. Q6_K's
(d * sc) * q (up to 19 bits times 6) may round once, the same product gguf.quants rounds. Q2_K's
d * sc and dmin * mn (11 bits times 4) and (d * sc) * q (15 times 2) are exact, so its one
rounding is the - dmin * mn, as gguf.quants'; Q3_K's d * (sc - 32) (11 bits times 6: |sc - 32| <=
32) times q (|q| <= 4, 2 bits) is at most 19 bits, exact: no rounding at all.

Stored: one int8 per value (Q4_0 as q - 8 in -8..7, Q5_0 as q - 16, Q6_K as q - 32 and Q3_K as
its signed q, the same form as Q8_0; the others as q) plus float32 scales and offsets (-0.0 for
Q8_0, Q4_0, Q5_0, Q3_K and Q6_K, which the CPU's fast product form needs, models/quant.py 5.):
1.25 bytes per weight (1.5 at Q2_K's, Q3_K's and Q6_K's 16-value blocks: more than the file's
0.33 / 0.43 bytes for Q2_K / Q3_K, less than float). A fused product, or a product stacked over
layers, whose parts have both block sizes is held at 16 (`with_block`: each 32-value block's scale
and offset repeated, the same weight exactly). Packed nibbles would be
0.5 + scales, but XLA:CPU does not fuse the unpacking into the product and runs
it several times slower (BUILD_NOTES.md "Quantization", experiments/bench/q4_forms.py).
Other types have no block form here: F32/F16/BF16 (and a product fused with one of them) are
read as floats in the model's dtype as before (`load_gguf` logs the quantized tensors so
dequantized, once per file); the IQ and TQ types are refused by name
(models/gguf_loader.py SUPPORTED_TYPES).
"""

from __future__ import annotations

import numpy as np

from models.quant import QuantizedWeight
from models.weights import unpermute_rows

BLOCK = 32
# type name -> (bytes, values) of one stored block (a K-quant super-block holds 8 blocks of 32,
# Q2_K's, Q3_K's and Q6_K's 16 blocks of 16)
NATIVE_TYPES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32),
                "Q2_K": (84, 256), "Q3_K": (110, 256), "Q4_K": (144, 256), "Q5_K": (176, 256),
                "Q6_K": (210, 256)}
BLOCK_16 = ("Q2_K", "Q3_K", "Q6_K")  # the types with a scale per 16 values


def block_of(kind: str) -> int:
    """The values per scale of a NATIVE_TYPES type as served: 16 for BLOCK_16, else 32."""
    return 16 if kind in BLOCK_16 else BLOCK


def with_block(w: QuantizedWeight, block: int) -> QuantizedWeight:
    """A block weight (numpy, as loaded) with its scales and offsets repeated to `block` values
    each (which must divide its own): the same weight, exactly, at a finer block (a fused product or a stack of
    layers whose parts differ: Q2_K's, Q3_K's or Q6_K's 16 beside 32)."""
    if w.block == block:
        return w
    if w.block % block:
        raise ValueError(f"a block weight of {w.block}-value blocks cannot be held at {block}")
    repeat = lambda a: None if a is None else np.repeat(a, w.block // block, axis=-1)  # noqa: E731
    return QuantizedWeight(w.q, repeat(w.scale), w.dtype_name, block=block, offset=repeat(w.offset))


def block_weight(path: str, tensor, dtype: str) -> QuantizedWeight:
    """A tensor [rows, cols] of a NATIVE_TYPES type as int8 codes and float32 block scales and
    offsets (numpy)."""
    kind = tensor.tensor_type.name
    rows, cols = (int(n) for n in reversed(tensor.shape))
    raw = np.asarray(tensor.data).reshape(-1)
    size, values = NATIVE_TYPES[kind]
    if cols % values or raw.size * raw.itemsize != rows * cols // values * size:
        raise ValueError(f"{path}: {kind} tensor {tensor.name} holds {raw.size * raw.itemsize} bytes, expected "
                         f"{rows * cols // values * size} for [{rows}, {cols}] ({values}-value blocks)")
    blocks = raw.view(np.uint8).reshape(rows, cols // values, size)

    def half(at):  # the float16 at byte `at` of every block, as float32
        return np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)[..., 0].astype(np.float32)

    def codes(low_high, fifth=None):  # nibble bytes [..., 16] (and fifth bits [..., 32]) -> values
        q = np.concatenate([low_high & 15, low_high >> 4], axis=-1)
        return q if fifth is None else q | (fifth << 4)

    if kind in ("Q4_K", "Q5_K"):
        return _k_quant(blocks, kind, rows, cols, dtype, half(0), half(2))
    if kind == "Q6_K":
        return _q6_k(blocks, rows, cols, dtype, half(208))
    if kind == "Q2_K":
        return _q2_k(blocks, rows, cols, dtype, half(80), half(82))
    if kind == "Q3_K":
        return _q3_k(blocks, rows, cols, dtype, half(108))
    d = half(0)
    # Q8_0, Q4_0 and Q5_0 get offsets of -0.0 (x + -0.0 is x bit for bit, negative zeros
    # included): the product's fast form on XLA:CPU needs an offset, and a constant one
    # miscompiles there (models/quant.py, 5.).
    zero = np.full_like(d, -0.0)
    if kind == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return QuantizedWeight(q, d, dtype_name=dtype, block=BLOCK, offset=zero)
    start = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4}[kind]
    fifth = None
    if kind in ("Q5_0", "Q5_1"):  # a little-endian uint32 of fifth bits, then the nibbles
        qh = np.ascontiguousarray(blocks[..., start:start + 4]).view("<u4")[..., 0]
        fifth = ((qh[..., None] >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
        start += 4
    q = codes(blocks[..., start:], fifth).reshape(rows, cols).astype(np.int8)
    if kind in ("Q4_0", "Q5_0"):
        return QuantizedWeight(q - np.int8(8 if kind == "Q4_0" else 16), d, dtype_name=dtype, block=BLOCK,
                               offset=zero)
    return QuantizedWeight(q, d, dtype_name=dtype, block=BLOCK, offset=half(2))


def _k_quant(blocks, kind, rows, cols, dtype, d, dmin) -> QuantizedWeight:
    """Q4_K / Q5_K super-blocks [rows, n, bytes] -> 8 blocks of 32 each: scale d * sc, offset
    -(dmin * mn), codes 0..15 / 0..31 (module docstring)."""
    packed = blocks[..., 4:16]  # 6-bit sc and mn of the 8 blocks
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1).astype(np.float32)
    scale = (d[..., None] * sc).reshape(rows, cols // BLOCK)
    offset = (-(dmin[..., None] * mn)).reshape(rows, cols // BLOCK)
    n = blocks.shape[1]
    fifth, nibbles = None, blocks[..., 16:]
    if kind == "Q5_K":  # bit b of byte j: block b's value j
        qh = blocks[..., 16:48]
        fifth = ((qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(rows, n, 4, 2, 32)
        nibbles = blocks[..., 48:]
    pairs = nibbles.reshape(rows, n, 4, 32)  # 32 bytes: two blocks, low nibbles then high
    q = np.stack([pairs & 15, pairs >> 4], axis=3)  # [rows, n, 4, 2, 32]
    if fifth is not None:
        q = q | (fifth << 4)
    return QuantizedWeight(q.reshape(rows, cols).astype(np.int8), scale, dtype_name=dtype, block=BLOCK, offset=offset)


def _q6_k(blocks, rows, cols, dtype, d) -> QuantizedWeight:
    """Q6_K super-blocks [rows, n, 210] -> 16 blocks of 16 each: scale d * sc (sc int8), codes
    q - 32 in -32..31, offsets -0.0. Bytes: 128 of low nibbles, 64 of high 2-bit pairs, 16 scales,
    float16 d. Of the 256 values, the 32 of group h * 4 + k (h the half, k 0..3) take the low
    (k < 2) or high nibbles of the half's 64 low-nibble bytes (their first or last 32 for even or
    odd k), and bits 2k..2k+1 of the half's 32 high-pair bytes."""
    n = blocks.shape[1]
    low = blocks[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    low = (low & 15).reshape(rows, n, 2, 4, 32)  # (half, k, 32)
    pairs = blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (low | ((pairs & 3) << 4)).reshape(rows, cols).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, n, 16]
    scale = (d[..., None] * sc).reshape(rows, cols // 16)
    return QuantizedWeight(q, scale, dtype_name=dtype, block=16, offset=np.full_like(scale, -0.0))


# Q2_K / Q3_K: the 2-bit codes of a 128-value half are its 32 bytes read 4 times, bits 2k..2k+1
# giving its values k * 32 .. k * 32 + 31.
_PAIRS = np.array([0, 2, 4, 6], np.uint8)[:, None]


def _q2_k(blocks, rows, cols, dtype, d, dmin) -> QuantizedWeight:
    """Q2_K super-blocks [rows, n, 84] -> 16 blocks of 16 each: scale d * sc, offset -(dmin * mn),
    codes 0..3. Bytes: 16 of (sc low nibble, mn high) per 16 values, 64 of 2-bit codes (two
    halves of 32 bytes, _PAIRS), float16 d, float16 dmin."""
    n = blocks.shape[1]
    packed = blocks[..., :16]
    scale = (d[..., None] * (packed & 15).astype(np.float32)).reshape(rows, cols // 16)
    offset = (-(dmin[..., None] * (packed >> 4).astype(np.float32))).reshape(rows, cols // 16)
    q = (blocks[..., 16:80].reshape(rows, n, 2, 1, 32) >> _PAIRS) & 3  # [rows, n, half, k, 32]
    return QuantizedWeight(q.reshape(rows, cols).astype(np.int8), scale, dtype_name=dtype, block=16, offset=offset)


def _q3_k(blocks, rows, cols, dtype, d) -> QuantizedWeight:
    """Q3_K super-blocks [rows, n, 110] -> 16 blocks of 16 each: scale d * (sc - 32), codes
    q in -4..3, offsets -0.0. Bytes: 32 of high bits (bit b of byte j: value b * 32 + j), 64 of
    low 2-bit codes (as Q2_K's), 12 of scales, float16 d. Scale i: its low 4 bits the low (i < 8)
    or high nibble of byte i % 8, its high 2 bits bits 2 (i // 4)..2 (i // 4) + 1 of byte 8 + i % 4.
    A value is low - 4 where its high bit is clear, low where set: (low | high << 2) - 4."""
    n = blocks.shape[1]
    high = (blocks[..., None, :32] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [rows, n, 8, 32]
    low = (blocks[..., 32:96].reshape(rows, n, 2, 1, 32) >> _PAIRS) & 3  # [rows, n, half, k, 32]
    q = (low.reshape(rows, n, 8, 32) | (high << 2)).reshape(rows, cols).astype(np.int8) - np.int8(4)
    a, b = blocks[..., 96:104], blocks[..., 104:108]
    top = ((b[..., None, :] >> _PAIRS) & 3).reshape(rows, n, 16)
    sc = np.concatenate([a & 15, a >> 4], axis=-1) | (top << 4)  # 0..63
    scale = (d[..., None] * (sc.astype(np.float32) - 32)).reshape(rows, cols // 16)
    return QuantizedWeight(q, scale, dtype_name=dtype, block=16, offset=np.full_like(scale, -0.0))


def concat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Block weights [o_k, i] stacked along their rows (a fused product: qkv_proj, gate_up_proj),
    at the finest block among them (with_block); a part with no offset gets -0.0 (exact: d * q +
    -0.0 is d * q)."""
    if len(weights) == 1:
        return weights[0]
    block = min(w.block for w in weights)
    weights = [with_block(w, block) for w in weights]
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
