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

An 8-bit cache (kv_quant.ScaledCache; `write_scaled_kv_tpu`): k and v are quantized per token and
kv head in XLA (kv_quant.quantize_kv), then written as two caches of their own with the kernels
above: the values [L, num_blocks, block_size, Hkv, D] (int8, or uint8 e4m3 bits) as a cache, and
the scales [L, num_blocks, block_size, Hkv] (uint16 bfloat16 bits) as a one-head cache of head_dim
Hkv, [L, num_blocks, block_size, 1, Hkv] (a free view): one token's scales are one row of a packed
16-bit tile, so they take the page read-modify-write form (`_page_kernel`). That form selects in
float32: the stored integers (int8, uint8 codes, uint16 bits) convert to float32 and back exactly.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_quant import ScaledCache, quantize_kv


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


def _page_kernel(layer_ref, slots_ref, k_new, v_new, k_in, v_in, k_out, v_out, k_page, v_page, sems):
    """One kv head, caches [L, num_blocks, 1, block_size, D] (tpu.heads_major): a token is one row
    of a (block_size, D) tile, which a DMA cannot write alone in a packed 16-bit dtype, so pages are
    read, updated and written back: tokens run in order and the page stays in VMEM while the next
    token writes the same page (a sequence's tokens are consecutive), one page round trip per page
    touched. k_new, v_new [T, D] float32 in VMEM (an integer cache: its stored integers, exact)."""
    del k_in, v_in
    layer = layer_ref[0]
    block_size = k_out.shape[3]
    num_tokens = slots_ref.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, k_page.shape[1:], 0)  # [block_size, D]

    def page_copies(block, to_hbm):
        pairs = ((k_page, k_out.at[layer, block], sems.at[0]), (v_page, v_out.at[layer, block], sems.at[1]))
        return [pltpu.make_async_copy(vmem, hbm, sem) if to_hbm else pltpu.make_async_copy(hbm, vmem, sem)
                for vmem, hbm, sem in pairs]

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
            here = rows == lax.rem(slot, block_size)
            for page, new in ((k_page, k_new), (v_page, v_new)):
                row = new[pl.ds(t, 1), :]  # [1, D] float32
                page[0] = jnp.where(here, row, page[0].astype(jnp.float32)).astype(page.dtype)

        return jnp.where(block >= 0, block, current)

    last = lax.fori_loop(0, num_tokens, body, jnp.int32(-1))

    @pl.when(last >= 0)
    def _():
        move(last, to_hbm=True)


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
    """(k_cache, v_cache) 8-bit caches with k[t], v[t] quantized and written at slot rows[t] of
    `layer` (int32[1]); rows[t] == -1 writes nothing. stacked_shape: the values as
    [L, num_blocks, block_size, Hkv, D] (a single-layer cache is L = 1). Validation is the caller's."""
    kind = k_cache.kv_cache_dtype
    (k_values, k_scales), (v_values, v_scales) = quantize_kv(k, kind), quantize_kv(v, kind)
    num_layers, num_blocks, block_size, num_kv_heads, _ = stacked_shape
    values = write_kv_tpu(k_cache.values.reshape(stacked_shape), v_cache.values.reshape(stacked_shape),
                          k_values, v_values, rows, layer, interpret=interpret)
    scale_view = (num_layers, num_blocks, block_size, 1, num_kv_heads)  # one "head" of Hkv scales
    scales = write_kv_tpu(k_cache.scales.reshape(scale_view), v_cache.scales.reshape(scale_view),
                          k_scales[:, None, :], v_scales[:, None, :], rows, layer, interpret=interpret)
    return tuple(ScaledCache(x.reshape(c.values.shape), s.reshape(c.scales.shape), kind)
                 for c, x, s in zip((k_cache, v_cache), values, scales))
