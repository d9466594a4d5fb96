"""write_kv: values land at their slots, out-of-range slots are dropped, and it runs in place."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv

NUM_BLOCKS, BLOCK_SIZE, HKV, D = 6, 4, 2, 8


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
    compiled = fn.lower(k_pages, v_pages, k, k, slots).compile()
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


@pytest.mark.parametrize(
    "k_shape, slots_shape",
    [((3, HKV, D + 1), (3,)), ((3, HKV, D), (4,)), ((3, HKV, D), (3, 1))],
)
def test_write_kv_validates_shapes(k_shape, slots_shape):
    k_pages, v_pages = _cache()
    k = np.zeros(k_shape, np.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k_pages, v_pages, k, k, np.zeros(slots_shape, np.int32))
