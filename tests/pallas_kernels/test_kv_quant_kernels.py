"""The Pallas kernels on an 8-bit KV cache (pallas_kernels/kv_quant.py), in interpret mode on the CPU.

The decode the kernels use (int32 and float32 operations only, e4m3 decoded from its bits) equals
the native conversion for every stored code; both attention kernels over a ScaledCache equal the
float64 oracle over the pages the cache gives back (dequantized), the TPU kernel reading the page
scale layout; the TPU write kernels store exactly what the scatter stores (values, and the scales
moved into the page layout; both layouts of tpu.heads_major); each backend refuses the other scale
layout by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv
from pallas_kernels.kv_quant import (
    ScaledCache,
    as_page_layout,
    dequantize_kv,
    quantize_kv,
    scales_to_float32,
    values_to_float32,
)
from tests.pallas_kernels.cases import Case, attend, case_options, make_batch, oracle, tolerance


def test_the_kernels_decode_equals_the_native_conversion_for_every_code():
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3's NaNs: never written (quantize_kv clips to 448)
    native = jax.lax.bitcast_convert_type(jnp.asarray(codes), jnp.float8_e4m3fn).astype(jnp.float32)
    got = values_to_float32(jnp.asarray(codes), "fp8_e4m3")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(native))
    assert np.asarray(got).min() == -448.0 and np.asarray(got)[1] == 2.0**-9  # the smallest subnormal
    ints = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(values_to_float32(ints, "int8")), np.arange(-128, 128))
    bits = jnp.asarray(np.random.default_rng(0).integers(0, 2**16, 512), jnp.uint16)
    want = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(scales_to_float32(bits)), np.asarray(want))
    with pytest.raises(ValueError, match="fp8_e5m2"):
        values_to_float32(ints, "fp8_e5m2")


def _scaled_batch(case: Case, kv_cache_dtype: str):
    """make_batch's pages as an 8-bit cache, and the batch the oracle sees (pages dequantized)."""
    batch = make_batch(case)
    caches, dequantized = {}, {}
    for name in ("k_pages", "v_pages"):
        values, scales = quantize_kv(jnp.asarray(batch[name]), kv_cache_dtype)
        caches[name] = ScaledCache(values, scales, kv_cache_dtype)
        dequantized[name] = np.asarray(dequantize_kv(values, scales, kv_cache_dtype), np.float64)
    return {**batch, **caches}, {**batch, **dequantized}


# Both kernels meet each case: GQA 2 with two kv heads (TPU: the [block_size, Hkv, D] pages and
# the scale column taken per head), one kv head (TPU: heads_major pages) with 128-wide heads in
# bfloat16 and a soft cap, three kv heads with a window; int8 and fp8 both.
CASES = [
    (Case("q8-mixed-g2", q_lens=(1, 9, 1), kv_lens=(40, 9, 17), pad_tokens=2, pad_seqs=1,
          num_kv_heads=2, group=2), "int8"),
    (Case("q8-decode-g4-d128-bf16-cap", q_lens=(1, 1), kv_lens=(33, 70), num_kv_heads=1, group=4,
          head_dim=128, block_size=32, dtype="bfloat16", soft_cap=30.0), "fp8_e4m3"),
    (Case("q8-prefill-k3-window", q_lens=(13, 2), kv_lens=(30, 20), num_kv_heads=3, group=1,
          sliding_window=20), "fp8_e4m3"),
]
BACKENDS = {"gpu": ("pallas_gpu", {}), "gpu-split4": ("pallas_gpu", dict(num_kv_splits=4, pages_per_step=1)),
            "tpu": ("pallas_tpu", {})}
RUNS = [(case, kind, name) for case, kind in CASES for name in ("gpu", "tpu")] + [(*CASES[0], "gpu-split4")]


@pytest.mark.parametrize("case, kind, backend", RUNS, ids=[f"{c.name}-{k}-{b}" for c, k, b in RUNS])
def test_kernels_read_an_8bit_cache_as_the_oracle_reads_its_dequantized_pages(case, kind, backend):
    name, tuning = BACKENDS[backend]
    batch, dequantized = _scaled_batch(case, kind)
    options = case_options(case)
    arrays = {k: (v if isinstance(v, ScaledCache) else jnp.asarray(v)) for k, v in batch.items()}
    if name == "pallas_tpu":  # the TPU reads its scales as rows per page (kv_quant.py "Scale layouts")
        arrays = {k: as_page_layout(v) if isinstance(v, ScaledCache) else v for k, v in arrays.items()}
    out = jax.jit(lambda b: attend(b, backend=name, options=options, interpret=True, **tuning))(arrays)
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, oracle(dequantized, **options), **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


def test_tpu_kernel_on_an_8bit_cache_has_no_races_and_reads_no_unwritten_memory():
    """The scale pages' two extra DMAs per page, under TPU interpret mode's race detector and with
    uninitialized memory NaN (a scale page read before its copy lands would show)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.tpu import ragged_paged_attention_tpu
    from tests.pallas_kernels.cases import prepare

    case, kind = CASES[0]
    batch, dequantized = _scaled_batch(case, kind)
    options = case_options(case)
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")

    def run(b):
        md = prepare(b, backend="pallas_tpu", sliding_window=options["sliding_window"])
        return ragged_paged_attention_tpu(b["q"], b["k_pages"], b["v_pages"], md, **options, interpret=params)

    arrays = {k: (as_page_layout(v) if isinstance(v, ScaledCache) else jnp.asarray(v)) for k, v in batch.items()}
    got = np.asarray(jax.jit(run)(arrays))
    np.testing.assert_allclose(got, oracle(dequantized, **options), **tolerance(case))
    assert tpu_interpreter.races is not None and not tpu_interpreter.races.races_found


NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, D = 3, 6, 4, 128


@pytest.mark.parametrize("num_kv_heads, kind", [(1, "int8"), (2, "fp8_e4m3")],
                         ids=["one-head-page-rmw-int8", "two-heads-token-dma-fp8"])
def test_tpu_kernels_write_an_8bit_cache_as_the_scatter_does(num_kv_heads, kind):
    """write_kv(backend="pallas_tpu") (interpret mode) quantizes and writes values and scales
    bit for bit as the scatter does (its scales then moved into the page layout; the padding lanes
    stay as they were): a traced layer, a single-layer cache, slots out of range dropped, a page
    revisited, two padding tokens at one slot."""
    rng = np.random.default_rng(5)
    shape = (NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, D)

    def random_cache():
        values, scales = quantize_kv(jnp.asarray(rng.normal(size=shape) * 3, jnp.float32), kind)
        return ScaledCache(values, scales, kind)

    k_cache, v_cache = random_cache(), random_cache()
    slots = np.array([0, 5, 1, 23, -1, 24, 1000, 6, 3, 3], np.int32)
    k = jnp.asarray(rng.normal(size=(len(slots), num_kv_heads, D)), jnp.bfloat16)
    v = 2 * k
    k, v = k.at[-1].set(k[-2]), v.at[-1].set(v[-2])
    tpu = jax.jit(lambda kc, vc, k, v, s, layer: write_kv(kc, vc, k, v, s, layer=layer, backend="pallas_tpu",
                                                          interpret=True))

    def check(got, want):
        for g, w in zip(got, want):
            w = as_page_layout(w)
            assert isinstance(g, ScaledCache) and g.kv_cache_dtype == kind and g.layout == "page"
            assert g.shape == w.shape and g.scales.shape == w.scales.shape
            np.testing.assert_array_equal(np.asarray(g.values), np.asarray(w.values))
            np.testing.assert_array_equal(np.asarray(g.scales), np.asarray(w.scales))

    def paged(caches, padding):  # the page layout, its padding lanes set to `padding`
        out = []
        for c in caches:
            p = as_page_layout(c)
            lanes = np.arange(p.scales.shape[-1]) >= BLOCK_SIZE * num_kv_heads
            out.append(ScaledCache(p.values, jnp.where(lanes, jnp.uint32(padding), p.scales), kind, "page"))
        return out

    layer = jnp.int32(NUM_LAYERS - 1)  # traced (a static layer is the same kernel: test_kv_write.py)
    got = tpu(*paged((k_cache, v_cache), 0), k, v, slots, layer)
    check(got, write_kv(k_cache, v_cache, k, v, slots, layer=layer))
    marked = tpu(*paged((k_cache, v_cache), 7), k, v, slots, layer)  # the padding lanes are never written
    assert all(int(np.asarray(c.scales)[..., BLOCK_SIZE * num_kv_heads:].min()) == 7 for c in marked)
    one = [ScaledCache(c.values[1], c.scales[1], kind) for c in (k_cache, v_cache)]
    check(write_kv(*paged(one, 0), k, v, slots, backend="pallas_tpu", interpret=True), write_kv(*one, k, v, slots))


def test_the_cache_dtypes_the_pool_sizes_are_the_formats_the_kernels_implement():
    from models import kv_bytes
    from pallas_kernels import kv_quant

    assert kv_bytes.KV_CACHE_DTYPES == ("auto", *kv_quant.EIGHT_BIT_FORMATS)
    for bad in ("fp8_e5m2", "int4"):
        for check in (kv_bytes.check_kv_cache_dtype, kv_quant.check_kv_cache_dtype):
            with pytest.raises(ValueError, match=bad):
                check(bad)


def test_the_page_layout_holds_the_token_layouts_scales_and_each_backend_refuses_the_other_layout():
    """as_page_layout / page_scales_as_tokens round trip (one and two shards: each shard's piece
    holds its own heads, head-major, padded to 128 lanes); the lane a kernel reads for (head h,
    token t) holds that scale; models/kv_bytes.py's width and bytes are the kernels' rule; the xla
    path refuses a page-layout cache and the TPU kernel a token-layout one, naming the layouts."""
    from models import kv_bytes
    from pallas_kernels import kv_quant
    from pallas_kernels.tpu import ragged_paged_attention_tpu
    from pallas_kernels.xla_forms import ragged_paged_attention_xla
    from tests.pallas_kernels.cases import prepare

    rng = np.random.default_rng(3)
    shape = (2, 5, 16, 4, 8)  # L, blocks, block_size, Hkv, D
    values, scales = quantize_kv(jnp.asarray(rng.normal(size=shape), jnp.float32), "int8")
    token = ScaledCache(values, scales, "int8")
    for shards in (1, 2):
        page = as_page_layout(token, shards)
        width = kv_quant.page_scale_width(16, 4, shards)
        assert page.scales.shape == (2, 5, width) and page.scales.dtype == jnp.uint32 and width == shards * 128
        back = kv_quant.page_scales_as_tokens(page.scales, 16, 4, shards)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(scales))
        rows = np.asarray(scales_to_float32(page.scales)).reshape(2, 5, shards, width // shards)
        want = np.asarray(scales_to_float32(scales))
        for h in range(4):  # kv head h of shard h // (4 // shards), token t at lane (h % local) * 16 + t
            local = 4 // shards
            np.testing.assert_array_equal(rows[:, :, h // local, (h % local) * 16:(h % local + 1) * 16],
                                          want[:, :, :, h])
        assert not rows[:, :, :, local * 16:].any()  # padding lanes
        kv_quant.check_scaled_pair(page, page, "page")
    for block_size, heads, shards in ((16, 8, 1), (16, 3, 1), (32, 8, 2), (8, 2, 2), (64, 1, 1)):
        assert kv_bytes.page_scale_width(block_size, heads, shards) == kv_quant.page_scale_width(
            block_size, heads, shards)
    assert kv_bytes.scale_bytes_per_token(8, "page", 16) == 4 * 8  # Llama-3-8B: 128 lanes, no padding
    assert kv_bytes.scale_bytes_per_token(3, "page", 16) == 4 * 128 // 16  # the default model: 48 -> 128
    assert kv_bytes.scale_layout_for("tpu") == kv_quant.scale_layout("pallas_tpu") == "page"
    assert kv_bytes.scale_layout_for("gpu") == kv_quant.scale_layout("pallas_gpu") == kv_quant.scale_layout("xla")
    with pytest.raises(ValueError, match="shards"):
        kv_quant.page_scale_width(16, 3, 2)

    case, kind = CASES[0]
    batch, _ = _scaled_batch(case, kind)
    options = case_options(case)
    arrays = {k: (v if isinstance(v, ScaledCache) else jnp.asarray(v)) for k, v in batch.items()}
    paged = {k: as_page_layout(v) if isinstance(v, ScaledCache) else v for k, v in arrays.items()}
    md_xla = prepare(arrays, backend="xla", sliding_window=options["sliding_window"])
    with pytest.raises(ValueError, match="reads the 'token' scale layout.*'page'"):
        ragged_paged_attention_xla(paged["q"], paged["k_pages"], paged["v_pages"], md_xla, **options)
    with pytest.raises(ValueError, match="reads the 'token' scale layout.*'page'"):
        write_kv(paged["k_pages"], paged["v_pages"], paged["q"][:, :2], paged["q"][:, :2], jnp.zeros(len(paged["q"]),
                 jnp.int32))
    md_tpu = prepare(arrays, backend="pallas_tpu", sliding_window=options["sliding_window"])
    with pytest.raises(ValueError, match="reads the 'page' scale layout.*'token'"):
        ragged_paged_attention_tpu(arrays["q"], arrays["k_pages"], arrays["v_pages"], md_tpu, **options,
                                   interpret=True)
