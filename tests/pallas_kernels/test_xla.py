"""The pure-jnp path against the float64 oracle, plus shape validation and recompilation.

Stacked multi-layer caches (static and scanned layers) are in test_layers.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import AttentionMetadata, prepare_attention_metadata, ragged_paged_attention
from tests.pallas_kernels.cases import (
    BATCH_KEYS,
    Case,
    attend,
    case_options,
    make_batch,
    oracle,
    prepare,
    random_cases,
    tolerance,
)

CASES = random_cases(24)
EDGE_CASES = [
    # Partial last pages, a sequence whose single page is exactly full, long prefill chunk.
    Case(
        "edges-partial",
        q_lens=(1, 16, 5),
        kv_lens=(17, 16, 40),
        pad_tokens=3,
        pad_seqs=2,
        num_kv_heads=2,
        group=2,
        block_size=16,
    ),
    # Window smaller than a page, window spanning pages, prefill and decode together.
    Case(
        "edges-window",
        q_lens=(9, 1, 1),
        kv_lens=(9, 70, 33),
        num_kv_heads=1,
        group=4,
        block_size=16,
        sliding_window=5,
    ),
    Case(
        "edges-softcap-bf16",
        q_lens=(3, 1),
        kv_lens=(50, 1),
        group=8,
        head_dim=128,
        block_size=32,
        dtype="bfloat16",
        soft_cap=5.0,
        pad_tokens=5,
    ),
]


def _run(case: Case, backend="xla", **tuning):
    batch = make_batch(case)
    options = case_options(case)
    fn = jax.jit(lambda b: attend(b, backend=backend, options=options, **tuning))
    out = fn({k: jnp.asarray(v) for k, v in batch.items()})
    want = oracle(batch, **options)
    return np.asarray(out.astype(jnp.float32)), want, out.dtype, batch


@pytest.mark.parametrize("case", CASES + EDGE_CASES, ids=lambda c: c.name)
def test_xla_matches_oracle(case):
    got, want, dtype, batch = _run(case)
    assert dtype == batch["q"].dtype
    np.testing.assert_allclose(got, want, **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("tuning", [dict(block_q=1, pages_per_step=1), dict(block_q=16)])
def test_xla_tuning_overrides(tuning):
    case = EDGE_CASES[0]
    got, want, _, _ = _run(case, **tuning)
    np.testing.assert_allclose(got, want, **tolerance(case))


def test_metadata_is_a_pytree_with_static_choices():
    batch = {k: jnp.asarray(v) for k, v in make_batch(EDGE_CASES[0]).items()}
    md = prepare(batch, backend="xla")
    assert isinstance(md, AttentionMetadata)
    leaves, treedef = jax.tree_util.tree_flatten(md)
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert md.backend == "xla" and md.block_q >= 1 and md.pages_per_step >= 1
    assert md.tables.shape == (md.num_query_blocks, md.tables.shape[1])
    assert md.tables.shape[1] % md.pages_per_step == 0
    # Passed across a jit boundary, then used by the per-layer call.
    options = case_options(EDGE_CASES[0])
    fn = jax.jit(
        lambda m, b: ragged_paged_attention(b["q"], b["k_pages"], b["v_pages"], m, **options)
    )
    np.testing.assert_allclose(
        fn(md, batch), oracle(make_batch(EDGE_CASES[0]), **options), atol=2e-5, rtol=2e-5
    )
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert rebuilt.block_q == md.block_q and rebuilt.tables is md.tables


def test_no_recompile_when_counts_change():
    """Same padded shapes, different real counts and lengths: one compilation."""
    a = make_batch(Case("a", q_lens=(1, 7), kv_lens=(20, 7), pad_tokens=8, pad_seqs=2))
    b = make_batch(
        Case("b", q_lens=(3, 1, 1, 11), kv_lens=(30, 2, 9, 11), pad_tokens=0, pad_seqs=0, seed=5)
    )
    b["k_pages"], b["v_pages"] = (
        b["k_pages"][: a["k_pages"].shape[0]],
        b["v_pages"][: a["v_pages"].shape[0]],
    )
    b["block_tables"] = np.minimum(
        b["block_tables"][:, : a["block_tables"].shape[1]], a["k_pages"].shape[0] - 1
    )
    assert {k: np.shape(v) for k, v in a.items()} == {k: np.shape(v) for k, v in b.items()}
    fn = jax.jit(lambda x: attend(x, backend="xla", options=dict(sm_scale=0.125)))
    for batch in (a, b, a):
        out = fn({k: jnp.asarray(v) for k, v in batch.items()})
        np.testing.assert_allclose(out, oracle(batch, sm_scale=0.125), atol=2e-5, rtol=2e-5)
    assert fn._cache_size() == 1


def test_num_seqs_as_shape_one():
    case = Case("n1", q_lens=(2, 1), kv_lens=(2, 18), pad_seqs=1)
    batch = make_batch(case)
    want = oracle(batch, sm_scale=0.125)
    batch["num_seqs"] = np.array([batch["num_seqs"]], np.int32)
    out = jax.jit(lambda b: attend(b, backend="xla", options=dict(sm_scale=0.125)))(
        {k: jnp.asarray(v) for k, v in batch.items()}
    )
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


GOOD_BATCH = dict(
    seq_lens=np.zeros((2,), np.int32),
    block_tables=np.zeros((2, 3), np.int32),
    query_start_loc=np.zeros((3,), np.int32),
    num_seqs=np.int32(0),
)
GOOD_SIZES = dict(num_tokens=4, num_q_heads=4, num_kv_heads=2, block_size=16, backend="xla")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("seq_lens", np.zeros((3,), np.int32), "block_tables must be"),
        ("seq_lens", np.zeros((2, 1), np.int32), "seq_lens must be"),
        ("query_start_loc", np.zeros((2,), np.int32), "query_start_loc must be"),
        ("num_seqs", np.zeros((2,), np.int32), "num_seqs must be"),
        ("block_tables", np.zeros((2, 3), np.float32), "block_tables must be an integer"),
        ("block_tables", np.zeros((2, 0), np.int32), "max_blocks_per_seq"),
        ("num_q_heads", 3, "multiple of"),
        ("num_tokens", 0, "num_tokens"),
        ("block_size", 16.0, "block_size"),
        ("head_dim", -1, "head_dim"),
        ("backend", "pallas", "backend"),
        ("sliding_window", 0, "sliding_window"),
        ("num_kv_splits", 2, "num_kv_splits"),
        ("block_q", 0, "block_q"),
    ],
)
def test_prepare_validation_names_the_argument(field, value, match):
    args, sizes = dict(GOOD_BATCH), dict(GOOD_SIZES)
    (args if field in args else sizes)[field] = value
    with pytest.raises(ValueError, match=match) as info:
        prepare_attention_metadata(*(args[k] for k in BATCH_KEYS), **sizes)
    assert "got" in str(info.value)  # shows what it saw


def _good_layer_call():
    md = prepare_attention_metadata(*(GOOD_BATCH[k] for k in BATCH_KEYS), **GOOD_SIZES)
    return dict(
        q=np.zeros((4, 4, 64), np.float32),
        k_cache=np.zeros((3, 5, 16, 2, 64), np.float32),
        v_cache=np.zeros((3, 5, 16, 2, 64), np.float32),
        md=md,
        layer=1,
        sm_scale=0.125,
    )


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("q", np.zeros((4, 4, 64), np.float32)[None], "q must be"),
        ("q", np.zeros((4, 4, 32), np.float32), "head_dim"),
        ("q", np.zeros((5, 4, 64), np.float32), "num_tokens"),
        ("q", np.zeros((4, 4, 64), np.int32), "floating"),
        ("v_cache", np.zeros((3, 5, 16, 2, 32), np.float32), "v_cache must match"),
        ("k_cache", np.zeros((5, 16, 2, 64), np.float32), "layer=None"),
        ("k_cache", np.zeros((16, 2, 64), np.float32), "k_cache must be"),
        ("layer", None, "needs layer"),
        ("layer", 3, "layer must be in"),
        ("layer", -1, "layer must be in"),
        ("layer", np.zeros((2,), np.int32), "layer must be"),
        ("layer", np.float32(1), "layer must be"),
        ("backend", "pallas_tpu", "md was prepared for backend"),
        ("sliding_window", 0, "sliding_window"),
    ],
)
def test_layer_call_validation_names_the_argument(field, value, match):
    call = _good_layer_call()
    if field == "k_cache":
        call["v_cache"] = value
    call[field] = value
    q, k_cache, v_cache, md = (call.pop(k) for k in ("q", "k_cache", "v_cache", "md"))
    with pytest.raises(ValueError, match=match) as info:
        ragged_paged_attention(q, k_cache, v_cache, md, **call)
    assert "got" in str(info.value)


def test_layer_call_checks_cache_against_metadata():
    call = _good_layer_call()
    for k_cache in (
        np.zeros((3, 5, 8, 2, 64), np.float32),
        np.zeros((3, 5, 16, 1, 64), np.float32),
    ):
        with pytest.raises(ValueError, match="block_size and num_kv_heads"):
            ragged_paged_attention(call["q"], k_cache, k_cache, call["md"], layer=0, sm_scale=0.1)


def test_window_must_fit_the_metadata():
    """Metadata cut for window W serves windows <= W; a wider (or no) window is an error."""
    case = EDGE_CASES[1]  # sliding_window=5
    batch = {k: jnp.asarray(v) for k, v in make_batch(case).items()}
    md = prepare(batch, backend="xla", sliding_window=8)
    args = (batch["q"], batch["k_pages"], batch["v_pages"], md)
    out = ragged_paged_attention(*args, sm_scale=0.125, sliding_window=5)
    np.testing.assert_allclose(
        out, oracle(make_batch(case), sm_scale=0.125, sliding_window=5), atol=2e-5, rtol=2e-5
    )
    for window in (None, 9):
        with pytest.raises(ValueError, match="sliding_window"):
            ragged_paged_attention(*args, sm_scale=0.125, sliding_window=window)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sm_scale=0.0), "sm_scale"),
        (dict(sm_scale=0.1, sliding_window=0), "sliding_window"),
        (dict(sm_scale=0.1, soft_cap=-1.0), "soft_cap"),
        (dict(sm_scale=0.1, backend="pallas"), "backend"),
    ],
)
def test_option_validation(kwargs, match):
    batch = make_batch(Case("v", q_lens=(1,), kv_lens=(3,)))
    md = prepare(batch, backend="xla")
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(batch["q"], batch["k_pages"], batch["v_pages"], md, **kwargs)
