"""Shared pytest setup: CPU, float32, persistent compilation cache, a few virtual devices.

Environment variables must be set before jax is imported anywhere, so this runs first.
"""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Multi-device code (sharding) is tested on virtual CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax"))

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAXSERVE_COMPILATION_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
