"""The native CPU kernel of the one-token rows (pallas_kernels/cpu_native.py, native/
paged_decode.cc) against the float64 oracle and the jnp page loop it replaces.

Both xla forms over test_xla.py's grids (every kind, GQA 1-8, head dims 64 and 128 and one the
kernel is not specialized for, blocks of 16 and 32, float32 and bfloat16 pages, a window, a soft
cap, padded tokens and sequence slots, garbage in every slot no row may see), a stacked cache
read at a traced layer inside a scan, the caches it does not read (they keep the page loop), the
compiled program holding the custom call, a corrupt block table, the kernel's own refusals, and a
machine with no compiler.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_native, ragged_paged_attention, write_kv, xla_forms
from pallas_kernels.kv_quant import ScaledCache, dequantize_kv, quantize_kv
from tests.pallas_kernels.cases import (
    Case,
    case_options,
    make_batch,
    make_stacked_batch,
    oracle,
    prepare,
    tolerance,
)
from tests.pallas_kernels.test_head_major import _heads_first
from tests.pallas_kernels.test_xla import CASES, EDGE_CASES

GRID = CASES[::3] + EDGE_CASES + [
    Case("d32-window", q_lens=(1, 1, 5, 1), kv_lens=(70, 9, 30, 33), pad_seqs=2, num_kv_heads=2, group=3,
         head_dim=32, sliding_window=20),
    Case("d96-bf16-cap", q_lens=(1, 1), kv_lens=(47, 130), pad_tokens=3, num_kv_heads=1, group=5, head_dim=96,
         dtype="bfloat16", soft_cap=20.0, block_size=32),
]
SPLIT = dict(form="split", chunk_block_q=4, chunk_tail_block_q=2)


def _run(batch, options, rows_kernel, kv_layout="head_major", **tuning):
    """(output float32, the lowered program's text) of one jitted layer."""
    def layer(b):
        md = prepare(b, backend="xla", sliding_window=options["sliding_window"], rows_kernel=rows_kernel, **tuning)
        k, v = b["k_pages"], b["v_pages"]
        if kv_layout == "head_major":
            k, v = _heads_first(k), _heads_first(v)
        return ragged_paged_attention(b["q"], k, v, md, backend="xla", kv_layout=kv_layout, **options)

    lowered = jax.jit(layer).lower(batch)
    return np.asarray(lowered.compile()(batch).astype(jnp.float32)), lowered.as_text()


def _arrays(case):
    return {k: (jnp.asarray(v) if k != "num_seqs" else v) for k, v in make_batch(case).items()}


def _check(case, got, batch):
    np.testing.assert_allclose(got, oracle(make_batch(case), **case_options(case)), **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("case", GRID, ids=lambda c: c.name)
def test_native_rows_of_the_split_form_match_the_oracle(case):
    batch = _arrays(case)
    got, text = _run(batch, case_options(case), "native", **SPLIT)
    assert cpu_native.TARGET in text
    _check(case, got, batch)


@pytest.mark.parametrize("case", [CASES[0], CASES[4], GRID[-2]], ids=lambda c: c.name)
def test_native_rows_of_the_loop_form_match_the_oracle(case):
    """The loop form at block_q 1 (every token a row: a one-token bucket's form)."""
    batch = _arrays(case)
    got, text = _run(batch, case_options(case), "native", form="loop", block_q=1)
    assert cpu_native.TARGET in text
    _check(case, got, batch)


@pytest.mark.parametrize("case", [EDGE_CASES[0], GRID[-1]], ids=lambda c: c.name)
def test_native_rows_match_the_page_loop(case):
    batch, options = _arrays(case), case_options(case)
    got, _ = _run(batch, options, "native", **SPLIT)
    loop, loop_text = _run(batch, options, "jnp", **SPLIT)
    assert cpu_native.TARGET not in loop_text
    # The page loop rounds P to bfloat16 for its product over bfloat16 pages; the kernel does not.
    np.testing.assert_allclose(got, loop, rtol=1e-5, atol=1e-5 if case.dtype == "float32" else 2e-2)


def test_a_stacked_cache_read_at_a_traced_layer_inside_a_scan():
    """Every layer written, then read through the kernel at the scan's layer index (the
    engine's loop): the kernel reads that layer's pages of the whole cache, not layer 0's."""
    case = Case("stacked", q_lens=(1, 1, 6, 1), kv_lens=(23, 50, 6, 40), pad_tokens=2, num_kv_heads=2, group=3)
    stacked = make_stacked_batch(case, num_layers=3)
    written = stacked.pop("written")
    s = {k: jnp.asarray(v) for k, v in stacked.items()}
    options = case_options(case)

    def run(s):
        md = prepare({**s, "q": s["q"][0], "k_pages": s["k_cache"][0]}, backend="xla",
                     sliding_window=options["sliding_window"])

        def body(cache, xs):
            layer, q, k, v = xs
            cache = write_kv(*cache, k, v, s["slot_mapping"], layer=layer, kv_layout="head_major")
            return cache, ragged_paged_attention(q, *cache, md, layer=layer, kv_layout="head_major", **options)

        layers = jnp.arange(s["k_cache"].shape[0], dtype=jnp.int32)
        cache = (_heads_first(s["k_cache"]), _heads_first(s["v_cache"]))
        return jax.lax.scan(body, cache, (layers, s["q"], s["k_new"], s["v_new"]))[1]

    with xla_forms.rows_kernel("native"):  # the context the engine lowers its buckets in
        lowered = jax.jit(run).lower(s)
    assert cpu_native.TARGET in lowered.as_text()
    got = np.asarray(lowered.compile()(s))
    for layer, batch in enumerate(written):
        np.testing.assert_allclose(got[layer], oracle(batch, **options), **tolerance(case))


def _quantized(batch, kv_cache_dtype):
    """(the batch with an 8-bit cache, the batch with that cache dequantized for the oracle)."""
    scaled, dequantized = dict(batch), dict(batch)
    for name in ("k_pages", "v_pages"):
        values, scales = quantize_kv(jnp.asarray(batch[name]), kv_cache_dtype)
        scaled[name] = ScaledCache(values, scales, kv_cache_dtype)
        dequantized[name] = np.asarray(dequantize_kv(values, scales, kv_cache_dtype), np.float64)
    return scaled, dequantized


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("case", [CASES[3], GRID[-2]], ids=lambda c: c.name)
def test_native_rows_read_an_8bit_cache_as_the_oracle_reads_it_dequantized(case, kv_cache_dtype):
    """Values decoded exactly (int8 widened, e4m3 through its table) and each token's scale on
    its score and on its P: the oracle over the dequantized cache, and the page loop."""
    scaled, dequantized = _quantized(make_batch(case), kv_cache_dtype)
    arrays = {k: (jnp.asarray(v) if k not in ("num_seqs", "k_pages", "v_pages") else v) for k, v in scaled.items()}
    options = case_options(case)
    got, text = _run(arrays, options, "native", **SPLIT)
    assert cpu_native.TARGET in text
    tol = dict(atol=2e-2, rtol=2e-2) if case.dtype == "bfloat16" else dict(atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(got, oracle(dequantized, **options), **tol)
    loop, _ = _run(arrays, options, "jnp", **SPLIT)
    np.testing.assert_allclose(got, loop, rtol=1e-4, atol=1e-4 if case.dtype == "float32" else 2e-2)


@pytest.mark.parametrize("what", ["token-major", "float16"])
def test_caches_the_kernel_does_not_read_keep_the_page_loop(what):
    case = Case("other", q_lens=(1, 4, 1), kv_lens=(30, 9, 41), num_kv_heads=2, group=2)
    batch, options = _arrays(case), case_options(case)
    layout = "token_major" if what == "token-major" else "head_major"
    if what == "float16":
        batch = {**batch, **{k: batch[k].astype(jnp.float16) for k in ("q", "k_pages", "v_pages")}}
    got, text = _run(batch, options, "native", kv_layout=layout)
    want, _ = _run(batch, options, "jnp", kv_layout=layout)
    assert cpu_native.TARGET not in text
    np.testing.assert_array_equal(got, want)


def test_a_corrupt_block_table_reads_inside_the_layer_and_leaves_other_rows_exact():
    """Page ids past the layer's pages (or negative) are clamped into it: the row's answer is
    garbage but finite, nothing is read outside the cache, and every other row is exact."""
    case = Case("corrupt", q_lens=(1, 1, 1), kv_lens=(40, 33, 20), num_kv_heads=2, group=2)
    batch = make_batch(case)
    want = oracle(batch, **case_options(case))
    batch["block_tables"] = batch["block_tables"].copy()
    batch["block_tables"][1, :2] = (10**6, -7)
    got, _ = _run({k: (jnp.asarray(v) if k != "num_seqs" else v) for k, v in batch.items()}, case_options(case),
                  "native", form="split")
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], **tolerance(case))


def test_the_kernel_refuses_inputs_outside_its_contract_by_name():
    q = jnp.zeros((2, 2, 3, 8), jnp.float32)
    pages = jnp.zeros((10, 2, 4, 8), jnp.float32)
    tables, ends = jnp.zeros((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    call = jax.jit(lambda q, k, base, num_blocks: cpu_native.decode_rows(
        q, k, k, tables, ends * 0, ends, base, scale=1.0, soft_cap=None, num_blocks=num_blocks), static_argnums=3)
    np.testing.assert_array_equal(np.asarray(call(q, pages, 5, 5)), 0.0)  # the contract's zeros: V is 0
    with pytest.raises(Exception, match="jaxserve_paged_decode: k must be"):
        call(q, jnp.zeros((10, 3, 4, 8), jnp.float32), 0, 5).block_until_ready()
    with pytest.raises(Exception, match="jaxserve_paged_decode: layer pages"):
        call(q, pages, 6, 5).block_until_ready()
    with pytest.raises(Exception, match="jaxserve_paged_decode: k and v must be"):
        call(q, pages.astype(jnp.float16), 0, 5).block_until_ready()
    with pytest.raises(ValueError, match="decode_rows reads float pages"):
        cpu_native.decode_rows(q, pages, pages, tables, ends, ends, 0, scale=1.0, soft_cap=None, num_blocks=5,
                               kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="rows_kernel must be one of"):
        with xla_forms.rows_kernel("fast"):
            pass


def test_no_compiler_leaves_the_kernel_unavailable_with_the_reason(tmp_path):
    """A machine without a C++ compiler: available() is False, require() names why, and an
    engine asked for "native" refuses by name while "auto" serves through the page loop."""
    script = (
        "from pallas_kernels import cpu_native\n"
        "from engine import EngineConfig\n"
        "from engine.core.builder import rows_kernel\n"
        "print(cpu_native.available(), cpu_native.unavailable_reason())\n"
        "print(rows_kernel(EngineConfig(model='random:tiny'), 'cpu', 'xla'))\n"
        "try:\n"
        "    rows_kernel(EngineConfig(model='random:tiny', cpu_attention_kernel='native'), 'cpu', 'xla')\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CXX": "", "JAXSERVE_NATIVE_DIR": str(tmp_path / "native"),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    first, second, third = done.stdout.splitlines()[:3]
    assert first.startswith("False NativeUnavailable: no C++ compiler")
    assert second == "jnp"
    assert third.startswith("refused EngineConfig.cpu_attention_kernel='native': NativeUnavailable: no C++ compiler")
    assert "decode rows run the jnp page loop" in done.stderr
