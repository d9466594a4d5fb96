"""Quantized weights: int8 and fp8 (e4m3) with one scale per output channel, and their products.

Axes: t rows of a product (tokens, or logit rows), i its input, o its output, E experts. Served
weights are out-major [o, i] (models/served_layout.py), stacked [n, o, i] on a scan over stacked
layers, [E, o, i] for experts.

1. What is quantized (`quantize_params`, on the served layout, so every projection is already
   one out-major matrix): qkv_proj, o_proj, gate_up_proj, down_proj and the experts'
   experts_gate_up / experts_down; with int8 also the tables (models/weight_formats.py
   QUANTIZED_TABLES), the embedding
   (per vocabulary row) and output_proj (an untied lm_head). int8 quantizes the embedding because
   it is the lm_head of a tied model and 21 % of the default model's weights: left in float32,
   int8 would be 0.41x float32's bytes instead of 0.25x. fp8 leaves both tables in the model's
   dtype, as vLLM's fp8 does: e4m3's 3 mantissa bits in the tied lm_head cost the default model 2
   of 65 clear greedy positions and 2.5 % perplexity, the layers alone 0 and 0.8 % (BUILD_NOTES.md
   "Quantization"). Not quantized: norms, biases, the MoE router (E x e, small, and routing is a
   discrete choice that rounding can flip), anything 1-D.
2. Scheme: symmetric, one float32 scale per output channel (per row of [o, i]; per (layer, row)
   stacked; per (expert, row) for experts): int8 s = max|w_row| / 127, q = round(w / s) in
   [-127, 127]; fp8 s = max|w_row| / 448 (e4m3's largest finite), q = float8_e4m3fn(w / s).
3. Products (`QuantizedWeight.product`), in one of two forms chosen from the product's static
   row count t (the compiled bucket fixes t, so each bucket compiles one form, never a device
   value):
     weight-only   y = dot(x, convert(q)) * s: the weights are converted to x's dtype inside
                   the dot (XLA:CPU fuses the convert into the product's loop for a few rows).
     activations   t >= activation_rows: each row of x is quantized too, with a dynamic scale
                   sx = max|x_row| / 127 (int8) or / 448 (fp8), y = dot(xq, q) accumulated in
                   int32 (int8, exact; models/int8_dot.py runs it as u8 x s8 on the CPU, or
                   weight-first s8 x s8 where that was measured faster) or
                   float32 (fp8) * sx * s. A row's result depends only on that row, so batching
                   never changes it.
   The activation scales are per row, or (activation_group G) per G input channels of a row
   (y = sum over groups of sx * the group's int32 dot): finer, since one outlier channel of the
   residual stream coarsens a whole row, but slow on XLA:CPU (see quantize_params). The engine
   keeps per-row scales and smooths the weights first (models/smoothing.py), which moves the
   outlier channels' range into the weights.
   activation_rows is a static field of every QuantizedWeight: None never quantizes activations.
   The engine sets it per platform from measurement (engine/config.py QUANT_ACTIVATION_ROWS,
   BUILD_NOTES.md "Quantization").
4. The embedding lookup (`rows`) gathers quantized rows (fp8 as its bits) and their scales.
5. Block scales (`block` B): int8 q [o, i] with one scale per B input channels of a row,
   scale [o, i / B], and optionally one `offset` per block (w = scale * q + offset): GGUF's
   Q8_0, Q4_0 / Q5_0 (q - 8 / q - 16 held as int8) and Q4_1 / Q5_1 / Q4_K / Q5_K (q in 0..15 or
   0..31, offset the block's minimum, -dmin * mn for the K-quants' 32-value blocks) with B = 32,
   and Q6_K (q - 32, d * sc per 16 values), Q3_K (signed q, d * (sc - 32)) and Q2_K (q in 0..3,
   offset -dmin * mn) with B = 16,
   as the file stores them (models/gguf_blocks.py), no float copy made. Their products are
   weight-only and exact (no activation rounding; `_block_product`), in the form measured
   fastest on XLA:CPU for the static row count t:
     t = 1      x . dequantized^T: a loop that reads the codes once (the weight never exists
                in float; as fast as the int8 weight-only form, about 1.8x faster than float32).
     t > 1      the split form x . (scale q)^T + blocksum(x) . offset^T (blocksum(x) [t, i / B]
                the sums of x over each block, a dot 1/B the size): XLA:CPU compiles it to one
                YNNPACK fusion holding the convert, the scale multiply and both dots, where
                x . (scale q + offset)^T, and even x . (scale q)^T alone, become a loop writing
                a float32 copy of the weight every step and then the dot (2x slower). So the
                GGUF loader gives Q8_0 and Q4_0 weights offsets of -0.0 (exact, x + -0.0 is x
                bit for bit; a constant
                zero offset instead, jnp.zeros in the product, made XLA:CPU's fusion compute
                garbage, inf and NaN, for the [49152, 576] lm_head in the full model's step);
                2-7 rows are padded to 8 (the fusion is no faster at 2 rows than at 8); a
                weight of more than 16384 rows (a vocabulary table: the tied lm_head) runs in
                slices of 3072 rows, 2x faster than the split form on the whole (and than a
                float copy). No float copy of the weight is made at any row count.
     no offset  x . dequantized^T at every row count (a block weight built without offset).
   Still 1.2-2.4x float32's time from 2 rows on (the lm_head 3.7x at 8): each step expands
   every weight in the dot (BUILD_NOTES.md "Quantization", experiments/bench/q4_forms.py).
   Other platforms: the same forms, without the padding and slicing (unmeasured). Lookups
   dequantize the rows gathered.
6. Smoothing factors (`input_scale`, float32 [i], from models/smoothing.py for a tied lm_head):
   q and scale quantize W * s (s per input column) and input_scale = 1 / s; a product multiplies
   its input by input_scale first, a lookup and dequantize() their columns, so each is W's again.
   `quantize_params` makes it from params["embed_smoothing"].

`QuantizedWeight.dtype` is the float dtype the weight stands for (the model's dtype, what the
products return to and what a dequantized copy would be), so code that asks a weight for the
model's dtype (models/llama.py) works unchanged; the stored dtype is `q.dtype`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from models.int8_dot import codes_product, int8_product
from models.weight_first import check_out_major
from models.weight_formats import QUANTIZATIONS, QUANTIZED_TABLES

# quantize_params(activation_group=G): activations quantized with one scale per G input channels
# of a row (where G divides the product's input width). On the default model per-row scales cost
# 3.5 % perplexity on 2,048 tokens (the residual stream's outlier channels coarsen the whole row),
# groups of 64 1.0 %; but XLA:CPU runs the grouped (batched) int8 dot 1.5-8x slower than float32,
# against 3x faster per row, so the engine uses per-row scales after smoothing (models/smoothing.py:
# 1.4 %; BUILD_NOTES.md "Activation scales").
_QMAX = {"int8": 127.0, "fp8": 448.0}
_STORED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# The served layout's weight matrices that are quantized (models/layer_loops.py SERVED_PRODUCTS and
# GROUPED_PRODUCTS, plus the tables); the router stays float.
QUANTIZED_LAYER_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts_gate_up",
                           "experts_down")
# Block weights on XLA:CPU (module docstring, 5.): products of 2-7 rows are padded to this many,
# where the split form's fusion is 2x faster than at 2-6 rows; a weight of more output rows than
# _SPLIT_MAX_ROWS (a vocabulary table) runs in slices of _SPLIT_CHUNK rows, 2x faster than whole.
_SPLIT_MIN_ROWS, _SPLIT_MAX_ROWS, _SPLIT_CHUNK = 8, 16384, 3072
_GROUPED_OUT_MAJOR = jax.lax.RaggedDotDimensionNumbers(  # as models/moe.py's grouped product
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """An out-major weight [..., o, i] as q (int8 or float8_e4m3fn) times scale [..., o]."""

    q: jax.Array  # int8 | float8_e4m3fn [..., o, i]
    scale: jax.Array  # float32 [..., o]
    dtype_name: str = dataclasses.field(metadata=dict(static=True), default="float32")
    activation_rows: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # Activation scales per this many input channels of a row (None: one per row); must divide i.
    activation_group: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # Scales per this many input channels of a row ([..., o, i / block]; GGUF Q8_0: 32), or None:
    # one per row. Block-scaled weights are weight-only (module docstring, 5.).
    block: int | None = dataclasses.field(metadata=dict(static=True), default=None)
    # float32 [i] or None: the weight stored is W * s per input column (models/smoothing.py, a tied
    # lm_head: SmoothQuant's factor kept at run time) and input_scale = 1 / s; a product's input
    # is multiplied by it first, rows and dequantize() multiply their columns by it: W again.
    input_scale: jax.Array | None = None
    # Block weights only: a float32 value added per block ([..., o, i / block]; GGUF Q4_1's m),
    # w = scale * q + offset. None: no offset.
    offset: jax.Array | None = None
    # int32 [o] or None: sum_i q[o, i] of a 2-D int8 weight with per-row scales, held where the
    # CPU's u8 x s8 product reads them (`hold_code_sums`; models/int8_dot.py). None: the product
    # computes the correction itself.
    code_sums: jax.Array | None = None

    @property
    def dtype(self):
        """The float dtype this weight stands for (the model's); q.dtype is what is stored."""
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return self.q.ndim

    @property
    def method(self) -> str:
        return "int8" if self.q.dtype == jnp.int8 else "fp8"

    def dequantize(self) -> jax.Array:
        return self._unsmoothed(self._scaled(self.q, self.scale, self.offset)).astype(self.dtype)

    def _unsmoothed(self, w):
        return w if self.input_scale is None else w * self.input_scale

    def _scaled(self, q, scale, offset=None):
        """q [..., i] times its scales (per row [...], or per block [..., i / block]) plus the
        block offsets if given, float32."""
        if self.block is None:
            return q.astype(jnp.float32) * scale[..., None]
        blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, self.block) * scale[..., None]
        if offset is not None:
            blocks = blocks + offset[..., None]
        return blocks.reshape(q.shape)

    def quantizes_activations(self, num_rows: int) -> bool:
        return self.block is None and self.activation_rows is not None and num_rows >= self.activation_rows

    def product(self, spec: str, x: jax.Array) -> jax.Array:
        """x [t, i] times this [o, i] weight -> float32 [t, o]; spec is the served layout's
        einsum ("te,ne->tn", "tf,ef->te", ...), which must contract x's and the weight's last
        axes."""
        check_out_major(spec, self.q.shape, "a quantized")
        if self.input_scale is not None:  # smoothed: x / s . (W * s)^T
            x = (x.astype(jnp.float32) * self.input_scale).astype(x.dtype)
        if self.quantizes_activations(x.shape[0]) and self.activation_group:
            return self._grouped_activation_product(x)
        if self.quantizes_activations(x.shape[0]):
            xq, sx = quantize_rows(x, self.method)
            if self.method == "int8":  # per platform (models/int8_dot.py: u8 x s8 on the CPU)
                y = int8_product(xq, self.q, self.code_sums)
            else:
                y = codes_product(xq, self.q, jnp.float32)
            return y.astype(jnp.float32) * sx * self.scale[None, :]
        if self.block is not None:
            return self._block_product(x.astype(self.dtype))
        # Written as x . (q^T converted): XLA:CPU then fuses the transpose and the convert into
        # the product's loop and reads the int8 weight once (the same product contracted on q's
        # last axis converted the whole weight to float first: 5x slower at one row).
        x = x.astype(self.dtype)

        def weight_only(x, dtype):
            return jnp.dot(x.astype(dtype), self.q.T.astype(dtype), preferred_element_type=jnp.float32)

        if x.shape[0] == 1 and self.dtype != jnp.float32:
            # A 16-bit model's one row on the CPU in float32: XLA:CPU's one-row bfloat16 loop is
            # 2.7x slower than its float32 one (BUILD_NOTES.md "Quantization", stop 49; x and the
            # codes widen exactly, so only the order of the float32 sum differs). Other
            # platforms keep the model's dtype.
            y = jax.lax.platform_dependent(x, cpu=lambda x: weight_only(x, jnp.float32),
                                           default=lambda x: weight_only(x, self.dtype))
        else:
            y = weight_only(x, self.dtype)
        return y * self.scale[None, :]

    def _block_product(self, x):
        """Block weights, weight-only and exact, in the form measured fastest for the row count
        on XLA:CPU (module docstring, 5.): one row, or no offset, x . dequantized^T (at one row
        a loop reading the codes once); more rows the split form x . (scale q)^T +
        blocksum(x) . offset^T, padded to 8 rows on the CPU, a table-sized weight in slices."""
        rows, offset = x.shape[0], self.offset
        if rows == 1 or offset is None:
            return jnp.dot(x, self.dequantize().T, preferred_element_type=jnp.float32)

        def split(x, q, scale, offset):
            sums = x.astype(jnp.float32).reshape(x.shape[0], -1, self.block).sum(-1)  # [t, i / block]
            y = jnp.dot(x, self._scaled(q, scale).astype(self.dtype).T, preferred_element_type=jnp.float32)
            return y + jnp.dot(sums, offset.T, preferred_element_type=jnp.float32)

        def on_cpu(x):
            if rows < _SPLIT_MIN_ROWS:
                x = jnp.concatenate([x, jnp.zeros((_SPLIT_MIN_ROWS - rows, x.shape[1]), x.dtype)])
            o = self.q.shape[0]
            if o <= _SPLIT_MAX_ROWS:
                return split(x, self.q, self.scale, offset)[:rows]
            return jnp.concatenate([split(x, self.q[c:c + _SPLIT_CHUNK], self.scale[c:c + _SPLIT_CHUNK],
                                          offset[c:c + _SPLIT_CHUNK]) for c in range(0, o, _SPLIT_CHUNK)],
                                   axis=1)[:rows]

        # The platform the step is lowered for (a compile for a TPU on a CPU host takes the TPU's).
        return jax.lax.platform_dependent(x, cpu=on_cpu, default=lambda x: split(x, self.q, self.scale, offset))

    def _grouped_activation_product(self, x):
        """Activations quantized per group of `activation_group` input channels: one outlier
        channel coarsens only its group. y = sum_g sx[t, g] * (xq[t, g, :] . q[o, g, :])."""
        t, i = x.shape
        g = self.activation_group
        if i % g:
            raise ValueError(f"activation_group={g} must divide the input width {i}")
        xq, sx = quantize_rows(x.reshape(t, i // g, g), self.method)  # [t, G, g], [t, G, 1]
        rows = t
        if t == 1:
            xq, sx = jnp.concatenate([xq, jnp.zeros_like(xq)]), jnp.concatenate([sx, sx])
        acc = jnp.int32 if self.method == "int8" else jnp.float32
        q = self.q.reshape(self.q.shape[0], i // g, g)
        y = jax.lax.dot_general(xq, q, (((2,), (2,)), ((1,), (1,))), preferred_element_type=acc)  # [G, t, o]
        y = jnp.sum(y.astype(jnp.float32) * jnp.swapaxes(sx, 0, 1), axis=0)
        return y[:rows] * self.scale[None, :]

    def grouped_product(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """rows [a, i] sorted by group times this [G, o, i] weight -> float32 [a, o] (weight-only:
        models/moe.py's grouped product with each row's output scaled by its group's scales)."""
        y = jax.lax.ragged_dot_general(rows.astype(self.dtype), self.q.astype(self.dtype), group_sizes,
                                       _GROUPED_OUT_MAJOR, preferred_element_type=jnp.float32)
        ends = jnp.cumsum(group_sizes)
        group = jnp.searchsorted(ends, jnp.arange(rows.shape[0], dtype=ends.dtype), side="right")
        group = jnp.minimum(group, self.q.shape[0] - 1)  # rows past the groups are zero already
        return y * self.scale[group]

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `ids` of a [v, e] table, dequantized, float32 [len(ids), e] (an embedding lookup;
        fp8 gathered as its bits, as layers.embed_tokens gathers 16-bit tables)."""
        if self.q.dtype == jnp.int8:
            rows = self.q[ids].astype(jnp.float32)
        else:
            bits = jax.lax.bitcast_convert_type(self.q, jnp.uint8)[ids]
            rows = jax.lax.bitcast_convert_type(bits, self.q.dtype).astype(jnp.float32)
        if self.block is not None:
            offset = None if self.offset is None else self.offset[ids]
            return self._scaled(rows, self.scale[ids], offset).astype(self.dtype).astype(jnp.float32)
        return self._unsmoothed(rows * self.scale[ids][:, None]).astype(self.dtype).astype(jnp.float32)


def quantize_rows(x: jax.Array, method: str) -> tuple[jax.Array, jax.Array]:
    """x [t, i] -> (xq [t, i] int8 | float8_e4m3fn, scale float32 [t, 1]): per row, symmetric,
    dynamic (max|x_row| / qmax; an all-zero row gets scale 1)."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / _QMAX[method], 1.0)
    return _to_stored(x / scale, method), scale


def _to_stored(x, method):
    if method == "int8":
        return jnp.clip(jnp.round(x), -127, 127).astype(jnp.int8)
    return jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn)


def quantize_weight(w: jax.Array, method: str, *, activation_rows: int | None = None,
                    activation_group: int | None = None) -> QuantizedWeight:
    """An out-major float weight [..., o, i] -> QuantizedWeight (per output channel, symmetric)."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    w = jnp.asarray(w)
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-1)
    return quantize_with_amax(w, amax, method, activation_rows=activation_rows,
                              activation_group=activation_group)


def quantize_params(params: dict, method: str | None, *, activation_rows: int | None = None,
                    activation_group: int | None = None) -> dict:
    """The served layout (models/served_layout.py; layers a list or a stacked dict) with its
    weight matrices quantized (module docstring, 1.). method None returns params unchanged.
    params["embed_smoothing"] (float32 [e], models/smoothing.py: a tied lm_head's factors s) is
    consumed: the embedding is quantized as embed * s per column with input_scale 1 / s, or left
    as it is where the method keeps the tables in float (fp8; the factors then cancel)."""
    embed_smoothing = params.get("embed_smoothing")
    if embed_smoothing is not None:
        params = {k: v for k, v in params.items() if k != "embed_smoothing"}
    if method is None:
        return params
    if any(getattr(w, "dtype", None) == jnp.uint16 for w in jax.tree.leaves(params["layers"])):
        raise ValueError("quantize_params takes float weights; these layers hold 16-bit bits "
                         "(pack_layer_bits): quantize before packing (engine/step/program.py serve_layout)")
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {method!r}")
    def quantize(w):
        if isinstance(w, QuantizedWeight):  # already quantized (a GGUF's own Q8_0 table)
            return w
        group = activation_group if activation_group and w.shape[-1] % activation_group == 0 else None
        return _quantize_jit(w, method, activation_rows, group)

    def layer(d: dict) -> dict:
        if "qkv_proj" not in d:
            raise ValueError("quantize_params takes the served layout (fuse_projections first); got "
                             f"layer weights {sorted(d)}")
        return {k: quantize(w) if k in QUANTIZED_LAYER_WEIGHTS else w for k, w in d.items()}

    layers, tables = params["layers"], QUANTIZED_TABLES[method]
    out = {k: quantize(w) if k in tables else w for k, w in params.items() if k != "layers"}
    out["layers"] = [layer(d) for d in layers] if isinstance(layers, list) else layer(layers)
    if embed_smoothing is not None and "embed" in tables and not isinstance(params["embed"], QuantizedWeight):
        s = jnp.asarray(embed_smoothing, jnp.float32)
        table = (params["embed"].astype(jnp.float32) * s).astype(params["embed"].dtype)
        out["embed"] = dataclasses.replace(quantize(table), input_scale=1.0 / s)
    return out


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _quantize_jit(w, method, activation_rows, activation_group):
    return quantize_weight(w, method, activation_rows=activation_rows, activation_group=activation_group)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def quantize_with_amax(w: jax.Array, amax: jax.Array, method: str, *, activation_rows: int | None = None,
                       activation_group: int | None = None) -> QuantizedWeight:
    """quantize_weight with each output channel's max |w| given (amax float32 [..., o]): for a
    row held in pieces (an expert's down_proj split over devices, models/sharded_quant.py), the
    max of the whole row, so every piece gets the one-device scale."""
    w = jnp.asarray(w)
    scale = jnp.where(amax > 0, amax / _QMAX[method], 1.0)
    q = _to_stored(w.astype(jnp.float32) / scale[..., None], method)
    return QuantizedWeight(q, scale, jnp.dtype(w.dtype).name, activation_rows, activation_group)


def hold_code_sums(params: dict) -> dict:
    """A served layout (one device) with each 2-D int8 weight that quantizes its activations given
    its code sums (QuantizedWeight.code_sums), so the CPU's u8 x s8 product needs no correction row
    (models/int8_dot.py); anything else as it is. Not for a mesh's shards: a row-parallel weight's
    local sums are not the whole row's."""

    def held(w):
        if (isinstance(w, QuantizedWeight) and w.q.dtype == jnp.int8 and w.q.ndim == 2 and w.block is None
                and w.activation_rows is not None and w.activation_group is None and w.code_sums is None):
            return dataclasses.replace(w, code_sums=_code_sums(w.q))
        return w

    return jax.tree.map(held, params, is_leaf=is_quantized)


@jax.jit
def _code_sums(q):
    return jnp.sum(q.astype(jnp.int32), axis=-1)
