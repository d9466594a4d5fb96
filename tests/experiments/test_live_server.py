"""Acceptance: `python -m experiments.bench.serving` against a live
`python -m entrypoints.openai.serve`.

The server is the real entry point in its own process (random tiny weights, small buckets, so it
starts in seconds); the benchmark is the real entry point too, streaming over HTTP.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "entrypoints"))
from server_launcher import ServerProcess  # noqa: E402

# bench_serving against a real server: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

SERVER_FLAGS = (
    "--model=random:tiny", "--max_num_seqs=4", "--max_num_batched_tokens=64", "--max_model_len=512",
    "--block_size=16", "--num_kv_blocks=129", "--token_buckets=16,64", "--seq_buckets=4",
    "--compilation_cache_dir=" + os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax")),
)


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(*SERVER_FLAGS, fake=False, startup_timeout=120).start()
    yield proc
    assert proc.terminate(timeout=60) == 0, proc.output()[-3000:]


def test_bench_serving_against_the_real_server(server, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.serving", f"--base_url={server.url}",
         "--dataset=random", "--random_input_len=16", "--random_output_len=8", "--num_prompts=8",
         "--max_concurrency=4", "--ignore_eos", "--temperature=0", "--disable_tqdm",
         "--label=live-test", f"--result_json={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Successful requests:" in proc.stdout
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["config"]["model"] == "random:tiny"  # asked the server's /v1/models
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == 8 * 8  # usage.completion_tokens, ignore_eos
    assert m["total_input_tokens"] > 8 * 16  # the server's byte tokenizer counts more tokens
    assert m["ttft_ms"]["median"] > 0 and m["e2el_ms"]["median"] >= m["ttft_ms"]["median"]
    assert m["itl_ms"]["median"] > 0 and m["tpot_ms"]["median"] > 0
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    for r in result["requests"]:
        assert r["success"] and r["output_tokens"] == 8 and r["ttft_ms"] > 0, r
        assert r["e2el_ms"] > r["ttft_ms"]
