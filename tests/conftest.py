"""Shared pytest setup: CPU, float32, persistent compilation cache, a few virtual devices.

Environment variables must be set before jax is imported anywhere, so this runs first.
"""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Multi-device code (sharding) is tested on virtual CPU devices. Compilation dominates the suite:
# LLVM at -O1 and XLA:CPU's older loop emitters (no fusion emitters) compile a step about 45 %
# faster (2.5 s -> 1.4 s a bucket); steps measured the same (their dots are library calls), and
# the tests compare numerics between executables compiled alike. TEST_XLA_FLAGS is what
# tests/engine/multihost_worker.py uses too.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
# Tests that assert on compiled HLO (in-place cache writes) compile with the production compiler
# (`lowered.compile(compiler_options=PRODUCTION_COMPILER)`): without fusion emitters XLA:CPU
# expands a scatter into a loop of dynamic-update-slices, another program than users get.
PRODUCTION_COMPILER = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True}
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}")
os.environ.setdefault("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAXSERVE_COMPILATION_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


# Kernel and layer tests run arrays of a few kilobytes: compile time is all they spend, and XLA at
# -O0 compiles their programs in half the time (tests/pallas_kernels, test_paged_equals_dense:
# 99 -> 84 s cold on this CPU). They get it through `fast_compile`, which makes jax.jit pass these
# options while a test runs; tests that assert on compiled HLO compile with PRODUCTION_COMPILER
# explicitly, and the default-model tests keep -O1 (their steps run 3-5x slower at -O0).
FAST_COMPILER = {"xla_backend_optimization_level": 0}


@pytest.fixture
def fast_compile(monkeypatch):
    if jax.default_backend() != "cpu":
        yield
        return
    jit = jax.jit

    def fast_jit(fun=None, **kwargs):
        kwargs.setdefault("compiler_options", FAST_COMPILER)
        return jit(fun, **kwargs) if fun is not None else (lambda f: jit(f, **kwargs))

    monkeypatch.setattr(jax, "jit", fast_jit)
    yield


@pytest.fixture
def no_persistent_cache():
    """Executables for compile-only devices (the TPU and GPU targets) cannot be loaded back from
    the persistent cache this file turns on: neither write them there nor try to read them."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)


# Modules that share the session-scoped compiled engines of tests/engine/conftest.py (the default
# model, random:tiny, random:tiny with speculation): one pytest-xdist work unit, so one worker
# compiles each engine once instead of every worker compiling it again.
SHARED_ENGINE_MODULES = frozenset(f"tests/engine/{name}.py" for name in (
    "test_engine_behaviour", "test_greedy_equivalence", "test_prompt_logprobs", "test_runner_shapes",
    "test_structured_output", "test_spec_decode_tiny", "test_spec_decode_draft", "test_request_table",
    "test_pallas_engine"))
# Modules that share the session-scoped real server on the default model
# (tests/entrypoints/conftest.py): one work unit, so it starts once.
REAL_SERVER_MODULES = frozenset(f"tests/entrypoints/{name}.py" for name in ("test_server_real", "test_server_structured"))
# Modules that share the session-scoped disaggregated engine `pd` (tests/engine/conftest.py): one
# work unit, so it is built once.
DISAGGREGATION_MODULES = frozenset(f"tests/engine/{name}.py" for name in ("test_disaggregation",
                                                                          "test_disaggregation_process"))


# Worker-seconds of the longest work units in a fresh-clone run (BUILD_NOTES.md, "Test suite"):
# units start longest first, so no long unit starts last while the other worker idles
# (xdist's own reorder sorts units by their number of tests, which put the 4-test TP module and
# its 100 s near the end). Units not listed follow, in collection order.
UNIT_SECONDS = {
    "shared-engines": 229, "real-server": 55, "tests/pallas_kernels/test_pallas_interpret.py": 53,
    "disaggregation": 47, "tests/engine/test_tp_greedy.py": 65,
    "tests/experiments/test_experiments_entry_points.py": 41, "tests/entrypoints/test_server_hostile.py": 37,
    "tests/pallas_kernels/test_xla.py": 30, "tests/models/test_reference_logits.py": 24,
    "tests/pallas_kernels/test_layers.py": 24, "tests/entrypoints/test_server_load.py": 23,
    "tests/models/test_paged_equals_dense.py": 16, "tests/engine/test_tensor_parallel.py": 15,
    "tests/entrypoints/test_server_tiny.py": 12, "tests/engine/test_spec_decode_head.py": 45,
    "tests/experiments/test_speculative_report.py": 15,
    "tests/engine/test_lora.py": 22, "tests/engine/test_lora_tp.py": 12,
    "tests/pallas_kernels/test_kv_quant_kernels.py": 18,  # measured in one process, the machine loaded
}


def work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module (or class), or one of the shared groups."""
    module = nodeid.split("::", 1)[0]
    if module in SHARED_ENGINE_MODULES:
        return "shared-engines"
    if module in REAL_SERVER_MODULES:
        return "real-server"
    if module in DISAGGREGATION_MODULES:
        return "disaggregation"
    return nodeid.rsplit("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    """Longest work units first (UNIT_SECONDS), the same order on every worker."""
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-UNIT_SECONDS.get(work_unit(item.nodeid), 0), order[id(item)]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadscope (a module per work unit), with SHARED_ENGINE_MODULES as one unit,
    REAL_SERVER_MODULES as another and DISAGGREGATION_MODULES as a third, handed out in collection
    order (longest first)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class SharedEngineScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return SharedEngineScheduling(config, log)
