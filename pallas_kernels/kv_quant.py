"""An 8-bit paged KV cache: int8 or fp8 (e4m3) values with one scale per token and kv head.

Layout (`ScaledCache`, one for K and one for V):
  values  [L, num_blocks, block_size, Hkv, D]  int8 (kv_cache_dtype "int8") or uint8 holding
          float8_e4m3fn bits ("fp8_e4m3")
  scales  [L, num_blocks, block_size, Hkv]     uint16 holding bfloat16 bits (the "token" layout;
          the TPU's "page" layout: "Scale layouts" below)
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
1.94x; head_dim 128: 0.51x, 1.97x); the page layout's padded rows cost more (models/kv_bytes.py).

Backends: all three read and write it. The xla path dequantizes after each page gather (xla.py
PagedKV); write_kv scatters values and scales on the xla and pallas_gpu paths, and on pallas_tpu
writes them with a Mosaic kernel (tpu_kv_write.py). The Pallas attention kernels copy or gather the
8-bit pages and their scale pages and dequantize them inside the kernel (tpu.py, gpu.py) with
`values_to_float32` and `scales_to_float32`: integer and float32 operations and same-width
bitcasts only, so no target needs an fp8 type (Triton's float8_e4m3fn conversion aborts the
compiler below sm_89): e4m3 is decoded from its bits.

Scale layouts (`ScaledCache.layout`, SCALE_LAYOUTS; chosen by the attention backend, `scale_layout`):
  "token"  the scales above, one uint16 row of Hkv per token: what the xla and pallas_gpu paths
           gather with the values' rows.
  "page"   pallas_tpu: scales [L, num_blocks, W] uint32 (float32 bits of the same bfloat16-rounded
           scale, so the numbers are the token layout's), one lane-dense row per page. A row holds
           `shards` pieces (one per device of a mesh splitting the kv heads), each its heads'
           scales head-major (lane h * block_size + t for kv head h and token t of the page)
           padded to a multiple of 128 lanes (`page_scale_width`); a mesh splits W into those
           pieces. Why: Mosaic tiles the token layout's minor dims (block_size, Hkv) as (8, 128)
           (16-bit: (16, 128)), so XLA kept the scale arrays in a layout of its own and copied
           them, Hkv padded to 128 lanes, into the kernels' at every step's entry and back at its
           exit (`experiments.aot --target=v5e-1 --model=random:llama3-8b --kv_cache_dtype=int8`:
           261 MiB of temporaries against 16 MiB for a bfloat16 cache); and a DMA cannot move
           one row of a packed 16-bit tile. A 32-bit row per page is one DMA, and XLA keeps the
           kernels' layout for it (BUILD_NOTES.md "Quantization").
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
SCALE_LAYOUTS = ("token", "page")
_SCALE_STORED = {"token": jnp.uint16, "page": jnp.uint32}
LANES = 128  # a TPU vector register's lanes: the page layout's rows are a multiple of this


def scale_layout(backend: str) -> str:
    """The scale layout an attention backend reads: "page" for pallas_tpu, else "token"."""
    return "page" if backend == "pallas_tpu" else "token"


def page_scale_width(block_size: int, num_kv_heads: int, shards: int = 1) -> int:
    """W, the lanes of one page's scale row in the "page" layout: per shard of the kv heads, its
    heads' block_size scales each, padded to a multiple of LANES."""
    if shards < 1 or num_kv_heads % shards:
        raise ValueError(f"page scales: {num_kv_heads} kv heads do not split into {shards} shards")
    local = num_kv_heads // shards * block_size
    return shards * (-(-local // LANES) * LANES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScaledCache:
    """One of K or V of an 8-bit cache: values and their per-(token, kv head) scales."""

    values: jax.Array  # int8 | uint8 (e4m3 bits) [L, num_blocks, block_size, Hkv, D]
    scales: jax.Array  # "token": uint16 (bfloat16 bits) [L, num_blocks, block_size, Hkv];
    #                    "page": uint32 (float32 bits) [L, num_blocks, W]
    kv_cache_dtype: str = dataclasses.field(metadata=dict(static=True), default="int8")
    layout: str = dataclasses.field(metadata=dict(static=True), default="token")

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


def allocate_scaled(shape: tuple[int, ...], kv_cache_dtype: str, layout: str = "token",
                    shards: int = 1) -> ScaledCache:
    """A zeroed ScaledCache of values shape [L, num_blocks, block_size, Hkv, D] (or one layer's
    [num_blocks, block_size, Hkv, D]); layout "page" with its rows in `shards` pieces."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        raise ValueError("allocate_scaled makes an 8-bit cache; kv_cache_dtype 'auto' is the float cache")
    if layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale layout must be one of {SCALE_LAYOUTS}; got {layout!r}")
    scale_shape = shape[:-1]
    if layout == "page":
        *lead, block_size, num_kv_heads, _ = shape
        scale_shape = (*lead, page_scale_width(block_size, num_kv_heads, shards))
    return ScaledCache(jnp.zeros(shape, _STORED[kv_cache_dtype]), jnp.zeros(scale_shape, _SCALE_STORED[layout]),
                       kv_cache_dtype, layout)


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
    """Scale bits -> float32, exactly (also inside the Pallas kernels): uint16 holding bfloat16
    (the token layout) by a same-width bitcast and a widening, uint32 holding float32 (the page
    layout) by a bitcast."""
    if scale_bits.dtype == jnp.uint32:
        return jax.lax.bitcast_convert_type(scale_bits, jnp.float32)
    return jax.lax.bitcast_convert_type(scale_bits, jnp.bfloat16).astype(jnp.float32)


def page_bits(scale_bits: jax.Array) -> jax.Array:
    """Token-layout scale bits (uint16, bfloat16) -> the page layout's (uint32, float32 bits of
    the same number: bfloat16 is float32's upper half)."""
    return jax.lax.shift_left(scale_bits.astype(jnp.uint32), jnp.uint32(16))


def page_lanes(block_size: int, num_kv_heads: int, width: int) -> np.ndarray:
    """int32[width]: for each lane of a page's scale row (one shard's piece, `width` lanes, its
    num_kv_heads heads), the token within the page whose scale it holds, or -1 (padding); the
    lane of (kv head h, token t) is h * block_size + t."""
    lanes = np.arange(width)
    return np.where(lanes < num_kv_heads * block_size, lanes % block_size, -1).astype(np.int32)


def as_page_layout(c: ScaledCache, shards: int = 1) -> ScaledCache:
    """A token-layout ScaledCache with its scales moved into the page layout (the same numbers;
    values shared): `shards` pieces per row, each its heads' scales head-major, padded."""
    if c.layout != "token":
        raise ValueError(f"as_page_layout takes a token-layout cache; got {c.layout!r}")
    *lead, block_size, num_kv_heads = c.scales.shape
    width = page_scale_width(block_size, num_kv_heads, shards)
    local = num_kv_heads // shards
    tokens = page_bits(c.scales).reshape(*lead, block_size, shards, local)
    pieces = jnp.moveaxis(tokens, -3, -1).reshape(*lead, shards, local * block_size)  # [..., shard, head * token]
    pad = [(0, 0)] * (len(lead) + 1) + [(0, width // shards - local * block_size)]
    return ScaledCache(c.values, jnp.pad(pieces, pad).reshape(*lead, width), c.kv_cache_dtype, "page")


def page_scales_as_tokens(scales: jax.Array, block_size: int, num_kv_heads: int, shards: int = 1) -> jax.Array:
    """Page-layout scales [..., W] -> the token layout's [..., block_size, Hkv] bits (uint16):
    the reference the TPU kernels are tested against."""
    *lead, width = scales.shape
    local = num_kv_heads // shards
    pieces = scales.reshape(*lead, shards, width // shards)[..., : local * block_size]
    per_head = pieces.reshape(*lead, shards, local, block_size)  # [..., shard, head, token]
    tokens = jnp.moveaxis(per_head, -1, -3).reshape(*lead, block_size, num_kv_heads)
    return jax.lax.shift_right_logical(tokens, jnp.uint32(16)).astype(jnp.uint16)


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


def rotate_heads(*xs: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
    """Each x [..., H_i, D] (the same leading dims and D) times `rotation(D)`, computed in float32
    as one product of all of them, concatenated along the head axis, by the matrix; each result in
    its x's dtype (one x: the array, several: a tuple). Rotating twice gives x back (up to
    rounding).

    Why (models/llama.py applies it to q, k and v before an 8-bit cache is written and read, and
    to the attention output after): q . k and P . V are unchanged by an orthogonal rotation of
    the head dimension, but a few channels of K hold most of its magnitude (RoPE's slow
    dimensions), and a per-token scale sized for them leaves the other channels a few codes
    (int8) or, against q's matching large channels, a large error in q . k (fp8's relative
    error on the big products). Rotated, every channel carries a share of the magnitude.
    Measured on the default model (BUILD_NOTES.md "Quantization", stop 42): the KL divergence
    from float32 of an int8 cache 0.0006 -> 0.0002, of an fp8 cache 0.0036 -> 0.0029; its clear
    greedy positions stay at the line. The cache layout and the kernels do not change: they hold
    and read the rotated K and V.

    Why one product of q, k and v together (stop 46): on the CPU a layer's rotations as fast
    Walsh-Hadamard transforms (log2 D add/subtract passes each for q, k, v and the output) were 33
    small op executions, about 1.2 ms of an 8-row int8 step's 26-28 ms; as two products (q, k, v
    together, then the output) about 0.6 ms (BUILD_NOTES.md "Quantization", stop 46). Precision
    HIGHEST: a float32 product on a TPU or GPU may otherwise round its operands to bfloat16 or tf32."""
    if not xs:
        raise ValueError("rotate_heads takes at least one array")
    d, lead = xs[0].shape[-1], xs[0].shape[:-2]
    for x in xs:
        if x.ndim < 2 or x.shape[-1] != d or x.shape[:-2] != lead:
            raise ValueError(f"rotate_heads takes arrays [..., H, D] with the same leading dims and D; got "
                             f"{[tuple(x.shape) for x in xs]}")
    x = jnp.concatenate([x.astype(jnp.float32) for x in xs], axis=-2)  # one array: no copy
    y = jnp.dot(x, jnp.asarray(rotation(d)), precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32)
    out, start = [], 0
    for x in xs:
        out.append(y[..., start:start + x.shape[-2], :].astype(x.dtype))
        start += x.shape[-2]
    return out[0] if len(xs) == 1 else tuple(out)


def fake_quantize_kv(x: jax.Array, kv_cache_dtype: str) -> jax.Array:
    """x [..., Hkv, D] as an 8-bit cache would give it back (float32; "auto": unchanged): the
    dense oracle's K and V (models/llama.py forward_dense)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return x
    return dequantize_kv(*quantize_kv(x, kv_cache_dtype), kv_cache_dtype)


def split_cache(k_cache, v_cache, layout: str = "token"):
    """(k, v, scales, kv_cache_dtype) for a kernel that reads scale `layout`: an 8-bit cache's
    values, its (k, v) scale arrays and its dtype (checked: check_scaled_pair; another layout is
    a ValueError naming both); a float cache as it is, (), None."""
    if isinstance(k_cache, ScaledCache) or isinstance(v_cache, ScaledCache):
        check_scaled_pair(k_cache, v_cache, layout)
        return k_cache.values, v_cache.values, (k_cache.scales, v_cache.scales), k_cache.kv_cache_dtype
    return k_cache, v_cache, (), None


def check_scaled_pair(k_cache: ScaledCache, v_cache: ScaledCache, layout: str | None = None) -> None:
    """Both halves of one 8-bit cache, with matching values and scales (in `layout`, when given:
    the one the reading backend implements)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, ScaledCache):
            raise ValueError(f"an 8-bit cache is a ScaledCache for K and for V; {name} is {type(c).__name__}")
        if c.layout not in SCALE_LAYOUTS or (layout is not None and c.layout != layout):
            raise ValueError(f"{name}: this backend reads the {layout!r} scale layout (kv_quant.scale_layout); "
                             f"got a cache in {c.layout!r}")
        want = _STORED.get(c.kv_cache_dtype)
        want_scales = _SCALE_STORED[c.layout]
        if want is None or c.values.dtype != want or c.scales.dtype != want_scales:
            raise ValueError(f"{name}: kv_cache_dtype {c.kv_cache_dtype!r} in the {c.layout!r} layout stores "
                             f"values {jnp.dtype(want).name if want else '?'} and {jnp.dtype(want_scales).name} "
                             f"scales; got values {c.values.dtype}, scales {c.scales.dtype}")
        _check_scale_shape(name, c)
    if (k_cache.kv_cache_dtype != v_cache.kv_cache_dtype or k_cache.layout != v_cache.layout
            or tuple(k_cache.values.shape) != tuple(v_cache.values.shape)
            or tuple(k_cache.scales.shape) != tuple(v_cache.scales.shape)):
        raise ValueError(f"k_cache and v_cache must match: {k_cache.kv_cache_dtype} {k_cache.layout} "
                         f"{tuple(k_cache.values.shape)} vs {v_cache.kv_cache_dtype} {v_cache.layout} "
                         f"{tuple(v_cache.values.shape)}")


def _check_scale_shape(name: str, c: ScaledCache) -> None:
    values, scales = tuple(c.values.shape), tuple(c.scales.shape)
    if c.layout == "token":
        if scales != values[:-1]:
            raise ValueError(f"{name}: scales must be values' shape without head_dim; got values"
                             f"{values}, scales{scales}")
        return
    block_size, num_kv_heads = values[-3], values[-2]
    if (scales[:-1] != values[:-3] or scales[-1] % LANES
            or scales[-1] < page_scale_width(block_size, num_kv_heads)):
        raise ValueError(f"{name}: page-layout scales must be values' [..., num_blocks] plus a row of a "
                         f"multiple of {LANES} lanes holding block_size x Hkv scales; got values{values}, "
                         f"scales{scales}")
