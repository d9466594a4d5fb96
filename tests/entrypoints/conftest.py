"""The real server on the default model, one per test session, shared by the modules that need
real numerics behind HTTP (test_server_real.py, test_server_structured.py)."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import ROOT, ServerProcess  # noqa: E402

from tests.engine.conftest import ENGINE_KNOBS  # noqa: E402

REAL_MODEL = "SmolLM2-135M-Instruct"
REAL_MAX_MODEL_LEN = ENGINE_KNOBS["max_model_len"]
# The shapes of the engine tests' shared engine (tests/engine/conftest.py ENGINE_KNOBS): the
# server then finds its executables in the persistent compilation cache that engine wrote.
_SHARED = {name: ENGINE_KNOBS[name] for name in (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks")}
REAL_FLAGS = (
    "--model=default", *(f"--{name}={value}" for name, value in _SHARED.items()),
    "--token_buckets=" + ",".join(map(str, ENGINE_KNOBS["token_buckets"])),
    "--seq_buckets=" + ",".join(map(str, ENGINE_KNOBS["seq_buckets"])),
    "--compilation_cache_dir=" + os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax")),
)


@pytest.fixture(scope="session")
def real_server():
    proc = ServerProcess(*REAL_FLAGS, fake=False, startup_timeout=600).start()
    yield proc
    assert proc.terminate(timeout=60) == 0, proc.output()[-3000:]
