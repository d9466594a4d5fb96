"""experiments.ideas.speculative's summary (experiments.lab.speculative_summary): each arm against off, the crossover, the automatic arm's goal."""

import pytest

from experiments.lab.speculative_summary import ArmResult, median_of_rounds, summarize


def _arm(arm, c, tok_s):
    return ArmResult(arm, c, 8, 100, 100 / tok_s, tok_s, 50.0, 0.5 if arm != "off" else 0.0, 2.0, 0)


def test_crossover_is_the_first_concurrency_where_always_on_loses_and_auto_is_judged_per_c():
    results = [_arm("off", 1, 10.0), _arm("on", 1, 15.0), _arm("auto", 1, 14.5),
               _arm("off", 4, 30.0), _arm("on", 4, 31.0), _arm("auto", 4, 30.0),
               _arm("off", 16, 60.0), _arm("on", 16, 50.0), _arm("auto", 16, 55.0),
               _arm("off", 64, 80.0), _arm("on", 64, 60.0), _arm("auto", 64, 79.0)]
    summary, text = summarize(results, [1, 4, 16, 64])
    assert summary["crossover"] == 16
    met = {g["goal"]: g["met"] for g in summary["goals"]}
    assert met == {"c=1: auto / best of off and on": True, "c=4: auto / best of off and on": True,
                   "c=16: auto / best of off and on": False, "c=64: auto / best of off and on": True}
    assert "| 16 | on | 50.0 | 0.83x |" in text and "crossover (first c where always-on loses to off): 16" in text


def test_rounds_report_the_median_throughput_and_keep_every_round():
    rounds = [_arm("on", 4, 30.0), _arm("on", 4, 12.0), _arm("on", 4, 20.0)]
    r = median_of_rounds(rounds)
    assert r.tokens_per_s == 20.0 and r.tokens_per_s_rounds == [30.0, 12.0, 20.0]
    assert r.num_requests == 24 and r.output_tokens == 300 and r.acceptance_rate == 0.5
    assert median_of_rounds(rounds[:2]).tokens_per_s == 21.0


@pytest.mark.extended  # make test-extended (CI runs it after make test)
def test_the_sweep_end_to_end_on_random_tiny(tmp_path):
    """experiments.ideas.speculative's command line at toy size (a subprocess: its absl flags are global): two
    concurrencies, two interleaved rounds, prompts cached first; what it writes and its accounting."""
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.ideas.speculative", "--model=random:tiny", "--concurrencies=1,2",
         "--num_requests=2", "--output_len=8", "--rounds=2", "--max_num_seqs=4", "--max_num_batched_tokens=64",
         "--token_buckets=4,16,64", f"--out_dir={tmp_path}"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "speculative_rewrite_ngram.json").read_text())
    assert s["prefill"] == "cached" and s["method"] == "ngram" and s["crossover"] in (None, 1, 2)
    assert [(r["concurrency"], r["arm"]) for r in s["results"]] == [
        (c, a) for c in (1, 2) for a in ("off", "on", "auto")]
    for r in s["results"]:
        assert len(r["tokens_per_s_rounds"]) == 2 and r["output_tokens"] == 2 * 2 * 8  # rounds x requests x 8
        assert r["tokens_per_s"] > 0 and r["itl_p95_ms"] > 0
    off = [r for r in s["results"] if r["arm"] == "off"]
    on = [r for r in s["results"] if r["arm"] == "on"]
    assert all(r["mean_accepted_length"] == 0 for r in off) and all(r["mean_accepted_length"] >= 1 for r in on)
    assert [g["goal"] for g in s["goals"]] == ["c=1: auto / best of off and on", "c=2: auto / best of off and on"]
    assert (tmp_path / "speculative_rewrite_ngram.png").stat().st_size > 1000
