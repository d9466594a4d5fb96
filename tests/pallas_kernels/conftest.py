"""Platform gate for compiled-kernel tests.

Tests marked `gpu` run the Pallas Triton kernel compiled on a CUDA device, tests marked `tpu` the
Mosaic kernel on a TPU. When JAX sees no such device they are deselected (not collected into the
run, so a CPU run reports only tests that ran); tests/conftest.py pins JAX_PLATFORMS=cpu unless the
environment sets it, e.g. `JAX_PLATFORMS=cuda,cpu pytest tests/pallas_kernels -m gpu` on a GPU
machine. Everything else (interpret mode, lowering/export checks) runs on the CPU in `make test`.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _kernel_tests_compile_fast(fast_compile):
    """Tiny arrays: -O0 (tests/conftest.py, fast_compile)."""

def _has_platform(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    absent = [p for p in ("gpu", "tpu") if not _has_platform(p)]
    if not absent:
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(p in item.keywords for p in absent) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
