"""A stacked [L, num_blocks, block_size, Hkv, D] cache: every layer, unrolled and under lax.scan.

One step of a 2-layer "model": prepare the metadata once, then per layer write this step's K/V
into that layer's slots (write_kv) and attend over that layer's pages. The layer is a Python int
(unrolled loop) or the traced index of a lax.scan whose carry is the cache. Each layer's output
is checked against the float64 oracle on that layer's cache after the write, and the final cache
against the expected writes, for every backend (Pallas kernels in interpret mode). The last tests
read the compiled xla path under scan: no copy of the cache, in place under donation.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, write_kv
from tests.conftest import PRODUCTION_COMPILER
from tests.pallas_kernels.cases import (
    BATCH_KEYS,
    Case,
    case_options,
    make_stacked_batch,
    oracle,
    prepare,
    tolerance,
)

NUM_LAYERS = 2
LAYER_CASES = [
    Case(
        "mixed-gqa-padded",
        q_lens=(1, 6, 3),
        kv_lens=(35, 6, 20),
        pad_tokens=2,
        pad_seqs=1,
        num_kv_heads=2,
        group=2,
        block_size=16,
    ),
    Case(
        "window-softcap-bf16",
        q_lens=(3, 1),
        kv_lens=(40, 17),
        num_kv_heads=1,
        group=4,
        block_size=16,
        sliding_window=20,
        soft_cap=10.0,
        dtype="bfloat16",
    ),
]


def _step(batch, k_cache, v_cache, *, backend, options, scan, interpret):
    """Writes and attends every layer; returns (outs [L, T, Hq, D], k_cache, v_cache)."""
    md = prepare(
        {**batch, "k_cache": k_cache}, backend=backend, sliding_window=options["sliding_window"]
    )
    slots = batch["slot_mapping"]

    def layer_step(k_cache, v_cache, layer, q, k_new, v_new):
        k_cache, v_cache = write_kv(k_cache, v_cache, k_new, v_new, slots, layer=layer)
        out = ragged_paged_attention(
            q, k_cache, v_cache, md, layer=layer, backend=backend, interpret=interpret, **options
        )
        return k_cache, v_cache, out

    if scan:

        def body(carry, xs):
            k_cache, v_cache, out = layer_step(*carry, *xs)
            return (k_cache, v_cache), out

        xs = (jnp.arange(NUM_LAYERS, dtype=jnp.int32), batch["q"], batch["k_new"], batch["v_new"])
        (k_cache, v_cache), outs = jax.lax.scan(body, (k_cache, v_cache), xs)
        return outs, k_cache, v_cache
    outs = []
    for layer in range(NUM_LAYERS):
        k_cache, v_cache, out = layer_step(
            k_cache, v_cache, layer, batch["q"][layer], batch["k_new"][layer], batch["v_new"][layer]
        )
        outs.append(out)
    return jnp.stack(outs), k_cache, v_cache


BACKENDS = [("xla", False), ("pallas_gpu", True), ("pallas_tpu", True)]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("backend, interpret", BACKENDS, ids=[b for b, _ in BACKENDS])
@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: c.name)
def test_every_layer_of_a_stacked_cache(case, backend, interpret, scan):
    stacked = make_stacked_batch(case, NUM_LAYERS)
    written = stacked.pop("written")
    options = case_options(case)
    arrays = {k: jnp.asarray(v) for k, v in stacked.items() if k not in ("k_cache", "v_cache")}
    fn = jax.jit(
        lambda b, k, v: _step(
            b, k, v, backend=backend, options=options, scan=scan, interpret=interpret
        ),
        donate_argnums=(1, 2),
    )
    outs, k_cache, v_cache = fn(
        arrays, jnp.asarray(stacked["k_cache"]), jnp.asarray(stacked["v_cache"])
    )
    assert outs.shape == stacked["q"].shape and outs.dtype == stacked["q"].dtype
    np.testing.assert_array_equal(np.asarray(k_cache), np.stack([w["k_pages"] for w in written]))
    np.testing.assert_array_equal(np.asarray(v_cache), np.stack([w["v_pages"] for w in written]))
    live = int(stacked["query_start_loc"][int(stacked["num_seqs"])])
    for layer in range(NUM_LAYERS):
        got = np.asarray(outs[layer].astype(jnp.float32))
        np.testing.assert_allclose(got, oracle(written[layer], **options), **tolerance(case))
        assert not np.any(got[live:]), "padding tokens must be zeros"


# A cache far larger than anything else in the program: a copy of it (or of one layer's slice,
# 1/L of it) stands out in the compiled temp size and in the HLO.
BIG = dict(num_layers=4, num_blocks=512, block_size=16, num_kv_heads=2, head_dim=64)


def _big_step_inputs():
    case = Case("big", q_lens=(1, 5, 1), kv_lens=(300, 40, 77), num_kv_heads=2, group=2)
    stacked = make_stacked_batch(case, 1)
    L, nb = BIG["num_layers"], BIG["num_blocks"]
    shape = (L, nb, BIG["block_size"], BIG["num_kv_heads"], BIG["head_dim"])
    k_cache = jnp.zeros(shape, jnp.float32)
    k_cache = k_cache.at[:, : stacked["k_cache"].shape[1]].set(stacked["k_cache"][0])
    q = jnp.broadcast_to(stacked["q"], (L, *stacked["q"].shape[1:]))
    k_new = jnp.broadcast_to(stacked["k_new"], (L, *stacked["k_new"].shape[1:]))
    arrays = {k: jnp.asarray(stacked[k]) for k in (*BATCH_KEYS, "slot_mapping")}
    return arrays, q, k_new, k_cache


def _cache_sized_copies(hlo: str, min_bytes: int) -> list[str]:
    """HLO instructions that copy or slice out >= min_bytes of f32 (a cache or one layer)."""
    found = []
    for line in hlo.splitlines():
        match = re.search(
            r"=\s*f32\[([\d,]*)\]\{[^}]*\}\s+(copy|copy-start|dynamic-slice|slice)\(", line
        )
        if match:
            dims = [int(d) for d in match.group(1).split(",") if d]
            if 4 * int(np.prod(dims)) >= min_bytes:
                found.append(line.strip())
    return found


def test_xla_layer_call_under_scan_reads_the_cache_in_place():
    """Attention only, the stacked cache closed over by the scan body: no copy of any layer."""
    arrays, q, _, k_cache = _big_step_inputs()
    cache_bytes = k_cache.size * 4
    layer_bytes = cache_bytes // BIG["num_layers"]

    def step(b, q, k_cache, v_cache):
        md = prepare({**b, "q": q, "k_cache": k_cache}, backend="xla")

        def body(carry, xs):
            layer, q_layer = xs
            out = ragged_paged_attention(q_layer, k_cache, v_cache, md, layer=layer, sm_scale=0.1)
            return carry + jnp.sum(out), None

        total, _ = jax.lax.scan(body, jnp.float32(0), (jnp.arange(BIG["num_layers"]), q))
        return total

    compiled = jax.jit(step).lower(arrays, q, k_cache, k_cache + 1).compile(compiler_options=PRODUCTION_COMPILER)
    hlo = compiled.as_text()
    assert "while" in hlo, "expected the layer scan to stay a loop"
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < layer_bytes // 4, f"temp {temp} bytes vs one layer's {layer_bytes}"
    copies = _cache_sized_copies(hlo, layer_bytes // 4)
    assert not copies, "cache copied or sliced:\n" + "\n".join(copies)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_xla_write_and_attend_per_layer_is_in_place(scan):
    """A toy model step: per layer, write_kv then attention, each layer's K/V depending on the
    previous layer's output (as in a transformer); the stacked cache is donated, and under scan it
    is the carry. The outputs alias the donated buffers and no cache-sized temporary exists.

    The dependency matters for the unrolled loop: a write of layer l + 1 that does not depend on
    layer l's attention could be scheduled before that attention's reads, so XLA would copy.
    """
    arrays, q, k_new, k_cache = _big_step_inputs()
    cache_bytes = k_cache.size * 4
    layer_bytes = cache_bytes // BIG["num_layers"]
    hkv = BIG["num_kv_heads"]

    def layer_step(b, md, k_cache, v_cache, layer, x, k_layer):
        k = k_layer + x[:, :hkv]  # this layer's K/V depend on the previous layer's output
        k_cache, v_cache = write_kv(k_cache, v_cache, k, -k, b["slot_mapping"], layer=layer)
        x = ragged_paged_attention(x, k_cache, v_cache, md, layer=layer, sm_scale=0.1)
        return k_cache, v_cache, x

    def step(b, q, k_new, k_cache, v_cache):
        md = prepare({**b, "q": q, "k_cache": k_cache}, backend="xla")
        x = q[0]
        if scan:

            def body(carry, xs):
                k_cache, v_cache, x = layer_step(b, md, *carry[:2], xs[0], carry[2], xs[1])
                return (k_cache, v_cache, x), None

            xs = (jnp.arange(BIG["num_layers"], dtype=jnp.int32), k_new)
            (k_cache, v_cache, x), _ = jax.lax.scan(body, (k_cache, v_cache, x), xs)
        else:
            for layer in range(BIG["num_layers"]):
                k_cache, v_cache, x = layer_step(b, md, k_cache, v_cache, layer, x, k_new[layer])
        return k_cache, v_cache, x

    fn = jax.jit(step, donate_argnums=(3, 4))
    v_cache = k_cache + 1
    compiled = fn.lower(arrays, q, k_new, k_cache, v_cache).compile(compiler_options=PRODUCTION_COMPILER)
    hlo = compiled.as_text()
    assert "input_output_alias" in hlo
    assert ("while" in hlo) if scan else (hlo.count(" scatter(") >= 2 * BIG["num_layers"])
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < layer_bytes // 4, f"temp {temp} bytes vs one layer's {layer_bytes}"
    copies = _cache_sized_copies(hlo, layer_bytes // 4)
    assert not copies, "cache copied or sliced:\n" + "\n".join(copies)
    ptrs = (k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer())
    k_out, v_out, _ = compiled(arrays, q, k_new, k_cache, v_cache)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == ptrs
