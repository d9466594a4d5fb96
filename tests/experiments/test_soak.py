"""`python -m experiments.bench.soak`, short: 150 requests at concurrency 8 against a random:tiny server
with 39 usable KV blocks (preemption is forced), random disconnects, bad requests and the hostile
cases (echo + logprobs over a long prompt, n=3 with long outputs, prompts near max_model_len); the
soak's own end checks must all pass (every request kept pace with its size class, blocks free or
cached, nothing stuck, no 5xx, RSS steady after warm-up, greedy unchanged)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

# A short soak against a real server: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

ROOT = pathlib.Path(__file__).resolve().parents[2]
CACHE = os.environ.get("JAXSERVE_COMPILATION_CACHE", str(ROOT / ".cache" / "jax"))


def test_short_soak_passes_every_check(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench.soak", "--num_requests=150", "--concurrency=8", "--abort_fraction=0.3",
         "--bad_fraction=0.15", f"--result_json={out}", "--settle_s=20",
         f"--server_args=--max_num_batched_tokens=64 --token_buckets=8,64 --seq_buckets=8 "
         f"--compilation_cache_dir={CACHE}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and all(result["checks"].values()), result["checks"]
    assert sum(result["outcomes"].values()) == 150
    assert result["outcomes"].get("aborted", 0) > 5 and result["outcomes"].get("bad", 0) > 5
    assert result["num_preemptions"] > 0  # the small cache forced recomputation
    assert result["num_free_blocks"] + result["num_cached_blocks"] == result["num_usable_blocks"] == 39
    assert result["num_leaked_blocks"] == 0
    # Every hostile case ran to the end and was held to its class; every finished request counted.
    assert set(result["hostile"]) == {"echo+logprobs long prompt", "n=3 long outputs", "prompt near max_model_len"}
    assert all(case["count"] > 0 and 0 < case["median_s"] <= case["max_s"] and case["worst_ratio"] <= 8
               for case in result["hostile"].values())
    progress = result["progress"]
    assert progress["num_checked"] == result["outcomes"]["good"] + result["outcomes"]["hostile"]
    assert progress["num_over"] == 0 and progress["worst_ratio"] <= progress["max_ratio"]
    rss = result["rss_kib"]
    assert rss["warm"] > 0 and rss["end"] > 0 and rss["growth"] < 0.05 and len(rss["series"]) >= 20
