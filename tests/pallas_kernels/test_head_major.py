"""Head-major pages (kv_layout "head_major", the engine's cache layout on the xla path): the same
attention and the same writes as the token-major pages they transpose.

A head-major page is [Hkv, block_size, D] where a token-major one is [block_size, Hkv, D]
(pallas_kernels/validation.py KV_LAYOUTS). Here: both xla forms over test_xla.py's grids against
the float64 oracle and against the token-major result, the 8-bit caches, a stacked cache written
and read inside a scan, write_kv equal to the token-major write transposed (dropped slots, one
token, 16-bit bits, 8-bit values and scales) and in place, and the refusals.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KV_LAYOUTS, kv_layout_for, ragged_paged_attention, write_kv
from pallas_kernels.kv_quant import ScaledCache, dequantize_kv, quantize_kv
from pallas_kernels.kv_write import as_bits
from tests.conftest import PRODUCTION_COMPILER
from tests.pallas_kernels.cases import (
    Case,
    case_options,
    make_batch,
    make_stacked_batch,
    oracle,
    prepare,
    tolerance,
)
from tests.pallas_kernels.test_xla import CASES, EDGE_CASES

GRID = CASES[::3] + EDGE_CASES  # every kind, GQA 1-8, float32 and bfloat16, a window, a soft cap


def _heads_first(pages):
    """Token-major pages [..., block_size, Hkv(, D)] -> head-major [..., Hkv, block_size(, D)]
    (values: the page axes are the last three; scales: the last two)."""
    if isinstance(pages, ScaledCache):
        return ScaledCache(_heads_first(pages.values), jnp.swapaxes(pages.scales, -1, -2), pages.kv_cache_dtype)
    return jnp.swapaxes(jnp.asarray(pages), -3, -2)


def _attend(batch, options, kv_layout, **tuning):
    md = prepare(batch, backend="xla", sliding_window=options["sliding_window"], **tuning)
    k, v = batch["k_pages"], batch["v_pages"]
    if kv_layout == "head_major":
        k, v = _heads_first(k), _heads_first(v)
    return ragged_paged_attention(batch["q"], k, v, md, backend="xla", kv_layout=kv_layout, **options).astype(
        jnp.float32)


@pytest.mark.parametrize("form", ["loop", "split"])
@pytest.mark.parametrize("case", GRID, ids=lambda c: c.name)
def test_head_major_pages_attend_as_the_token_major_ones(case, form):
    batch = {k: (jnp.asarray(v) if k != "num_seqs" else v) for k, v in make_batch(case).items()}
    options = case_options(case)
    tuning = dict(form=form) if form == "loop" else dict(form=form, chunk_block_q=4, chunk_tail_block_q=2)
    run = jax.jit(lambda b, layout: _attend(b, options, layout, **tuning), static_argnums=1)
    got, token_major = (np.asarray(run(batch, layout)) for layout in ("head_major", "token_major"))
    np.testing.assert_allclose(got, oracle(make_batch(case), **options), **tolerance(case))
    np.testing.assert_allclose(got, token_major, rtol=1e-5, atol=1e-5 if case.dtype == "float32" else 2e-2)
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_head_major_8bit_pages_attend_as_the_oracle_reads_them_dequantized(kv_cache_dtype):
    case = Case("hm-q8", q_lens=(1, 9, 1, 3), kv_lens=(40, 9, 17, 50), pad_tokens=2, pad_seqs=1, num_kv_heads=3,
                group=2, sliding_window=30)
    batch = make_batch(case)
    scaled, dequantized = dict(batch), dict(batch)
    for name in ("k_pages", "v_pages"):
        values, scales = quantize_kv(jnp.asarray(batch[name]), kv_cache_dtype)
        scaled[name] = ScaledCache(values, scales, kv_cache_dtype)
        dequantized[name] = np.asarray(dequantize_kv(values, scales, kv_cache_dtype), np.float64)
    options = case_options(case)
    got = jax.jit(lambda b: _attend(b, options, "head_major"))(scaled)
    np.testing.assert_allclose(np.asarray(got), oracle(dequantized, **options), **tolerance(case))


def _scan_write_then_attend(stacked, options, kv_layout):
    """Every layer of a stacked cache written, then read, inside a lax.scan (the engine's loop)."""
    md = prepare({**stacked, "q": stacked["q"][0], "k_pages": stacked["k_cache"][0]}, backend="xla",
                 sliding_window=options["sliding_window"])

    def body(cache, xs):
        layer, q, k, v = xs
        cache = write_kv(*cache, k, v, stacked["slot_mapping"], layer=layer, kv_layout=kv_layout)
        return cache, ragged_paged_attention(q, *cache, md, layer=layer, kv_layout=kv_layout, **options)

    k_cache, v_cache = stacked["k_cache"], stacked["v_cache"]
    if kv_layout == "head_major":
        k_cache, v_cache = _heads_first(k_cache), _heads_first(v_cache)
    layers = jnp.arange(k_cache.shape[0], dtype=jnp.int32)
    return jax.lax.scan(body, (k_cache, v_cache), (layers, stacked["q"], stacked["k_new"], stacked["v_new"]))


def test_a_stacked_head_major_cache_written_and_read_in_a_scan_matches_the_token_major_one():
    case = Case("hm-stacked", q_lens=(1, 6, 1), kv_lens=(23, 6, 40), pad_tokens=2, num_kv_heads=2, group=3)
    stacked = make_stacked_batch(case, num_layers=3)
    written = stacked.pop("written")
    arrays = {k: jnp.asarray(v) for k, v in stacked.items()}
    options = case_options(case)
    run = jax.jit(lambda a, layout: _scan_write_then_attend(a, options, layout), static_argnums=1)
    (hk, hv), got = run(arrays, "head_major")
    (tk, tv), want = run(arrays, "token_major")
    np.testing.assert_array_equal(np.asarray(hk), np.asarray(_heads_first(tk)))
    np.testing.assert_array_equal(np.asarray(hv), np.asarray(_heads_first(tv)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for layer, batch in enumerate(written):
        np.testing.assert_allclose(np.asarray(got[layer]), oracle(batch, **options), **tolerance(case))


NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HKV, D = 3, 6, 4, 2, 8
SLOTS = np.array([0, 5, 23, 24, -1, 1000, 11], np.int32)  # 24 = num_blocks * block_size: dropped


def _token_major_cache(dtype, kv_cache_dtype="auto", seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HKV, D)), dtype)
    if kv_cache_dtype != "auto":
        return ScaledCache(*quantize_kv(x, kv_cache_dtype), kv_cache_dtype)
    return as_bits(x) if dtype == jnp.bfloat16 else x


@pytest.mark.parametrize("slots", [SLOTS, SLOTS[1:2]], ids=["seven-tokens", "one-token"])
@pytest.mark.parametrize("dtype, kv_cache_dtype", [(jnp.float32, "auto"), (jnp.bfloat16, "auto"),
                                                   (jnp.float32, "int8"), (jnp.float32, "fp8_e4m3")],
                         ids=["float32", "bfloat16-bits", "int8", "fp8"])
@pytest.mark.parametrize("traced", [False, True], ids=["static-layer", "traced-layer"])
def test_write_kv_head_major_is_the_token_major_write_transposed(dtype, kv_cache_dtype, slots, traced):
    rng = np.random.default_rng(1)
    k, v = (jnp.asarray(rng.normal(size=(len(slots), HKV, D)), dtype) for _ in range(2))
    token_major = [_token_major_cache(dtype, kv_cache_dtype, seed) for seed in (0, 1)]
    for layer in range(NUM_LAYERS):
        def write(kc, vc, layer, kv_layout):
            return write_kv(kc, vc, k, v, slots, layer=layer, kv_layout=kv_layout)

        if traced:
            layer = jnp.int32(layer)
        want = jax.jit(write, static_argnums=(2, 3) if not traced else (3,))(*token_major, layer, "token_major")
        got = jax.jit(write, static_argnums=(2, 3) if not traced else (3,))(
            *(_heads_first(c) for c in token_major), layer, "head_major")
        for g, w in zip(got, want):
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(_heads_first(w))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_write_kv_head_major_in_a_scan_runs_in_place():
    k_cache, v_cache = (_heads_first(_token_major_cache(jnp.float32, seed=s)) for s in (0, 1))
    k = jnp.ones((NUM_LAYERS, 3, HKV, D), jnp.float32)
    slots = jnp.array([1, 2, -1], jnp.int32)

    def step(k_cache, v_cache, k, slots):
        def body(carry, xs):
            layer, k_layer = xs
            return write_kv(*carry, k_layer, 2 * k_layer, slots, layer=layer, kv_layout="head_major"), None

        return jax.lax.scan(body, (k_cache, v_cache), (jnp.arange(NUM_LAYERS, dtype=jnp.int32), k))[0]

    fn = jax.jit(step, donate_argnums=(0, 1))
    compiled = fn.lower(k_cache, v_cache, k, slots).compile(compiler_options=PRODUCTION_COMPILER)
    assert "input_output_alias" in compiled.as_text()
    one_layer = NUM_BLOCKS * BLOCK_SIZE * HKV * D * 4
    assert compiled.memory_analysis().temp_size_in_bytes < one_layer, "the cache was copied"
    ptrs = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out = compiled(k_cache, v_cache, k, slots)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs


def test_the_layout_is_refused_by_name_where_it_is_not_implemented():
    assert KV_LAYOUTS == ("token_major", "head_major")
    assert kv_layout_for("xla") == "head_major"
    assert kv_layout_for("pallas_tpu") == kv_layout_for("pallas_gpu") == "token_major"
    with pytest.raises(ValueError, match="backend must be one of"):
        kv_layout_for("triton")
    case = Case("hm-refuse", q_lens=(1, 3), kv_lens=(9, 3), num_kv_heads=2, group=2)
    batch = make_batch(case)
    options = case_options(case)
    k = jnp.zeros((2, 4, HKV, D), jnp.float32)
    for backend in ("pallas_gpu", "pallas_tpu"):
        md = prepare(batch, backend=backend)
        with pytest.raises(ValueError, match="head_major.*xla path"):
            ragged_paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], md, backend=backend,
                                   kv_layout="head_major", **options)
        with pytest.raises(ValueError, match="head_major.*xla path"):
            write_kv(k, k, k[0], k[0], jnp.zeros((4,), jnp.int32), backend=backend, kv_layout="head_major")
    md = prepare(batch, backend="xla")
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        ragged_paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], md, kv_layout="heads", **options)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        write_kv(k, k, k[0], k[0], jnp.zeros((4,), jnp.int32), kv_layout="heads")
    with pytest.raises(ValueError, match=r"\[num_layers, num_blocks, num_kv_heads, block_size, head_dim\]"):
        write_kv(k[0], k[0], k[0], k[0], jnp.zeros((4,), jnp.int32), kv_layout="head_major")
    # Token-major pages read as head-major: their [block_size, Hkv] is not the metadata's [Hkv, block_size].
    with pytest.raises(ValueError, match="block_size and num_kv_heads"):
        ragged_paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], md, kv_layout="head_major",
                               **options)
