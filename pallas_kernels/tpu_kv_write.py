"""Writing this step's K/V into the paged cache on the TPU: a Pallas (Mosaic) kernel of DMAs.

Why not the scatter (kv_write.py's XLA form): the attention kernel (tpu.py) is a Mosaic custom
call that reads the caches in HBM in the layout Mosaic gives them, while an XLA scatter into the
stacked caches makes XLA pick a layout for the scattered array; where the two differ, XLA inserts a
copy of BOTH whole stacked caches before every layer's attention (measured with
`experiments.aot --target=v5e-8 --model=random:llama3-8b`: 8.4 GB accessed per decode step instead
of 0.9 GB, and twice the KV pool as temporary memory). Writing the pages with the same kind of
custom call keeps the loop-carried caches in one layout, updated in place.

Layout
  k_cache, v_cache [L, num_blocks, block_size, Hkv, D] stay in HBM (memory space pl.ANY) and are
            aliased input -> output (input_output_aliases): the kernel writes into them in place.
  k, v      [T, Hkv, D] this step's keys and values, also left in HBM.
  Scalar prefetch (SMEM): the layer (int32[1]), and slot_mapping int32[T] with out-of-range
            slots (negative, or >= num_blocks * block_size) already replaced by -1.

Walkthrough (one program)
  1. For each token t with slot >= 0: start the DMA of k[t] and v[t] ([Hkv, D] each, HBM to HBM)
     into [layer, slot // block_size, slot % block_size] of the caches. All copies are in flight
     at once; K's signal one DMA semaphore and V's another.
  2. For the same tokens, wait for each copy (a wait consumes one copy of that size).
Tokens with slot -1 copy nothing. Two tokens with the same slot (padding pointed at the null
block) both write it; which one lands is unspecified, as for the scatter.

An 8-bit cache (kv_quant.ScaledCache in the page scale layout; `write_scaled_kv_tpu`): k and v
are quantized per token and kv head in XLA (kv_quant.quantize_kv), the values written as a cache
of their own with the kernels above ([L, num_blocks, block_size, Hkv, D] int8, or uint8 e4m3
bits), the scales by `_scale_row_kernel` into their rows [L, num_blocks, W] uint32 (a page's
scales are one lane-dense row; a token's are Hkv lanes of it, so each page touched is read,
updated and written back, `_read_modify_write`). The page form selects in float32: the stored
integers (int8, uint8 codes, uint16 bits) convert to float32 and back exactly; the scale rows
select as uint32.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_quant import ScaledCache, page_bits, page_lanes, quantize_kv


def _kernel(layer_ref, slots_ref, k_new, v_new, k_in, v_in, k_out, v_out, sems):
    del k_in, v_in  # the same buffers as k_out, v_out (aliased)
    layer = layer_ref[0]
    block_size = k_out.shape[2]
    num_tokens = slots_ref.shape[0]

    def copies(t):
        slot = slots_ref[t]
        block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
        return (pltpu.make_async_copy(k_new.at[t], k_out.at[layer, block, offset], sems.at[0]),
                pltpu.make_async_copy(v_new.at[t], v_out.at[layer, block, offset], sems.at[1]))

    def over_tokens(action):
        def body(t, carry):
            @pl.when(slots_ref[t] >= 0)
            def _():
                for copy in copies(t):
                    action(copy)

            return carry

        lax.fori_loop(0, num_tokens, body, 0)

    over_tokens(lambda copy: copy.start())
    over_tokens(lambda copy: copy.wait())


def _read_modify_write(slots_ref, block_size, page_copies, update):
    """Tokens in order, each page read into VMEM, updated (`update(t, offset)`) and written back;
    the page stays in VMEM while the next token writes the same page (a sequence's tokens are
    consecutive): one round trip per page touched. page_copies(block, to_hbm): the DMAs."""
    def move(block, to_hbm):
        copies = page_copies(block, to_hbm)
        for copy in copies:
            copy.start()
        for copy in copies:
            copy.wait()

    def body(t, current):
        slot = slots_ref[t]
        block = jnp.where(slot >= 0, lax.div(slot, block_size), -1)

        @pl.when((block != current) & (current >= 0))
        def _():
            move(current, to_hbm=True)

        @pl.when((block != current) & (block >= 0))
        def _():
            move(block, to_hbm=False)

        @pl.when(block >= 0)
        def _():
            update(t, lax.rem(slot, block_size))

        return jnp.where(block >= 0, block, current)

    last = lax.fori_loop(0, slots_ref.shape[0], body, jnp.int32(-1))

    @pl.when(last >= 0)
    def _():
        move(last, to_hbm=True)


def _copies(pairs, to_hbm):
    return [pltpu.make_async_copy(vmem, hbm, sem) if to_hbm else pltpu.make_async_copy(hbm, vmem, sem)
            for vmem, hbm, sem in pairs]


def _page_kernel(layer_ref, slots_ref, k_new, v_new, k_in, v_in, k_out, v_out, k_page, v_page, sems):
    """One kv head, caches [L, num_blocks, 1, block_size, D] (tpu.heads_major): a token is one row
    of a (block_size, D) tile, which a DMA cannot write alone in a packed 16-bit dtype, so pages are
    read, updated and written back (`_read_modify_write`). k_new, v_new [T, D] float32 in VMEM (an
    integer cache: its stored integers, exact)."""
    del k_in, v_in
    layer = layer_ref[0]
    rows = lax.broadcasted_iota(jnp.int32, k_page.shape[1:], 0)  # [block_size, D]

    def page_copies(block, to_hbm):
        return _copies(((k_page, k_out.at[layer, block], sems.at[0]),
                        (v_page, v_out.at[layer, block], sems.at[1])), to_hbm)

    def update(t, offset):
        here = rows == offset
        for page, new in ((k_page, k_new), (v_page, v_new)):
            row = new[pl.ds(t, 1), :]  # [1, D] float32
            page[0] = jnp.where(here, row, page[0].astype(jnp.float32)).astype(page.dtype)

    _read_modify_write(slots_ref, k_out.shape[3], page_copies, update)


def _scale_row_kernel(layer_ref, slots_ref, lanes_ref, k_new, v_new, k_in, v_in, k_out, v_out, k_page, v_page,
                      sems, *, block_size):
    """An 8-bit cache's scales in the page layout (kv_quant.py): caches [L, num_blocks, W] uint32,
    one row per page, token t's scale of kv head h at lane h * block_size + t. k_new, v_new [T, W]
    uint32 in VMEM: token t's scales already spread over every token's lanes (`_scale_rows`);
    lanes_ref [1, W] int32 the token each lane holds (-1: padding), so a token's update is one
    select of its lanes into the page's row, read and written back by `_read_modify_write`."""
    del k_in, v_in
    layer = layer_ref[0]

    def page_copies(block, to_hbm):
        return _copies(((k_page, k_out.at[layer, pl.ds(block, 1)], sems.at[0]),
                        (v_page, v_out.at[layer, pl.ds(block, 1)], sems.at[1])), to_hbm)

    def update(t, offset):
        here = lanes_ref[...] == offset  # [1, W]
        for page, new in ((k_page, k_new), (v_page, v_new)):
            page[...] = jnp.where(here, new[pl.ds(t, 1), :], page[...])

    _read_modify_write(slots_ref, block_size, page_copies, update)


def write_kv_tpu(k_cache, v_cache, k, v, rows, layer, *, interpret=False):
    """(k_cache, v_cache) [L, num_blocks, block_size, Hkv, D] with k[t], v[t] written at slot
    rows[t] of `layer` (int32[1]); rows[t] == -1 writes nothing. Validation is the caller's
    (kv_write.write_kv)."""
    from pallas_kernels import tpu

    if interpret is True:
        interpret = pltpu.InterpretParams()
    shape = k_cache.shape
    num_layers, num_blocks, block_size, num_kv_heads, head_dim = shape
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    if tpu.heads_major(num_kv_heads):
        num_tokens = k.shape[0]
        vmem = pl.BlockSpec((num_tokens, head_dim), lambda i, *_: (0, 0))
        kernel, in_specs = _page_kernel, [vmem, vmem, hbm, hbm]
        scratch = [pltpu.VMEM((1, block_size, head_dim), k_cache.dtype),
                   pltpu.VMEM((1, block_size, head_dim), v_cache.dtype), pltpu.SemaphoreType.DMA((2,))]
        k, v = (x.reshape(num_tokens, head_dim).astype(jnp.float32) for x in (k, v))
    else:
        kernel, in_specs = _kernel, [hbm, hbm, hbm, hbm]
        scratch = [pltpu.SemaphoreType.DMA((2,))]
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    k_view, v_view = tpu.kernel_view(k_cache), tpu.kernel_view(v_cache)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(1,), in_specs=in_specs, out_specs=[hbm, hbm], scratch_shapes=scratch)
    k_out, v_out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(k_view.shape, k_view.dtype),
                   jax.ShapeDtypeStruct(v_view.shape, v_view.dtype)],
        # Operands: layer, rows, k, v, k_cache, v_cache (scalar prefetch counts).
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_kv_tpu",
    )(layer, rows, k, v, k_view, v_view)
    return k_out.reshape(shape), v_out.reshape(shape)


def write_scaled_kv_tpu(k_cache: ScaledCache, v_cache: ScaledCache, k, v, rows, layer, stacked_shape, *,
                        interpret=False):
    """(k_cache, v_cache) 8-bit caches in the page scale layout with k[t], v[t] quantized and
    written at slot rows[t] of `layer` (int32[1]); rows[t] == -1 writes nothing. stacked_shape:
    the values as [L, num_blocks, block_size, Hkv, D] (a single-layer cache is L = 1). Validation
    is the caller's (kv_write.write_kv)."""
    kind = k_cache.kv_cache_dtype
    if interpret is True:
        interpret = pltpu.InterpretParams()
    (k_values, k_scales), (v_values, v_scales) = quantize_kv(k, kind), quantize_kv(v, kind)
    num_layers, num_blocks, block_size, num_kv_heads, _ = stacked_shape
    values = write_kv_tpu(k_cache.values.reshape(stacked_shape), v_cache.values.reshape(stacked_shape),
                          k_values, v_values, rows, layer, interpret=interpret)
    width = k_cache.scales.shape[-1]
    view = (num_layers, num_blocks, width)
    lanes = jnp.asarray(page_lanes(block_size, num_kv_heads, width))[None, :]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    num_tokens = k.shape[0]
    vmem = pl.BlockSpec((num_tokens, width), lambda i, *_: (0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(1,),
        in_specs=[pl.BlockSpec((1, width), lambda i, *_: (0, 0)), vmem, vmem, hbm, hbm],
        out_specs=[hbm, hbm],
        scratch_shapes=[pltpu.VMEM((1, width), jnp.uint32), pltpu.VMEM((1, width), jnp.uint32),
                        pltpu.SemaphoreType.DMA((2,))])
    scales = pl.pallas_call(
        functools.partial(_scale_row_kernel, block_size=block_size),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(view, jnp.uint32)] * 2,
        # Operands: layer, rows, lanes, k rows, v rows, k_scales, v_scales (scalar prefetch counts).
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="write_kv_scales_tpu",
    )(layer, rows, lanes, _scale_rows(k_scales, block_size, width), _scale_rows(v_scales, block_size, width),
      k_cache.scales.reshape(view), v_cache.scales.reshape(view))
    return tuple(ScaledCache(x.reshape(c.values.shape), sc.reshape(c.scales.shape), kind, c.layout)
                 for c, x, sc in zip((k_cache, v_cache), values, scales))


def _scale_rows(scale_bits, block_size, width):
    """Token-layout scale bits [T, Hkv] (uint16) -> [T, width] uint32 page-layout bits, token t's
    scale of head h on lanes h * block_size .. h * block_size + block_size - 1 (the kernel keeps
    the lane of t's offset), zero on the padding lanes."""
    spread = jnp.repeat(page_bits(scale_bits), block_size, axis=1)  # [T, Hkv * block_size]
    return jnp.pad(spread, ((0, 0), (0, width - spread.shape[1])))
