"""write_kv: values land at their slots, out-of-range slots are dropped, and it runs in place.

Both layouts: the single-layer [num_blocks, block_size, Hkv, D] cache (layer=None) and the
stacked [L, num_blocks, block_size, Hkv, D] cache with a static layer and with a traced layer
inside lax.scan (the cache as the scan carry).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv
from tests.conftest import PRODUCTION_COMPILER

NUM_BLOCKS, BLOCK_SIZE, HKV, D = 6, 4, 2, 8
NUM_LAYERS = 3


def _cache(seed=0):
    rng = np.random.default_rng(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


def _expected(k_pages, v_pages, k, v, slots):
    k_out, v_out = k_pages.copy(), v_pages.copy()
    for t, slot in enumerate(slots):
        if 0 <= slot < NUM_BLOCKS * BLOCK_SIZE:
            k_out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k[t]
            v_out[slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v[t]
    return k_out, v_out


def test_write_kv_places_tokens_and_drops_negative_slots():
    k_pages, v_pages = _cache()
    rng = np.random.default_rng(1)
    slots = np.array([5, 6, 7, 8, 22, -1, -7, 23, 1000], np.int32)  # -1 must not wrap to 23
    k = rng.normal(size=(len(slots), HKV, D)).astype(np.float32)
    v = rng.normal(size=(len(slots), HKV, D)).astype(np.float32)
    k_out, v_out = jax.jit(write_kv)(k_pages, v_pages, k, v, slots)
    want_k, want_v = _expected(k_pages, v_pages, k, v, slots)
    np.testing.assert_array_equal(k_out, want_k)
    np.testing.assert_array_equal(v_out, want_v)
    # The last slot of the last block holds token 7's values, not token 5's (slot -1).
    np.testing.assert_array_equal(k_out[-1, -1], k[7])


def test_write_kv_casts_to_cache_dtype():
    k_pages, v_pages = (x.astype(jnp.bfloat16) for x in _cache())
    k = np.ones((2, HKV, D), np.float32)
    k_out, v_out = write_kv(k_pages, v_pages, k, 2 * k, np.array([0, 9], np.int32))
    assert k_out.dtype == jnp.bfloat16 and v_out.dtype == jnp.bfloat16
    assert float(v_out[2, 1, 0, 0]) == 2.0


def test_write_kv_is_in_place_under_donation():
    """The compiled HLO holds no copy of a cache-sized buffer, and the donated buffers are reused.

    What this shows: XLA on this platform (CPU) aliases the outputs to the donated inputs
    (input_output_alias in the HLO module) and the result arrays live at the same device
    addresses as the inputs did. It does not prove the same for every backend, but the program
    XLA gets is the same everywhere: one scatter per array on a bitcast view.
    """
    k_pages, v_pages = (jnp.asarray(x) for x in _cache())
    k = jnp.ones((3, HKV, D), jnp.float32)
    slots = jnp.array([1, 2, -1], jnp.int32)
    fn = jax.jit(write_kv, donate_argnums=(0, 1))
    compiled = fn.lower(k_pages, v_pages, k, k, slots).compile(compiler_options=PRODUCTION_COMPILER)
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo
    cache_shape = f"f32[{NUM_BLOCKS},{BLOCK_SIZE},{HKV},{D}]"
    flat_shape = f"f32[{NUM_BLOCKS * BLOCK_SIZE},{HKV},{D}]"
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"\bcopy(-start)?\(", line) and (cache_shape in line or flat_shape in line)
    ]
    assert not copies, "cache copied:\n" + "\n".join(copies)
    assert hlo.count(" scatter(") == 2, "expected exactly one scatter per cache array"

    ptrs = (k_pages.unsafe_buffer_pointer(), v_pages.unsafe_buffer_pointer())
    k_out, v_out = compiled(k_pages, v_pages, k, k, slots)
    assert k_pages.is_deleted() and v_pages.is_deleted()
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


def _stacked_cache(seed=0):
    rng = np.random.default_rng(seed)
    shape = (NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    return rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)


@pytest.mark.parametrize("traced", [False, True], ids=["static-layer", "traced-layer"])
def test_write_kv_stacked_writes_only_its_layer(traced):
    k_cache, v_cache = _stacked_cache()
    rng = np.random.default_rng(2)
    # Slot 24 (== num_blocks * block_size) and -1 are out of range: they must not reach the next
    # or the previous layer either.
    slots = np.array([0, 5, 23, 24, -1, 1000, 11], np.int32)
    k = rng.normal(size=(len(slots), HKV, D)).astype(np.float32)
    v = rng.normal(size=(len(slots), HKV, D)).astype(np.float32)
    for layer in range(NUM_LAYERS):
        if traced:
            fn = jax.jit(lambda kc, vc, k, v, s, layer: write_kv(kc, vc, k, v, s, layer=layer))
            k_out, v_out = fn(k_cache, v_cache, k, v, slots, jnp.int32(layer))
        else:
            k_out, v_out = jax.jit(write_kv, static_argnums=5)(k_cache, v_cache, k, v, slots, layer)
        want_k, want_v = k_cache.copy(), v_cache.copy()
        want_k[layer], want_v[layer] = _expected(k_cache[layer], v_cache[layer], k, v, slots)
        np.testing.assert_array_equal(k_out, want_k)
        np.testing.assert_array_equal(v_out, want_v)


def _assert_no_cache_copy(compiled, cache_shape):
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo
    L, nb, bs, hkv, d = cache_shape
    shapes = [
        f"f32[{L},{nb},{bs},{hkv},{d}]",  # the stacked cache
        f"f32[{L * nb * bs},{hkv},{d}]",  # its flat row view
        f"f32[{nb},{bs},{hkv},{d}]",  # one layer
        f"f32[1,{nb},{bs},{hkv},{d}]",
        f"f32[{nb * bs},{hkv},{d}]",
    ]
    copies = [
        line
        for line in hlo.splitlines()
        if re.search(r"\b(copy(-start)?|dynamic-slice|slice)\(", line)
        and any(shape in line.split("=", 1)[-1].split("(", 1)[0] for shape in shapes)
    ]
    assert not copies, "cache copied:\n" + "\n".join(copies)
    # Nothing cache-sized is allocated beside the (aliased) arguments.
    one_layer = nb * bs * hkv * d * 4
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer
    return hlo


def test_write_kv_stacked_static_layer_is_in_place_under_donation():
    k_cache, v_cache = (jnp.asarray(x) for x in _stacked_cache())
    k = jnp.ones((3, HKV, D), jnp.float32)
    slots = jnp.array([1, 2, -1], jnp.int32)
    fn = jax.jit(lambda kc, vc, k, v, s: write_kv(kc, vc, k, v, s, layer=1), donate_argnums=(0, 1))
    compiled = fn.lower(k_cache, v_cache, k, k, slots).compile(compiler_options=PRODUCTION_COMPILER)
    hlo = _assert_no_cache_copy(compiled, k_cache.shape)
    assert hlo.count(" scatter(") == 2, "expected exactly one scatter per cache array"
    ptrs = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out = compiled(k_cache, v_cache, k, k, slots)
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


def test_write_kv_traced_layer_in_scan_is_in_place():
    """A lax.scan over layers with the stacked cache as the carry, one write per layer."""
    k_cache, v_cache = (jnp.asarray(x) for x in _stacked_cache())
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.normal(size=(NUM_LAYERS, 3, HKV, D)).astype(np.float32))
    slots = jnp.array([1, 2, -1], jnp.int32)

    def step(k_cache, v_cache, k, slots):
        def body(carry, xs):
            layer, k_layer = xs
            return write_kv(*carry, k_layer, 2 * k_layer, slots, layer=layer), None

        xs = (jnp.arange(NUM_LAYERS, dtype=jnp.int32), k)
        return jax.lax.scan(body, (k_cache, v_cache), xs)[0]

    want_k, want_v = np.array(k_cache), np.array(v_cache)
    for layer in range(NUM_LAYERS):
        want_k[layer], want_v[layer] = _expected(
            want_k[layer], want_v[layer], np.asarray(k[layer]), 2 * np.asarray(k[layer]), [1, 2, -1]
        )
    fn = jax.jit(step, donate_argnums=(0, 1))
    compiled = fn.lower(k_cache, v_cache, k, slots).compile(compiler_options=PRODUCTION_COMPILER)
    hlo = _assert_no_cache_copy(compiled, k_cache.shape)
    assert "while" in hlo
    ptrs = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out = compiled(k_cache, v_cache, k, slots)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs
    np.testing.assert_array_equal(k_out, want_k)
    np.testing.assert_array_equal(v_out, want_v)


def test_write_kv_rejects_bad_layers():
    k_cache, v_cache = _stacked_cache()
    k = np.zeros((2, HKV, D), np.float32)
    slots = np.zeros((2,), np.int32)
    for layer, match in ((None, "needs layer"), (NUM_LAYERS, "layer must be in"), (-1, "in")):
        with pytest.raises(ValueError, match=match):
            write_kv(k_cache, v_cache, k, k, slots, layer=layer)
    with pytest.raises(ValueError, match="layer=None"):
        write_kv(k_cache[0], v_cache[0], k, k, slots, layer=0)


@pytest.mark.parametrize(
    "k_shape, slots_shape",
    [((3, HKV, D + 1), (3,)), ((3, HKV, D), (4,)), ((3, HKV, D), (3, 1))],
)
def test_write_kv_validates_shapes(k_shape, slots_shape):
    k_pages, v_pages = _cache()
    k = np.zeros(k_shape, np.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k_pages, v_pages, k, k, np.zeros(slots_shape, np.int32))


@pytest.mark.parametrize("num_kv_heads", [1, 2], ids=["one-head-page-rmw", "two-heads-token-dma"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tpu_kernel_writes_what_the_scatter_writes(num_kv_heads, dtype):
    """pallas_tpu's Mosaic write (interpret mode) equals the scatter: stacked cache at a static and a
    traced layer, a single-layer cache, out-of-range slots dropped, tokens revisiting a page after
    another page (the one-head form reads it back), and padding tokens sharing one slot."""
    rng = np.random.default_rng(4)
    shape = (NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, 128)
    k_cache = jnp.asarray(rng.normal(size=shape), dtype)
    v_cache = -k_cache
    slots = np.array([0, 5, 1, 23, -1, 24, 1000, 6, 0, 0], np.int32)
    k = jnp.asarray(rng.normal(size=(len(slots), num_kv_heads, 128)), dtype)
    v = 2 * k
    slots[-2:] = 3  # two padding tokens at one slot write the same values
    k, v = k.at[-1].set(k[-2]), v.at[-1].set(v[-2])
    tpu = jax.jit(lambda kc, vc, k, v, s, layer: write_kv(kc, vc, k, v, s, layer=layer, backend="pallas_tpu",
                                                          interpret=True))
    for layer in (0, NUM_LAYERS - 1, jnp.int32(1)):
        want = write_kv(k_cache, v_cache, k, v, slots, layer=layer)
        got = tpu(k_cache, v_cache, k, v, slots, layer)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    want = write_kv(k_cache[0], v_cache[0], k, v, slots)
    got = write_kv(k_cache[0], v_cache[0], k, v, slots, backend="pallas_tpu", interpret=True)
    for w, g in zip(want, got):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_write_kv_refuses_an_unknown_backend():
    k_cache, v_cache = _cache()
    with pytest.raises(ValueError, match="write_kv backend must be one of.*'mosaic'"):
        write_kv(k_cache, v_cache, np.zeros((1, HKV, D), np.float32), np.zeros((1, HKV, D), np.float32),
                 np.zeros((1,), np.int32), backend="mosaic")
