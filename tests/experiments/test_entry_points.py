"""`python -m experiments.bench.serving` and `python -m experiments.bench.sweep` end to end, in a
subprocess (their flags are global), against the fake server, with the default model's tokenizer.
"""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(module, *args):
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_bench_serving_prints_table_and_writes_json(fake_server, tmp_path):
    fake_server.ttft_s, fake_server.itl_s = 0.01, 0.005
    out = tmp_path / "bench.json"
    stdout = _run("experiments.bench.serving", f"--base_url={fake_server.base_url}",
                  "--dataset=random", "--random_input_len=16", "--random_output_len=4",
                  "--num_prompts=6", "--max_concurrency=3", "--goodput=ttft:5000 itl_p95:5000",
                  "--temperature=0", "--ignore_eos", "--disable_tqdm", f"--result_json={out}")
    assert "Successful requests:" in stdout and "Request goodput (req/s):" in stdout
    result = json.loads(out.read_text())
    assert result["config"]["model"] == "fake-model"  # asked /v1/models
    assert result["metrics"]["completed"] == 6 and result["metrics"]["num_good"] == 6
    assert result["metrics"]["total_output_tokens"] == 24
    assert len(result["requests"]) == 6 and all(r["success"] for r in result["requests"])
    payload = fake_server.payloads[-1]
    assert payload["temperature"] == 0.0 and payload["ignore_eos"] is True
    assert fake_server.max_in_flight == 3


def test_sweep_writes_json_markdown_png(fake_server, tmp_path):
    fake_server.ttft_s, fake_server.itl_s = 0.01, 0.005
    _run("experiments.bench.sweep", f"--base_url={fake_server.base_url}", "--dataset=shared-prefix",
         "--num_prefixes=2", "--questions_per_prefix=4", "--prefix_len=16", "--question_len=4",
         "--shared_output_len=3", "--num_prompts=4", "--concurrencies=1,2,4",
         "--prompts_per_concurrency=1", "--goodput=ttft:5000", "--slo_itl_p95_ms=5000",
         "--disable_tqdm", f"--output_dir={tmp_path}", "--tag=t")
    summary = json.loads((tmp_path / "t.json").read_text())
    assert [p["load"] for p in summary["points"]] == [1.0, 2.0, 4.0]
    assert [p["metrics"]["completed"] for p in summary["points"]] == [4, 4, 4]
    assert summary["capacity_load"] == 4.0 and summary["model"] == "fake-model"
    assert (tmp_path / "t.md").read_text().startswith("# t")
    assert (tmp_path / "t.png").stat().st_size > 1000
    # One warm-up request, then 4 per point.
    assert len(fake_server.payloads) == 1 + 12
