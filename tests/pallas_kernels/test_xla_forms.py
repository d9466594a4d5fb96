"""The xla path's forms (pallas_kernels/xla_forms.py) against the float64 oracle.

test_xla.py runs the bucket's rule (the split form for every T > 1) over the random and edge
grids; here the loop form over the same grids, the split form with chunks small enough to cut
the grid's prefill chunks into several partial ones, batches with no sequences or only chunks,
the static rule, and the option errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    prepare_attention_metadata,
    ragged_paged_attention,
    validation,
    xla,
    xla_forms,
)
from tests.pallas_kernels.cases import BATCH_KEYS, Case, case_options, make_batch, oracle, tolerance
from tests.pallas_kernels.test_xla import CASES, EDGE_CASES

# Cheap subsets of test_xla.py's grids: each kind, GQA 1-8, both dtypes, window, soft cap, padding.
LOOP_GRID = CASES[::5] + EDGE_CASES
SPLIT_GRID = [CASES[i] for i in (1, 2, 5, 8, 10, 11)] + EDGE_CASES


def _attend(case_or_batch, options, **prepare_options):
    """jit(prepare through xla_forms.prepare_xla with its options, then the layer call)."""
    batch = make_batch(case_or_batch) if isinstance(case_or_batch, Case) else case_or_batch

    def fn(b):
        T, hq, d = b["q"].shape
        shapes = validation.check_batch_inputs(
            *(b[k] for k in BATCH_KEYS), num_tokens=T, num_q_heads=hq,
            num_kv_heads=b["k_pages"].shape[-2], block_size=b["k_pages"].shape[-3], head_dim=d)
        md = xla_forms.prepare_xla(*(b[k] for k in BATCH_KEYS), shapes,
                                   sliding_window=options["sliding_window"], **prepare_options)
        return ragged_paged_attention(b["q"], b["k_pages"], b["v_pages"], md, **options), md

    out, md = jax.jit(fn)({k: jnp.asarray(v) for k, v in batch.items()})
    return np.asarray(out.astype(jnp.float32)), oracle(batch, **options), md.form, batch


@pytest.mark.parametrize(
    "case, form_options",
    [(c, dict(form="loop")) for c in LOOP_GRID]
    + [(c, dict(form="split", chunk_block_q=4, chunk_pages_per_step=1)) for c in SPLIT_GRID]
    # Both chunk tiers: whole 8-token chunks, then each sequence's rest in chunks of 3.
    + [(c, dict(form="split", chunk_block_q=8, chunk_tail_block_q=3)) for c in SPLIT_GRID],
    ids=lambda x: x.name if isinstance(x, Case) else f"{x['form']}{len(x)}",
)
def test_form_matches_oracle(case, form_options):
    got, want, form, batch = _attend(case, case_options(case), **form_options)
    assert form == form_options["form"]
    np.testing.assert_allclose(got, want, **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("form", xla_forms.FORMS)
def test_no_sequences_gives_zeros(form):
    case = Case("empty", q_lens=(3, 1), kv_lens=(9, 20), pad_tokens=2, pad_seqs=1)
    batch = make_batch(case)
    batch["num_seqs"] = np.int32(0)
    got, want, _, _ = _attend(batch, case_options(case), form=form)
    assert not np.any(want) and not np.any(got)


def test_split_only_chunks_and_a_chunk_ending_the_token_axis():
    """No one-token rows; the last chunk's rows run to T (the padded q tail is never read)."""
    case = Case("chunks", q_lens=(7, 13), kv_lens=(7, 40), num_kv_heads=2, group=2, block_size=16)
    got, want, form, _ = _attend(case, case_options(case), form="split", chunk_block_q=8)
    assert form == "split"
    np.testing.assert_allclose(got, want, **tolerance(case))


# More sequence slots than xla.ROW_LOOP_MAX: the one-token rows run in groups of xla.ROW_GROUP,
# each up to its own longest context, and the groups past the last real row not at all. Decodes
# beside prefill chunks (rows that are not rows sit inside the groups), a bucket's padded
# sequences (S = 48 for 21 sequences), a group with nothing real after a real one, a sliding window.
ROW_GROUP_CASES = [
    Case("rows_and_chunks_padded", q_lens=(1,) * 9 + (5,) + (1,) * 9 + (12, 1), kv_lens=tuple(
        range(3, 30, 3)) + (40,) + tuple(range(70, 2, -8)) + (12, 90), pad_seqs=27, pad_tokens=7,
        num_kv_heads=2, group=2),
    Case("rows_far_apart", q_lens=(1,) + (6,) * 17 + (1,), kv_lens=(33,) + (6,) * 17 + (120,),
         pad_seqs=14, num_kv_heads=1, group=3, seed=2),
    Case("rows_window", q_lens=(1,) * 20, kv_lens=tuple(5 + 7 * i for i in range(20)), pad_seqs=13,
         num_kv_heads=2, group=1, sliding_window=24, seed=4),
    Case("rows_bf16", q_lens=(1,) * 17, kv_lens=tuple(range(40, 57)), pad_seqs=16, num_kv_heads=2,
         group=2, dtype="bfloat16", seed=5),
]


@pytest.mark.parametrize("case", ROW_GROUP_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("form_options", [dict(form="split"), dict(form="loop", block_q=1)], ids=("split", "loop1"))
def test_row_groups_match_oracle(case, form_options):
    assert len(case.q_lens) + case.pad_seqs > xla.ROW_LOOP_MAX
    assert sum(q == 1 for q in case.q_lens) > xla.ROW_GROUP or case.name == "rows_far_apart"
    got, want, _, batch = _attend(case, case_options(case), **form_options)
    np.testing.assert_allclose(got, want, **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("slots, grouped", [(xla.ROW_LOOP_MAX, False), (xla.ROW_LOOP_MAX + 1, True)])
def test_rows_run_in_groups_only_past_row_loop_max(monkeypatch, slots, grouped):
    """Up to ROW_LOOP_MAX sequence slots of one-token rows run in one page loop; one more, in
    groups (both against the oracle)."""
    calls = []
    row_groups = xla._row_groups
    monkeypatch.setattr(xla, "_row_groups", lambda *a, **k: calls.append(1) or row_groups(*a, **k))
    case = Case("slots", q_lens=(1,) * 20, kv_lens=tuple(3 + 5 * i for i in range(20)),
                pad_seqs=slots - 20, num_kv_heads=2, group=2, seed=6)
    got, want, _, _ = _attend(case, case_options(case), form="split")
    np.testing.assert_allclose(got, want, **tolerance(case))
    assert bool(calls) == grouped


def test_rule_is_static_and_every_bucket_compiles_once():
    assert xla_forms.choose_form(1, 1) == "loop"
    assert {xla_forms.choose_form(t, s) for t, s in ((8, 8), (32, 32), (256, 32))} == {"split"}
    # The public API applies the rule; changing real counts within a bucket never recompiles.
    fn = jax.jit(lambda b: ragged_paged_attention(
        b["q"], b["k_pages"], b["v_pages"], prepare_attention_metadata(
            *(b[k] for k in BATCH_KEYS), num_tokens=b["q"].shape[0], num_q_heads=2,
            num_kv_heads=1, block_size=16, backend="xla"), sm_scale=0.125))
    a = make_batch(Case("a", q_lens=(1, 1, 9), kv_lens=(30, 5, 9), pad_tokens=5, group=2))
    b = make_batch(Case("b", q_lens=(14, 1, 1), kv_lens=(20, 40, 2), group=2, seed=3))
    b["k_pages"], b["v_pages"] = a["k_pages"], a["v_pages"]
    b["block_tables"] = np.minimum(b["block_tables"][:, : a["block_tables"].shape[1]],
                                   a["k_pages"].shape[0] - 1)
    b["seq_lens"] = np.minimum(b["seq_lens"], a["block_tables"].shape[1] * 16)
    for batch in (a, b):
        out = fn({k: jnp.asarray(v) for k, v in batch.items()})
        np.testing.assert_allclose(out, oracle(batch, sm_scale=0.125), atol=2e-5, rtol=2e-5)
    assert fn._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(form="dense", backend="xla"), "form must be one of"),
        (dict(form="split", block_q=8, backend="xla"), "block_q is the loop form's"),
        (dict(form="split", backend="pallas_gpu"), "form is an xla option"),
        (dict(chunk_block_q=16, backend="pallas_tpu"), "chunk_block_q is an xla option"),
        (dict(chunk_tail_block_q=0, backend="xla"), "chunk_tail_block_q must be None or a positive int"),
        (dict(form="loop", chunk_block_q=16, backend="xla"), "chunk_block_q is the split form's option"),
    ],
)
def test_form_option_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        prepare_attention_metadata(
            np.zeros((2,), np.int32), np.zeros((2, 3), np.int32), np.zeros((3,), np.int32),
            np.int32(0), num_tokens=4, num_q_heads=4, num_kv_heads=2, block_size=16, **kwargs)
