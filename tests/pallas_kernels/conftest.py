"""Platform gate for compiled-kernel tests.

Tests marked `gpu` run the Pallas Triton kernel compiled on a CUDA device, tests marked `tpu` the
Mosaic kernel on a TPU. They are skipped here only when JAX sees no such device (tests/conftest.py
pins JAX_PLATFORMS=cpu unless the environment sets it, e.g. JAX_PLATFORMS=cuda,cpu); everything
else (interpret mode, lowering/export checks) runs on the CPU in every `make test`.
"""

import jax
import pytest


def _has_platform(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    for platform in ("gpu", "tpu"):
        if _has_platform(platform):
            continue
        gate = pytest.mark.skip(reason=f"platform gate: no {platform} device visible to JAX")
        for item in items:
            if platform in item.keywords:
                item.add_marker(gate)
