"""The real server on the default model, one per test session, shared by the modules that need
real numerics behind HTTP (test_server_real.py, test_server_structured.py)."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from server_launcher import ROOT, ServerProcess  # noqa: E402

REAL_MODEL = "SmolLM2-135M-Instruct"
REAL_MAX_MODEL_LEN = 256
REAL_FLAGS = (
    # The shapes of the engine tests' shared engine (tests/engine/conftest.py ENGINE_KNOBS): the
    # server then finds its executables in the persistent compilation cache that engine wrote.
    "--model=default", "--max_num_seqs=32", "--max_num_batched_tokens=128", f"--max_model_len={REAL_MAX_MODEL_LEN}",
    "--block_size=16", "--num_kv_blocks=257", "--token_buckets=1,8,32,128", "--seq_buckets=8,32",
    "--compilation_cache_dir=" + os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax")),
)


@pytest.fixture(scope="session")
def real_server():
    proc = ServerProcess(*REAL_FLAGS, fake=False, startup_timeout=600).start()
    yield proc
    assert proc.terminate(timeout=60) == 0, proc.output()[-3000:]
