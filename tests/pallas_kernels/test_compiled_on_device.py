"""The kernels compiled on a real accelerator against the float64 oracle.

Gated by tests/pallas_kernels/conftest.py: run with JAX_PLATFORMS=cuda,cpu (or tpu,cpu) on a
machine that has the device, e.g. `JAX_PLATFORMS=cuda,cpu pytest tests/pallas_kernels -m gpu`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import resolve_backend
from tests.pallas_kernels.cases import (
    attend,
    case_options,
    make_batch,
    oracle,
    random_cases,
    tolerance,
)

CASES = random_cases(24)


def _compiled_matches_oracle(case, platform, backend, **tuning):
    device = jax.devices(platform)[0]
    batch = make_batch(case)
    options = case_options(case)
    args = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, device)
    out = jax.jit(lambda b: attend(b, backend=backend, options=options, **tuning))(args)
    assert out.devices() == {device}
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, oracle(batch, **options), **tolerance(case))


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [None, 1, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_kernel_compiled(case, num_kv_splits):
    assert resolve_backend("auto", "gpu") == "pallas_gpu"
    _compiled_matches_oracle(case, "gpu", "pallas_gpu", num_kv_splits=num_kv_splits)


@pytest.mark.tpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tpu_kernel_compiled(case):
    _compiled_matches_oracle(case, "tpu", "pallas_tpu")
