"""resolve_backend: the platform table and the error for an unknown attention_backend."""

import jax
import pytest

from pallas_kernels import resolve_backend


@pytest.mark.parametrize(
    "attention_backend, platform, want",
    [
        ("auto", "cpu", "xla"),
        ("auto", "tpu", "pallas_tpu"),
        ("auto", "gpu", "pallas_gpu"),
        ("auto", "cuda", "pallas_gpu"),
        ("xla", "tpu", "xla"),
        ("xla", "gpu", "xla"),
        ("pallas", "tpu", "pallas_tpu"),
        ("pallas", "gpu", "pallas_gpu"),
        ("pallas", "cpu", "pallas_gpu"),
    ],
)
def test_resolve_backend_table(attention_backend, platform, want):
    assert resolve_backend(attention_backend, platform) == want


def test_resolve_backend_defaults_to_this_platform():
    assert jax.default_backend() == "cpu"  # tests/conftest.py pins the CPU
    assert resolve_backend("auto") == "xla"


def test_resolve_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_backend("flash")
    with pytest.raises(ValueError, match="platform"):
        resolve_backend("auto", "metal")
