"""bfloat16 pages on the xla path: a bfloat16 model's gathered pages stay bfloat16 and both products
take bfloat16 operands with float32 sums (pallas_kernels/xla.py PagedKV.compute_dtype), as the
Pallas kernels compute; every other cache and query is read in float32.

Here: which dtype each cache and query pair computes in; that the compiled bfloat16 program's
products read bfloat16 operands (no float32 copy of the pages between the gather and the product);
and that bfloat16 attention stays within the bfloat16 tolerance of the float64 oracle over a long
context in both forms, with a soft cap and a head_dim whose sm_scale is not a power of two.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, validation
from pallas_kernels.kv_quant import ScaledCache, quantize_kv
from pallas_kernels.xla import PagedKV
from tests.pallas_kernels.cases import Case, case_options, make_batch, oracle, prepare, tolerance


def _compute_dtype(cache_dtype, q_dtype, kv_cache_dtype=None):
    shape = (2, 4, 3, 16, 8)  # [L, blocks, Hkv, block_size, D], head-major
    if kv_cache_dtype is not None:
        values, scales = quantize_kv(jnp.ones(shape, jnp.float32), kv_cache_dtype)
        k = ScaledCache(values, scales, kv_cache_dtype)
        cache = validation.check_cache(values, values, 0, eight_bit=True, kv_layout="head_major")
    else:
        k = jnp.zeros(shape, cache_dtype)
        cache = validation.check_cache(k, k, 0, kv_layout="head_major")
    return PagedKV.of(k, k, cache, 0, jnp.dtype(q_dtype), 16).compute_dtype


@pytest.mark.parametrize("cache_dtype, q_dtype, kv_cache_dtype, expected", [
    (jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16),
    (jnp.uint16, jnp.bfloat16, None, jnp.bfloat16),  # a cache held as the bits of q's dtype
    (jnp.float32, jnp.float32, None, jnp.float32),
    (jnp.bfloat16, jnp.float32, None, jnp.float32),  # a float32 query is never rounded
    (jnp.float16, jnp.float16, None, jnp.float32),
    (jnp.uint16, jnp.float16, None, jnp.float32),
    (None, jnp.bfloat16, "int8", jnp.float32),  # 8-bit caches are dequantized to float32
    (None, jnp.bfloat16, "fp8_e4m3", jnp.float32),
])
def test_only_bfloat16_pages_read_by_a_bfloat16_query_compute_in_bfloat16(cache_dtype, q_dtype, kv_cache_dtype,
                                                                          expected):
    assert _compute_dtype(cache_dtype, q_dtype, kv_cache_dtype) == expected


LONG = Case("bf16-long", q_lens=(1, 1, 24, 1), kv_lens=(300, 41, 90, 170), pad_tokens=3, pad_seqs=1, num_kv_heads=2,
            group=3, dtype="bfloat16")
CAPPED = Case("bf16-cap-d128", q_lens=(5, 1, 1), kv_lens=(70, 130, 18), num_kv_heads=1, group=4, head_dim=128,
              dtype="bfloat16", soft_cap=30.0, sliding_window=64)


def _arrays(batch):
    return {k: (jnp.asarray(v) if k != "num_seqs" else v) for k, v in batch.items()}


def _attention(case, form):
    options = case_options(case)
    tuning = dict(form=form) if form == "loop" else dict(form=form, chunk_block_q=8, chunk_tail_block_q=4)

    def run(b):  # b's pages token-major, as prepare reads them; attended head-major
        md = prepare(b, backend="xla", sliding_window=options["sliding_window"], **tuning)
        k, v = (jnp.swapaxes(b[name], -3, -2) for name in ("k_pages", "v_pages"))
        return ragged_paged_attention(b["q"], k, v, md, backend="xla", kv_layout="head_major", **options)

    return jax.jit(run), options


@pytest.mark.parametrize("form", ["loop", "split"])
@pytest.mark.parametrize("case", [LONG, CAPPED], ids=lambda c: c.name)
def test_bfloat16_pages_attend_within_the_bfloat16_tolerance_of_the_oracle(case, form):
    batch = make_batch(case)
    run, options = _attention(case, form)
    got = run(_arrays(batch))
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(got, oracle(batch, **options), **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")  # name = type[


def _dot_operand_types(text: str) -> list[set[str]]:
    """The element types of each dot's operands in compiled HLO text (which names the operands
    without their types: each is looked up among its computation's definitions above it)."""
    types, dots = {}, []
    for line in text.splitlines():
        if line.rstrip().endswith("{"):  # a computation starts: its own names
            types = {}
        found = _DEF.match(line)
        if not found:
            continue
        types[found.group(1)] = found.group(2)
        dot = re.search(r"\sdot\(([^)]*)\)", line)
        if dot:
            names = [name.strip().lstrip("%") for name in dot.group(1).split(",")]
            dots.append({types[name] for name in names})
    return dots


@pytest.mark.parametrize("form", ["loop", "split"])
def test_the_compiled_bfloat16_products_read_bfloat16_pages(form):
    """Every dot of the compiled bfloat16 program takes bfloat16 operands: the gathered pages (and
    P) are not widened to float32 before their products. The float32 program's dots, checked the
    same way, read float32."""
    f32 = Case("f32", q_lens=LONG.q_lens, kv_lens=LONG.kv_lens, num_kv_heads=2, group=3)
    for case, operand in ((LONG, "bf16"), (f32, "f32")):
        run, _ = _attention(case, form)
        dots = _dot_operand_types(run.lower(_arrays(make_batch(case))).compile().as_text())
        assert len(dots) >= 2, f"{case.name}: the compiled attention has {len(dots)} dots"
        assert all(types == {operand} for types in dots), f"{case.name}: dot operand types {dots}"
