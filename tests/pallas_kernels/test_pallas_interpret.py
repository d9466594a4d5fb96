"""Both Pallas kernels in interpret mode on the CPU against the float64 oracle.

The Triton kernel runs under Pallas' generic interpreter; the TPU kernel under TPU interpret mode,
which simulates HBM, VMEM, DMAs and semaphores. The three tiny TPU cases at the end also turn on
the race detector and NaN-filled uninitialized memory (the default), so reading a VMEM buffer
before its copy lands, or an unmasked read of memory no copy wrote, shows up as NaN or a race.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gpu import default_num_splits
from pallas_kernels.tpu import ragged_paged_attention_tpu
from tests.pallas_kernels.cases import (
    Case,
    attend,
    case_options,
    make_batch,
    oracle,
    prepare,
    random_cases,
    tolerance,
)

# Each half of random_cases(24) covers every kind x GQA group pair once, both head dims, block
# sizes and dtypes, a window and a soft cap (cases.random_cases): the Triton kernel takes the
# first half, the TPU kernel the second, so each kernel meets every combination the list pairs up
# while the suite compiles 24 interpreted kernels instead of 48 (2-6 s each on a 2-core CPU).
# The jnp path (test_xla.py) runs all 24.
CASES = random_cases(24)
GPU_CASES, TPU_CASES = CASES[:12], CASES[12:]


def _check(case: Case, fn):
    """fn(batch, options) -> [T, Hq, D], run under jit against the oracle."""
    batch = make_batch(case)
    options = case_options(case)
    out = jax.jit(lambda b: fn(b, options))({k: jnp.asarray(v) for k, v in batch.items()})
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, oracle(batch, **options), **tolerance(case))
    live = int(batch["query_start_loc"][int(batch["num_seqs"])])
    assert not np.any(got[live:]), "padding tokens must be zeros"


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_kernel_interpret(case):
    """Through the public entry (backend="pallas_gpu", interpret=True); the split-K heuristic
    picks 1 or 2 splits on these small batches, so both paths are also forced just below
    (through prepare_attention_metadata's num_kv_splits / pages_per_step)."""
    _check(case, lambda b, o: attend(b, backend="pallas_gpu", options=o, interpret=True))


GPU_VARIANTS = {
    "single-pass": dict(num_kv_splits=1),
    # One page per step and 4 splits: many steps per split, and empty splits on short contexts.
    "split4-page1": dict(num_kv_splits=4, pages_per_step=1),
}
# Forced variants on cases of the TPU half too (the Triton kernel meets their shapes here only):
# both variants on three cases, the split one on three more.
VARIANT_CASES = [(case, variant) for case in CASES[1::8] for variant in GPU_VARIANTS] + [
    (case, "split4-page1") for case in CASES[12::4]]


@pytest.mark.parametrize("case, variant", VARIANT_CASES, ids=[f"{c.name}-{v}" for c, v in VARIANT_CASES])
def test_gpu_kernel_interpret_variants(case, variant):
    tuning = GPU_VARIANTS[variant]
    _check(case, lambda b, o: attend(b, backend="pallas_gpu", options=o, interpret=True, **tuning))


# A block's rows split over programs (the Triton kernel's answer to tiles too large for shared
# memory, pallas_kernels/gpu_tiles.py row_chunk): forced here with a tiny limit, 4 tokens x 8 heads =
# 32 rows as two programs of 16, whose causal and window masks start at their own rows.
CHUNKED_CASE = Case("chunked-rows", q_lens=(13, 1, 6), kv_lens=(45, 30, 6), pad_tokens=2,
                    num_kv_heads=2, group=8, sliding_window=20, soft_cap=30.0)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_gpu_kernel_interpret_row_chunks(monkeypatch, num_kv_splits):
    from pallas_kernels import gpu_tiles

    limit = gpu_tiles.shared_memory_bytes("sm_80", 16, 64, 64, 4, full_precision=True)
    monkeypatch.setattr(gpu_tiles, "SHARED_MEMORY_LIMITS", {"sm_80": limit})
    assert gpu_tiles.row_chunk(32, 64, 64, 4, full_precision=True) == 16
    tuning = dict(block_q=4, num_kv_splits=num_kv_splits)
    _check(CHUNKED_CASE, lambda b, o: attend(b, backend="pallas_gpu", options=o, interpret=True,
                                             **tuning))


def test_gpu_split_heuristic_splits_small_grids_only():
    assert default_num_splits(num_query_blocks=8, num_kv_heads=2, max_steps=64) == 16
    assert default_num_splits(num_query_blocks=8, num_kv_heads=2, max_steps=3) == 2
    assert default_num_splits(num_query_blocks=512, num_kv_heads=8, max_steps=64) == 1


@pytest.mark.parametrize("case", TPU_CASES, ids=lambda c: c.name)
def test_tpu_kernel_interpret(case):
    _check(case, lambda b, o: attend(b, backend="pallas_tpu", options=o, interpret=True))


TINY_TPU_CASES = [
    Case(
        "tiny-mixed-partial",
        q_lens=(1, 6),
        kv_lens=(35, 6),
        pad_tokens=2,
        pad_seqs=1,
        num_kv_heads=2,
        group=2,
        block_size=16,
    ),
    Case(
        "tiny-window-softcap",
        q_lens=(3, 1),
        kv_lens=(40, 17),
        num_kv_heads=1,
        group=4,
        block_size=16,
        sliding_window=20,
        soft_cap=10.0,
    ),
    Case(
        "tiny-bf16-decode",
        q_lens=(1, 1, 1),
        kv_lens=(1, 32, 50),
        pad_seqs=1,
        num_kv_heads=1,
        group=8,
        head_dim=128,
        block_size=32,
        dtype="bfloat16",
    ),
]


@pytest.mark.parametrize("case", TINY_TPU_CASES, ids=lambda c: c.name)
def test_tpu_kernel_race_detection_and_nan_memory(case):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")

    def run(b, options):
        md = prepare(b, backend="pallas_tpu", sliding_window=options["sliding_window"])
        return ragged_paged_attention_tpu(
            b["q"], b["k_pages"], b["v_pages"], md, **options, interpret=params
        )

    _check(case, run)
    assert tpu_interpreter.races is not None, "race detection did not run"
    assert not tpu_interpreter.races.races_found
