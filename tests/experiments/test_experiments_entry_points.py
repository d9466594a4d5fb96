"""The four experiment entry points end to end, in subprocesses (their absl flags are global), at
toy sizes: random tiny weights for the engine ones. They check what each writes and the
accounting that does not depend on timing; the measured numbers live in BUILD_NOTES.md.
"""

import json
import pathlib
import subprocess
import sys

import pytest

# The experiments end to end: make test-extended (CI runs it after make test).
pytestmark = pytest.mark.extended

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_ENGINE = ("--model=random:tiny", "--max_num_seqs=4", "--max_num_batched_tokens=64",
               "--token_buckets=16,64")


def run(module, tmp_path, *args):
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", f"--out_dir={tmp_path}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = module.removeprefix("ideas.")
    summary = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.png").stat().st_size > 1000
    assert (tmp_path / f"{name}.md").read_text().startswith(f"# {name}")
    assert summary["command"].startswith(f"python -m experiments.{module} ")
    assert summary["goals"] and all(isinstance(g["met"], bool) for g in summary["goals"])
    return proc.stdout, summary


def test_paged_vs_contiguous(tmp_path):
    stdout, s = run("ideas.paged_vs_contiguous", tmp_path, "--num_prompts=40", "--num_kv_blocks=513",
                    "--max_num_seqs=64", "--max_model_len=2048")
    assert "Scheduler-level" in stdout and s["level"].startswith("scheduler")
    paged, contiguous = s["arms"]["paged"], s["arms"]["contiguous"]
    assert contiguous["max_running"] == 4  # 512 blocks / 128 reserved per request
    assert paged["max_running"] > contiguous["max_running"]
    assert paged["waste_pct"] < 10 < 50 < contiguous["waste_pct"]
    assert paged["wasted_slots_per_request"] < 16  # under one block
    assert contiguous["num_preemptions"] == 0


def test_static_vs_continuous(tmp_path):
    stdout, s = run("ideas.static_vs_continuous", tmp_path, *TINY_ENGINE, "--seq_buckets=4",
                    "--num_prompts=8", "--length_scale=0.05", "--max_output_len=16")
    assert "continuous / static output throughput" in stdout
    arms = s["arms"]
    assert arms["static"]["all"]["completed"] == arms["continuous"]["all"]["completed"] == 8
    assert arms["static"]["all"]["output_tokens"] == arms["continuous"]["all"]["output_tokens"] == sum(
        s["workload"]["output_lens"])
    assert max(s["workload"]["output_lens"]) <= 16
    # The static batch never refills, so it needs at least as many steps.
    assert arms["static"]["num_steps"] >= arms["continuous"]["num_steps"]
    assert s["step_ratio"] == arms["static"]["num_steps"] / arms["continuous"]["num_steps"]


def test_chunked_prefill(tmp_path):
    _, s = run("ideas.chunked_prefill", tmp_path, "--model=random:tiny", "--num_users=2",
               "--user_prompt_len=8", "--user_output_len=12", "--long_prompt_len=200",
               "--long_arrival_s=0.01", "--chunk_budget=32")
    assert s["config"]["max_model_len"] == 224 and s["config"]["token_buckets"] == [16, 32, 224]
    for arm in s["arms"].values():
        assert [len(t) for t in arm["users_token_times_s"]] == [12, 12]
        assert arm["users_itl_ms"]["n"] == 2 * 11 and arm["newcomer_ttft_ms"] > 0
    # Whole: one step for the long prompt; chunked: at least 200 / 32 steps for it.
    assert s["arms"]["chunked"]["num_steps"] > s["arms"]["whole"]["num_steps"]


def test_prefix_caching(tmp_path):
    _, s = run("ideas.prefix_caching", tmp_path, *TINY_ENGINE, "--max_model_len=128",
               "--num_prefixes=2", "--questions_per_prefix=3", "--prefix_len=64",
               "--question_len=8", "--output_len=3", "--request_rate=inf")
    off, on = s["arms"]["no cache"], s["arms"]["prefix cache"]
    assert off["prompt_tokens"] == on["prompt_tokens"] == 6 * 72
    assert off["prefix_cache_hit_tokens"] == 0 and off["prompt_tokens_computed"] == off["prompt_tokens"]
    assert on["prefix_cache_hit_tokens"] > 0
    assert on["prompt_tokens_computed"] == on["prompt_tokens"] - on["prefix_cache_hit_tokens"]
