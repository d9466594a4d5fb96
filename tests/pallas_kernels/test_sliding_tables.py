"""Every attention backend reads a sliding layers' block table (scheduler/sliding_window.py): the
entries the window has passed are the null block 0, which holds garbage. A windowed layer over
that table equals the float64 oracle over the full table: no backend reads a released entry
unmasked (the jnp path reads some and masks them; the Pallas kernels' page ranges start past them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scheduler.sliding_window import num_out_of_window
from tests.pallas_kernels.cases import (
    GARBAGE,
    Case,
    attend,
    case_options,
    make_batch,
    oracle,
    tolerance,
)

pytestmark = pytest.mark.usefixtures("fast_compile")  # tiny shapes: -O0 (tests/conftest.py)

# A decode far past its window, a prefill chunk whose first rows still read an old block, a
# prompt inside its window, and a padded row.
CASE = Case("sliding-table", q_lens=(1, 5, 17), kv_lens=(70, 41, 17), pad_tokens=3, pad_seqs=1,
            num_kv_heads=2, group=2, block_size=16, sliding_window=20)


def sliding_batch(case: Case) -> tuple[dict, dict]:
    """(the batch with its full tables, the same with released entries null and garbage in 0)."""
    full = make_batch(case)
    tables = full["block_tables"].copy()
    for s, (q_len, kv_len) in enumerate(zip(case.q_lens, case.kv_lens)):
        tables[s, : num_out_of_window(kv_len - q_len, case.sliding_window, case.block_size)] = 0
    assert (tables == 0).sum() > (full["block_tables"] == 0).sum(), "the case releases nothing"
    rng = np.random.default_rng(7)
    k_pages, v_pages = full["k_pages"].copy(), full["v_pages"].copy()
    k_pages[0] = rng.uniform(-GARBAGE, GARBAGE, k_pages[0].shape)
    v_pages[0] = rng.uniform(-GARBAGE, GARBAGE, v_pages[0].shape)
    return full, {**full, "block_tables": tables, "k_pages": k_pages, "v_pages": v_pages}


# The GPU kernel (5 s to compile interpreted) in the extended tier, which also runs both Pallas
# kernels over sliding tables inside the engine (tests/models/test_sliding_window_engine.py).
@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", pytest.param("pallas_gpu", marks=pytest.mark.extended)])
def test_windowed_layer_over_a_sliding_table_equals_the_full_table(backend):
    full, sliding = sliding_batch(CASE)
    options = case_options(CASE)
    out = jax.jit(lambda b: attend(b, backend=backend, options=options, interpret=backend != "xla"))(
        {k: jnp.asarray(v) for k, v in sliding.items()})
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, oracle(full, **options), **tolerance(CASE))
