"""The pure-jnp path against the float64 oracle, plus shape validation and recompilation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from tests.pallas_kernels.cases import Case, make_batch, oracle, random_cases, tolerance

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


def _run(case: Case, backend="xla", **kwargs):
    batch = make_batch(case)
    sm_scale = case.head_dim**-0.5
    fn = jax.jit(
        lambda b: ragged_paged_attention(
            **b,
            sm_scale=sm_scale,
            sliding_window=case.sliding_window,
            soft_cap=case.soft_cap,
            backend=backend,
            **kwargs,
        )
    )
    out = fn({k: jnp.asarray(v) for k, v in batch.items()})
    want = oracle(
        batch, sm_scale=sm_scale, sliding_window=case.sliding_window, soft_cap=case.soft_cap
    )
    return np.asarray(out.astype(jnp.float32)), want, out.dtype, batch


@pytest.mark.parametrize("case", CASES + EDGE_CASES, ids=lambda c: c.name)
def test_xla_matches_oracle(case):
    got, want, dtype, batch = _run(case)
    assert dtype == batch["q"].dtype
    np.testing.assert_allclose(got, want, **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


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
    fn = jax.jit(lambda x: ragged_paged_attention(**x, sm_scale=0.125))
    for batch in (a, b, a):
        out = fn({k: jnp.asarray(v) for k, v in batch.items()})
        np.testing.assert_allclose(out, oracle(batch, sm_scale=0.125), atol=2e-5, rtol=2e-5)
    assert fn._cache_size() == 1


def test_num_seqs_as_shape_one():
    case = Case("n1", q_lens=(2, 1), kv_lens=(2, 18), pad_seqs=1)
    batch = make_batch(case)
    want = oracle(batch, sm_scale=0.125)
    batch["num_seqs"] = np.array([batch["num_seqs"]], np.int32)
    out = ragged_paged_attention(**{k: jnp.asarray(v) for k, v in batch.items()}, sm_scale=0.125)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("q", np.zeros((4, 2, 64), np.float32)[None], "q must be"),
        ("q", np.zeros((4, 4, 32), np.float32), "head_dim"),
        ("v_pages", np.zeros((5, 16, 2, 32), np.float32), "v_pages must match"),
        ("seq_lens", np.zeros((3,), np.int32), "block_tables must be"),
        ("query_start_loc", np.zeros((2,), np.int32), "query_start_loc must be"),
        ("num_seqs", np.zeros((2,), np.int32), "num_seqs must be"),
        ("block_tables", np.zeros((2, 3), np.float32), "block_tables must be an integer"),
        ("q", np.zeros((4, 3, 64), np.float32), "multiple of"),
    ],
)
def test_validation_names_the_argument(field, value, match):
    good = dict(
        q=np.zeros((4, 4, 64), np.float32),
        k_pages=np.zeros((5, 16, 2, 64), np.float32),
        v_pages=np.zeros((5, 16, 2, 64), np.float32),
        seq_lens=np.zeros((2,), np.int32),
        block_tables=np.zeros((2, 3), np.int32),
        query_start_loc=np.zeros((3,), np.int32),
        num_seqs=np.int32(0),
    )
    good[field] = value
    with pytest.raises(ValueError, match=match) as info:
        ragged_paged_attention(**good, sm_scale=0.125)
    assert "(" in str(info.value)  # the message shows shapes or dtypes


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
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(**batch, **kwargs)
