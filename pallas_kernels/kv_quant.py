"""An 8-bit paged KV cache: int8 or fp8 (e4m3) values with one scale per token and kv head.

Layout (`ScaledCache`, one for K and one for V):
  values  [L, num_blocks, block_size, Hkv, D]  int8 (kv_cache_dtype "int8") or uint8 holding
          float8_e4m3fn bits ("fp8_e4m3")
  scales  [L, num_blocks, block_size, Hkv]     uint16 holding bfloat16 bits
Both are integer arrays on purpose: XLA:CPU scatters integers in place, and converting a scattered
bits array back to a float type copied the whole cache (kv_write.py); readers bitcast after the
gather (free). Slots, blocks and the null block are those of the float cache (kv_write.py).

Scheme: for each written token t and kv head h, s = max_d |x[t, h, d]| / qmax (qmax 127 for int8,
448 for e4m3), rounded to bfloat16 first, and x is stored as round(x / s) (int8, clipped to
[-127, 127]) or as e4m3(x / s); a reader computes values * s in float32. Rounding the scale
first keeps writer and reader on the same s, so bfloat16 costs no accuracy, only range: the
reconstruction error stays under s / 2 (int8). An all-zero row (padding) gets s = 1.

The values are K and V in a rotated head basis (`rotate_heads`, applied by the model to q, k, v
and back to the attention output): the kernels never see the difference.

Why per token and kv head, not per block: a token's scale is fixed when it is written, so every
write is one scatter of the new rows (values and scales) and no block is ever re-quantized as it
fills; a per-block scale would have to grow with the block's largest value (re-quantizing the
block's earlier tokens, or clipping them). Its cost is the scales' bytes: 2 per token and kv
head, 3 % of an 8-bit token of head_dim 64 (KV bytes per token 0.52x bfloat16's, blocks that fit
1.94x; head_dim 128: 0.51x, 1.97x).

Backends: all three read and write it. The xla path dequantizes after each page gather (xla.py
PagedKV); write_kv scatters values and scales on the xla and pallas_gpu paths, and on pallas_tpu
writes them with a Mosaic kernel (tpu_kv_write.py). The Pallas attention kernels copy or gather the
8-bit pages and their scale pages and dequantize them inside the kernel (tpu.py, gpu.py) with
`values_to_float32` and `scales_to_float32`: integer and float32 operations and same-width
bitcasts only, so no target needs an fp8 type (Triton's float8_e4m3fn conversion aborts the
compiler below sm_89): e4m3 is decoded from its bits.
On a TPU this scale layout is not lane-dense: Mosaic tiles (block_size, Hkv) as (8, 128), so XLA
keeps the scale arrays in a layout of its own and copies them into the kernels' (Hkv padded to
128 lanes) at each step's entry and back at its exit (BUILD_NOTES.md "Quantization": measured
with experiments.aot, and the 32-bit row-per-page layout that would avoid it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The 8-bit formats this module implements, by vLLM's names. The bytes per token (values plus
# SCALE_BYTES) and the engine's list of cache dtypes ("auto" and these) are models/kv_bytes.py's,
# which has no jax so the capacity calculator reads them without it (kernels import nothing of
# models: DESIGN.md section 1); tests/pallas_kernels/test_kv_quant_kernels.py keeps the two equal.
EIGHT_BIT_FORMATS = ("int8", "fp8_e4m3")
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
_STORED = {"int8": jnp.int8, "fp8_e4m3": jnp.uint8}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledCache:
    """One of K or V of an 8-bit cache: values and their per-(token, kv head) scales."""

    values: jax.Array  # int8 | uint8 (e4m3 bits) [L, num_blocks, block_size, Hkv, D]
    scales: jax.Array  # uint16 (bfloat16 bits) [L, num_blocks, block_size, Hkv]
    kv_cache_dtype: str = dataclasses.field(metadata=dict(static=True), default="int8")

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self):
        return self.values.ndim

    def is_deleted(self) -> bool:
        return self.values.is_deleted() or self.scales.is_deleted()


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """"auto" (the float cache) or one of EIGHT_BIT_FORMATS, else a ValueError naming it."""
    if kv_cache_dtype != "auto" and kv_cache_dtype not in EIGHT_BIT_FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(EIGHT_BIT_FORMATS)}; got {kv_cache_dtype!r}")


def allocate_scaled(shape: tuple[int, ...], kv_cache_dtype: str) -> ScaledCache:
    """A zeroed ScaledCache of values shape [L, num_blocks, block_size, Hkv, D]."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        raise ValueError("allocate_scaled makes an 8-bit cache; kv_cache_dtype 'auto' is the float cache")
    return ScaledCache(jnp.zeros(shape, _STORED[kv_cache_dtype]), jnp.zeros(shape[:-1], jnp.uint16),
                       kv_cache_dtype)


def quantize_kv(x: jax.Array, kv_cache_dtype: str) -> tuple[jax.Array, jax.Array]:
    """x [..., Hkv, D] (float) -> (stored values [..., Hkv, D], scale bits uint16 [..., Hkv])."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / _QMAX[kv_cache_dtype], 1.0).astype(jnp.bfloat16)
    scaled = x / scale.astype(jnp.float32)[..., None]
    if kv_cache_dtype == "int8":
        values = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        values = jax.lax.bitcast_convert_type(
            jnp.clip(scaled, -448.0, 448.0).astype(jnp.float8_e4m3fn), jnp.uint8)
    return values, jax.lax.bitcast_convert_type(scale, jnp.uint16)


def dequantize_kv(values: jax.Array, scale_bits: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """Stored values [..., Hkv, D] and scale bits [..., Hkv] -> float32 [..., Hkv, D]."""
    if kv_cache_dtype == "fp8_e4m3":
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    scale = jax.lax.bitcast_convert_type(scale_bits, jnp.bfloat16).astype(jnp.float32)
    return values.astype(jnp.float32) * scale[..., None]


def scales_to_float32(scale_bits: jax.Array) -> jax.Array:
    """Scale bits (uint16 holding bfloat16) -> float32: a same-width bitcast, then a widening
    (exact; also inside the Pallas kernels)."""
    return jax.lax.bitcast_convert_type(scale_bits, jnp.bfloat16).astype(jnp.float32)


def values_to_float32(values: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """Stored 8-bit values -> float32, exactly, with int32 and float32 operations only (the
    kernels' decode: no fp8 type on any target). int8 widens; e4m3 bits (uint8) are decoded:
    sign bit 7, exponent bits 3-6 (bias 7), mantissa bits 0-2; exponent 0 is subnormal,
    mantissa * 2^-9. The NaN codes (0x7f, 0xff) are never written (quantize_kv clips to 448)."""
    bits = values.astype(jnp.int32)
    if kv_cache_dtype == "int8":
        return bits.astype(jnp.float32)
    if kv_cache_dtype != "fp8_e4m3":
        raise ValueError(f"values_to_float32 decodes an 8-bit cache (int8, fp8_e4m3); got {kv_cache_dtype!r}")
    magnitude = jnp.bitwise_and(bits, 0x7F)  # exponent << 3 | mantissa
    # A normal e4m3 number as float32 bits: exponent + (127 - 7) in bits 23-30, mantissa in 20-22.
    normal = jax.lax.bitcast_convert_type(jax.lax.shift_left(magnitude + (120 << 3), 20), jnp.float32)
    subnormal = jnp.bitwise_and(magnitude, 7).astype(jnp.float32) * (2.0 ** -9)
    x = jnp.where(magnitude < 8, subnormal, normal)
    return jnp.where(bits >= 128, -x, x)


def rotation(head_dim: int) -> np.ndarray:
    """The orthonormal Hadamard matrix [D, D] the model rotates q, k, v by for an 8-bit cache
    (block-diagonal, each block the largest power of two dividing D): symmetric and orthogonal,
    so it is its own inverse. float32."""
    block = head_dim & -head_dim  # the largest power of two dividing head_dim
    h = np.ones((1, 1))
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(head_dim // block), h / np.sqrt(block)).astype(np.float32)


def rotate_heads(x: jax.Array) -> jax.Array:
    """x [..., D] times `rotation(D)`, computed in float32 as a fast Walsh-Hadamard transform
    (log2(block) add/subtract passes: D / log2 D times fewer operations than the product by the
    matrix; on the CPU both cost the int8-cache engine about 4 % of its tok/s, BUILD_NOTES.md),
    in x's dtype; rotating twice gives x back (up to rounding).

    Why (models/llama.py applies it to q, k and v before an 8-bit cache is written and read, and
    to the attention output after): q . k and P . V are unchanged by an orthogonal rotation of
    the head dimension, but a few channels of K hold most of its magnitude (RoPE's slow
    dimensions), and a per-token scale sized for them leaves the other channels a few codes
    (int8) or, against q's matching large channels, a large error in q . k (fp8's relative
    error on the big products). Rotated, every channel carries a share of the magnitude.
    Measured on the default model (BUILD_NOTES.md "Quantization", stop 42): the KL divergence
    from float32 of an int8 cache 0.0006 -> 0.0002, of an fp8 cache 0.0036 -> 0.0029; its clear
    greedy positions stay at the line (fp8 64 of 65 in this form, 65 as a product by the matrix).
    The cache layout and the kernels do not change: they hold and read the rotated K and V."""
    d = x.shape[-1]
    block = d & -d
    y = x.astype(jnp.float32).reshape(*x.shape[:-1], d // block, block)
    h = 1
    while h < block:  # the fast Walsh-Hadamard transform: one butterfly per bit of the block index
        pairs = y.reshape(*y.shape[:-1], block // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = jnp.stack([a + b, a - b], axis=-2).reshape(y.shape)
        h *= 2
    return (y.reshape(x.shape) * jnp.float32(block ** -0.5)).astype(x.dtype)


def fake_quantize_kv(x: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """x [..., Hkv, D] as an 8-bit cache would give it back (float32; "auto": unchanged): the
    dense oracle's K and V (models/llama.py forward_dense)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return x
    return dequantize_kv(*quantize_kv(x, kv_cache_dtype), kv_cache_dtype)


def split_cache(k_cache, v_cache):
    """(k, v, scales, kv_cache_dtype) for a kernel: an 8-bit cache's values, its (k, v) scale
    arrays and its dtype (checked: check_scaled_pair); a float cache as it is, (), None."""
    if isinstance(k_cache, ScaledCache) or isinstance(v_cache, ScaledCache):
        check_scaled_pair(k_cache, v_cache)
        return k_cache.values, v_cache.values, (k_cache.scales, v_cache.scales), k_cache.kv_cache_dtype
    return k_cache, v_cache, (), None


def check_scaled_pair(k_cache: ScaledCache, v_cache: ScaledCache) -> None:
    """Both halves of one 8-bit cache, with matching values and scales."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, ScaledCache):
            raise ValueError(f"an 8-bit cache is a ScaledCache for K and for V; {name} is {type(c).__name__}")
        want = _STORED.get(c.kv_cache_dtype)
        if want is None or c.values.dtype != want or c.scales.dtype != jnp.uint16:
            raise ValueError(f"{name}: kv_cache_dtype {c.kv_cache_dtype!r} stores values "
                             f"{jnp.dtype(want).name if want else '?'} and uint16 scales; got values "
                             f"{c.values.dtype}, scales {c.scales.dtype}")
        if tuple(c.scales.shape) != tuple(c.values.shape[:-1]):
            raise ValueError(f"{name}: scales must be values' shape without head_dim; got values"
                             f"{tuple(c.values.shape)}, scales{tuple(c.scales.shape)}")
    if (k_cache.kv_cache_dtype != v_cache.kv_cache_dtype
            or tuple(k_cache.values.shape) != tuple(v_cache.values.shape)):
        raise ValueError(f"k_cache and v_cache must match: {k_cache.kv_cache_dtype} "
                         f"{tuple(k_cache.values.shape)} vs {v_cache.kv_cache_dtype} {tuple(v_cache.values.shape)}")
